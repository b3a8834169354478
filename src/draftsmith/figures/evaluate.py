"""The evaluate stage's figures (evaluate/stage.py: manifest_figures writes them): docs/CONTRACTS.md,
evaluate. `plan` reads the acceptance and step costs, `status` the rest."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from ..manifests import Figures, absent_when_none, section


@dataclass
class MethodRow(Figures):
    """metrics.methods.<m> (and by_temperature.<T>.<m>): one method's figures over every prompt."""
    tau: Optional[float] = None
    speedup: Optional[float] = None
    tokens_per_s: Optional[float] = None


@dataclass
class EvaluateMetrics(Figures):
    """metrics: the headline method's (`method`: eagle3_chain when it ran) figures, then every method's."""
    method: Optional[str] = None
    tau: Optional[float] = None
    tau_per_benchmark: dict[str, Optional[float]] = field(default_factory=dict)
    accept_rate_per_position: list[Optional[float]] = field(default_factory=list)
    accept_rate_per_position_unconditional: list[Optional[float]] = field(default_factory=list)
    accept_rate_per_position_by_method: dict[str, list[Optional[float]]] = field(default_factory=dict)
    accept_rate_per_position_per_round_by_method: dict[str, list[Optional[float]]] = field(default_factory=dict)
    """Over every round, those that drafted nothing rejected at depth 1: what `plan` reads for n-gram and the hybrid."""
    tokens_per_s_spec: Optional[float] = None
    tokens_per_s_plain: Optional[float] = None
    speedup: Optional[float] = None
    num_prompts: Optional[int] = None
    draft_steps: Optional[int] = None
    path: Optional[str] = None
    """The decoding path of plain decoding and every method: off / static / graphs / compile."""
    capture_fallbacks: Optional[int] = None
    plain_decode_bw_fraction: Optional[float] = None
    plain_decode_bw_fraction_nominal: Optional[float] = None
    methods: dict[str, MethodRow] = field(default_factory=dict)
    batches: dict[str, dict[str, Optional[float]]] = field(default_factory=dict)
    """Batch size -> method -> speedup."""
    temperature: Optional[float] = absent_when_none()
    """The served temperature (evaluate.temperature), whose figures these are."""
    by_temperature: Optional[dict[str, dict[str, MethodRow]]] = absent_when_none()
    """With several evaluate.temperatures: temperature -> method -> its row."""
    step_costs: Optional[dict[str, Any]] = absent_when_none()
    """Older manifests kept the step costs here; now the top-level step_costs."""


@dataclass
class EvaluateCounts(Figures):
    prompts: Optional[int] = None
    prompts_too_long: Optional[int] = None
    plain_new_tokens: Optional[int] = None
    batches: Optional[int] = None
    near_tie_divergences: Optional[int] = None
    prompts_in_training: Optional[int] = absent_when_none()


@dataclass
class EvaluateFigures(Figures):
    counts: EvaluateCounts = section(EvaluateCounts)
    metrics: EvaluateMetrics = section(EvaluateMetrics)
    step_costs: Optional[dict[str, Any]] = absent_when_none()
    """{context_tokens, batch_size, device, dtype, path, target_forward_ms: {"1": ms, ...}, draft_step_ms, ...}:
    costmodel.MeasuredCost.from_json reads it."""
