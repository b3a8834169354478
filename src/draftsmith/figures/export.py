"""The export stage's figures (export/__init__.py writes them): the formats written, each with its files."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from ..manifests import Figures, section


@dataclass
class ExportedFormat(Figures):
    dir: Optional[str] = None
    files: list[dict[str, Any]] = field(default_factory=list)
    """Each file's name, bytes and sha256."""


@dataclass
class ExportCounts(Figures):
    formats: Optional[int] = None


@dataclass
class ExportFigures(Figures):
    formats: dict[str, ExportedFormat] = field(default_factory=dict)
    counts: ExportCounts = section(ExportCounts)
