"""The vocab stage's figures (vocab.py writes them)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..manifests import Figures, section


@dataclass
class VocabCounts(Figures):
    loss_tokens: Optional[int] = None
    distinct_tokens: Optional[int] = None
    draft_vocab_size: Optional[int] = None


@dataclass
class VocabMetrics(Figures):
    coverage: Optional[float] = None
    """The share of prepare's loss tokens the draft vocab holds."""
    draft_vocab_size: Optional[int] = None


@dataclass
class VocabFigures(Figures):
    draft_vocab_size: Optional[int] = None
    target_vocab_size: Optional[int] = None
    counts: VocabCounts = section(VocabCounts)
    metrics: VocabMetrics = section(VocabMetrics)
