"""Ragged sample shards in safetensors: the on-disk format between prepare, capture and train.

A shard holds n samples packed end to end:
    input_ids    int32 [T]          token ids of all samples
    loss_mask    uint8 [T]          1 where the token is assistant content (a training label)
    offsets      int64 [n + 1]      sample j is rows offsets[j]:offsets[j+1]
    sample_index int64 [n]          index of the conversation in the source (after skip)
Capture shards add, row-aligned with input_ids:
    aux_hidden   [T, n_aux * H]     outputs of the aux layers, concatenated (storage dtype)
    final_hidden [T, H]             the target's last hidden state after its final norm
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch

from ..artifacts import DraftsmithError, atomic_save_safetensors


@dataclass
class Sample:
    input_ids: torch.Tensor  # int64 [L]
    loss_mask: torch.Tensor  # bool [L]
    sample_index: int
    aux_hidden: Optional[torch.Tensor] = None  # [L, n_aux * H]
    final_hidden: Optional[torch.Tensor] = None  # [L, H]

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


def shard_name(i: int) -> str:
    return f"shard-{i:05d}.safetensors"


def pack(samples: Sequence[Sample]) -> dict[str, torch.Tensor]:
    lengths = torch.tensor([len(s) for s in samples], dtype=torch.int64)
    offsets = torch.zeros(len(samples) + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    out = {
        "input_ids": torch.cat([s.input_ids.to(torch.int32) for s in samples]) if samples else torch.zeros(0, dtype=torch.int32),
        "loss_mask": torch.cat([s.loss_mask.to(torch.uint8) for s in samples]) if samples else torch.zeros(0, dtype=torch.uint8),
        "offsets": offsets,
        "sample_index": torch.tensor([s.sample_index for s in samples], dtype=torch.int64),
    }
    if samples and samples[0].aux_hidden is not None:
        out["aux_hidden"] = torch.cat([s.aux_hidden for s in samples])
        out["final_hidden"] = torch.cat([s.final_hidden for s in samples])
    return out


def write_shard(path: str | Path, samples: Sequence[Sample], metadata: Optional[dict[str, str]] = None) -> dict:
    """Write a shard atomically. Returns its manifest entry (file, sha256, counts)."""
    tensors = pack(samples)
    sha = atomic_save_safetensors(path, tensors, metadata)
    return {"file": Path(path).name, "sha256": sha, "num_samples": len(samples),
            "num_tokens": int(tensors["input_ids"].shape[0]),
            "num_loss_tokens": int(tensors["loss_mask"].sum())}


def read_shard(path: str | Path, with_hidden: bool = True) -> list[Sample]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        t = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise DraftsmithError(f"{path}: unreadable shard ({e}); delete its stage folder and rerun the stage") from None
    need = {"input_ids", "loss_mask", "offsets", "sample_index"}
    if not need <= set(t):
        raise DraftsmithError(f"{path}: shard lacks {sorted(need - set(t))}; it was not written by draftsmith, rerun its stage")
    off = t["offsets"].tolist()
    hidden = with_hidden and "aux_hidden" in t
    out = []
    for j in range(len(off) - 1):
        a, b = off[j], off[j + 1]
        out.append(Sample(
            input_ids=t["input_ids"][a:b].long(), loss_mask=t["loss_mask"][a:b].bool(),
            sample_index=int(t["sample_index"][j]),
            aux_hidden=t["aux_hidden"][a:b] if hidden else None,
            final_hidden=t["final_hidden"][a:b] if hidden else None))
    return out


def iter_samples(paths: Sequence[Path], with_hidden: bool = True) -> Iterator[Sample]:
    for p in paths:
        yield from read_shard(p, with_hidden)
