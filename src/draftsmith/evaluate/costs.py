"""Step costs and the roofline of the evaluate stage: the target's forward time over 1..64 tokens
and the drafter's step time (what `plan` predicts from), the engine's time beyond them, and plain
decoding's speed as a fraction of the memory-bandwidth limit (costmodel.py's weight bytes).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch

from ..costmodel import HARDWARE, MeasuredCost, target_spec
from ..speculate.eagle3 import Eagle3Proposer
from ..speculate.engine import EagerVerifier
from .measure import EAGER_RUNNERS, DecodeRunners, timed

STEP_COST_TOKENS = (1, 2, 4, 8, 16, 32, 64)


@torch.inference_mode()
def measure_step_costs(target, drafter, context: list[int], repeats: int = 3, runners: DecodeRunners = EAGER_RUNNERS) -> dict:
    """Target forward time over n = 1..64 new tokens after `context` and the drafter's step time
    over 1 row (chain) and 4 rows (a tree's width), on the decoding path the run measured (fast or
    eager); medians, in ms. Each step's rows are dropped again (cache cropped / past unchanged)."""
    dev, C = target.device, len(context)
    fast_target, fast_draft = runners.get(1)
    runner = fast_target or EagerVerifier(target)
    ids = torch.tensor([context], device=dev)
    out = runner.prefill(ids, torch.arange(C, device=dev)[None], torch.zeros(1, dtype=torch.long, device=dev),
                         max_new_tokens=0, max_rows=max(STEP_COST_TOKENS) + 1)
    start, end = torch.zeros(1, dtype=torch.long), torch.full((1,), C)  # verify takes host tensors

    def median_ms(fn) -> float:
        fn()  # warm-up (and graph capture)
        ts = sorted(timed(target, fn)[1] for _ in range(repeats))
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
            g2, logits = prop.step(x, g, pos, anc, L)
            if logits is None:
                drafter.logits(g2)
            prop.cache.crop(L)
        row[width] = median_ms(dstep)
    return {"context_tokens": C, "batch_size": 1, "device": str(dev), "dtype": str(target.dtype).replace("torch.", ""),
            "path": runners.mode, "target_forward_ms": forward_ms, "draft_step_ms": row[1], "draft_step_ms_4_rows": row[4]}


def overheads(summary: dict, step_costs: dict, cfg) -> dict:
    """The engine's time beyond the planner's cost model, from this run's batch-1 measurements:
    round_overhead_ms = chain ms per round - (k drafter steps + one (k+1)-token forward);
    plain_overhead_ms = plain ms per token - one 1-token forward. (costmodel.MeasuredCost adds them.)"""
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
