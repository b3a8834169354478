"""The target's forward over token samples to their hidden states: capture's (`capture_samples`, what
the capture stage stores) and online mode's, where the forward feeds training directly, no capture
on disk. Below the stages: target/capture.py and train/sources.py both call it.

`online_samples` gives, for token-only samples (prepare's shards), the hidden states that the
offline path would give after capture -> shard -> read: the same capture code (length-sorted
batches of `batch_tokens`), then the same storage rounding (bfloat16/float16 cast; fp8 encode +
decode per token and aux layer, float32 out, as `data.shards.read_shard` / `read_hidden_rows`).
With the same batch composition (capture.batch_tokens) the tensors are bit-identical to the
offline ones, so training on them gives the same drafter.

The train loop's use (train/loop.py, train.online: true): it keeps the token index
(train/data.py's TokenIndex) and batch plan it builds from data/ shards, and replaces
`index.batch(sample_ids, packed_tokens)` by
    online_batch(target, index.samples(sample_ids), recipe.capture.storage_dtype, recipe.capture.batch_tokens, packed_tokens)
with `target = load_target(...)` loaded once next to the drafter.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional, Sequence

import torch

from ..messages import DraftsmithError
from ..data.batch import Batch, collate
from ..data.shards import STORAGE_DTYPES, Sample, length_batches, round_to_storage
from .model import Target


def capture_samples(target: Target, samples: list[Sample], batch_tokens: int,
                    storage_dtype: str = "float32") -> tuple[list[Sample], int]:
    """Fill aux_hidden / final_hidden of each sample, rounded to the storage dtype (fp8 storage:
    kept in float32 here, encoded by write_shard). Returns (good samples in input order,
    rejected count): a sample whose hidden states hold NaN or inf is rejected, not stored."""
    hold = torch.float32 if storage_dtype == "float8_e4m3" else STORAGE_DTYPES[storage_dtype]
    dev = target.device
    out: list[Sample | None] = [None] * len(samples)
    for batch in length_batches([len(s) for s in samples], batch_tokens):
        L = max(len(samples[i]) for i in batch)
        ids = torch.zeros((len(batch), L), dtype=torch.long)  # right padding with id 0, masked out
        mask = torch.zeros((len(batch), L), dtype=torch.long)
        for r, i in enumerate(batch):
            n = len(samples[i])
            ids[r, :n] = samples[i].input_ids
            mask[r, :n] = 1
        valid = mask.to(dev)
        res = target.forward(ids.to(dev), attention_mask=valid, with_logits=False)
        aux, final = res.aux_hidden.to(hold), res.final_hidden.to(hold)
        # NaN/inf check on the device, over each sample's own tokens (a host check of the
        # copied states costs more than the forward), then one read of a flag per sample.
        bad = ((~torch.isfinite(aux)).flatten(2).any(-1) | (~torch.isfinite(final)).flatten(2).any(-1)) & valid.bool()
        finite = (~bad.any(1)).tolist()
        aux, final = _to_host(aux), _to_host(final)
        for r, i in enumerate(batch):
            if finite[r]:
                n, s = len(samples[i]), samples[i]
                out[i] = replace(s, aux_hidden=aux[r, :n].clone(), final_hidden=final[r, :n].clone())
    good = [s for s in out if s is not None]
    return good, len(samples) - len(good)


def _to_host(x: torch.Tensor) -> torch.Tensor:
    """A GPU tensor copied to host memory through a pinned buffer from torch's caching host
    allocator (reused across batches): the DMA writes straight into it, where a pageable copy is
    staged through a driver buffer. The callers clone what they keep, so the buffer goes back."""
    if x.device.type != "cuda":
        return x.cpu()
    buf = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    return buf.copy_(x)


def online_samples(target: Target, samples: Sequence[Sample], storage_dtype: str = "bfloat16",
                   batch_tokens: int = 8192) -> tuple[list[Sample], int]:
    """Samples with aux_hidden / final_hidden filled as a capture shard would hold them after
    reading back. Returns (good samples in input order, rejected count: NaN/inf states)."""
    good, rejected = capture_samples(target, list(samples), batch_tokens, storage_dtype)
    if storage_dtype == "float8_e4m3":
        n_aux = len(target.aux_layer_ids)
        good = [replace(s, aux_hidden=round_to_storage(s.aux_hidden, storage_dtype, n_aux),
                        final_hidden=round_to_storage(s.final_hidden, storage_dtype, 1)) for s in good]
    return good, rejected


def online_batch(target: Target, samples: Sequence[Sample], storage_dtype: str = "bfloat16",
                 batch_tokens: int = 8192, packed_tokens: Optional[int] = None) -> Batch:
    """One train Batch straight from the target's forward, laid out as CaptureIndex.batch lays
    out the same samples (packed into one row of packed_tokens, or right-padded when None). A
    sample with NaN/inf states is left out (as capture rejects it); when all are, the error names
    the first sample."""
    good, _ = online_samples(target, samples, storage_dtype, batch_tokens)
    if not good:
        raise DraftsmithError(f"online capture: sample {samples[0].sample_index}: every sample of the batch has NaN/inf "
                              "hidden states; check the target's dtype (target.dtype float32) and weights")
    return collate(good, packed_tokens)
