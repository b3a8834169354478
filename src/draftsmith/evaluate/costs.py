"""Step costs and the roofline of the evaluate stage: the target's forward time over 1..64 tokens
and the drafter's step time (what `plan` predicts from), the engine's time beyond them, and plain
decoding's speed as a fraction of the memory-bandwidth limit (costmodel.py's weight bytes).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Optional, Sequence

import torch

from ..costmodel import HARDWARE, MeasuredCost, target_spec
from ..speculate.eagle3 import Eagle3Proposer
from ..speculate.verify import EagerVerifier, rows_of
from ..speculate.methods import EAGER_RUNNERS, DecodeRunners
from .measure import timed

STEP_COST_TOKENS = (1, 2, 4, 8, 16, 32, 64)


BATCH_COST_TOKENS = (1, 2, 4, 8, 16, 32)
"""Tokens per sequence the target's forward is timed over at batch sizes > 1 (chain k + 1, tree budget + 1)."""


def _median_ms(target, fn, repeats: int) -> float:
    fn()  # warm-up (and graph capture)
    ts = sorted(timed(target, fn)[1] for _ in range(repeats))
    return 1000 * ts[len(ts) // 2]


@torch.inference_mode()
def _costs_at(target, drafter, context: list[int], batch: int, tokens: Sequence[int], widths: Sequence[int],
              repeats: int, runners: DecodeRunners, probe: Optional[Callable] = None) -> tuple[dict, dict]:
    """({n: target forward ms over n new tokens per sequence}, {r: drafter step ms over r rows per
    sequence}) for `batch` copies of `context`, on the runners' path. Each step's rows are dropped again.
    On a fast path the drafter step is its graphed call alone, mask and write position already on the
    device, as inside a resident round's expansion (the host loop builds them per step on top).
    probe(kind, batch, n, step), when given, is called after each timing with the warmed-up step
    ("target" over n tokens, "draft" over n rows): a profiler's hook (benchmarks/bench_engine.py)."""
    dev, C = target.device, len(context)
    fast_target, fast_draft = runners.get(batch)
    runner = fast_target or EagerVerifier(target)
    ids = torch.tensor([context] * batch, device=dev)
    pos = torch.arange(C, device=dev)[None].expand(batch, C)
    out = runner.prefill(ids, pos, torch.zeros(batch, dtype=torch.long, device=dev),
                         max_new_tokens=0, max_rows=max(tokens) + 1)
    start, end = torch.zeros(batch, dtype=torch.long), torch.full((batch,), C)  # verify takes host tensors
    forward_ms = {}
    for n in tokens:
        x = torch.tensor([context[-1:] * n] * batch)
        vpos = torch.arange(C, C + n)[None].expand(batch, n)
        anc = torch.ones(n, n, dtype=torch.bool).tril()[None].expand(batch, n, n)

        def step():
            runner.verify(x, vpos, start, end, anc, n)
            runner.keep([], [], [], C)
        forward_ms[str(n)] = _median_ms(target, step, repeats)
        if probe:
            probe("target", batch, n, step)

    prop = Eagle3Proposer(drafter, topk=1, budget=1, fast=fast_draft)
    prop.start([context] * batch, [rows_of(out, b, torch.arange(C, device=dev)) for b in range(batch)])
    draft_ms = {}
    for width in widths:
        x = torch.tensor([context[-1:] * width] * batch, device=dev)
        g = prop.g_last[:, None].expand(batch, width, -1).contiguous()
        dpos = prop.rows[:, None].expand(batch, width)
        anc = torch.eye(width, dtype=torch.bool, device=dev)[None].expand(batch, width, width)
        L = prop.cache.length
        if fast_draft is not None:  # the graphed step alone, its inputs already on the device: a step as a round pays it
            mask, at = prop.fast_inputs(width, anc, L)

            def dstep():
                fast_draft.step(x, g, dpos, mask, at)
        else:
            def dstep():
                drafter.logits(prop.step(x, g, dpos, anc, L)[0])
                prop.cache.crop(L)
        draft_ms[width] = _median_ms(target, dstep, repeats)
        if probe:
            probe("draft", batch, width, dstep)
    return forward_ms, draft_ms


@torch.inference_mode()
def measure_step_costs(target, drafter, context: list[int], repeats: int = 3, runners: DecodeRunners = EAGER_RUNNERS,
                       batch_sizes: Sequence[int] = (), tree_topk: int = 4, probe: Optional[Callable] = None) -> dict:
    """Target forward time over n = 1..64 new tokens after `context` and the drafter's step time
    over 1 row (chain) and `tree_topk` rows (a tree's frontier), on the decoding path the run measured
    (fast or eager); medians, in ms. At every batch size > 1 in `batch_sizes` the same is measured
    for that many copies of the context (tokens per sequence up to 32): `by_batch`, which `plan`
    uses at that batch size instead of scaling the batch-1 figures. `probe`: see _costs_at."""
    widths = sorted({1, 4, tree_topk})
    forward_ms, draft_ms = _costs_at(target, drafter, context, 1, STEP_COST_TOKENS, widths, repeats, runners, probe)
    out = {"context_tokens": len(context), "batch_size": 1, "device": str(target.device),
           "dtype": str(target.dtype).replace("torch.", ""), "path": runners.mode, "target_forward_ms": forward_ms,
           "draft_step_ms": draft_ms[1], "draft_step_ms_4_rows": draft_ms[4],
           "draft_step_ms_rows": {str(w): ms for w, ms in draft_ms.items() if w > 1}}
    by_batch = {}
    for b in sorted({b for b in batch_sizes if b > 1}):
        f, d = _costs_at(target, drafter, context, b, BATCH_COST_TOKENS, widths, repeats, runners, probe)
        by_batch[str(b)] = {"target_forward_ms": f, "draft_step_ms": d[1],
                            "draft_step_ms_rows": {str(w): ms for w, ms in d.items() if w > 1}}
    if by_batch:
        out["by_batch"] = by_batch
    return out


def overheads(summary: dict, step_costs: dict, cfg) -> dict:
    """The engine's time beyond the planner's cost model, from this run's measurements:
    round_overhead_ms = chain ms per round - (k drafter steps + one (k+1)-token forward);
    plain_overhead_ms = plain ms per step - one 1-token forward. At batch 1 from the per-prompt runs,
    at every other batch size from its batches (a batch round: its longest sequence's rounds), written
    into by_batch. (costmodel.MeasuredCost adds them.)"""
    cost = MeasuredCost.from_json(step_costs)
    k = cfg.draft_steps
    out = {}
    p = summary["plain"]
    if p["new_tokens"]:
        out["plain_overhead_ms"] = round(1000 * p["plain_s"] / p["new_tokens"] - cost.verify_ms(1), 4)
    chain = summary["methods"].get("eagle3_chain", {}).get("overall")
    if chain and chain["rounds"]:
        out["round_overhead_ms"] = round(1000 * chain["spec_s"] / chain["rounds"]
                                         - (k * cost.draft_step_ms + cost.verify_ms(k + 1)), 4)
    by_batch = {b: dict(c) for b, c in (step_costs.get("by_batch") or {}).items()}
    for b, row in summary.get("batches", {}).items():
        if b not in by_batch:
            continue
        B = int(b)
        if row.get("plain_ms_per_step"):
            by_batch[b]["plain_overhead_ms"] = round(row["plain_ms_per_step"] - cost.verify_ms(B, B), 4)
        ms = row["methods"].get("eagle3_chain", {}).get("ms_per_round")
        if ms:
            by_batch[b]["round_overhead_ms"] = round(ms - (k * cost.draft_ms(B) + cost.verify_ms(B * (k + 1), B)), 4)
    if by_batch:
        out["by_batch"] = by_batch
    return out


def measure_bandwidth_gbps(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Device memory bandwidth by a large copy (bytes read + written per second), GB/s."""
    n = nbytes // 2 if device.type == "cuda" else nbytes // 16
    a = torch.empty(n, dtype=torch.bfloat16, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    ts = [timed(device, lambda: b.copy_(a))[1] for _ in range(5)]
    return 2 * a.numel() * a.element_size() / min(ts) / 1e9


def nominal_bandwidth_gbps(device: torch.device) -> tuple[Optional[float], Optional[str]]:
    """The data-sheet bandwidth of a known GPU (costmodel.HARDWARE), or (None, None)."""
    if device.type != "cuda":
        return None, None
    name = torch.cuda.get_device_name(device).lower()
    for key, hw in HARDWARE.items():
        if key.split("-")[0] in name:
            return hw.mem_bw_gbps, key
    return None, None


def decode_roofline(target, tokens_per_s: Optional[float], batch: int = 1) -> dict:
    """Plain decoding's speed as a fraction of the memory-bandwidth limit: weight bytes one
    forward over `batch` tokens reads (costmodel.target_spec: every dense weight, the lm_head, the
    routed experts those tokens touch; not the input embedding, not the KV cache) times forward
    steps per second, over the measured copy bandwidth and the data-sheet one."""
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
    b = torch.finfo(dtype).bits / 8 if dtype.is_floating_point else 1.0
    return replace(spec, dense_bytes_per_param=b, expert_bytes_per_param=b)
