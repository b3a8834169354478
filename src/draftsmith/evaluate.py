"""The evaluate stage: EAGLE-3 (chain and tree), n-gram and plain decoding of the same target.

For every benchmark prompt (MT-Bench both turns: turn 2 follows the target's own first answer;
HumanEval; any JSONL of prompts), rendered with the target's chat template, every method runs
in this process, one after the other, after one warm-up. Reported per method:
    tau         tokens emitted per target verification forward (the target's own token counted)
    per position: P(accept | reached) and P(accept) for draft depths 1..k, and a histogram
    tokens/s and the speedup (plain time / method time, same target, same process)
and, for batch sizes > 1, the same over batches of prompts. Greedy speculative output must equal
plain output (check_lossless). Step costs for `plan` (target forward over 1..64 tokens, drafter
step) go into the manifest. Each prompt's result is appended to eval/partial.jsonl, so a killed
evaluation resumes after the last finished prompt.
"""
from __future__ import annotations

import io
import json
import os
import time
from pathlib import Path
from typing import Optional

import torch

from .artifacts import (DraftsmithError, atomic_write_bytes, atomic_write_json, atomic_write_text, finish_manifest,
                        load_manifest, log, new_manifest, require_complete, sha256_file, stage_dir,
                        write_manifest)
from .config import Recipe
from .speculate.eagle3 import Eagle3Proposer
from .speculate.engine import PerSequence, generate, plain_generate, plain_generate_batch
from .speculate.fast import FastDraft, FastTarget, choose_mode, fast_target_or_none
from .speculate.ngram import NgramProposer

PARTIAL = "partial.jsonl"
SPEC_METHODS = ("eagle3_chain", "eagle3_tree", "ngram")
STEP_COST_TOKENS = (1, 2, 4, 8, 16, 32, 64)
# Relative top-1 vs chosen-token logit gap below which a divergence counts as a rounding tie:
# a verify forward over k+1 rows may round differently from single-row forwards, and in 16-bit
# dtypes the difference grows through the layers. bf16: on the H200 the 12-layer MoE reference
# target's graphed 1-row plain decoding chose tokens up to 0.063 below an uncached forward's top
# (31 divergences, 2026-12-03 driver run, call C), so 0.1; float16 has 8x finer rounding.
# In bf16 the check catches only gross errors: exactness is tested in float32 (tests/test_fast.py).
TIE_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 0.1, torch.float16: 0.02}


# ----------------------------------------------------------------------------- inputs


def load_models(recipe: Recipe, drafter_dir: Path):
    """The target (with the drafter's aux layers hooked) and the drafter, on one device and dtype."""
    from .draft.model import Eagle3Config, load_drafter
    from .target.model import load_target

    cfg_path = drafter_dir / "config.json"
    dcfg = Eagle3Config.load(cfg_path)
    t = recipe.target
    aux = dcfg.aux_layer_ids or t.aux_layer_ids
    if t.aux_layer_ids and dcfg.aux_layer_ids and list(t.aux_layer_ids) != list(dcfg.aux_layer_ids):
        raise DraftsmithError(f"{cfg_path}: drafter was trained on aux layers {dcfg.aux_layer_ids} but "
                              f"target.aux_layer_ids is {t.aux_layer_ids}; use the drafter's ids or retrain")
    target = load_target(t.path, device=t.device, dtype=t.dtype, trust_remote_code=t.trust_remote_code,
                         aux_layer_ids=aux,
                         experts_implementation=t.experts_implementation)
    want = {"vocab_size": target.vocab_size, "target_hidden_size": target.hidden_size,
            "num_aux_layers": len(target.aux_layer_ids)}
    bad = {k: (getattr(dcfg, k), v) for k, v in want.items() if getattr(dcfg, k) != v}
    if bad:
        what = ", ".join(f"{k} {a} != target's {b}" for k, (a, b) in bad.items())
        raise DraftsmithError(f"{cfg_path}: drafter does not fit target {t.path} ({what}); retrain it for this target")
    drafter = load_drafter(drafter_dir, device=target.device, dtype=target.dtype)
    return target, drafter


def eos_token_ids(target) -> list[int]:
    ids = set()
    for v in (getattr(target.tokenizer, "eos_token_id", None),
              getattr(getattr(target.model, "generation_config", None), "eos_token_id", None)):
        ids.update(v if isinstance(v, (list, tuple)) else [] if v is None else [v])
    return sorted(int(i) for i in ids)


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


# ----------------------------------------------------------------------------- methods


def check_methods(cfg, where: str) -> list[str]:
    """Methods in a fixed order; plain is the reference and always runs."""
    bad = [m for m in cfg.methods if m not in (*SPEC_METHODS, "plain")]
    if bad:
        raise DraftsmithError(f"{where}: evaluate.methods {bad} unknown; choose from {[*SPEC_METHODS, 'plain']}")
    if cfg.draft_steps < 1 or cfg.max_new_tokens < 1 or cfg.tree_depth < 1 or cfg.tree_topk < 1 or cfg.tree_budget < 1:
        raise DraftsmithError(f"{where}: evaluate.draft_steps, max_new_tokens, tree_depth, tree_topk and tree_budget "
                              "must be >= 1")
    if not cfg.batch_sizes or min(cfg.batch_sizes) < 1:
        raise DraftsmithError(f"{where}: evaluate.batch_sizes {cfg.batch_sizes} must be a non-empty list of sizes >= 1")
    return [m for m in SPEC_METHODS if m in cfg.methods]


def method_depth(cfg, method: str) -> int:
    return cfg.tree_depth if method == "eagle3_tree" else cfg.draft_steps


class Paths:
    """The decoding path every measurement of one evaluate run shares (evaluate.fast): per batch
    size a FastTarget and a FastDraft (static caches, graphs captured once and reused), or
    neither (eager). With `auto`, a target the fast path cannot run (sliding-window layers, a
    target spread over several GPUs) falls back to eager with a log line; an explicit mode errs."""

    def __init__(self, target=None, drafter=None, mode: str = "off"):
        self.target_model, self.drafter, self.requested = target, drafter, mode
        self.mode = choose_mode(mode, target) if target is not None else "off"
        self._by_batch: dict[int, tuple] = {}

    def get(self, batch: int) -> tuple[Optional[FastTarget], Optional[FastDraft]]:
        if self.mode == "off":
            return None, None
        if batch not in self._by_batch:
            ft = fast_target_or_none(self.target_model, self.mode, self.requested, "evaluate.fast",
                                     "eager decoding for plain and every method", batch_size=batch)
            if ft is None:
                self.mode = "off"
                return None, None
            self._by_batch[batch] = (ft, FastDraft(self.drafter, graphs=ft.graphs))
        return self._by_batch[batch]


EAGER = Paths()


def make_proposer(method: str, drafter, cfg, batch: int, generator=None, paths: Paths = EAGER):
    fast = paths.get(batch)[1]
    if method == "eagle3_chain":
        return Eagle3Proposer(drafter, topk=1, budget=cfg.draft_steps, temperature=cfg.temperature, generator=generator,
                              fast=fast)
    if method == "eagle3_tree":
        return Eagle3Proposer(drafter, topk=cfg.tree_topk, budget=cfg.tree_budget, temperature=cfg.temperature,
                              generator=generator, fast=fast)
    if method == "ngram":
        return PerSequence([NgramProposer(cfg.ngram_max) for _ in range(batch)])
    raise ValueError(method)


def _generator(target, cfg, salt: int) -> Optional[torch.Generator]:
    if cfg.temperature <= 0:
        return None
    return torch.Generator(device=target.device).manual_seed(cfg.seed * 1_000_003 + salt)


def _timed(where, fn):
    """(fn(), seconds), the device synchronised before and after; `where` is a device or has one."""
    device = getattr(where, "device", where)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    r = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return r, time.perf_counter() - t0


def run_plain(target, prompts: list[list[int]], cfg, eos_ids, generator=None, paths: Paths = EAGER,
              max_new_tokens=None) -> tuple[list[list[int]], float]:
    """Plain decoding, the baseline: on the fast path its own graphed loop (the token fed back on
    the GPU), else one eager forward per token."""
    n, T = max_new_tokens or cfg.max_new_tokens, cfg.temperature
    fast = paths.get(len(prompts))[0]
    if fast is not None:
        return _timed(target, lambda: fast.plain(prompts, n, eos_ids, T))
    if len(prompts) == 1:
        out, s = _timed(target, lambda: plain_generate(target, prompts[0], n, eos_ids, T, generator))
        return [out], s
    return _timed(target, lambda: plain_generate_batch(target, prompts, n, eos_ids, T, generator))


def run_method(target, drafter, method: str, prompts: list[list[int]], cfg, eos_ids, generator=None, max_new_tokens=None,
               paths: Paths = EAGER):
    """(new tokens per prompt, SpecStats per prompt, wall seconds) of one speculative method."""
    prop = make_proposer(method, drafter, cfg, len(prompts), generator, paths)
    (new, stats), s = _timed(target, lambda: generate(target, prop, prompts, max_new_tokens or cfg.max_new_tokens,
                                                      method_depth(cfg, method), eos_ids, cfg.temperature, generator,
                                                      fast=paths.get(len(prompts))[0], resident=cfg.resident))
    return new, stats, s


# ----------------------------------------------------------------------------- one prompt


def _first_difference(a: list[int], b: list[int]) -> Optional[int]:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def divergence_gaps(target, prompt_ids: list[int], plain: list[int], spec: list[int], pos: int):
    """(gap of plain's token, gap of spec's token) below the top logit of ONE independent, uncached
    forward of the common prefix, relative to |top|; None when one side ended at `pos`."""
    if pos >= min(len(plain), len(spec)):
        return None
    logits = target.forward(torch.tensor([prompt_ids + plain[:pos]], device=target.device)).logits[0, -1].float()
    top = logits.max()
    scale = top.abs().clamp(min=1.0)
    return float((top - logits[plain[pos]]) / scale), float((top - logits[spec[pos]]) / scale)


def classify_divergence(gaps, dtype: torch.dtype) -> str:
    """tie:      the speculative token is (within the dtype's rounding) the top of the independent
                 forward too: two near-equal logits, rounded differently by differently shaped forwards;
    numeric:  the independent forward sides with neither decoder: rounding alone moves the top by
                 more than the tolerance here (bf16 MoE targets, whose routing can flip);
    bug:      the independent forward agrees with plain decoding and not with the speculative one."""
    if gaps is None:
        return "bug"
    tol = TIE_TOLERANCE.get(dtype, 1e-5)
    gap_plain, gap_spec = gaps
    if gap_spec <= tol:
        return "tie"
    return "numeric" if gap_plain > tol else "bug"


def _gap(gaps, i: int) -> str:
    return "n/a" if gaps is None else f"{gaps[i]:.4g}"


def lossless_check(target, prompt_ids, plain, spec, check: bool, where: str, method: str) -> dict:
    """{lossless, first_difference, divergence, gap_plain, gap_spec, near_tie_gap}; raises on a
    divergence classified `bug` (see classify_divergence) when `check`."""
    rec = {"lossless": spec == plain, "first_difference": None, "divergence": None, "gap_plain": None,
           "gap_spec": None, "near_tie_gap": None}
    if spec != plain:
        pos = _first_difference(plain, spec)
        gaps = divergence_gaps(target, prompt_ids, plain, spec, pos)
        kind = classify_divergence(gaps, target.dtype)
        rec.update(first_difference=pos, divergence=kind, gap_plain=gaps and gaps[0], gap_spec=gaps and gaps[1],
                   near_tie_gap=gaps[1] if kind == "tie" else None)
        if check and kind == "bug":
            got = spec[pos] if pos < len(spec) else "end"
            want = plain[pos] if pos < len(plain) else "end"
            raise DraftsmithError(f"{where}: {method}: speculative output differs from plain greedy decoding at new token "
                                  f"{pos} (plain {want}, speculative {got}), and an independent forward agrees with plain "
                                  f"decoding: no rounding tie (logit gaps to its top: plain {_gap(gaps, 0)}, speculative "
                                  f"{_gap(gaps, 1)}, tie tolerance {TIE_TOLERANCE.get(target.dtype, 1e-5):g}). This is a draftsmith bug "
                                  "unless the target's routing or kernels differ by row count in this dtype; please report it "
                                  "(set evaluate.check_lossless false to measure anyway)")
    return rec


def evaluate_prompt(target, drafter, prompt_ids: list[int], cfg, methods: list[str], eos_ids: list[int],
                    salt: int, where: str, paths: Paths = EAGER) -> dict:
    """Plain and every method on one prompt, batch 1."""
    [plain], plain_s = run_plain(target, [prompt_ids], cfg, eos_ids, _generator(target, cfg, salt), paths)
    rec = {"prompt_tokens": len(prompt_ids), "plain_new_tokens": len(plain), "plain_s": plain_s, "plain_tokens": plain,
           "methods": {}}
    for m in methods:
        [spec], [st], spec_s = run_method(target, drafter, m, [prompt_ids], cfg, eos_ids, _generator(target, cfg, salt),
                                          paths=paths)
        r = {"new_tokens": len(spec), "spec_s": spec_s, "target_s": st.target_s, "draft_s": st.draft_s,
             "rounds": st.rounds, "emitted": sum(st.emitted_per_round),
             "drafted_per_round": st.drafted_per_round, "accepted_per_round": st.accepted_per_round,
             "drafted": st.drafted, "reached": st.reached, "accepted": st.accepted}
        if cfg.temperature <= 0:
            r.update(lossless_check(target, prompt_ids, plain, spec, cfg.check_lossless, where, m))
        rec["methods"][m] = r
    return rec


def evaluate_batch(target, drafter, prompts: list[list[int]], references: list[list[int]], cfg, methods, eos_ids,
                   salt: int, paths: Paths = EAGER) -> dict:
    """Plain and every method on one batch of prompts; outputs compared with the batch-1 plain ones."""
    plain, plain_s = run_plain(target, prompts, cfg, eos_ids, _generator(target, cfg, salt), paths)
    rec = {"batch_size": len(prompts), "plain_s": plain_s, "plain_new_tokens": sum(map(len, plain)), "methods": {}}
    for m in methods:
        new, stats, s = run_method(target, drafter, m, prompts, cfg, eos_ids, _generator(target, cfg, salt), paths=paths)
        rec["methods"][m] = {"spec_s": s, "new_tokens": sum(map(len, new)), "rounds": sum(st.rounds for st in stats),
                             "emitted": sum(sum(st.emitted_per_round) for st in stats),
                             "identical": sum(a == b for a, b in zip(new, references))}
    return rec


# ----------------------------------------------------------------------------- step costs


@torch.inference_mode()
def measure_step_costs(target, drafter, context: list[int], repeats: int = 3, paths: Paths = EAGER) -> dict:
    """Target forward time over n = 1..64 new tokens after `context` and the drafter's step time
    over 1 row (chain) and 4 rows (a tree's width), on the decoding path the run measured (fast or
    eager); medians, in ms. Each step's rows are dropped again (cache cropped / past unchanged)."""
    from .speculate.engine import EagerVerifier

    dev, C = target.device, len(context)
    fast_target, fast_draft = paths.get(1)
    runner = fast_target or EagerVerifier(target)
    ids = torch.tensor([context], device=dev)
    out = runner.prefill(ids, torch.arange(C, device=dev)[None], torch.zeros(1, dtype=torch.long, device=dev),
                         max_new_tokens=0, max_rows=max(STEP_COST_TOKENS) + 1)
    start, end = torch.zeros(1, dtype=torch.long), torch.full((1,), C)  # verify takes host tensors

    def median_ms(fn) -> float:
        fn()  # warm-up (and graph capture)
        ts = sorted(_timed(target, fn)[1] for _ in range(repeats))
        return 1000 * ts[len(ts) // 2]

    forward_ms = {}
    for n in STEP_COST_TOKENS:
        x = torch.tensor([context[-1:] * n])
        pos = torch.arange(C, C + n)[None]
        anc = torch.ones(n, n, dtype=torch.bool).tril()[None]

        def step():
            runner.verify(x, pos, start, end, anc, n)
            runner.keep([], [], [], C)
        forward_ms[str(n)] = median_ms(step)

    prop = Eagle3Proposer(drafter, topk=1, budget=1, fast=fast_draft)
    prop.start([context], [out])
    row = {}
    for width in (1, 4):
        x = torch.tensor([context[-1:] * width], device=dev)
        g = prop.g_last[:, None].expand(1, width, -1).contiguous()
        pos = prop.rows[:, None].expand(1, width)
        anc = torch.eye(width, dtype=torch.bool, device=dev)[None]
        L = prop.cache.length

        def dstep():
            g2, logits = prop._step(x, g, pos, anc, L)
            if logits is None:
                drafter.logits(g2)
            prop.cache.crop(L)
        row[width] = median_ms(dstep)
    return {"context_tokens": C, "batch_size": 1, "device": str(dev), "dtype": str(target.dtype).replace("torch.", ""),
            "path": paths.mode, "target_forward_ms": forward_ms, "draft_step_ms": row[1], "draft_step_ms_4_rows": row[4]}


def overheads(summary: dict, step_costs: dict, cfg) -> dict:
    """The engine's time beyond the planner's cost model, from this run's batch-1 measurements:
    round_overhead_ms = chain ms per round - (k drafter steps + one (k+1)-token forward);
    plain_overhead_ms = plain ms per token - one 1-token forward. (plan.MeasuredCost adds them.)"""
    from .plan import MeasuredCost

    cost = MeasuredCost.from_json(step_costs)
    out = {}
    p = summary["plain"]
    if p["new_tokens"]:
        out["plain_overhead_ms"] = round(1000 * p["plain_s"] / p["new_tokens"] - cost.verify_ms(1), 4)
    chain = summary["methods"].get("eagle3_chain", {}).get("overall")
    if chain and chain["rounds"]:
        k = cfg.draft_steps
        out["round_overhead_ms"] = round(1000 * chain["spec_s"] / chain["rounds"]
                                         - (k * cost.draft_step_ms + cost.verify_ms(k + 1)), 4)
    return out


def measure_bandwidth_gbps(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Device memory bandwidth by a large copy (bytes read + written per second), GB/s."""
    n = nbytes // 2 if device.type == "cuda" else nbytes // 16
    a = torch.empty(n, dtype=torch.bfloat16, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    ts = [_timed(device, lambda: b.copy_(a))[1] for _ in range(5)]
    return 2 * a.numel() * a.element_size() / min(ts) / 1e9


def nominal_bandwidth_gbps(device: torch.device) -> tuple[Optional[float], Optional[str]]:
    """The data-sheet bandwidth of a known GPU (plan.HARDWARE), or (None, None)."""
    from .plan import HARDWARE

    if device.type != "cuda":
        return None, None
    name = torch.cuda.get_device_name(device).lower()
    for key, hw in HARDWARE.items():
        if key.split("-")[0] in name:
            return hw.mem_bw_gbps, key
    return None, None


def decode_roofline(target, tokens_per_s: Optional[float], batch: int = 1) -> dict:
    """Plain decoding's speed as a fraction of the memory-bandwidth limit: weight bytes one
    forward over `batch` tokens reads (plan.target_spec: every dense weight, the lm_head, the
    routed experts those tokens touch; not the input embedding, not the KV cache) times forward
    steps per second, over the measured copy bandwidth and the data-sheet one."""
    from .plan import target_spec

    spec = target_spec(target.model.config.to_dict())
    spec = replace_bytes(spec, target.dtype)
    bytes_per_step = spec.bytes_read(batch)
    measured = measure_bandwidth_gbps(target.device)
    nominal, hw = nominal_bandwidth_gbps(target.device)
    rate = bytes_per_step * (tokens_per_s / batch) / 1e9 if tokens_per_s else None
    return {"batch_size": batch, "weight_bytes_per_step": bytes_per_step, "limit_tokens_per_s_measured_bw":
            batch * measured * 1e9 / bytes_per_step, "measured_bw_gbps": measured, "nominal_bw_gbps": nominal,
            "hardware": hw, "plain_tokens_per_s": tokens_per_s,
            "fraction_of_measured_bw": rate / measured if rate else None,
            "fraction_of_nominal_bw": rate / nominal if rate and nominal else None}


def replace_bytes(spec, dtype: torch.dtype):
    """The spec's bytes per parameter for the dtype the target is actually loaded in."""
    from dataclasses import replace

    b = torch.finfo(dtype).bits / 8 if dtype.is_floating_point else 1.0
    return replace(spec, dense_bytes_per_param=b, expert_bytes_per_param=b)


# ----------------------------------------------------------------------------- aggregation


def _ratio(a: float, b: float) -> Optional[float]:
    return a / b if b else None


def _sum_or_none(xs) -> Optional[float]:
    """The sum, or None when a value is None (resident rounds do not split target and drafter time)."""
    xs = list(xs)
    return None if any(x is None for x in xs) else sum(xs)


def summarize_method(records: list[dict], method: str, k: int) -> dict:
    rows = [(r, r["methods"][method]) for r in records if method in r["methods"]]

    def agg(rs) -> dict:
        new, plain_new = sum(m["new_tokens"] for _, m in rs), sum(r["plain_new_tokens"] for r, _ in rs)
        spec_s, plain_s = sum(m["spec_s"] for _, m in rs), sum(r["plain_s"] for r, _ in rs)
        return {"prompts": len(rs), "new_tokens": new, "rounds": sum(m["rounds"] for _, m in rs),
                "tau": _ratio(sum(m["emitted"] for _, m in rs), sum(m["rounds"] for _, m in rs)),
                "tokens_per_s_spec": _ratio(new, spec_s), "tokens_per_s_plain": _ratio(plain_new, plain_s),
                "speedup": _ratio(plain_s, spec_s), "spec_s": spec_s, "plain_s": plain_s,
                **{k: _sum_or_none(m[k] for _, m in rs) for k in ("target_s", "draft_s")}}

    per_pos = {name: [sum(m[name][j] for _, m in rows) for j in range(k)] for name in ("drafted", "reached", "accepted")}
    hist = [0] * (k + 1)  # over rounds that drafted (the last round of a prompt may not)
    for _, m in rows:
        for d, a in zip(m["drafted_per_round"], m["accepted_per_round"]):
            hist[a] += d > 0
    benchmarks: dict[str, list] = {}
    for r, m in rows:
        benchmarks.setdefault(benchmark_name(r["benchmark"]), []).append((r, m))
    out = {"overall": agg(rows), "per_benchmark": {b: agg(rs) for b, rs in benchmarks.items()},
           "per_position": {**per_pos,
                            "accept_rate": [_ratio(a, n) for a, n in zip(per_pos["accepted"], per_pos["reached"])],
                            "accept_rate_unconditional": [_ratio(a, n) for a, n in zip(per_pos["accepted"], per_pos["drafted"])]},
           "accepted_length_histogram": hist}
    if rows and "lossless" in rows[0][1]:
        out["lossless"] = {"checked": len(rows), "identical": sum(m["lossless"] for _, m in rows),
                           "near_tie_divergences": sum(m.get("divergence") == "tie" or (m.get("divergence") is None
                                                           and m["near_tie_gap"] is not None) for _, m in rows),
                           "numeric_divergences": sum(m.get("divergence") == "numeric" for _, m in rows)}
    return out


def summarize(records: list[dict], batch_records: list[dict], cfg, methods: list[str]) -> dict:
    plain_new, plain_s = sum(r["plain_new_tokens"] for r in records), sum(r["plain_s"] for r in records)
    summary = {"plain": {"prompts": len(records), "new_tokens": plain_new, "plain_s": plain_s,
                         "tokens_per_s": _ratio(plain_new, plain_s)},
               "methods": {m: summarize_method(records, m, method_depth(cfg, m)) for m in methods},
               "batches": {}}
    for B in sorted({r["batch_size"] for r in batch_records}):
        rs = [r for r in batch_records if r["batch_size"] == B]
        p_s, p_new = sum(r["plain_s"] for r in rs), sum(r["plain_new_tokens"] for r in rs)
        row = {"batches": len(rs), "plain_tokens_per_s": _ratio(p_new, p_s), "methods": {}}
        for m in methods:
            ms = [r["methods"][m] for r in rs]
            s, new = sum(x["spec_s"] for x in ms), sum(x["new_tokens"] for x in ms)
            row["methods"][m] = {"tau": _ratio(sum(x["emitted"] for x in ms), sum(x["rounds"] for x in ms)),
                                 "tokens_per_s": _ratio(new, s), "speedup": _ratio(p_s, s),
                                 "identical": sum(x["identical"] for x in ms)}
        summary["batches"][str(B)] = row
    return summary


# ----------------------------------------------------------------------------- outputs


PATH_TEXT = {"off": "eager transformers, dynamic KV cache", "static": "static KV cache, no CUDA graphs",
             "graphs": "static KV cache, CUDA graphs", "compile": "static KV cache, torch.compile, CUDA graphs"}


def benchmark_name(bench: str) -> str:
    """`mtbench` stays; a path shows as its file name without .jsonl(.gz)."""
    name = bench.replace("\\", "/").rsplit("/", 1)[-1]
    for ext in (".gz", ".jsonl", ".json"):
        name = name[: -len(ext)] if name.endswith(ext) else name
    return name or bench


def _f(x: Optional[float], nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def table_rows(summary: dict) -> list[list[str]]:
    """One row per method and benchmark (plus `all`); plain is the reference (speedup 1)."""
    rows = [["method", "benchmark", "prompts", "tokens", "tau", "tok/s", "speedup", "lossless"]]
    for m, s in summary["methods"].items():
        items = list(s["per_benchmark"].items())
        items = (items if len(items) > 1 else []) + [("all", s["overall"])]
        ll = s.get("lossless")
        for name, a in items:
            rows.append([m, name, str(a["prompts"]), str(a["new_tokens"]), _f(a["tau"]), _f(a["tokens_per_s_spec"], 1),
                         _f(a["speedup"]), f"{ll['identical']}/{ll['checked']}" if ll and name == "all" else "-"])
    p = summary["plain"]
    rows.append(["plain", "all", str(p["prompts"]), str(p["new_tokens"]), "1.00", _f(p["tokens_per_s"], 1), "1.00", "-"])
    for B, row in summary["batches"].items():
        for m, a in row["methods"].items():
            rows.append([f"{m} bs{B}", "all", str(row["batches"]) + " batches", "-", _f(a["tau"]), _f(a["tokens_per_s"], 1),
                         _f(a["speedup"]), "-"])
    return rows


def _md(rows: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0]),
                      *("| " + " | ".join(r) + " |" for r in rows[1:])])


def render_report(summary: dict, recipe: Recipe) -> str:
    e = recipe.evaluate
    mode = "greedy" if e.temperature <= 0 else f"sampling at temperature {e.temperature}"
    parts = [f"# Evaluation: {recipe.name}",
             f"Target `{recipe.target.path}`, {mode}, max_new_tokens={e.max_new_tokens}; eagle3_chain k={e.draft_steps}, "
             f"eagle3_tree depth={e.tree_depth} top-k={e.tree_topk} budget={e.tree_budget}, ngram k={e.draft_steps} "
             f"(n <= {e.ngram_max}). tau = tokens per target verification forward (the target's own token counted); "
             "speedup = plain decoding time / method time, same target, same process, same decoding path "
             f"(`{summary.get('path', 'off')}`: {PATH_TEXT.get(summary.get('path', 'off'), '')}).",
             _md(table_rows(summary))]
    r = summary.get("roofline")
    if r and r.get("fraction_of_measured_bw") is not None:
        nominal = f", {r['fraction_of_nominal_bw']:.2f} of the {r['hardware']} data-sheet {r['nominal_bw_gbps']:.0f} GB/s" \
            if r.get("fraction_of_nominal_bw") else ""
        parts.append(f"Plain decoding at batch 1 runs at {r['plain_tokens_per_s']:.1f} tokens/s, reading "
                     f"{r['weight_bytes_per_step'] / 1e6:.1f} MB of weights per token: {r['fraction_of_measured_bw']:.3f} of the "
                     f"memory-bandwidth limit ({r['measured_bw_gbps']:.0f} GB/s measured by a copy{nominal}). "
                     "Speedups over a baseline far below that limit overstate what a serving engine would see.")
    for m, s in summary["methods"].items():
        pp = s["per_position"]
        pos_rows = [["depth", "drafted", "reached", "accepted", "accepted / reached", "accepted / drafted"]]
        for j in range(len(pp["drafted"])):
            pos_rows.append([str(j + 1), str(pp["drafted"][j]), str(pp["reached"][j]), str(pp["accepted"][j]),
                             _f(pp["accept_rate"][j], 3), _f(pp["accept_rate_unconditional"][j], 3)])
        hist = s["accepted_length_histogram"]
        total = sum(hist) or 1
        hist_rows = [["accepted drafts", "rounds", "share"]] + [[str(a), str(n), f"{n / total:.1%}"] for a, n in enumerate(hist)]
        parts += [f"## {m}: acceptance per draft position", _md(pos_rows),
                  f"## {m}: accepted drafts per round (rounds that drafted)", _md(hist_rows)]
        ll = s.get("lossless")
        if ll:
            ties, numeric = ll["near_tie_divergences"], ll.get("numeric_divergences", 0)
            unexplained = ll["checked"] - ll["identical"] - ties - numeric
            parts.append(f"Lossless: {ll['identical']}/{ll['checked']} prompts token-identical to plain greedy decoding"
                         + (f"; {ties} diverged at a rounding tie" if ties else "")
                         + (f"; {numeric} where an independent forward agreed with neither decoder (rounding beyond "
                            "the tie tolerance)" if numeric else "")
                         + (f"; **{unexplained} unexplained** (an independent forward agreed with plain decoding)"
                            if unexplained else "") + ".")
    return "\n\n".join(parts) + "\n"


def plot_acceptance(summary: dict) -> bytes:
    """Left: share of rounds by accepted drafts, per method. Right: P(accept | reached) per depth."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4))
    FigureCanvasAgg(fig)
    ax1, ax2 = fig.subplots(1, 2)
    methods = summary["methods"]
    w = 0.8 / max(len(methods), 1)
    for i, (m, s) in enumerate(methods.items()):
        hist = s["accepted_length_histogram"]
        total = sum(hist) or 1
        ax1.bar([a + (i - (len(methods) - 1) / 2) * w for a in range(len(hist))], [n / total for n in hist], w,
                label=f"{m} (tau {_f(s['overall']['tau'])})")
        rates = s["per_position"]["accept_rate"]
        ax2.bar([j + 1 + (i - (len(methods) - 1) / 2) * w for j in range(len(rates))], [r or 0 for r in rates], w, label=m)
    ax1.set(xlabel="accepted drafts per round", ylabel="share of rounds", title="accepted length")
    ax2.set(xlabel="draft depth", ylabel="accepted / reached", ylim=(0, 1), title="acceptance per draft position")
    for ax in (ax1, ax2):
        if methods:
            ax.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


def _print_table(rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))


# ----------------------------------------------------------------------------- stage


def _read_partial(path: Path) -> dict[str, dict]:
    """Finished prompts of an interrupted run; a torn last line is ignored."""
    done = {}
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                rec = json.loads(line)
                done[rec["key"]] = rec
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
    return done


def _append(path: Path, rec: dict) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(rec) + "\n")
        f.flush()
        os.fsync(f.fileno())


def run(recipe: Recipe, run_dir: Path, fp: str) -> dict:
    from .data.readers import load_prompts

    cfg = recipe.evaluate
    run_dir = Path(run_dir)
    out_dir = stage_dir(run_dir, "evaluate")
    drafter_dir = stage_dir(run_dir, "train") / "drafter"
    train = require_complete(stage_dir(run_dir, "train"), "train")
    methods = check_methods(cfg, str(run_dir / "recipe.yaml"))

    old = load_manifest(out_dir)
    resuming = old is not None and old.get("status") == "running" and old.get("fingerprint") == fp
    out_dir.mkdir(parents=True, exist_ok=True)
    partial = out_dir / PARTIAL
    if not resuming:
        partial.unlink(missing_ok=True)
    done = _read_partial(partial)

    target, drafter = load_models(recipe, drafter_dir)
    paths = Paths(target, drafter, cfg.fast)
    rounds = ("; greedy EAGLE-3 rounds on the device" if cfg.resident and cfg.temperature <= 0 and paths.mode != "off"
              else "")
    log(f"[evaluate] decoding path: {paths.mode} (plain decoding and every method alike{rounds})")
    eos = eos_token_ids(target)
    todo = []  # (key, bench, prompt, turn index)
    for bench in cfg.benchmarks:
        for i, p in enumerate(load_prompts(bench, cfg.max_prompts)):
            todo.append((f"{bench}#{i}", bench, p))

    manifest = new_manifest("evaluate", fp, cfg, {"train": train["fingerprint"],
                                                  "drafter_sha256": sha256_file(drafter_dir / "model.safetensors")})
    if resuming:
        manifest["started_at"] = old.get("started_at", manifest["started_at"])
    write_manifest(out_dir, manifest)
    if done:
        log(f"[evaluate] resuming: {len(done)} measurements already done")

    warmed: set[int] = set()

    def warm_up(prompts: list[list[int]]) -> None:
        """First calls at a batch size pay for allocation, kernel selection and graph capture."""
        if len(prompts) in warmed:
            return
        n = min(8, cfg.max_new_tokens)
        run_plain(target, prompts, cfg, eos, paths=paths, max_new_tokens=n)
        for m in methods:
            run_method(target, drafter, m, prompts, cfg, eos, _generator(target, cfg, -1), n, paths=paths)
        warmed.add(len(prompts))
    records, rendered = [], []  # rendered: (prompt ids, batch-1 plain output) of every turn, for batches
    for n, (key, bench, p) in enumerate(todo, 1):
        history: list[dict] = []
        for turn, text in enumerate(p.turns[:max(cfg.max_turns, 1)]):
            where = f"{bench}: prompt {p.id}" + (f" turn {turn + 1}" if turn else "")
            history.append({"role": "user", "content": text})
            ids = render_prompt(target.tokenizer, list(history), where)
            tkey = key if turn == 0 else f"{key}/turn{turn + 1}"
            rec = done.get(tkey)
            if rec is None:
                warm_up([ids])
                rec = {"key": tkey, "benchmark": bench, "id": p.id, "category": p.category, "turn": turn + 1,
                       **evaluate_prompt(target, drafter, ids, cfg, methods, eos, len(records), where, paths=paths)}
                _append(partial, rec)
                log(f"[evaluate] {n}/{len(todo)} {where}: {rec['plain_new_tokens']} tokens, " + ", ".join(
                    f"{m} tau {_f(r['emitted'] / r['rounds'] if r['rounds'] else None)} speedup "
                    f"{_f(rec['plain_s'] / r['spec_s'] if r['spec_s'] else None)}" for m, r in rec["methods"].items()))
            records.append(rec)
            rendered.append((ids, rec["plain_tokens"]))
            history.append({"role": "assistant", "content": answer_text(target.tokenizer, rec["plain_tokens"], eos)})

    batch_records = []
    for B in sorted({b for b in cfg.batch_sizes if b > 1}):
        for j in range(0, len(rendered) - B + 1, B):  # full batches only
            bkey = f"batch{B}#{j // B}"
            rec = done.get(bkey)
            if rec is None:
                chunk = rendered[j:j + B]
                warm_up([c[0] for c in chunk])
                rec = {"key": bkey, **evaluate_batch(target, drafter, [c[0] for c in chunk], [c[1] for c in chunk],
                                                     cfg, methods, eos, j, paths=paths)}
                _append(partial, rec)
                log(f"[evaluate] batch size {B}, batch {j // B + 1}: " + ", ".join(
                    f"{m} speedup {_f(rec['plain_s'] / r['spec_s'])}" for m, r in rec["methods"].items()))
            batch_records.append(rec)

    step_costs = measure_step_costs(target, drafter, rendered[0][0] + rendered[0][1], paths=paths) \
        if cfg.step_costs and rendered else None
    summary = summarize(records, batch_records, cfg, methods)
    if step_costs:
        step_costs.update(overheads(summary, step_costs, cfg))
    summary["path"] = paths.mode
    summary["roofline"] = decode_roofline(target, summary["plain"]["tokens_per_s"]) if records else None
    atomic_write_json(out_dir / "results.json", {"config": cfg, "eos_ids": eos, "summary": summary, "step_costs": step_costs,
                                                 "prompts": records, "batches": batch_records})
    atomic_write_text(out_dir / "report.md", render_report(summary, recipe))
    atomic_write_bytes(out_dir / "acceptance.png", plot_acceptance(summary))
    _print_table(table_rows(summary))

    # The headline figures: EAGLE-3 chain (the planner's per-position profile is a chain's).
    main = next((m for m in ("eagle3_chain", "eagle3_tree", "ngram") if m in methods), None)
    o = summary["methods"][main]["overall"] if main else {}
    manifest["counts"] = {"prompts": len(records), "plain_new_tokens": summary["plain"]["new_tokens"],
                          "batches": len(batch_records),
                          "near_tie_divergences": sum((s.get("lossless") or {}).get("near_tie_divergences", 0)
                                                      for s in summary["methods"].values())}
    manifest["metrics"] = {
        "method": main, "tau": o.get("tau"),
        "tau_per_benchmark": {b: s["tau"] for b, s in summary["methods"][main]["per_benchmark"].items()} if main else {},
        "accept_rate_per_position": summary["methods"][main]["per_position"]["accept_rate"] if main else [],
        "accept_rate_per_position_unconditional":
            summary["methods"][main]["per_position"]["accept_rate_unconditional"] if main else [],
        "tokens_per_s_spec": o.get("tokens_per_s_spec"), "tokens_per_s_plain": summary["plain"]["tokens_per_s"],
        "speedup": o.get("speedup"), "num_prompts": len(records), "draft_steps": cfg.draft_steps,
        "path": paths.mode,
        "plain_decode_bw_fraction": (summary["roofline"] or {}).get("fraction_of_measured_bw"),
        "plain_decode_bw_fraction_nominal": (summary["roofline"] or {}).get("fraction_of_nominal_bw"),
        "methods": {m: {"tau": s["overall"]["tau"], "speedup": s["overall"]["speedup"],
                        "tokens_per_s": s["overall"]["tokens_per_s_spec"]} for m, s in summary["methods"].items()},
        "batches": {B: {m: a["speedup"] for m, a in row["methods"].items()} for B, row in summary["batches"].items()}}
    if step_costs:
        manifest["step_costs"] = step_costs
    manifest["timings"] = {"plain_s": summary["plain"]["plain_s"],
                           **{f"{m}_s": s["overall"]["spec_s"] for m, s in summary["methods"].items()}}
    manifest["files"] = ["results.json", "report.md", "acceptance.png"]
    return finish_manifest(out_dir, manifest)
