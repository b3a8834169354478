"""Prometheus text parsing and speculative-decoding acceptance from a server's /metrics.

vLLM (v1 engine) exports counters, summed here over label sets such as `engine`:
    vllm:spec_decode_num_drafts_total                drafts (verification steps with drafts)
    vllm:spec_decode_num_draft_tokens_total          draft tokens proposed
    vllm:spec_decode_num_accepted_tokens_total       draft tokens accepted
    vllm:spec_decode_num_accepted_tokens_per_pos_total{position="i"}   accepted at depth i
so over a window: acceptance rate = accepted / draft_tokens, mean acceptance length
(bonus token included, vLLM's convention) = 1 + accepted / drafts, and the rate per position
= accepted_per_pos[i] / drafts. SGLang exports gauges of recent batches instead:
`sglang:spec_accept_length` and `sglang:spec_accept_rate`; those are read as they stand.
"""
from __future__ import annotations

import re
from collections import defaultdict
from typing import Optional

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')

VLLM = "vllm:spec_decode_"


def parse_prometheus(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """name -> [(labels, value)] of every sample in a Prometheus text exposition."""
    out: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            continue
        try:
            value = float(m.group(4))
        except ValueError:
            continue
        out[m.group(1)].append((dict(_LABEL.findall(m.group(3) or "")), value))
    return dict(out)


def _counter(samples: dict, name: str) -> Optional[float]:
    """Sum of a counter over its label sets; exposed as NAME_total (prometheus_client) or NAME."""
    for n in (name + "_total", name):
        if n in samples:
            return sum(v for _, v in samples[n])
    return None


def _per_pos(samples: dict, name: str) -> dict[int, float]:
    out: dict[int, float] = defaultdict(float)
    for n in (name + "_total", name):
        for labels, v in samples.get(n, []):
            pos = labels.get("position", "")
            if pos.isdigit():  # a position label that is not a number is not ours to guess: skipped
                out[int(pos)] += v
        if out:
            break
    return dict(out)


def spec_counters(samples: dict) -> Optional[dict]:
    """vLLM spec-decode counters of one scrape (None when the server exports none)."""
    drafts = _counter(samples, VLLM + "num_drafts")
    if drafts is None:
        return None
    return {"drafts": drafts,
            "draft_tokens": _counter(samples, VLLM + "num_draft_tokens") or 0.0,
            "accepted_tokens": _counter(samples, VLLM + "num_accepted_tokens") or 0.0,
            "accepted_per_pos": _per_pos(samples, VLLM + "num_accepted_tokens_per_pos")}


def spec_window(before: Optional[dict], after: Optional[dict]) -> Optional[dict]:
    """Acceptance over the window between two scrapes (parsed samples); None when not exposed."""
    if after is None:
        return None
    a = spec_counters(after)
    if a is not None:
        b = spec_counters(before or {}) or {"drafts": 0.0, "draft_tokens": 0.0, "accepted_tokens": 0.0,
                                               "accepted_per_pos": {}}
        drafts = a["drafts"] - b["drafts"]
        draft_tokens = a["draft_tokens"] - b["draft_tokens"]
        accepted = a["accepted_tokens"] - b["accepted_tokens"]
        per_pos = [a["accepted_per_pos"].get(i, 0.0) - b["accepted_per_pos"].get(i, 0.0)
                   for i in range(len(a["accepted_per_pos"]))]
        return {"source": "vllm", "drafts": int(drafts), "draft_tokens": int(draft_tokens),
                "accepted_tokens": int(accepted),
                "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
                "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
                "accept_rate_per_position": [p / drafts for p in per_pos] if drafts else []}
    gauges = {k: after.get(f"sglang:spec_accept_{k}") for k in ("length", "rate")}
    if gauges["length"]:
        mean = lambda s: sum(v for _, v in s) / len(s) if s else None  # noqa: E731  (one value per rank)
        return {"source": "sglang", "mean_acceptance_length": mean(gauges["length"]),
                "acceptance_rate": mean(gauges["rate"] or [])}
    return None
