"""The vocab mapping's file, vocab/vocab.safetensors (the vocab stage, vocab.py, writes it; DESIGN.md §4):
    d2t  int64 [Vd]  offset: target_id = i + d2t[i]
    t2d  bool  [V]   t2d[target_id] is True iff the token is in the draft vocab
load_vocab reads it back checked; draft_ids gives the target ids of the draft vocab.
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from ..manifests import verify_listed_file
from ..messages import DraftsmithError
from ..rundir import fix_command

VOCAB_FILE = "vocab.safetensors"


def draft_ids(d2t: torch.Tensor) -> torch.Tensor:
    """Target ids of the draft vocab, in draft order: i + d2t[i]."""
    return torch.arange(d2t.numel(), dtype=torch.int64, device=d2t.device) + d2t


def load_vocab(path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) from vocab/vocab.safetensors, checked for consistency."""
    path = Path(path)
    verify_listed_file(path)
    try:
        t = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise DraftsmithError(f"{path}: unreadable ({e}); rerun {fix_command('vocab', path, then=('train',))}") from None
    if "d2t" not in t or "t2d" not in t:
        raise DraftsmithError(f"{path}: lacks d2t/t2d; rerun {fix_command('vocab', path, then=('train',))}")
    d2t, t2d = t["d2t"], t["t2d"]
    if d2t.dim() != 1 or t2d.dim() != 1 or d2t.is_floating_point() or t2d.is_floating_point():
        raise DraftsmithError(f"{path}: d2t {str(d2t.dtype).removeprefix('torch.')} {list(d2t.shape)} and t2d "
                              f"{str(t2d.dtype).removeprefix('torch.')} {list(t2d.shape)} are not a vocab mapping (1-D integer "
                              f"offsets, a 1-D mask); rerun {fix_command('vocab', path, then=('train',))}")
    d2t, t2d = d2t.to(torch.int64), t2d.to(torch.bool)
    ids = draft_ids(d2t)
    if ids.numel() and (ids.min() < 0 or ids.max() >= t2d.numel() or not bool(t2d[ids].all())
                        or int(t2d.sum()) != ids.numel()):
        raise DraftsmithError(f"{path}: d2t and t2d disagree; rerun {fix_command('vocab', path, then=('train',))}")
    return d2t, t2d
