"""The token stages' figures: prepare's and regenerate's counts (data/prepare.py, data/regenerate.py).

Both stages count into a Counter as they go (a resumed run continues the manifest's counts), so they
write the counts themselves; each key they write is a field here or, prepare's skipped_<reason>,
an entry of `skipped` (tests/test_figures.py checks both against real manifests)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Self

from ..manifests import BAD, Figures, absent_when_none, read_as, section

SKIPPED = "skipped_"


@dataclass
class PrepareCounts(Figures):
    read: Optional[int] = None
    kept: Optional[int] = None
    truncated: Optional[int] = None
    tokens: Optional[int] = None
    loss_tokens: Optional[int] = None
    assistant_turns_without_eot: Optional[int] = absent_when_none()
    dropped_leading_assistant: Optional[int] = absent_when_none()
    dropped_trailing_user: Optional[int] = absent_when_none()
    cut_at_role_break: Optional[int] = absent_when_none()
    cut_at_empty_turn: Optional[int] = absent_when_none()
    skipped: dict[str, int] = field(default_factory=dict)
    """The manifest's skipped_<reason> keys, by reason."""

    @classmethod
    def from_manifest(cls, m: Any, problems: list[str] | None = None, where: str = "") -> Self:
        out = super().from_manifest(m, problems, where)
        if isinstance(m, dict):
            for k, v in m.items():
                if k.startswith(SKIPPED) and read_as(int, v, f"{where}{k}", problems) is not BAD:
                    out.skipped[k[len(SKIPPED):]] = v
        return out

    def to_dict(self) -> dict:
        d = super().to_dict()
        return {**{k: v for k, v in d.items() if k != "skipped"}, **{SKIPPED + k: v for k, v in d["skipped"].items()}}

    def skipped_total(self) -> int:
        return sum(self.skipped.values())


@dataclass
class PrepareMetrics(Figures):
    mean_tokens_per_sample: Optional[float] = None
    loss_token_fraction: Optional[float] = None


@dataclass
class PrepareFigures(Figures):
    counts: PrepareCounts = section(PrepareCounts)
    metrics: PrepareMetrics = section(PrepareMetrics)


@dataclass
class RegenerateCounts(Figures):
    conversations: Optional[int] = None
    kept: Optional[int] = None
    failed: Optional[int] = None
    truncated: Optional[int] = None
    no_loss_tokens: Optional[int] = None
    tokens: Optional[int] = None
    loss_tokens: Optional[int] = None
    answers_reencoded: Optional[int] = None
    prompt_mismatch: Optional[int] = None


@dataclass
class RegenerateMetrics(Figures):
    loss_tokens_per_s: Optional[float] = absent_when_none()
    """Absent when no request ran (a resumed stage with nothing left)."""


@dataclass
class RegenerateFigures(Figures):
    counts: RegenerateCounts = section(RegenerateCounts)
    metrics: RegenerateMetrics = section(RegenerateMetrics)
