"""The evaluate stage: EAGLE-3 (chain and tree), n-gram and plain decoding of the same target.

For every benchmark prompt (MT-Bench both turns: turn 2 follows the target's own first answer;
HumanEval; any JSONL of prompts), rendered with the target's chat template, every method runs
in this process, one after the other, after one warm-up (measure.py). Reported per method
(report.py):
    tau         tokens emitted per target verification forward (the target's own token counted)
    per position: P(accept | reached) and P(accept) for draft depths 1..k, and a histogram
    tokens/s and the speedup (plain time / method time, same target, same process)
and, for batch sizes > 1, the same over batches of prompts. Greedy speculative output must equal
plain output (check_lossless; when evaluate samples, on a greedy spot check of the first turns).
Step costs for `plan` (target forward over 1..64 tokens, drafter step; costs.py) go into the
manifest. Each prompt's result is appended to eval/partial.jsonl, so a killed evaluation resumes
after the last finished prompt.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

from ..fileio import append_jsonl, atomic_write_bytes, atomic_write_json, atomic_write_text, read_jsonl, sha256_file
from ..manifests import finish_manifest, load_manifest, new_manifest, require_complete, verify_shards, write_manifest
from ..messages import DraftsmithError, log
from ..rundir import RECIPE_FILE, stage_dir
from ..config import EvaluateConfig, Recipe, check_recipe
from ..data.conversations import conversation_keys, conversation_of
from ..data.readers import Prompt, load_prompts, resolve_source
from ..data.shards import source_ids
from ..figures.evaluate import EvaluateCounts, EvaluateFigures, EvaluateMetrics, MethodRow
from ..speculate.cache import CAPTURE_FALLBACKS, seeded_generator
from ..speculate.methods import DecodeRunners, load_models, prompt_budget
from ..target.model import eos_token_ids
from .costs import decode_roofline, measure_step_costs, overheads
from .measure import check_methods, check_recorded, evaluate_batch, evaluate_prompt, run_method, run_plain
from .report import fmt, lossless_tally, plot_acceptance, print_table, ratio, render_report, summarize, table_rows

PARTIAL = "partial.jsonl"
SPOT_CHECK_TURNS, SPOT_CHECK_TOKENS = 4, 64
"""When evaluate samples (its outputs are draws, no lossless verdict), the first SPOT_CHECK_TURNS turns
are decoded greedily too, SPOT_CHECK_TOKENS new tokens, and checked lossless as at temperature 0."""


# ----------------------------------------------------------------------------- inputs


def trained_conversations(run_dir: Path) -> tuple[Optional[Path], set]:
    """(the file prepare read, the conversations of its samples): a benchmark read from that file
    must not measure on a conversation any part of which the drafter trained on. Every prepared
    sample counts (train's own held-out ones too), so the exclusion never depends on train's split."""
    data_dir = stage_dir(run_dir, "prepare")
    m = load_manifest(data_dir)
    path = ((m or {}).get("source") or {}).get("path")
    if not path:
        return None, set()
    ids: list = []
    for s in verify_shards(data_dir, m, check_hash=False):
        entry = next(e for e in m["shards"] if e["file"] == s.name)
        ids += source_ids(s, int(entry["num_samples"])) or [None] * int(entry["num_samples"])
    return Path(path).resolve(), set(conversation_keys(ids, list(range(len(ids)))))


def benchmark_prompts(cfg: EvaluateConfig, run_dir: Path) -> tuple[list[tuple[str, str, Prompt]], int]:
    """(key, benchmark, prompt) of every prompt evaluate measures, and how many were passed over as
    part of a training conversation (a benchmark that is the file prepare read; ShareGPT parts
    `abc_0`, `abc_1` are one conversation, data/conversations.py)."""
    source, trained = trained_conversations(run_dir)
    todo, excluded = [], [0]

    def in_training(record_id: str) -> bool:
        hit = conversation_of(record_id, trained) is not None
        excluded[0] += hit
        return hit

    for bench in cfg.benchmarks:
        same = source is not None and resolve_source(bench)[0].resolve() == source
        prompts = load_prompts(bench, cfg.max_prompts, in_training if same else None)
        todo += [(f"{bench}#{i}", bench, p) for i, p in enumerate(prompts)]
    return todo, excluded[0]


def render_prompt(tokenizer, text: str | list[dict], where: str) -> list[int]:
    """A user turn (or a whole conversation ending with a user turn) -> chat-template token ids,
    ending with the assistant header."""
    if not getattr(tokenizer, "chat_template", None):
        raise DraftsmithError(f"{where}: the target tokenizer has no chat template; add `chat_template` to its "
                              "tokenizer_config.json (or a chat_template.jinja next to it)")
    messages = [{"role": "user", "content": text}] if isinstance(text, str) else text
    try:
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:
        raise DraftsmithError(f"{where}: chat template failed ({type(e).__name__}: {' '.join(str(e).split())[:200]}); "
                              "fix the prompt or the template") from None
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


def answer_text(tokenizer, new_tokens: list[int], eos_ids: list[int]) -> str:
    """The target's answer as text for the next turn (EOS dropped)."""
    return tokenizer.decode([t for t in new_tokens if t not in eos_ids], skip_special_tokens=True).strip()


def turn_key(key: str, turn: int) -> str:
    """A turn's key in partial.jsonl and results.json: the prompt's key, then /turnN from turn 2 on (turn 0-based)."""
    return key if turn == 0 else f"{key}/turn{turn + 1}"


def turn_where(bench: str, prompt: Prompt, turn: int) -> str:
    """A turn as the log and errors name it."""
    return f"{bench}: prompt {prompt.id}" + (f" turn {turn + 1}" if turn else "")


def turn_prompt(tokenizer, prompt: Prompt, turn: int, answers: list[list[int]], eos_ids: list[int], where: str) -> list[int]:
    """Turn `turn` (0-based) of a prompt as the target reads it: each earlier user turn followed by the
    target's own plain answer to it (answers[i]: its new tokens), then this turn's user text."""
    history: list[dict] = []
    for text, answer in zip(prompt.turns[:turn], answers):
        history += [{"role": "user", "content": text}, {"role": "assistant", "content": answer_text(tokenizer, answer, eos_ids)}]
    return render_prompt(tokenizer, history + [{"role": "user", "content": prompt.turns[turn]}], where)


# ----------------------------------------------------------------------------- stage


def per_round_rates(method_summary: dict) -> list:
    """P(depth j accepted | depth j - 1 accepted) over every round of a method."""
    acc = method_summary["per_position"]["accepted"]
    prev = [method_summary["overall"]["rounds"]] + acc[:-1]
    return [ratio(a, n) for a, n in zip(acc, prev)]


def manifest_figures(summary: dict, cfg, methods: list[str], too_long: int, batches: int, path: str,
                     fallbacks: int) -> tuple[EvaluateCounts, EvaluateMetrics]:
    """The manifest's counts and metrics (what `status` and `plan` read) from the summary."""
    # The headline figures: EAGLE-3 chain (the planner's per-position profile is a chain's).
    main = next((m for m in ("eagle3_chain", "eagle3_tree", "ngram") if m in methods), None)
    o = summary["methods"][main]["overall"] if main else {}
    counts = EvaluateCounts(prompts=summary["plain"]["prompts"], prompts_too_long=too_long,
                            plain_new_tokens=summary["plain"]["new_tokens"], batches=batches,
                            near_tie_divergences=sum((s.get("lossless") or {}).get("near_tie_divergences", 0)
                                                     for s in summary["methods"].values()))
    metrics = EvaluateMetrics(
        method=main, tau=o.get("tau"),
        tau_per_benchmark={b: s["tau"] for b, s in summary["methods"][main]["per_benchmark"].items()} if main else {},
        accept_rate_per_position=summary["methods"][main]["per_position"]["accept_rate"] if main else [],
        accept_rate_per_position_unconditional=
            summary["methods"][main]["per_position"]["accept_rate_unconditional"] if main else [],
        accept_rate_per_position_by_method={m: s["per_position"]["accept_rate"] for m, s in summary["methods"].items()
                                            if "per_position" in s},
        # over every round, those that drafted nothing counted as rejected at depth 1 (prompt lookup often
        # finds no match): E = 1 + sum_j prod_{i<=j} a_i gives the method's tau, what `plan` needs of n-gram
        accept_rate_per_position_per_round_by_method={m: per_round_rates(s) for m, s in summary["methods"].items()
                                                      if "per_position" in s},
        tokens_per_s_spec=o.get("tokens_per_s_spec"), tokens_per_s_plain=summary["plain"]["tokens_per_s"],
        speedup=o.get("speedup"), num_prompts=counts.prompts, draft_steps=cfg.draft_steps,
        path=path, capture_fallbacks=fallbacks,
        plain_decode_bw_fraction=(summary["roofline"] or {}).get("fraction_of_measured_bw"),
        plain_decode_bw_fraction_nominal=(summary["roofline"] or {}).get("fraction_of_nominal_bw"),
        methods={m: MethodRow(tau=s["overall"]["tau"], speedup=s["overall"]["speedup"],
                              tokens_per_s=s["overall"]["tokens_per_s_spec"]) for m, s in summary["methods"].items()},
        batches={B: {m: a["speedup"] for m, a in row["methods"].items()} for B, row in summary["batches"].items()})
    return counts, metrics


@dataclass
class Evaluation:
    """What evaluate decodes with, set up once (target, drafter, methods, decoding path), and the
    measurements partial.jsonl already holds (`done`, by key): each is made once and appended there."""
    target: Any
    drafter: Any
    cfg: EvaluateConfig
    methods: list[str]
    eos: list[int]
    runners: DecodeRunners
    partial: Path
    done: dict
    warmed: set = field(default_factory=set)
    prefix: str = ""
    """Before every key of this temperature's records (several temperatures: "T0.7/")."""

    def warm_up(self, prompts: list[list[int]]) -> None:
        """First calls at a batch size pay for allocation, kernel selection and graph capture."""
        if len(prompts) in self.warmed:
            return
        n = min(8, self.cfg.max_new_tokens)
        run_plain(self.target, prompts, self.cfg, self.eos, runners=self.runners, max_new_tokens=n)
        for m in self.methods:
            gen = seeded_generator(self.target.device, self.cfg.temperature, self.cfg.seed, -1)
            run_method(self.target, self.drafter, m, prompts, self.cfg, self.eos, gen, n, runners=self.runners)
        self.warmed.add(len(prompts))

    def turns(self, todo: list[tuple[str, str, Prompt]], budget: Optional[int]):
        """Every turn at batch 1 -> (records, too_long). A record holds its prompt ids and plain output
        (the batches' prompts and lossless reference); too_long: turns whose prompt does not fit the target's
        positions with max_new_tokens (refused, counted and reported; the prompt's later turns only grow)."""
        cfg, tokenizer = self.cfg, self.target.tokenizer
        records, too_long = [], []
        for n, (key, bench, p) in enumerate(todo, 1):
            answers: list[list[int]] = []
            for turn in range(min(len(p.turns), max(cfg.max_turns, 1))):
                where = turn_where(bench, p, turn)
                ids = turn_prompt(tokenizer, p, turn, answers, self.eos, where)
                tkey = self.prefix + turn_key(key, turn)
                if budget is not None and len(ids) > budget:
                    too_long.append({"key": tkey, "benchmark": bench, "id": p.id, "prompt_tokens": len(ids), "limit": budget})
                    log(f"[evaluate] {where}: {len(ids):,} prompt tokens, over the {budget:,} that fit the target's positions "
                        f"with max_new_tokens {cfg.max_new_tokens}; skipped (counted as prompts_too_long)")
                    break
                rec = self.done.get(tkey)
                if rec is None:
                    self.warm_up([ids])
                    rec = {"key": tkey, "benchmark": bench, "id": p.id, "category": p.category, "turn": turn + 1,
                           "temperature": cfg.temperature,
                           **evaluate_prompt(self.target, self.drafter, ids, cfg, self.methods, self.eos, len(records), where,
                                             runners=self.runners)}
                    append_jsonl(self.partial, rec)
                    log(f"[evaluate] {self.prefix}{n}/{len(todo)} {where}: {rec['plain_new_tokens']} tokens, " + ", ".join(
                        f"{m} tau {fmt(r['emitted'] / r['rounds'] if r['rounds'] else None)} speedup "
                        f"{fmt(rec['plain_s'] / r['spec_s'] if r['spec_s'] else None)}" for m, r in rec["methods"].items()))
                else:
                    rec.setdefault("prompt_ids", ids)  # resumed from a partial.jsonl written before records kept them
                    if cfg.check_lossless and cfg.temperature <= 0:  # it may have been measured with the check off
                        check_recorded(rec, where, self.target.dtype)
                records.append(rec)
                answers.append(rec["plain_tokens"])
        return records, too_long

    def greedy_spot_check(self, records: list[dict]) -> dict[str, dict]:
        """At temperature > 0 (with check_lossless): plain decoding and every method, greedy, on the first
        SPOT_CHECK_TURNS turns, each method's output checked against plain's (lossless_check: a bug
        raises). {method: lossless tally, marked greedy_spot_check}; empty when greedy or not checked."""
        if self.cfg.temperature <= 0 or not self.cfg.check_lossless:
            return {}
        greedy = replace(self.cfg, temperature=0.0, max_new_tokens=min(self.cfg.max_new_tokens, SPOT_CHECK_TOKENS))
        checks: dict[str, list[dict]] = {m: [] for m in self.methods}
        for rec in records[:SPOT_CHECK_TURNS]:
            r = evaluate_prompt(self.target, self.drafter, rec["prompt_ids"], greedy, self.methods, self.eos, 0,
                                f"{rec['key']} (greedy spot check)", runners=self.runners)
            for m in self.methods:
                checks[m].append(r["methods"][m])
        log(f"[evaluate] greedy spot check of {min(len(records), SPOT_CHECK_TURNS)} turn(s): " + ", ".join(
            f"{m} {sum(c['lossless'] for c in cs)}/{len(cs)} identical to plain decoding" for m, cs in checks.items()))
        return {m: {**lossless_tally(cs), "greedy_spot_check": True} for m, cs in checks.items()}

    def batches(self, records: list[dict]) -> list[dict]:
        """Each batch size > 1 over consecutive turns (full batches only), every method against plain
        decoding of the same batch; the batch-1 plain outputs are the lossless reference."""
        out = []
        for B in sorted({b for b in self.cfg.batch_sizes if b > 1}):
            for j in range(0, len(records) - B + 1, B):
                bkey = f"{self.prefix}batch{B}#{j // B}"
                rec = self.done.get(bkey)
                if rec is None:
                    chunk = records[j:j + B]
                    prompts = [r["prompt_ids"] for r in chunk]
                    self.warm_up(prompts)
                    rec = {"key": bkey, "temperature": self.cfg.temperature, **evaluate_batch(self.target, self.drafter, prompts, [r["plain_tokens"] for r in chunk],
                                                         self.cfg, self.methods, self.eos, j, runners=self.runners)}
                    append_jsonl(self.partial, rec)
                    log(f"[evaluate] batch size {B}, batch {j // B + 1}: " + ", ".join(
                        f"{m} speedup {fmt(rec['plain_s'] / r['spec_s'])}" for m, r in rec["methods"].items()))
                out.append(rec)
        return out


def evaluate_temperatures(cfg: EvaluateConfig) -> list[float]:
    """The temperatures one evaluation measures at: evaluate.temperatures (unset: [temperature]), with the
    served one (evaluate.temperature) among them even when the list leaves it out."""
    temps = [float(t) for t in (cfg.temperatures if cfg.temperatures is not None else [cfg.temperature])]
    return temps if float(cfg.temperature) in temps else [float(cfg.temperature), *temps]


def check_verdict(manifest: dict, recipe: Recipe) -> tuple[str, str]:
    """A complete evaluation is done whatever evaluate.check_lossless now says (it is hashed at one value,
    pipeline.HASHED_AT), except one measured with the check off when it is now on: the check runs while
    measuring, so that one starts over."""
    if recipe.evaluate.check_lossless and manifest.get("config", {}).get("check_lossless") is False:
        return "restart", "evaluate.check_lossless is on and this output was measured with it off"
    return "done", ""


def run(recipe: Recipe, run_dir: Path, fp: str) -> dict:
    cfg = recipe.evaluate
    run_dir = Path(run_dir)
    out_dir = stage_dir(run_dir, "evaluate")
    drafter_dir = stage_dir(run_dir, "train") / "drafter"
    train = require_complete(stage_dir(run_dir, "train"), "train")
    check_recipe(recipe, str(run_dir / RECIPE_FILE), only=("evaluate",))
    methods = check_methods(cfg, str(run_dir / RECIPE_FILE))

    old = load_manifest(out_dir)
    resuming = old is not None and old.get("status") == "running" and old.get("fingerprint") == fp
    out_dir.mkdir(parents=True, exist_ok=True)
    partial = out_dir / PARTIAL
    if not resuming:
        partial.unlink(missing_ok=True)
    done = {rec["key"]: rec for rec in read_jsonl(partial) if "key" in rec}

    target, drafter = load_models(recipe, drafter_dir)
    runners = DecodeRunners(target, drafter, cfg.fast, cfg.verify_gemm)
    rounds = "; EAGLE-3 rounds on the device" if cfg.resident and runners.mode != "off" else ""
    log(f"[evaluate] decoding path: {runners.mode} (plain decoding and every method alike{rounds})")
    todo, in_training = benchmark_prompts(cfg, run_dir)
    if in_training:
        log(f"[evaluate] {in_training} prompt(s) passed over: part of a conversation prepare gave to training")

    manifest = new_manifest("evaluate", fp, cfg, {"train": train["fingerprint"],
                                                  "drafter_sha256": sha256_file(drafter_dir / "model.safetensors")})
    if resuming:
        manifest["started_at"] = old.get("started_at", manifest["started_at"])
    write_manifest(out_dir, manifest)
    if done:
        log(f"[evaluate] resuming: {len(done)} measurements already done")

    temps = evaluate_temperatures(cfg)
    budget = prompt_budget(target, cfg, methods)
    measured = {}  # temperature -> (summary, records, batch records, too_long, fallbacks)
    n0 = len(CAPTURE_FALLBACKS)  # this stage's CUDA-graph captures that fall back to eager (step costs' too)
    eos, spot_check = eos_token_ids(target), None
    for T in temps:
        cfg_t = replace(cfg, temperature=T)
        prefix = f"T{T:g}/" if len(temps) > 1 else ""  # one temperature: the keys partial.jsonl always had
        ev = Evaluation(target, drafter, cfg_t, methods, eos, runners, partial, done, prefix=prefix)
        n_fallbacks = len(CAPTURE_FALLBACKS)  # this temperature's CUDA-graph captures that fall back to eager
        records, too_long = ev.turns(todo, budget)
        if not records:
            raise DraftsmithError(f"{', '.join(cfg.benchmarks)}: no prompt fits the target's positions with evaluate.max_new_tokens "
                                  f"{cfg.max_new_tokens} ({len(too_long)} refused, longest limit {budget}); use shorter prompts or "
                                  "lower evaluate.max_new_tokens")
        if spot_check is None and T > 0:  # greedy decoding is checked once: measured (0 in temps) or spot-checked
            spot_check = {} if 0 in temps else ev.greedy_spot_check(records)
        batch_records = ev.batches(records)
        summary = summarize(records, batch_records, cfg_t, methods)
        for m, tally in (spot_check or {}).items():
            summary["methods"][m]["lossless"] = tally
        summary["path"], summary["temperature"] = runners.mode, T
        summary["roofline"] = decode_roofline(target, summary["plain"]["tokens_per_s"])
        measured[T] = (summary, records, batch_records, too_long, CAPTURE_FALLBACKS[n_fallbacks:])
    summary, records, batch_records, too_long, _ = measured[float(cfg.temperature)]  # the served temperature's: headline

    step_costs = measure_step_costs(target, drafter, records[0]["prompt_ids"] + records[0]["plain_tokens"], runners=runners,
                                    batch_sizes=[b for b in cfg.batch_sizes if b > 1 and b <= len(records)],
                                    tree_topk=cfg.tree_topk) if cfg.step_costs and records else None
    if step_costs:
        step_costs.update(overheads(summary, step_costs, cfg))
    all_fallbacks = CAPTURE_FALLBACKS[n0:]
    if all_fallbacks:  # those calls ran eagerly: their timings are not the graphs path's
        log(f"[evaluate] WARNING: {len(all_fallbacks)} CUDA-graph capture(s) fell back to eager (capture_fallbacks in results.json)")
    results = {"config": cfg, "eos_ids": eos, "summary": summary,
               "step_costs": step_costs, "prompts": [r for m in measured.values() for r in m[1]],
               "batches": [r for m in measured.values() for r in m[2]], "prompts_too_long": too_long,
               "capture_fallbacks": all_fallbacks}
    if len(temps) > 1:
        results["by_temperature"] = {f"{T:g}": m[0] for T, m in measured.items()}
    atomic_write_json(out_dir / "results.json", results)
    atomic_write_text(out_dir / "report.md", "\n\n".join(render_report(m[0], recipe, T if len(temps) > 1 else None)
                                                         for T, m in measured.items()))
    atomic_write_bytes(out_dir / "acceptance.png", plot_acceptance(summary))
    for T, m in measured.items():
        if len(temps) > 1:
            print(f"temperature {T:g}" + (" (served: evaluate.temperature)" if T == float(cfg.temperature) else ""))
        print_table(table_rows(m[0]))

    counts, metrics = manifest_figures(summary, cfg, methods, len(too_long), len(batch_records), runners.mode,
                                       len(all_fallbacks))
    metrics.temperature = cfg.temperature
    if len(temps) > 1:
        metrics.by_temperature = {
            f"{T:g}": manifest_figures(m[0], replace(cfg, temperature=T), methods, len(m[3]), len(m[2]), runners.mode,
                                       len(m[4]))[1].methods for T, m in measured.items()}
    counts.prompts_in_training = in_training
    manifest.update(EvaluateFigures(counts=counts, metrics=metrics, step_costs=step_costs or None).to_dict())
    manifest["timings"] = {"plain_s": sum(m[0]["plain"]["plain_s"] for m in measured.values()),
                           **{f"{k}_s": sum(m[0]["methods"][k]["overall"]["spec_s"] for m in measured.values())
                              for k in summary["methods"]}}
    manifest["files"] = ["results.json", "report.md", "acceptance.png"]
    return finish_manifest(out_dir, manifest)
