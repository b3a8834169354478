"""The peer at equal data: speculators' trainer on our captured tokens and states, then both
drafters measured by our engine on the same held-out prompts.

speculators 0.9.0 (vllm-project/speculators) is driven through its own pieces: its
Eagle3DraftModel (built by `Eagle3DraftModel.from_training_args`, its TTT forward and loss), its
packing sampler (MultipackDistributedBatchSamplerV2), collate function and `shift_batch`, its
optimizers (`build_optimizers`: Muon + AdamW), schedulers and `Trainer` loop, with its default
recipe for EAGLE-3 (PEER_DEFAULTS, from its train/config/schema.py; its CLI cannot be imported
here: it needs pydantic_settings). What is ours: the data. A Dataset hands its collate function
the token ids, loss masks, aux hidden states and final hidden states of our capture (the same
bytes our trainer reads), so both train on identical tensors, the same conversations, the same
draft vocab (our d2t/t2d), TTT depth and number of epochs; every other setting is its own default,
its batch too (8,192 packed tokens a step). Two shims, both named:
  * our capture stores the target's final hidden state after its last norm (what its lm_head
    reads); speculators' data holds it before and applies the target norm itself
    (`verifier_norm`). The bench sets `verifier_norm` to the identity, so its targets are the
    target's own logits, exactly as ours.
  * on a CPU: its Trainer moves the model to `local_rank` (a CUDA index) and synchronises the
    accelerator for step timing; both are pointed at the CPU.
Its loss runs the "eager" implementation everywhere (`--peer-loss`): the fused one is a Triton
kernel (no CPU), and on the H200 with torch 2.11 dynamo fails to trace it inside speculators'
compiled forward; the tests of speculators check that both give the same values.
Its checkpoint (save_pretrained, the vLLM format) is imported with `draftsmith import-drafter`,
then both drafters go through the same measurement as benchmarks/bench_ablation.py: held-out
teacher-forced acceptance per position on a capture of other conversations, and the measured
tau of our engine on MT-Bench (chain and tree, greedy).

    OMP_NUM_THREADS=1 python benchmarks/bench_peer.py --recipe runs/lab/base.yaml --base runs/lab/base \
        --heldout runs/lab/heldout --work runs/lab/peer --seeds 0,1 --out benchmarks/results/peer-cpu.json
    python benchmarks/bench_peer.py --smoke        # tiny synthetic target, no engine (the CPU test)
    python benchmarks/bench_peer.py --merge s0.json s1.json s2.json --out all.json   # seeds run apart

JSON: ours and theirs per seed (held-out acceptance, simulated tau, measured tau chain/tree),
means, and peer_tau_ratio = our mean held-out tree tau / theirs (the issue's goal: >= 1.05).
"""
from __future__ import annotations

import argparse
import math
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_ablation beside this file
import bench_ablation as ablation  # noqa: E402

from draftsmith import pipeline  # noqa: E402
from draftsmith.fileio import atomic_write_json, read_json
from draftsmith.manifests import require_complete, verify_shards
from draftsmith.messages import DraftsmithError
from draftsmith.rundir import stage_dir

# speculators 0.9.0's defaults for `--speculator-type eagle3` (train/config/schema.py: OptimizerArgs,
# SchedulerArgs, LossArgs, DraftArgs after _resolve_derived_defaults; train/trainer.py: clip 1.0).
PEER_DEFAULTS = {
    "optimizer": "muon", "lr": 1e-3, "muon_lr": 1e-3, "weight_decay": 0.01, "muon_weight_decay": 0.1,
    "muon_momentum": 0.95, "muon_ns_steps": 5, "muon_adjust_lr_fn": "match_rms_adamw",
    "scheduler_type": "linear", "scheduler_warmup_steps": None,  # None: 1 % of the steps
    "loss_fn": "kl_div", "ttt_step_loss_decay": 1.0,
    "norm_before_residual": True, "norm_before_fc": True, "norm_output": True, "fc_norm": False,
    "embed_requires_grad": False, "sliding_window": 2048,
    "total_seq_len": 8192,  # DataArgs: packed tokens a step (our recipe's batch_tokens would give it other steps)
}


def peer_layer_config(target_path: str, sliding_window: int):
    """The draft decoder config speculators' CLI builds for a Llama verifier
    (train/cli.py create_transformer_layer_config: one llama layer shaped like the verifier,
    sliding-window attention, the verifier's rope)."""
    from copy import deepcopy

    from transformers import AutoConfig, LlamaConfig

    v = AutoConfig.from_pretrained(target_path)
    v = getattr(v, "text_config", v)
    cfg = LlamaConfig(vocab_size=v.vocab_size, hidden_size=v.hidden_size, intermediate_size=v.intermediate_size,
                      num_hidden_layers=1, num_attention_heads=v.num_attention_heads,
                      num_key_value_heads=v.num_key_value_heads, hidden_act=v.hidden_act,
                      max_position_embeddings=v.max_position_embeddings, initializer_range=v.initializer_range,
                      rms_norm_eps=v.rms_norm_eps, head_dim=getattr(v, "head_dim", None), tie_word_embeddings=False,
                      sliding_window=sliding_window, use_sliding_window=True, layer_types=["sliding_attention"])
    if getattr(v, "rope_parameters", None):
        cfg.rope_parameters = deepcopy(v.rope_parameters)
    return cfg


def capture_dataset(index, sample_ids: list[int], max_len: int, dtype: torch.dtype):
    """speculators' BaseDataset over samples of our CaptureIndex: the raw sample dict its
    collate function and shift_batch expect."""
    from speculators.train.data import BaseDataset

    class CaptureDataset(BaseDataset):
        def __init__(self):
            self.ids = list(sample_ids)
            super().__init__(max_len, dtype)

        def _compute_approx_lengths(self):
            return [index.lengths[j] for j in self.ids]

        def __len__(self):
            return len(self.ids)

        def _get_raw_data(self, i):
            b = index.batch([self.ids[i]])
            return {"hidden_states": b.aux_hidden[0].to(dtype), "input_ids": b.input_ids[0],
                    "verifier_last_hidden_states": b.final_hidden[0].to(dtype), "loss_mask": b.loss_mask[0].bool()}

    return CaptureDataset()


def train_peer(args, recipe, seed: int, out_dir: Path) -> dict:
    """Train speculators' EAGLE-3 drafter on the base capture; returns its checkpoint folder and counts.
    On a GPU its forward is compiled whole, as speculators does; should that fail to compile (its first
    step, as its fused loss did on the H200), it is trained again from the start with flex attention
    compiled alone and the rest eager: the same arithmetic, slower, and `trained["compiled"]` says which."""
    if args.peer_compile == "attention" or not torch.cuda.is_available():
        return _train_peer(args, recipe, seed, out_dir, "attention" if torch.cuda.is_available() else "none")
    try:
        return _train_peer(args, recipe, seed, out_dir, "forward")
    except Exception as e:  # noqa: BLE001 -- any failure of their compiled step: one retry, named in the log
        first = (str(e).strip().splitlines() or [""])[0][:300]
        print(f"[peer] speculators' compiled forward failed ({type(e).__name__}: {first}); training again with "
              "only flex attention compiled", flush=True)
        return _train_peer(args, recipe, seed, out_dir, "attention", compile_failure=f"{type(e).__name__}: {first}")


def peer_batch(args) -> int:
    """speculators' packed tokens a step: --total-seq-len, else its default."""
    return args.total_seq_len or PEER_DEFAULTS["total_seq_len"]


def _eager_forward_compiled_attention():
    """speculators' Eagle3DraftModel.forward without its torch.compile wrapper, and its flex attention
    compiled on its own (eager flex attention would build every score)."""
    import speculators.models.attention as attn
    from speculators.models.eagle3 import Eagle3DraftModel

    fwd = Eagle3DraftModel.forward
    Eagle3DraftModel.forward = getattr(fwd, "_torchdynamo_orig_callable", fwd)
    if not getattr(attn.flex_attention, "_draftsmith_compiled", False):
        attn.flex_attention = torch.compile(attn.flex_attention)
        attn.flex_attention._draftsmith_compiled = True


def _train_peer(args, recipe, seed: int, out_dir: Path, compiled: str, compile_failure: str | None = None) -> dict:
    import speculators.train.trainer as trainer_mod
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.dataloader import _setup_dataloader
    from speculators.train.trainer import Trainer, TrainerConfig

    from draftsmith.export.conventions import to_vllm
    from draftsmith.train.data import CaptureIndex
    from draftsmith.draft.vocab import VOCAB_FILE, load_vocab

    if compiled == "attention":
        _eager_forward_compiled_attention()
    d = dict(PEER_DEFAULTS)
    base = Path(args.base)
    cap_dir = stage_dir(base, "capture")
    m = require_complete(cap_dir, "capture")
    index = CaptureIndex(verify_shards(cap_dir, m, check_hash=False), recipe.train.max_length, int(m["hidden_size"]),
                         len(m["aux_layer_ids"]))
    d2t, t2d = load_vocab(stage_dir(base, "vocab") / VOCAB_FILE)
    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(seed)
    model = Eagle3DraftModel.from_training_args(
        verifier_config=peer_layer_config(recipe.target.path, d["sliding_window"]), t2d=t2d, d2t=d2t,
        draft_vocab_size=d2t.numel(), norm_before_residual=d["norm_before_residual"], norm_before_fc=d["norm_before_fc"],
        fc_norm=d["fc_norm"], norm_output=d["norm_output"], embed_requires_grad=d["embed_requires_grad"],
        ttt_steps=recipe.train.ttt_steps, verifier_name_or_path=recipe.target.path,
        target_layer_ids=to_vllm(list(m["aux_layer_ids"])),
        draft_attn_impl="simple_flex_attention" if cuda else "sdpa")
    model.verifier_norm = torch.nn.Identity()  # our final states are post-norm already (module docstring)
    train_kw, val_kw = Eagle3DraftModel.get_trainer_kwargs(ttt_steps=recipe.train.ttt_steps,
                                                           ttt_step_loss_decay=d["ttt_step_loss_decay"],
                                                           loss_fn=d["loss_fn"], loss_implementation=args.peer_loss)
    ids = list(range(len(index)))
    total_seq_len = peer_batch(args)
    loader = _setup_dataloader(capture_dataset(index, ids, total_seq_len, dtype), total_seq_len, int(m["hidden_size"]),
                               num_workers=0, num_target_layers=len(m["aux_layer_ids"]), prefetch_factor=None,
                               preprocess=shift_batch, seed=seed)
    if not cuda:  # the two CPU shims of the module docstring
        trainer_mod.get_local_rank = lambda: "cpu"
        trainer_mod._StepTimer.now = lambda self: None
        trainer_mod._StepTimer.mark = lambda self, name: None
        trainer_mod._StepTimer.profile = lambda self, num_tokens: None
    epochs = recipe.train.epochs
    if epochs != int(epochs):
        raise SystemExit(f"bench_peer: train.epochs {epochs}: speculators trains whole epochs only")
    cfg = TrainerConfig(lr=d["lr"], num_epochs=int(epochs), save_path=str(out_dir), train_call_kwargs=train_kw,
                        val_call_kwargs=val_kw, optimizer=d["optimizer"], weight_decay=d["weight_decay"],
                        muon_lr=d["muon_lr"], muon_momentum=d["muon_momentum"], muon_weight_decay=d["muon_weight_decay"],
                        muon_ns_steps=d["muon_ns_steps"], muon_adjust_lr_fn=d["muon_adjust_lr_fn"],
                        scheduler_type=d["scheduler_type"], scheduler_warmup_steps=d["scheduler_warmup_steps"],
                        hidden_states_dtype=dtype, log_freq=10 ** 9, resume_from_checkpoint=False)
    t0 = time.time()
    trainer = Trainer(model, cfg, loader, None)
    trainer.run_training()
    if (out_dir / "interrupted").exists():  # its signal handler saved a checkpoint there and returned as if done
        raise SystemExit(f"bench_peer: seed {seed}: speculators' training was interrupted by a signal after "
                         f"{trainer.global_step} steps; {out_dir} is not marked complete (a rerun trains it again)")
    # Its epoch checkpoints are rounded to bf16 (Checkpointer.save_checkpoint); the drafter it
    # trained is the float32 model in memory, written here with its own save_pretrained.
    model.save_pretrained(str(out_dir / "final"))
    trained = {"checkpoint": str(out_dir / "final"), "steps": trainer.global_step,
               "steps_per_epoch": len(loader), "total_seq_len": total_seq_len, "train_s": round(time.time() - t0, 1),
               "tokens_per_epoch": sum(index.lengths), "compiled": compiled, "defaults": d,
               "setting": peer_setting(args, recipe)}
    if compile_failure:  # the first, whole-forward attempt's error (train_peer)
        trained["compile_failure"] = compile_failure
    atomic_write_json(out_dir / TRAINED, trained)  # written last: its presence says the checkpoint is whole
    return trained


TRAINED = "trained.json"


def peer_setting(args, recipe) -> dict:
    """What the peer's training depends on beyond its defaults: the data (the base capture) and what
    equal data fixes (epochs, TTT depth, cut length, tokens a step)."""
    return {"capture": require_complete(stage_dir(Path(args.base), "capture"), "capture")["fingerprint"],
            "epochs": recipe.train.epochs, "ttt_steps": recipe.train.ttt_steps, "max_length": recipe.train.max_length,
            "total_seq_len": peer_batch(args)}


def trained_peer(args, recipe, seed: int, out_dir: Path) -> dict:
    """The peer's checkpoint of an earlier run of this seed when it finished (its trained.json) with
    the same defaults and setting (peer_setting), else a fresh training: a rerun after an interruption
    goes on to the measurement, a run at other epochs or on other data trains again."""
    if (out_dir / TRAINED).exists() and (out_dir / "final").is_dir():
        trained = read_json(out_dir / TRAINED)
        if trained.get("defaults") == PEER_DEFAULTS and trained.get("setting") == peer_setting(args, recipe):
            print(f"[peer] seed {seed}: speculators' checkpoint {out_dir / 'final'} is complete; reused", flush=True)
            return trained
        print(f"[peer] seed {seed}: speculators' checkpoint {out_dir / 'final'} was trained with other settings; "
              "training again", flush=True)
    shutil.rmtree(out_dir, ignore_errors=True)  # no epoch or interrupt checkpoint of an earlier training stays beside the new one
    return train_peer(args, recipe, seed, out_dir)


def import_peer(checkpoint: str, recipe, run_dir: Path) -> dict:
    """`draftsmith import-drafter CHECKPOINT --target TARGET --run-dir RUN_DIR` (then evaluate works)."""
    from draftsmith.cli import main as cli

    rc = cli(["import-drafter", checkpoint, "--target", recipe.target.path, "--run-dir", str(run_dir)])
    if rc != 0:
        raise SystemExit(f"bench_peer: import-drafter {checkpoint} failed (exit {rc})")
    return read_json(run_dir / "train" / "manifest.json")["imported"]


def lap(phases: dict, name: str, since: float, seed: int) -> float:
    """phases[name] = seconds since `since`, printed; returns now."""
    now = time.time()
    phases[name] = round(now - since, 1)
    print(f"[peer] seed {seed}: {name} in {phases[name]} s", flush=True)
    return now


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipe", help="base recipe YAML (our training recipe: defaults unless flags are given)")
    p.add_argument("--base", help="run folder with complete data/, capture/ and vocab/")
    p.add_argument("--heldout", help="run folder with a complete capture/ of other conversations")
    p.add_argument("--work", default="runs/peer")
    p.add_argument("--seeds", default="0")
    p.add_argument("--ours", default="", help="extra recipe flags for our drafter (space-separated)")
    p.add_argument("--ours-name", default="ours",
                   help="our run folder is WORK/NAME-sSEED (bench_ablation's names reuse its trained variants)")
    p.add_argument("--total-seq-len", type=int, default=None,
                   help="speculators' packed tokens per step (default: its own, 8192; the CPU figure of BENCHMARKS.md "
                        "used 4096)")
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--sim-depth", type=int, default=5)
    p.add_argument("--eval-prompts", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--benchmark", default="mtbench", help="evaluate.benchmarks entry: mtbench or a question file")
    p.add_argument("--draft-steps", type=int, default=5)
    p.add_argument("--temperatures", type=lambda v: [float(t) for t in v.split(",")], default=None,
                   help="comma-separated temperatures the engine measures both drafters at (evaluate.temperatures; "
                        "default: the recipe's evaluate.temperature alone); peer_tau_ratio_by_temperature has one ratio each")
    p.add_argument("--serves", type=lambda v: [float(t) for t in v.split(",")], default=None,
                   help="the temperatures our recipe is made for (a greedy server: 0; a sampling one: e.g. 0.7,1): "
                        "--by-temperature takes each temperature's ratio from the result that serves it")
    p.add_argument("--by-temperature", nargs="+", metavar="JSON",
                   help="no training: one ratio per temperature from bench_peer results run with --serves, each "
                        "temperature's from the result whose recipe serves it, into --out")
    p.add_argument("--peer-loss", choices=("eager", "fused"), default="eager",
                   help="speculators' loss implementation: eager (default; the same values, its tests check) or fused, "
                        "its Triton kernel, which torch 2.11's dynamo fails to trace inside its compiled forward on the "
                        "H200 (benchmarks/results/h200-2026-12-05-s7/B-peer.log)")
    p.add_argument("--peer-compile", choices=("forward", "attention"), default="forward",
                   help="on a GPU: speculators' whole forward compiled (its own way; on failure the run falls back to "
                        "the other) or only its flex attention compiled")
    p.add_argument("--ngram", action="store_true",
                   help="measure n-gram prompt lookup beside our drafter (same prompts and evaluation; it needs no drafter)")
    p.add_argument("--no-engine", action="store_true")
    p.add_argument("--smoke", action="store_true", help="tiny synthetic target, one seed, no engine (CPU test)")
    p.add_argument("--merge", nargs="+", metavar="JSON",
                   help="no training: merge bench_peer outputs of other seeds (same settings) into --out")
    p.add_argument("--out")
    args = p.parse_args(argv)
    if args.merge:
        return merge(args.merge, args.out)
    if args.by_temperature:
        return combine_temperatures(args.by_temperature, args.out)
    if args.smoke:
        import tempfile

        root = Path(tempfile.mkdtemp(prefix="bench_peer_"))
        args.recipe, args.base, args.heldout = ablation.make_smoke(root)
        args.work, args.no_engine, args.depth, args.sim_depth, args.seeds = str(root / "peer"), True, 3, 3, "0"
    if not (args.recipe and args.base and args.heldout):
        p.error("--recipe, --base and --heldout are required (or --smoke)")
    ours_flags = args.ours.split()
    result = {"recipe": args.recipe, "ours_flags": ours_flags, "depth": args.depth, "sim_depth": args.sim_depth,
              "eval_prompts": args.eval_prompts, "benchmark": args.benchmark, "serves": args.serves,
              "ours": [], "theirs": []}
    for seed in [int(s) for s in args.seeds.split(",")]:
        ours_dir = Path(args.work) / f"{args.ours_name}-s{seed}"
        ablation.link_stages(Path(args.base), ours_dir)
        recipe = ablation.recipe_for(args.recipe, ours_dir, seed, ours_flags)
        theirs_dir = Path(args.work) / f"theirs-s{seed}"
        ablation.link_stages(Path(args.base), theirs_dir)
        # the peer trains first: a failure of its trainer (a dependency, a kernel) ends the run before ours
        # spent its time (on the H200, 2026-12-05, it failed after ours had trained and been measured)
        phases, t = {}, time.time()  # where a device call's time goes, printed as it goes (result["phases_s"])
        trained = trained_peer(args, recipe, seed, theirs_dir / "speculators")
        t = lap(phases, "peer_trained", t, seed)
        m = pipeline.run_stage("train", recipe)
        t = lap(phases, "ours_trained", t, seed)
        ours = ablation.measure(args, ours_dir, recipe, seed, ours_flags, args.ngram)
        t = lap(phases, "ours_measured", t, seed)
        ours.update(steps=m["counts"]["steps"], train_s=m["timings"].get("train_s_this_session"))
        result["ours"].append(ours)
        keep_partial(result, args.out, f"seed {seed}: ours measured, the peer not yet", seed, "ours", ours)

        imported = theirs_dir / "train" / "manifest.json"
        if imported.exists() and read_json(imported).get("status") == "complete" and \
                Path(read_json(imported).get("imported", {}).get("source", "")).resolve() == Path(trained["checkpoint"]).resolve():
            info = read_json(imported)["imported"]
        else:
            info = import_peer(trained["checkpoint"], recipe, theirs_dir)
        theirs = ablation.measure(args, theirs_dir, ablation.recipe_for(args.recipe, theirs_dir, seed, ours_flags), seed,
                                  ours_flags)
        lap(phases, "peer_imported_and_measured", t, seed)
        result.setdefault("phases_s", {})[str(seed)] = phases
        theirs.update({k: v for k, v in trained.items() if k != "defaults"}, imported=info)
        result["theirs"].append(theirs)
        result["peer_defaults"] = trained["defaults"]
        keep_partial(result, args.out, f"seed {seed}: both measured", seed, "theirs", theirs)
    result.pop("partial", None)
    return summarize(result, "tau_tree" if not args.no_engine else "tau_sim", args.out)


def keep_partial(result: dict, out: str | None, where: str, seed: int, side: str, row: dict) -> None:
    """A side's row as soon as it is measured: printed, and the result so far written to `out` with
    `partial` saying how far it got, so that a run cut at a device call's limit keeps what it measured
    (the final write replaces it; --merge refuses a partial file)."""
    taus = " ".join(f"{k} {row[k]:.3f}" for k in ("tau_sim", "tau_tf", "tau_sim_sampled_t1", "tau_chain", "tau_tree", "ngram_tau") if k in row)
    print(f"[peer] seed {seed}: {side} acc {' '.join(f'{a:.3f}' for a in row['heldout_acc'])} {taus}", flush=True)
    result["partial"] = where
    if out:
        atomic_write_json(Path(out), result)


def summarize(result: dict, key: str, out: str | None) -> int:
    """Both sides' means over the seeds and peer_tau_ratio (ours / theirs, of `key`); printed, and
    written to `out`."""
    for side in ("ours", "theirs"):
        result[f"{side}_mean"] = ablation.mean_row(result[side])
    result["peer_tau_ratio"] = result["ours_mean"][key] / result["theirs_mean"][key]
    result["peer_tau_ratio_of"] = key
    ci = ratio_interval(result, key)
    if ci:
        result["peer_tau_ratio_ci95"], result["peer_tau_ratio_turns"] = ci
    temps = [set(r.get("by_temperature", {})) for r in result["ours"] + result["theirs"]]
    if key == "tau_tree" and temps and all(temps):
        result["peer_tau_ratio_by_temperature"] = {}
        for T in sorted(set.intersection(*temps), key=float):
            at = {side: [r["by_temperature"][T] for r in result[side]] for side in ("ours", "theirs")}
            mean = {side: sum(r["tau_tree"] for r in rows) / len(rows) for side, rows in at.items()}
            ci_T = ratio_interval(at, key)
            result["peer_tau_ratio_by_temperature"][T] = {
                "ratio": mean["ours"] / mean["theirs"], "ours_tau_tree": mean["ours"], "theirs_tau_tree": mean["theirs"],
                **({"ci95": ci_T[0], "turns": ci_T[1]} if ci_T else {})}
            print(f"[peer] temperature {T}: ours tree tau {mean['ours']:.3f}, theirs {mean['theirs']:.3f}: "
                  f"ratio {mean['ours'] / mean['theirs']:.3f}" + (f" (95% {ci_T[0][0]:.3f}-{ci_T[0][1]:.3f})" if ci_T else ""))
    print(f"[peer] seeds {','.join(str(r['seed']) for r in result['ours'])}: ours {key} {result['ours_mean'][key]:.3f}, "
          f"theirs {result['theirs_mean'][key]:.3f}: peer_tau_ratio {result['peer_tau_ratio']:.3f}"
          + (f" (95% over turns: {ci[0][0]:.3f}-{ci[0][1]:.3f}, {ci[1]} turns)" if ci else ""))
    if out:
        atomic_write_json(Path(out), result)
    return 0 if math.isfinite(result["peer_tau_ratio"]) else 1


def ratio_interval(result: dict, key: str, draws: int = 2000, seed: int = 0):
    """((lo, hi), turns): a paired bootstrap 95% interval of peer_tau_ratio over the evaluation's
    turns: the same resampled turns (with replacement) for every seed and both sides, each seed's
    tau over them sum(emitted) / sum(rounds), the ratio of the sides' means over seeds. None when
    a row lacks its turns (older results, tau_sim) or the sides measured other turns."""
    method = {"tau_tree": "eagle3_tree", "tau_chain": "eagle3_chain"}.get(key)
    rows = result["ours"] + result["theirs"]  # result: or any {"ours": rows, "theirs": rows} (one temperature's)
    if method is None or not all(method in r.get("per_turn", {}) for r in rows):
        return None
    keys = [t[0] for t in rows[0]["per_turn"][method]]
    if any([t[0] for t in r["per_turn"][method]] != keys for r in rows):
        return None
    counts = torch.tensor([[t[1:] for t in r["per_turn"][method]] for r in rows], dtype=torch.float64)  # [rows, turns, 2]
    pick = torch.randint(0, len(keys), (draws, len(keys)), generator=torch.Generator().manual_seed(seed))
    sums = counts[:, pick].sum(2)  # [rows, draws, 2]: emitted and rounds over each draw's turns
    tau = sums[..., 0] / sums[..., 1]
    n = len(result["ours"])
    ratio = (tau[:n].mean(0) / tau[n:].mean(0)).sort().values
    return (float(ratio[int(0.025 * draws)]), float(ratio[int(0.975 * draws) - 1])), len(keys)


SAME = ("recipe", "ours_flags", "depth", "sim_depth", "eval_prompts", "benchmark", "serves", "peer_tau_ratio_of")


def merge(files: list[str], out: str | None) -> int:
    """One result from runs of other seeds with the same settings (a device call holds a seed or
    two): their rows together, the means and ratio computed again. Each file's own summary is left."""
    try:
        results = [read_json(Path(f)) for f in files]
    except DraftsmithError as e:
        raise SystemExit(f"bench_peer --merge: {e}") from None
    for f, r in zip(files, results):
        if "partial" in r:
            raise SystemExit(f"bench_peer --merge: {f}: a partial result ({r['partial']}: the run was cut); "
                             "run that seed again to its end")
        if not all(k in r for k in ("ours", "theirs", "peer_tau_ratio_of")):
            raise SystemExit(f"bench_peer --merge: {f}: not a bench_peer result (no ours, theirs or peer_tau_ratio_of); "
                             "merge the --out files of bench_peer runs")
    first = results[0]
    for f, r in zip(files[1:], results[1:]):
        for k in SAME:
            if r.get(k) != first.get(k):
                raise SystemExit(f"bench_peer --merge: {f}: {k} {r.get(k)!r} differs from {files[0]}'s "
                                 f"{first.get(k)!r}; merge runs of the same settings only")
    captures = {f: {row.get("setting", {}).get("capture") for row in r["theirs"]} - {None} for f, r in zip(files, results)}
    if len(set().union(*captures.values())) > 1:  # another target (retrained on another card) or other data
        raise SystemExit("bench_peer --merge: the peer trained on different captures (" + "; ".join(
            f"{f}: {', '.join(sorted(c))}" for f, c in captures.items() if c) + "); seeds on different data or targets "
            "stand beside each other: merge the seeds of one capture only")
    seeds = [row["seed"] for r in results for row in r["ours"]]
    if len(set(seeds)) != len(seeds):
        raise SystemExit(f"bench_peer --merge: seed(s) {sorted({s for s in seeds if seeds.count(s) > 1})} in more "
                         f"than one of {', '.join(files)}; keep one run of each seed")
    merged = {k: first.get(k) for k in SAME} | {"merged_from": [Path(f).name for f in files]}
    for side in ("ours", "theirs"):
        merged[side] = [row for r in results for row in r[side]]
    merged["peer_defaults"] = first.get("peer_defaults")
    merged["phases_s"] = {s: v for r in results for s, v in r.get("phases_s", {}).items()}
    return summarize(merged, first["peer_tau_ratio_of"], out)


def combine_temperatures(files: list[str], out: str | None) -> int:
    """peer_tau_ratio at each temperature from the bench_peer result whose recipe serves it (--serves):
    a server decoding greedily runs the greedy recipe, one sampling at 0.7 or 1 the sampling recipe, and
    each is compared with the same peer checkpoint measured at that temperature. One line for a file
    without --serves or a temperature two files claim."""
    picked: dict = {}
    for f in files:
        try:
            r = read_json(Path(f))
        except DraftsmithError as e:
            raise SystemExit(f"bench_peer --by-temperature: {e}") from None
        if "partial" in r or not r.get("serves") or "peer_tau_ratio_by_temperature" not in r:
            raise SystemExit(f"bench_peer --by-temperature: {f}: not a complete bench_peer result run with --serves and "
                             "--temperatures (it needs serves and peer_tau_ratio_by_temperature); run it so")
        for t in r["serves"]:
            T = f"{t:g}"
            if T in picked:
                raise SystemExit(f"bench_peer --by-temperature: temperature {T} is served by {picked[T]['file']} and {f}; "
                                 "give each temperature one recipe")
            if T not in r["peer_tau_ratio_by_temperature"]:
                raise SystemExit(f"bench_peer --by-temperature: {f} serves temperature {T} but did not measure it; "
                                 f"rerun it with --temperatures including {T}")
            picked[T] = {"file": Path(f).name, "ours_flags": r["ours_flags"], **r["peer_tau_ratio_by_temperature"][T]}
    result = {"by_temperature": dict(sorted(picked.items(), key=lambda kv: float(kv[0]))),
              "min_ratio": min(v["ratio"] for v in picked.values())}
    for T, v in result["by_temperature"].items():
        print(f"[peer] temperature {T} ({v['file']}): ratio {v['ratio']:.3f}")
    if out:
        atomic_write_json(Path(out), result)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except DraftsmithError as e:  # the pipeline's own one-line errors (a stage missing, a bad recipe)
        sys.exit(f"bench_peer: {e}")
