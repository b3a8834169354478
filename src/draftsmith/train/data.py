"""Training data: an index over capture shards (or token shards, online mode), a deterministic
batch plan per epoch, padded batches.

Capture shards can be far larger than memory (T x 3H hidden states), so the index keeps only
token ids, loss masks and row ranges, and a batch reads its samples' hidden rows by slicing the
memory-mapped safetensors files (`safe_open(...).get_slice`); `data.shards.read_shard` would
load whole shards.

Batch plan of epoch e: permute the samples with a generator seeded by (seed, e); cut each
into chunks of CHUNK samples, sort a chunk by length (long first) and fill batches greedily
while batch_size * longest <= batch_tokens (padded tokens, at least one sample); then permute
the batches with the same generator. The plan depends only on (lengths, batch_tokens, seed, e),
so a data cursor (epoch, position in the plan) resumes exactly.

Online mode (train.online) indexes prepare's token shards with `TokenIndex`: the same samples,
cut and dropped by the same rule, in the same order as `CaptureIndex` over the capture of those
shards (capture writes one shard per data shard, samples in source order), so the lengths and
hence the batch plans are the same; the hidden states then come from the target's forward
(target/online.py) instead of `CaptureIndex.batch`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch
from safetensors import SafetensorError, safe_open

from ..artifacts import DraftsmithError
from ..data.batch import Batch
from ..data.shards import Sample, length_batches, read_hidden_rows, read_shard

CHUNK = 1024
REQUIRED = ("input_ids", "loss_mask", "offsets", "aux_hidden", "final_hidden")


class _Lengths:
    """What the batch planner needs of an index: per-sample lengths after the cut."""

    lengths: list[int]

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)


def trainable_length(loss_mask: torch.Tensor, max_length: int) -> int:
    """A sample's length after the cut to max_length, or 0 when it has no trainable row: a row t
    needs tokens t+1 and t+2 (input and label), so a sample needs 3 tokens and a loss token at
    position >= 2."""
    n = min(len(loss_mask), max_length)
    return n if n >= 3 and bool(loss_mask[2:n].any()) else 0


class CaptureIndex(_Lengths):
    """Samples of capture shards, cut to max_length; samples with no trainable row are dropped
    (`trainable_length`)."""

    def __init__(self, paths: Sequence[Path], max_length: int, hidden_size: int, num_aux: int):
        self.paths = [Path(p) for p in paths]
        self.max_length = int(max_length)
        self._handles: dict[int, Any] = {}
        self.entries: list[tuple[int, int, int]] = []  # (shard, first row, length after cut)
        self.input_ids: list[torch.Tensor] = []
        self.loss_mask: list[torch.Tensor] = []
        self.dropped = 0
        for si, p in enumerate(self.paths):
            try:
                h = safe_open(str(p), framework="pt")
                keys = set(h.keys())
            except (SafetensorError, OSError) as e:
                raise DraftsmithError(f"{p}: unreadable capture shard ({e}); delete the capture folder and rerun `draftsmith capture`") from None
            missing = [k for k in REQUIRED if k not in keys]
            if missing:
                raise DraftsmithError(f"{p}: capture shard lacks {missing}; delete the capture folder and rerun `draftsmith capture`")
            aux_shape = h.get_slice("aux_hidden").get_shape()
            fin_shape = h.get_slice("final_hidden").get_shape()
            if aux_shape[-1] != num_aux * hidden_size or fin_shape[-1] != hidden_size:
                raise DraftsmithError(f"{p}: aux_hidden width {aux_shape[-1]} / final_hidden width {fin_shape[-1]} do not match "
                                      f"{num_aux} aux layers x hidden {hidden_size}; the capture is from another target, rerun `draftsmith capture`")
            self._handles[si] = h
            ids, mask, off = h.get_tensor("input_ids").long(), h.get_tensor("loss_mask").bool(), h.get_tensor("offsets").tolist()
            if off[-1] != ids.shape[0] or aux_shape[0] != ids.shape[0] or fin_shape[0] != ids.shape[0]:
                raise DraftsmithError(f"{p}: offsets/rows disagree ({off[-1]} offsets end, {ids.shape[0]} tokens, "
                                      f"{aux_shape[0]} aux rows); delete the capture folder and rerun `draftsmith capture`")
            for a, b in zip(off[:-1], off[1:]):
                n = trainable_length(mask[a:b], self.max_length)
                if not n:
                    self.dropped += 1
                    continue
                self.entries.append((si, a, n))
                self.input_ids.append(ids[a:a + n])
                self.loss_mask.append(mask[a:a + n])
        self.lengths = [e[2] for e in self.entries]

    def batch(self, sample_ids: Sequence[int]) -> Batch:
        """Right-padded batch of the given samples (padding: token 0, mask 0, zero states)."""
        L = max(self.lengths[j] for j in sample_ids)
        B = len(sample_ids)
        ids = torch.zeros(B, L, dtype=torch.int64)
        mask = torch.zeros(B, L, dtype=torch.float32)
        aux = fin = None
        for r, j in enumerate(sample_ids):
            si, a, n = self.entries[j]
            h = self._handles[si]
            a_rows = read_hidden_rows(h, "aux_hidden", a, a + n)  # fp8 shards: decoded to float32
            f_rows = read_hidden_rows(h, "final_hidden", a, a + n)
            if aux is None:
                aux = torch.zeros(B, L, a_rows.shape[-1], dtype=a_rows.dtype)
                fin = torch.zeros(B, L, f_rows.shape[-1], dtype=f_rows.dtype)
            ids[r, :n] = self.input_ids[j]
            mask[r, :n] = self.loss_mask[j].float()
            aux[r, :n] = a_rows
            fin[r, :n] = f_rows
        return Batch(ids, mask, aux, fin, sum(self.lengths[j] for j in sample_ids))


class TokenIndex(_Lengths):
    """Samples of token shards (prepare's data/ or regenerate's regen/), cut to max_length;
    samples with no trainable row are dropped, as in CaptureIndex. `samples(ids)` gives the cut
    token-only samples for the target's forward (online mode)."""

    def __init__(self, paths: Sequence[Path], max_length: int):
        self.paths = [Path(p) for p in paths]
        self.max_length = int(max_length)
        self.entries: list[tuple[int, int, int]] = []  # (shard, sample within the shard, length after cut)
        self.input_ids: list[torch.Tensor] = []
        self.loss_mask: list[torch.Tensor] = []
        self.sample_index: list[int] = []
        self.dropped = 0
        for si, p in enumerate(self.paths):
            for j, s in enumerate(read_shard(p, with_hidden=False)):
                n = trainable_length(s.loss_mask, self.max_length)
                if not n:
                    self.dropped += 1
                    continue
                self.entries.append((si, j, n))
                self.input_ids.append(s.input_ids[:n])
                self.loss_mask.append(s.loss_mask[:n])
                self.sample_index.append(s.sample_index)
        self.lengths = [e[2] for e in self.entries]

    def max_token_id(self) -> tuple[int, int]:
        """(largest token id, index of a sample holding it); (-1, -1) when empty."""
        best, where = -1, -1
        for j, ids in enumerate(self.input_ids):
            top = int(ids.max())
            if top > best:
                best, where = top, j
        return best, where

    def samples(self, sample_ids: Sequence[int]) -> list[Sample]:
        """Token-only samples (cut to max_length), in the given order."""
        return [Sample(self.input_ids[j], self.loss_mask[j], self.sample_index[j]) for j in sample_ids]


def epoch_plan(lengths: Sequence[int], batch_tokens: int, seed: int, epoch: int) -> list[list[int]]:
    """The batches (lists of sample ids) of one epoch; see the module docstring."""
    gen = torch.Generator().manual_seed(int(seed) * 1_000_003 + int(epoch))
    order = torch.randperm(len(lengths), generator=gen).tolist()
    batches: list[list[int]] = []
    for c in range(0, len(order), CHUNK):
        chunk = sorted(order[c:c + CHUNK])  # ascending ids: ties in length_batches break by id
        batches += [[chunk[i] for i in b] for b in length_batches([lengths[j] for j in chunk], batch_tokens)]
    perm = torch.randperm(len(batches), generator=gen).tolist()
    return [batches[i] for i in perm]
