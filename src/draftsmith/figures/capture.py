"""The capture stage's figures (target/capture.py writes them): the captured states' shape, counts, throughput."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..manifests import Figures, absent_when_none, section


@dataclass
class CaptureCounts(Figures):
    samples: Optional[int] = None
    tokens: Optional[int] = None
    rejected_nonfinite: Optional[int] = None
    """Samples whose hidden states held NaN/inf: not written."""


@dataclass
class CaptureMetrics(Figures):
    capture_tokens_per_s: Optional[float] = absent_when_none()
    """All ranks together; absent when a resumed capture had nothing left to run."""


@dataclass
class CaptureFigures(Figures):
    aux_layer_ids: Optional[list[int]] = None
    """Outputs of 0-indexed decoder layers (DESIGN.md §4)."""
    num_layers: Optional[int] = None
    hidden_size: Optional[int] = None
    target_vocab_size: Optional[int] = None
    storage_dtype: Optional[str] = None
    bytes_per_token: Optional[int] = None
    target_architecture: Optional[str] = None
    world_size: Optional[int] = None
    source: Optional[str] = None
    """The token stage it read: prepare, or regenerate when enabled."""
    counts: CaptureCounts = section(CaptureCounts)
    metrics: CaptureMetrics = section(CaptureMetrics)
