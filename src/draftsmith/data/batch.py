"""The padded batch that training reads: right-padded token ids, loss masks and hidden states of
a few samples (data/shards.py's Sample). Capture shards (train/data.py's CaptureIndex) and the
target's live forward (target/online.py) both give one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .shards import Sample


@dataclass
class Batch:
    input_ids: torch.Tensor  # int64 [B, L], 0 past each sample's end
    loss_mask: torch.Tensor  # float32 [B, L], 0 past each sample's end
    aux_hidden: torch.Tensor  # [B, L, n_aux * H] storage dtype
    final_hidden: torch.Tensor  # [B, L, H] storage dtype
    num_tokens: int  # real (unpadded) tokens

    def to(self, device: torch.device) -> "Batch":
        return Batch(*(t.to(device, non_blocking=True) for t in
                       (self.input_ids, self.loss_mask, self.aux_hidden, self.final_hidden)), self.num_tokens)


def pad_batch(samples: Sequence[Sample]) -> Batch:
    """Right-padded train Batch (token 0, mask 0, zero states past each end), as CaptureIndex.batch."""
    L = max(len(s) for s in samples)
    B = len(samples)
    first = samples[0]
    ids = torch.zeros(B, L, dtype=torch.int64)
    mask = torch.zeros(B, L, dtype=torch.float32)
    aux = torch.zeros(B, L, first.aux_hidden.shape[-1], dtype=first.aux_hidden.dtype)
    fin = torch.zeros(B, L, first.final_hidden.shape[-1], dtype=first.final_hidden.dtype)
    for r, s in enumerate(samples):
        n = len(s)
        ids[r, :n], mask[r, :n] = s.input_ids, s.loss_mask.float()
        aux[r, :n], fin[r, :n] = s.aux_hidden, s.final_hidden
    return Batch(ids, mask, aux, fin, sum(len(s) for s in samples))

