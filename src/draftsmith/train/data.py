"""Training data: an index over capture shards (or token shards, online mode), a deterministic
batch plan per epoch, packed (default) or padded batches, and a background loader.

Capture shards can be far larger than memory (T x 3H hidden states), so the index keeps only
token ids, loss masks and row ranges, and a batch reads its samples' hidden rows by slicing the
memory-mapped safetensors files (`safe_open(...).get_slice`); `data.shards.read_shard` would
load whole shards.

Two batch layouts (train.batch_layout):
    packed  whole samples end to end in one fixed [1, budget] row: position ids restart at 0 per
            sample, document ids say which sample a row belongs to (attention stays inside a
            sample, ttt.ttt_loss), the tail after the last sample is padding (a document of its
            own, token 0, mask 0, zero states). Every micro-batch has the same shape, so compiled
            kernels compile once. Samples are cut to the budget (the index's max_length).
    padded  samples of similar length, one per row, right-padded to the longest: [B, longest].
Batch plan of epoch e: permute the samples with a generator seeded by (seed, e); cut the
permutation into chunks, and group each chunk into batches: packed, best-fit decreasing into
bins of `budget` tokens (a chunk holds PACK_CHUNK_BATCHES budgets of tokens, so that only its
last bin can be left part-full); padded, CHUNK samples sorted by length (long first) filled
greedily while batch_size * longest <= budget (at least one sample). Then permute the batches
with the same generator. The plan depends only on (lengths, budget, seed, e, layout), so a data
cursor (epoch, position in the plan) resumes exactly.

Online mode (train.online) indexes prepare's token shards with `TokenIndex`: the same samples,
cut and dropped by the same rule, in the same order as `CaptureIndex` over the capture of those
shards (capture writes one shard per data shard, samples in source order), so the lengths and
hence the batch plans are the same; the hidden states then come from the target's forward
(target/online.py, laid out by data/batch.py's `collate`) instead of `CaptureIndex.batch`.
"""
from __future__ import annotations

import bisect
import math
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Literal, Optional, Sequence

import torch
from safetensors import SafetensorError, safe_open

from ..messages import DraftsmithError
from ..rundir import fix_command
from ..config import Recipe
from ..data.batch import Batch, empty_batch
from ..data.shards import Sample, length_batches, read_hidden_rows, read_shard, source_ids

CHUNK = 1024
PACK_CHUNK_BATCHES = 64
REQUIRED = ("input_ids", "loss_mask", "offsets", "aux_hidden", "final_hidden")
Layout = Literal["packed", "padded"]


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
        self.sample_index: list[int] = []  # the sample's record in the source
        self.source_id: list[Optional[str]] = []  # its id there (None: a shard written without ids); data.conversations.conversation_keys
        self.dropped = 0
        for si, p in enumerate(self.paths):
            try:
                h = safe_open(str(p), framework="pt")
                keys = set(h.keys())
            except (SafetensorError, OSError) as e:
                raise DraftsmithError(f"{p}: unreadable capture shard ({e}); rerun {fix_command('capture', p, then=('train',))}") from None
            missing = [k for k in REQUIRED if k not in keys]
            if missing:
                raise DraftsmithError(f"{p}: capture shard lacks {missing}; rerun {fix_command('capture', p, then=('train',))}")
            aux_shape = h.get_slice("aux_hidden").get_shape()
            fin_shape = h.get_slice("final_hidden").get_shape()
            if aux_shape[-1] != num_aux * hidden_size or fin_shape[-1] != hidden_size:
                raise DraftsmithError(f"{p}: aux_hidden width {aux_shape[-1]} / final_hidden width {fin_shape[-1]} do not match "
                                      f"{num_aux} aux layers x hidden {hidden_size}; the capture is from another target, rerun {fix_command('capture', p, then=('train',))}")
            self._handles[si] = h
            ids, mask, off = h.get_tensor("input_ids").long(), h.get_tensor("loss_mask").bool(), h.get_tensor("offsets").tolist()
            records = h.get_tensor("sample_index").tolist() if "sample_index" in keys else [None] * (len(off) - 1)
            ids_of = source_ids(p, len(off) - 1, h.metadata() or {}) or [None] * (len(off) - 1)
            if off[-1] != ids.shape[0] or aux_shape[0] != ids.shape[0] or fin_shape[0] != ids.shape[0]:
                raise DraftsmithError(f"{p}: offsets/rows disagree ({off[-1]} offsets end, {ids.shape[0]} tokens, "
                                      f"{aux_shape[0]} aux rows); rerun {fix_command('capture', p, then=('train',))}")
            for a, b, rec, sid in zip(off[:-1], off[1:], records, ids_of):
                n = trainable_length(mask[a:b], self.max_length)
                if not n:
                    self.dropped += 1
                    continue
                self.entries.append((si, a, n))
                self.input_ids.append(ids[a:a + n])
                self.loss_mask.append(mask[a:a + n])
                # a shard without sample_index: each sample a conversation of its own
                self.sample_index.append(int(rec) if rec is not None else -len(self.entries))
                self.source_id.append(sid)
        self.lengths = [e[2] for e in self.entries]

    def batch(self, sample_ids: Sequence[int], packed_tokens: Optional[int] = None, pin: bool = False) -> Batch:
        """The batch of the given samples, packed into one row of packed_tokens or (None)
        right-padded; each sample's hidden rows are read straight into its slot. pin: in
        page-locked memory (an asynchronous copy to the GPU)."""
        batch = None
        for k, j in enumerate(sample_ids):
            si, a, n = self.entries[j]
            h = self._handles[si]
            a_rows = read_hidden_rows(h, "aux_hidden", a, a + n)  # fp8 shards: decoded to float32
            f_rows = read_hidden_rows(h, "final_hidden", a, a + n)
            if batch is None:
                batch, slots = empty_batch([self.lengths[i] for i in sample_ids], packed_tokens, a_rows.shape[-1],
                                           f_rows.shape[-1], a_rows.dtype, pin)
            r, c = slots[k]
            batch.input_ids[r, c:c + n] = self.input_ids[j]
            batch.loss_mask[r, c:c + n] = self.loss_mask[j].float()
            batch.aux_hidden[r, c:c + n] = a_rows
            batch.final_hidden[r, c:c + n] = f_rows
        return batch


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
        self.source_id: list[Optional[str]] = []
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
                self.source_id.append(s.source_id)
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
        return [Sample(self.input_ids[j], self.loss_mask[j], self.sample_index[j], source_id=self.source_id[j])
                for j in sample_ids]


def epoch_plan(lengths: Sequence[int], budget: int, seed: int, epoch: int, layout: Layout = "packed") -> list[list[int]]:
    """The batches (lists of sample ids) of one epoch; see the module docstring."""
    gen = torch.Generator().manual_seed(int(seed) * 1_000_003 + int(epoch))
    order = torch.randperm(len(lengths), generator=gen).tolist()
    batches: list[list[int]] = []
    if layout == "packed":
        chunk: list[int] = []
        tokens = 0
        for j in order:
            chunk.append(j)
            tokens += lengths[j]
            if tokens >= PACK_CHUNK_BATCHES * budget:
                batches += pack_bins(chunk, lengths, budget)
                chunk, tokens = [], 0
        batches += pack_bins(chunk, lengths, budget)
    elif layout == "padded":
        for c in range(0, len(order), CHUNK):
            chunk = sorted(order[c:c + CHUNK])  # ascending ids: ties in length_batches break by id
            batches += [[chunk[i] for i in b] for b in length_batches([lengths[j] for j in chunk], budget)]
    else:
        raise ValueError(f"unknown batch layout {layout!r} (packed, padded)")
    perm = torch.randperm(len(batches), generator=gen).tolist()
    return [batches[i] for i in perm]


def pack_bins(sample_ids: Sequence[int], lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Best-fit decreasing: the samples, longest first (ties by id), each into the fullest bin
    with room for it, else a new bin of `budget` tokens. A sample longer than the budget gets a
    bin of its own (the index cuts samples to the budget, so training never sees one)."""
    bins: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (free tokens, bin), ascending
    for j in sorted(sample_ids, key=lambda j: (-lengths[j], j)):
        n = lengths[j]
        k = bisect.bisect_left(room, (n, -1))
        if k < len(room):
            free, b = room.pop(k)
            bins[b].append(j)
        else:
            free, b = budget, len(bins)
            bins.append([j])
        if free - n > 0:
            bisect.insort(room, (free - n, b))
    return bins


def steps_of_plan(plan_len: int, per_step: int) -> int:
    """Optimizer steps of one epoch: micro-batches per_step at a time, the last step of an epoch
    takes what is left (steps never span two epochs, so `epochs: N` is N whole passes)."""
    return -(-plan_len // per_step)


class Loader:
    """Builds batches on one background thread, in the order they are asked for, while the
    device trains on the previous ones; every read of the shards goes through this one thread.
    `ahead(ids)` queues a batch; `next()` returns the oldest queued one (its exception, if the
    load failed); `now(ids)` loads one batch out of turn, after those already queued."""

    def __init__(self, load: Callable[[Sequence[int]], Batch], device: torch.device):
        self.load, self.device = load, device
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="draftsmith-loader")
        self.queue: deque[Future] = deque()

    def ahead(self, ids: Sequence[int]) -> None:
        self.queue.append(self.pool.submit(self.load, ids))

    def next(self) -> Batch:
        return self.queue.popleft().result().to(self.device)

    def now(self, ids: Sequence[int]) -> Batch:
        return self.pool.submit(self.load, ids).result().to(self.device)

    def close(self) -> None:
        for f in self.queue:
            f.cancel()
        self.queue.clear()
        self.pool.shutdown(wait=True, cancel_futures=True)


def micro_batching(batch_tokens: int, micro_batch_tokens: int | None, world_size: int) -> tuple[int, int]:
    """(micro-batch token budget, micro-batches per optimizer step)."""
    micro = int(micro_batch_tokens or max(1, batch_tokens // world_size))
    per_step = max(1, batch_tokens // micro)
    if per_step % world_size:
        raise DraftsmithError(f"train: batch_tokens {batch_tokens} / micro_batch_tokens {micro} = {per_step} micro-batches per step, "
                              f"not a multiple of the world size {world_size}; set batch_tokens to a multiple of "
                              f"micro_batch_tokens * {world_size}")
    return micro, per_step


def total_steps_of(recipe: Recipe, plan_len, micro_per_step: int) -> int:
    """max_steps and/or the steps of max_tokens (ceil(max_tokens / batch_tokens)), the smaller;
    else the steps of `epochs` whole passes: each epoch's steps counted from its own plan
    (plan_len(e): micro-batches of epoch e), a fraction of the last one rounded up."""
    tc = recipe.train
    caps = ([int(tc.max_steps)] if tc.max_steps is not None else []) + ([-(-int(tc.max_tokens) // tc.batch_tokens)] if tc.max_tokens else [])
    if caps:
        return max(1, min(caps))
    whole = int(tc.epochs)
    steps = sum(steps_of_plan(plan_len(e), micro_per_step) for e in range(whole))
    if tc.epochs > whole:
        steps += math.ceil((tc.epochs - whole) * steps_of_plan(plan_len(whole), micro_per_step))
    return max(1, steps)
