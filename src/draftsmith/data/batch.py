"""The batch that training reads, in one of two layouts (train.batch_layout): packed, whole
samples end to end in one fixed [1, packed_tokens] row with position ids restarting at each
sample and document ids (the sample of each row; the padding tail a document of its own);
padded, one sample per row, right-padded to the longest. Token ids, loss masks and hidden states
of a few samples (data/shards.py's Sample). Capture shards (train/data.py's CaptureIndex, which
reads each sample's rows straight into its slot of `empty_batch`) and the target's live forward
(target/online.py, through `collate`) both give one, laid out the same way.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .shards import Sample


@dataclass
class Batch:
    input_ids: torch.Tensor  # int64 [B, L], 0 past each sample's end
    loss_mask: torch.Tensor  # float32 [B, L], 0 past each sample's end
    aux_hidden: torch.Tensor  # [B, L, n_aux * H] storage dtype
    final_hidden: torch.Tensor  # [B, L, H] storage dtype
    num_tokens: int  # real (unpadded) tokens
    position_ids: Optional[torch.Tensor] = None  # int64 [B, L], 0 at each sample's start (packed); None: 0..L-1
    doc_ids: Optional[torch.Tensor] = None  # int32 [B, L] sample of each row, padding last (packed); None: one per row

    def tensors(self) -> tuple:
        """The model's inputs: (input_ids, loss_mask, aux_hidden, final_hidden, position_ids, doc_ids)."""
        return self.input_ids, self.loss_mask, self.aux_hidden, self.final_hidden, self.position_ids, self.doc_ids

    def to(self, device: torch.device) -> "Batch":
        ids, mask, aux, fin, pos, docs = (None if t is None else t.to(device, non_blocking=True) for t in self.tensors())
        return Batch(ids, mask, aux, fin, self.num_tokens, pos, docs)

    def pin_memory(self) -> "Batch":
        ids, mask, aux, fin, pos, docs = (None if t is None else t.pin_memory() for t in self.tensors())
        return Batch(ids, mask, aux, fin, self.num_tokens, pos, docs)


def batch_slots(lengths: Sequence[int], packed_tokens: Optional[int]) -> tuple[tuple[int, int], list[tuple[int, int]]]:
    """((B, L), [(row, first column) of each sample]): packed (packed_tokens set), one row of
    packed_tokens with the samples end to end; padded, one row per sample, L the longest."""
    if packed_tokens is None:
        return (len(lengths), max(lengths)), [(r, 0) for r in range(len(lengths))]
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    if starts[-1] > packed_tokens:
        raise ValueError(f"samples of {starts[-1]} tokens do not fit a packed row of {packed_tokens}")
    return (1, int(packed_tokens)), [(0, c) for c in starts[:-1]]


def empty_batch(lengths: Sequence[int], packed_tokens: Optional[int], aux_width: int, final_width: int,
                dtype: torch.dtype, pin: bool = False) -> tuple[Batch, list[tuple[int, int]]]:
    """A batch for samples of these lengths with its position and document ids set, and each
    sample's (row, first column) to fill in. Tokens and masks are 0 and the hidden states zero
    wherever no sample will be written (padding); the states under the samples are left
    unwritten (they are hundreds of MiB at large widths, and the caller fills them)."""
    (B, L), slots = batch_slots(lengths, packed_tokens)
    zeros = dict(pin_memory=pin)
    aux = torch.empty(B, L, aux_width, dtype=dtype, **zeros)
    fin = torch.empty(B, L, final_width, dtype=dtype, **zeros)
    for r, ends in enumerate(_row_ends(slots, lengths, B)):
        aux[r, ends:].zero_()
        fin[r, ends:].zero_()
    batch = Batch(torch.zeros(B, L, dtype=torch.int64, **zeros), torch.zeros(B, L, dtype=torch.float32, **zeros), aux, fin,
                  int(sum(lengths)))
    if packed_tokens is not None:
        pos = torch.empty(1, L, dtype=torch.int64, **zeros)
        docs = torch.empty(1, L, dtype=torch.int32, **zeros)
        end = 0
        for d, ((_, c), n) in enumerate(zip(slots, lengths)):
            pos[0, c:c + n] = torch.arange(n)
            docs[0, c:c + n] = d
            end = c + n
        pos[0, end:] = torch.arange(L - end)
        docs[0, end:] = len(lengths)  # the padding tail: a document of its own
        batch.position_ids, batch.doc_ids = pos, docs
    return batch, slots


def _row_ends(slots: list[tuple[int, int]], lengths: Sequence[int], rows: int) -> list[int]:
    """Per row, the column after its last sample (samples fill each row from column 0, end to end)."""
    ends = [0] * rows
    for (r, c), n in zip(slots, lengths):
        ends[r] = max(ends[r], c + n)
    return ends


def collate(samples: Sequence[Sample], packed_tokens: Optional[int] = None) -> Batch:
    """A Batch of samples with hidden states: packed into one row of packed_tokens, or (None)
    right-padded, one sample per row."""
    first = samples[0]
    batch, slots = empty_batch([len(s) for s in samples], packed_tokens, first.aux_hidden.shape[-1],
                               first.final_hidden.shape[-1], first.aux_hidden.dtype)
    for (r, c), s in zip(slots, samples):
        n = len(s)
        batch.input_ids[r, c:c + n], batch.loss_mask[r, c:c + n] = s.input_ids, s.loss_mask.float()
        batch.aux_hidden[r, c:c + n], batch.final_hidden[r, c:c + n] = s.aux_hidden, s.final_hidden
    return batch
