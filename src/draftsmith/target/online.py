"""Online mode: the target's forward feeds training directly, no capture on disk.

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

from ..artifacts import DraftsmithError
from ..data.batch import Batch, collate
from ..data.shards import Sample, round_to_storage
from .capture import capture_samples
from .model import Target


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
