"""Training ablation: which training choices make a drafter accept more, at equal data.

Every variant trains on the same capture (one `draftsmith capture`, reused) with the same token
budget (train.epochs whole passes), TTT depth and draft vocab, and is measured the same way:
    held-out acceptance   teacher-forced argmax agreement per draft position (0..depth-1) on a
                          capture of other conversations (never trained on), and the simulated
                          tau of a chain of `--sim-depth` drafts (train.ttt.simulated_tau)
    measured tau          our engine, greedy, on MT-Bench (chain and tree), which no drafter saw
Each variant is a list of recipe flags on top of the base recipe, so the table is reproducible
with plain `draftsmith` commands (printed with --print-commands):
    draftsmith train  BASE.yaml --run_dir WORK/NAME-sSEED --seed SEED FLAGS...
    draftsmith evaluate BASE.yaml --run_dir WORK/NAME-sSEED --seed SEED FLAGS... --evaluate.*

    # once: the data (prepare + capture + vocab) and a held-out capture of other conversations
    draftsmith prepare runs/lab/base.yaml && draftsmith capture runs/lab/base.yaml && draftsmith vocab runs/lab/base.yaml
    draftsmith prepare runs/lab/base.yaml --run_dir runs/lab/heldout --prepare.skip_samples 12800 --prepare.max_samples 115
    draftsmith capture runs/lab/base.yaml --run_dir runs/lab/heldout --prepare.skip_samples 12800 --prepare.max_samples 115
    # the table (nice it on a shared machine)
    OMP_NUM_THREADS=1 python benchmarks/bench_ablation.py --recipe runs/lab/base.yaml --base runs/lab/base \
        --heldout runs/lab/heldout --work runs/lab/ablate --variants baseline,muon --seeds 0,1 --out ablation.json
    python benchmarks/bench_ablation.py --smoke          # a 2-variant run on a tiny synthetic target (the CPU test)

JSON: {"variants": {NAME: {"flags", "runs": [{seed, heldout_acc, tau_sim, tau_chain, tau_tree,
train_s, steps, tokens}], "mean": {...}}}, "ngram_tau": ...}. A variant's run folder is kept, so a
rerun skips the stages that are complete (pipeline fingerprints).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Collection

import torch

from draftsmith import pipeline
from draftsmith.fileio import atomic_write_json, read_json, to_jsonable
from draftsmith.manifests import code_fingerprint, require_complete, verify_shards
from draftsmith.messages import DraftsmithError
from draftsmith.rundir import stage_dir
from draftsmith.config import parse_recipe
from draftsmith.data.conversations import conversation_of
from draftsmith.evaluate.stage import trained_conversations

# name -> recipe flags on top of the base recipe. "baseline" is the recipe as it is: since lr 3e-3
# and head_init target became the defaults (this ablation's winners), a base recipe that does not set
# them trains what "lr3e-3+head_target" names; set --train.lr 3e-4 --train.head_init random in it to
# get the first baseline back. Since draft.norm_output and ttt_decay 1.0 became the defaults too (the
# ablation at equal batch, BENCHMARKS.md "New defaults"), "eagle3" is the baseline before them.
VARIANTS: dict[str, list[str]] = {
    "baseline": [],
    # optimizer and learning rate
    "lr1e-3": ["--train.lr", "1e-3"],
    "lr3e-3": ["--train.lr", "3e-3"],
    "lr1e-2": ["--train.lr", "1e-2"],
    "muon": ["--train.optimizer", "muon", "--train.lr", "1e-3"],
    "muon3e-3": ["--train.optimizer", "muon", "--train.lr", "3e-3"],  # won at 630 steps (BENCHMARKS.md, tenth session)
    # the law the drafter learns: the target's at temperature 1 (recipes/gpu.yaml: a server that samples)
    "t1": ["--train.ttt_target_temperature", "1"],
    # the head: the target's own rows, trained or frozen
    "head_target": ["--train.head_init", "target"],
    "head_frozen": ["--train.head_init", "target", "--train.train_head", "false"],
    # loss weighting over TTT positions (EAGLE-3's 0.8**i; the default is 1.0)
    "decay0.8": ["--train.ttt_decay", "0.8"],
    # rows past a miss left out of later steps (GRIFFIN's token-alignable training; top-1 and top-4)
    "align1": ["--train.ttt_align_topk", "1"],
    "align4": ["--train.ttt_align_topk", "4"],
    # schedule: speculators' linear decay to 0
    "linear": ["--train.lr_schedule", "linear", "--train.min_lr_ratio", "0.0"],
    # architecture flags (speculators' defaults turn all three on; norm_output is on by default)
    "no_norm_output": ["--draft.norm_output", "false"],
    "eagle3": ["--draft.norm_output", "false", "--train.ttt_decay", "0.8"],  # the defaults before 2026-12-05
    "norm_before_residual": ["--draft.norm_before_residual", "true"],
    "norm_before_fc": ["--draft.norm_before_fc", "true"],
    "all_norms": ["--draft.norm_output", "true", "--draft.norm_before_residual", "true", "--draft.norm_before_fc", "true"],
    # combinations of the single changes that won
    "lr3e-3+head_target+norm_output": ["--train.lr", "3e-3", "--train.head_init", "target", "--draft.norm_output", "true"],
    # how sensitive the combination is to the lr, and what each remaining single change adds to it
    "lr1e-3+head_target+norm_output": ["--train.lr", "1e-3", "--train.head_init", "target", "--draft.norm_output", "true"],
    "lr3e-3+head_target+norm_output+decay1": ["--train.lr", "3e-3", "--train.head_init", "target",
                                              "--draft.norm_output", "true", "--train.ttt_decay", "1.0"],
    "lr3e-3+head_target+norm_output+norm_before_residual": ["--train.lr", "3e-3", "--train.head_init", "target",
                                                             "--draft.norm_output", "true",
                                                             "--draft.norm_before_residual", "true"],
    # speculators' whole recipe in our trainer: Muon + AdamW 1e-3, frozen target head, decay 1,
    # linear schedule to 0 with 1% warmup, clip 1.0, AdamW weight decay 0.01, all three norms
    "peer_recipe": ["--train.optimizer", "muon", "--train.lr", "1e-3", "--train.head_init", "target",
                    "--train.train_head", "false", "--train.ttt_decay", "1.0", "--train.lr_schedule", "linear",
                    "--train.min_lr_ratio", "0.0", "--train.grad_clip", "1.0", "--train.weight_decay", "0.01",
                    "--draft.norm_output", "true", "--draft.norm_before_residual", "true", "--draft.norm_before_fc", "true"],
}


# ----------------------------------------------------------------------------- held-out figures


@torch.no_grad()
def heldout_acceptance(drafter, capture_dir: Path, target_path: str, depth: int, max_length: int,
                       batch_tokens: int = 4096, trained: Collection = ()) -> dict:
    """Teacher-forced acceptance per draft position 0..depth-1 on every sample of a capture
    folder: argmax of the drafter == argmax of the target (restricted to the draft vocab), the
    training metric, here on conversations the drafter never saw; and speculative sampling's
    expected acceptance at temperature 1 (ttt.py). Returns {acc, chain, accept_t1, weight, samples}.
    The samples are packed into rows of one shape, [1, max(batch_tokens, max_length)], as training
    packs them (the same figures as one sample a row): on a GPU the TTT attention (flex, compiled
    for static shapes) then compiles once, where rows of each bin's own length compiled again for
    every new length (the likeliest cause of the first measurement's 309 s on a fresh H200 against
    40-53 s once the compile cache was warm: BENCHMARKS.md, twelfth and thirteenth sessions).
    A sample part of a conversation in `trained` (the base run's, evaluate.stage.trained_conversations)
    is left out: a skip_samples split by record can cut one ShareGPT conversation (`abc_0` | `abc_1`)."""
    from draftsmith.target.model import read_target_embeddings
    from draftsmith.train.data import CaptureIndex, epoch_plan
    from draftsmith.train.ttt import ttt_loss
    from draftsmith.draft.vocab import draft_ids

    m = require_complete(capture_dir, "capture")
    index = CaptureIndex(verify_shards(capture_dir, m, check_hash=False), max_length, int(m["hidden_size"]),
                         len(m["aux_layer_ids"]))
    _, lm_head, _ = read_target_embeddings(target_path)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    head = lm_head[draft_ids(drafter.d2t)].float().to(dev)
    drafter = drafter.float().eval().to(dev)
    correct, weight, chain, accept = (torch.zeros(depth, dtype=torch.float64) for _ in range(4))
    row = max(batch_tokens, max_length)
    keep = [j for j, sid in enumerate(index.source_id) if sid is None or conversation_of(sid, trained) is None]
    for plan in epoch_plan([index.lengths[j] for j in keep], row, seed=0, epoch=0, layout="packed"):
        ids = [keep[i] for i in plan]
        tokens, mask, aux, fin, pos, docs = (t.to(dev) for t in index.batch(ids, packed_tokens=row).tensors())
        out = ttt_loss(drafter, tokens, mask, aux.float(), fin.float(), head, depth, 1.0, position_ids=pos, doc_ids=docs,
                       sample_temperature=1.0)
        correct += out.correct.double().cpu()
        accept += out.accept.double().cpu()
        weight += out.weight.double().cpu()
        chain += out.chain.double().cpu()
    return {"acc": (correct / weight.clamp_min(1)).tolist(), "chain": (chain / weight.clamp_min(1)).tolist(),
            "accept_t1": (accept / weight.clamp_min(1)).tolist(), "weight": weight.tolist(), "samples": len(keep),
            "samples_in_training": len(index) - len(keep)}


def heldout_row(ho: dict, sim_depth: int) -> dict:
    """A result row's held-out figures: accuracy per position and its simulated tau (the product
    of the accuracies); chain acceptance per position (the rows whose drafts all matched up to it)
    and tau_tf = 1 + its sum over sim_depth positions, the teacher-forced tau of a chain (exact on
    the target's own text, and fair to training that gives up rows past a miss: train.ttt_align_topk);
    speculative sampling's expected acceptance at temperature 1 per position and its simulated tau."""
    return {"heldout_acc": ho["acc"], "tau_sim": simulated_tau(ho["acc"][:sim_depth]),
            "heldout_chain": ho["chain"], "tau_tf": 1 + sum(ho["chain"][:sim_depth]),
            "heldout_accept_t1": ho["accept_t1"], "tau_sim_sampled_t1": simulated_tau(ho["accept_t1"][:sim_depth])}


def simulated_tau(acc: list[float]) -> float:
    from draftsmith.train.ttt import simulated_tau as tau

    return tau(acc)


# ----------------------------------------------------------------------------- one variant


def link_stages(base: Path, run_dir: Path, stages=("prepare", "capture", "vocab")) -> None:
    """The variant's run folder reads the base run's data, capture and vocab (symlinks), and its regen
    when the base regenerated (a recipe with regenerate on, or training online, reads it); a stage of
    the base that is not complete is a one-line error before anything is linked."""
    for s in stages:
        require_complete(stage_dir(base, s), s)
    regen = stage_dir(base, "regenerate") / "manifest.json"
    if regen.exists() and read_json(regen).get("status") == "complete":
        stages = ("regenerate", *stages)
    run_dir.mkdir(parents=True, exist_ok=True)
    for s in stages:
        link = stage_dir(run_dir, s)
        if not link.is_symlink() and not link.exists():
            link.symlink_to(stage_dir(base, s).resolve(), target_is_directory=True)


# Every variant (and bench_peer's peer) trains on all of the base capture: the held-out figures come
# from the separate --heldout capture, so train's own held-out split (default auto) is turned off.
EQUAL_DATA = ["--train.heldout_samples", "0"]


def recipe_for(recipe_path: str, run_dir: Path, seed: int, flags: list[str], extra: list[str] = ()):
    recipe, _ = parse_recipe([recipe_path, "--run_dir", str(run_dir), "--seed", str(seed), *EQUAL_DATA, *flags, *extra])
    return recipe


def eval_flags(args, ngram: bool = False) -> list[str]:
    """MT-Bench (both turns) with our engine, greedy; n-gram prompt lookup once (it does not
    depend on the drafter)."""
    methods = "[eagle3_chain,eagle3_tree,ngram]" if ngram else "[eagle3_chain,eagle3_tree]"
    return ["--evaluate.benchmarks", f"[{args.benchmark}]", "--evaluate.batch_sizes", "[1]",
            "--evaluate.max_prompts", str(args.eval_prompts),
            "--evaluate.max_new_tokens", str(args.max_new_tokens), "--evaluate.draft_steps", str(args.draft_steps),
            "--evaluate.tree_depth", str(args.draft_steps), "--evaluate.methods", methods, "--evaluate.step_costs", "false",
            # bf16 MoE targets: a verify over N rows may end a near-tie otherwise than plain decoding (H200, 2026-12-06:
            # a 0.127 gap against the 0.1 tolerance); each turn's divergence is recorded (identical_to_plain), not fatal
            "--evaluate.check_lossless", "false",
            *(["--evaluate.temperatures", "[" + ",".join(f"{t:g}" for t in args.temperatures) + "]"]
              if getattr(args, "temperatures", None) else [])]


def engine_taus(args, recipe_path: str, run_dir: Path, seed: int, flags: list[str], ngram: bool = False) -> dict:
    """The engine's tau (chain, tree; n-gram when asked) on MT-Bench. A complete evaluation of this
    drafter with the same evaluate config (every key: prompts, temperature, tree shape, ...) by the
    same draftsmith code is reused (one with n-gram as well counts); after a change to the code it
    is measured again (the stage's own fingerprint, config and inputs, would reuse it: the run is
    forced)."""
    ev, complete = None, False
    want = recipe_for(recipe_path, run_dir, seed, flags, eval_flags(args, ngram))
    m_path = stage_dir(run_dir, "evaluate") / "manifest.json"
    if m_path.exists() and (stage_dir(run_dir, "train") / "manifest.json").exists():
        old = read_json(m_path)
        c, complete = old.get("config", {}), old.get("status") == "complete"
        cfg = to_jsonable(want.evaluate)
        same = (complete and all(c.get(k) == v for k, v in cfg.items() if k != "methods")  # temperature, tree shape, ...
                and set(cfg["methods"]) <= set(c.get("methods", []))  # one with n-gram as well counts
                and old.get("inputs", {}).get("train") == read_json(stage_dir(run_dir, "train") / "manifest.json")["fingerprint"]
                and old.get("versions", {}).get("draftsmith_code") == code_fingerprint())
        ev = old if same else None
    if ev is None:
        ev = pipeline.run_stage("evaluate", want, force=complete)
    eagle = ("eagle3_chain", "eagle3_tree")
    prompts = read_json(stage_dir(run_dir, "evaluate") / "results.json")["prompts"]
    by = by_temperature(ev["metrics"], prompts, eagle)
    # the headline row is the served temperature's (evaluate.temperature): its figures and its turns alone
    return {**by[served_key(ev["metrics"])], "engine_accept_rate": ev["metrics"]["accept_rate_per_position"],
            # greedy answers identical to plain decoding's (in bf16 the rest left it at a near-tie: another answer)
            "identical_to_plain": {m: sum(p["methods"][m].get("lossless") is True for p in prompts) for m in eagle},
            "by_temperature": by}


def served_key(metrics: dict) -> str:
    """The key of evaluate's served temperature among metrics.by_temperature's (f"{T:g}")."""
    return f"{float(metrics.get('temperature') or 0):g}"


def by_temperature(metrics: dict, prompts: list[dict], eagle) -> dict:
    """{"<T>": {tau_chain, tau_tree, speedup_chain, speedup_tree, [ngram_tau, ngram_speedup,] per_turn}} for
    every temperature the evaluation measured (evaluate.temperatures; one: the evaluation's own), each from
    that temperature's figures and turns (a record names its temperature)."""
    by = metrics.get("by_temperature") or {served_key(metrics): metrics["methods"]}
    out = {}
    for T, methods in by.items():
        row = {f"{k}_{m.split('_')[-1]}": methods[m][k] for m in eagle if m in methods for k in ("tau", "speedup")}
        if "ngram" in methods:
            row.update(ngram_tau=methods["ngram"]["tau"], ngram_speedup=methods["ngram"]["speedup"])
        row["per_turn"] = per_turn([p for p in prompts if f"{float(p.get('temperature') or 0):g}" == T], eagle)
        out[T] = row
    return out


def per_turn(prompts: list[dict], methods) -> dict:
    """{method: [[turn key, tokens emitted, rounds], ...]} at batch 1 from the prompts of an evaluate
    stage's results.json: tau of any set of turns is sum(emitted) / sum(rounds), as evaluate's own."""
    return {m: [[p["key"], p["methods"][m]["emitted"], p["methods"][m]["rounds"]] for p in prompts] for m in methods}


def run_variant(args, name: str, flags: list[str], seed: int, ngram: bool = False) -> dict:
    run_dir = Path(args.work) / f"{name}-s{seed}"
    link_stages(Path(args.base), run_dir)
    recipe = recipe_for(args.recipe, run_dir, seed, flags)
    t0 = time.time()
    m = pipeline.run_stage("train", recipe)
    train_s = time.time() - t0
    row = {**measure(args, run_dir, recipe, seed, flags, ngram), "steps": m["counts"]["steps"],
           "tokens_per_epoch": m["counts"]["tokens_per_epoch"], "epochs_started": m["counts"]["epochs_started"],
           "train_loss": m["metrics"]["loss"],
           "train_s": round(m.get("timings", {}).get("train_s_this_session", train_s), 1)}
    print(f"[ablation] {name} seed {seed}: held-out acc {' '.join(f'{a:.3f}' for a in row['heldout_acc'])} | "
          f"tau_sim {row['tau_sim']:.3f} tau_tf {row['tau_tf']:.3f}"
          + (f" | tau chain {row['tau_chain']:.3f} tree {row['tau_tree']:.3f}" if "tau_tree" in row else ""), flush=True)
    return row


def measure(args, run_dir: Path, recipe, seed: int, flags: list[str], ngram: bool = False) -> dict:
    """A trained drafter's row: its held-out figures (heldout_row) and, unless --no-engine, the
    engine's tau and speedup on MT-Bench (engine_taus; n-gram beside them when asked)."""
    from draftsmith.draft.io import load_drafter

    ho = heldout_acceptance(load_drafter(run_dir / "train" / "drafter"), stage_dir(Path(args.heldout), "capture"),
                            recipe.target.path, args.depth, recipe.train.max_length,
                            trained=trained_conversations(Path(args.base))[1])
    row = {"seed": seed, **heldout_row(ho, args.sim_depth)}
    if not args.no_engine:
        row.update(engine_taus(args, args.recipe, run_dir, seed, flags, ngram))
    return row


def mean_row(rows: list[dict]) -> dict:
    keys = [k for k in ("tau_sim", "tau_tf", "tau_sim_sampled_t1", "tau_chain", "tau_tree", "speedup_chain", "speedup_tree", "ngram_tau",
                        "ngram_speedup", "train_loss") if all(k in r for r in rows)]
    out = {k: sum(r[k] for r in rows) / len(rows) for k in keys}
    for k in ("heldout_acc", "heldout_chain", "heldout_accept_t1"):
        if all(k in r for r in rows):
            out[k] = [sum(r[k][i] for r in rows) / len(rows) for i in range(len(rows[0][k]))]
    return out


def markdown(result: dict) -> str:
    depth = len(next(iter(result["variants"].values()))["mean"]["heldout_acc"])
    head = ["variant", "seeds"] + [f"acc@{i}" for i in range(depth)] + ["τ sim", "τ chain", "τ tree", "steps"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, v in result["variants"].items():
        mean = v["mean"]
        cells = [name, ",".join(str(r["seed"]) for r in v["runs"])] + [f"{a:.3f}" for a in mean["heldout_acc"]]
        cells += [f"{mean[k]:.3f}" if k in mean else "—" for k in ("tau_sim", "tau_chain", "tau_tree")]
        cells.append(str(v["runs"][0]["steps"]))
        lines.append("| " + " | ".join(cells) + " |")
    if result.get("ngram_tau") is not None:
        lines.append(f"\nn-gram prompt lookup on the same prompts: τ {result['ngram_tau']:.3f}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- smoke


def make_smoke(root: Path) -> tuple[str, str, str]:
    """A tiny synthetic target, a few dozen conversations, prepare/capture/vocab for a base run
    and a held-out capture: (recipe path, base run, held-out run). CPU, seconds."""
    from draftsmith.testing import make_model_dir

    target = make_model_dir(root / "target", num_layers=8)  # distinct default aux layers [1, 3, 4]
    convs = []
    for i in range(60):
        turns = [{"from": "human", "value": f"question {i} about topic {i % 7} please"},
                 {"from": "gpt", "value": " ".join(f"word{(i * j) % 23}" for j in range(12))}]
        convs.append({"id": str(i), "conversations": turns})
    (root / "convs.json").write_text(json.dumps(convs))
    recipe = root / "recipe.yaml"
    recipe.write_text(f"""run_dir: {root / 'base'}
seed: 0
target: {{path: {target}, device: cpu, dtype: float32}}
prepare: {{source: {root / 'convs.json'}, max_samples: 48, max_length: 64}}
capture: {{batch_tokens: 2048, storage_dtype: float32}}
vocab: {{draft_vocab_size: 64}}
train: {{ttt_steps: 2, epochs: 1, batch_tokens: 256, max_length: 64, warmup_steps: 2, log_every: 5, save_every: 1000, device: cpu, dtype: float32}}
evaluate: {{max_prompts: 2, max_new_tokens: 8}}
""")
    for stage in ("prepare", "capture", "vocab"):
        r, _ = parse_recipe([str(recipe)])
        pipeline.run_stage(stage, r)
    for stage in ("prepare", "capture"):
        r, _ = parse_recipe([str(recipe), "--run_dir", str(root / "heldout"), "--prepare.skip_samples", "48",
                             "--prepare.max_samples", "12"])
        pipeline.run_stage(stage, r)
    return str(recipe), str(root / "base"), str(root / "heldout")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipe", help="base recipe YAML (data, target, train budget)")
    p.add_argument("--base", help="run folder with complete data/, capture/ and vocab/")
    p.add_argument("--heldout", help="run folder with a complete capture/ of conversations outside the base data")
    p.add_argument("--work", default="runs/ablate", help="one run folder per variant and seed goes here")
    p.add_argument("--variants", default="baseline", help=f"comma-separated names of {sorted(VARIANTS)}")
    p.add_argument("--seeds", default="0")
    p.add_argument("--depth", type=int, default=6, help="held-out draft positions measured (past the trained depth too)")
    p.add_argument("--sim-depth", type=int, default=5, help="positions in the simulated tau (evaluate.draft_steps)")
    p.add_argument("--eval-prompts", type=int, default=20, help="MT-Bench questions (x 2 turns)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--benchmark", default="mtbench", help="evaluate.benchmarks entry: mtbench or a question file")
    p.add_argument("--draft-steps", type=int, default=5, help="chain length and tree depth of the engine")
    p.add_argument("--no-engine", action="store_true", help="skip the measured tau (held-out acceptance only)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="the engine's evaluate.temperature (0: greedy; > 0: speculative sampling, seeded by --seeds)")
    p.add_argument("--no-ngram", action="store_true", help="leave n-gram prompt lookup out of the engine's methods")
    p.add_argument("--print-commands", action="store_true", help="print the draftsmith commands of each run and exit")
    p.add_argument("--smoke", action="store_true", help="tiny synthetic target, two variants, no engine (CPU test)")
    p.add_argument("--out", help="JSON file")
    args = p.parse_args(argv)
    if args.smoke:
        import tempfile

        root = Path(tempfile.mkdtemp(prefix="bench_ablation_"))
        args.recipe, args.base, args.heldout = make_smoke(root)
        args.work, args.variants, args.no_engine, args.depth, args.sim_depth = str(root / "ablate"), "baseline,eagle3", True, 3, 3
    if not (args.recipe and args.base and args.heldout):
        p.error("--recipe, --base and --heldout are required (or --smoke)")
    names = [v for v in args.variants.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; choose from {sorted(VARIANTS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    at = ["--evaluate.temperature", str(args.temperature)] if args.temperature else []
    flags = {name: VARIANTS[name] + at for name in names}  # a variant's run folder is reused at another temperature
    if args.print_commands:
        for name in names:
            for seed in seeds:
                d = Path(args.work) / f"{name}-s{seed}"
                common = f"{args.recipe} --run_dir {d} --seed {seed} {' '.join(EQUAL_DATA + flags[name])}".rstrip()
                print(f"# {name}, seed {seed} (data/, capture/, vocab/ linked from {args.base})")
                print(f"draftsmith train {common}")
                print(f"draftsmith evaluate {common} {' '.join(eval_flags(args))}")
        return 0
    result = {"recipe": args.recipe, "base": args.base, "heldout": args.heldout, "depth": args.depth,
              "sim_depth": args.sim_depth, "eval_prompts": args.eval_prompts, "variants": {}}
    out = Path(args.out) if args.out else None
    if out and out.exists():  # extend an earlier table (a rerun recomputes nothing that is complete)
        old = read_json(out)
        result["variants"], result["ngram_tau"] = old.get("variants", {}), old.get("ngram_tau")
    for name in names:
        runs = [r for r in result["variants"].get(name, {}).get("runs", []) if r["seed"] not in seeds]
        for seed in seeds:
            runs.append(run_variant(args, name, flags[name], seed, ngram=not args.no_ngram and result.get("ngram_tau") is None))
            result["ngram_tau"] = result.get("ngram_tau") or runs[-1].get("ngram_tau")
        runs.sort(key=lambda r: r["seed"])
        result["variants"][name] = {"flags": flags[name], "runs": runs, "mean": mean_row(runs)}
        if out:
            atomic_write_json(out, result)
    print(markdown(result))
    if out:
        atomic_write_json(out, result)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except DraftsmithError as e:  # the pipeline's own one-line errors (a stage missing, a bad recipe)
        sys.exit(f"bench_ablation: {e}")
