"""Where a micro-batch's hidden states come from, decided once (data_source):

    CaptureSource   offline: capture/'s shards hold the hidden states (CaptureIndex.batch reads them)
    OnlineSource    online (train.online: true): the token shards of prepare (data/, or regen/ when
                    regenerate is on) and the target's forward per micro-batch

Both give the same sample index (lengths, cuts, order) for the same token shards, so the batch
plans, cursor and checkpoints are shared; `load(sample_ids)` runs on the loader's thread.

Online mode loads the whole target once next to the drafter (recipe.target: path, device, dtype,
aux_layer_ids, device_map, ...) and gets each micro-batch's hidden states from its forward
(target/online.py: capture's forward batching by capture.batch_tokens, rounded to
capture.storage_dtype as a capture shard would hold them). For the same token shards and seed it
trains the same drafter as the offline path (bit-identical when the forward batches are the same,
e.g. capture.batch_tokens 1) and resumes the same way. Under torchrun each rank runs its own
target copy on its own micro-batches. Nothing is written for the hidden states; the manifest
records `online: true`. A sample whose states hold NaN/inf is left out of its micro-batch
(capture would not have stored it).
"""
from __future__ import annotations

import time
from pathlib import Path

from ..manifests import require_complete
from ..messages import DraftsmithError
from ..rundir import rerun_command, stage_dir, token_stage
from ..config import Recipe
from ..distributed.group import DistInfo, rank_device
from ..target.model import Target, load_target
from ..target.online import online_batch
from .data import CaptureIndex, TokenIndex


ONLINE_INPUTS: tuple[tuple[str, ...], tuple[str, ...]] = (("draft", "train", "seed", "capture"), ("prepare", "regenerate", "vocab"))
"""The train stage's (config sections, upstream stages) when train.online is set: it reads the
token shards and runs the target itself, so capture is not upstream, but capture's
storage_dtype and batch_tokens shape the hidden states it trains on."""


def stage_inputs(recipe: Recipe) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """The train stage's inputs in this recipe (stages.Stage.inputs): ONLINE_INPUTS online, else the table's."""
    return ONLINE_INPUTS if getattr(recipe.train, "online", False) else None


def _load_online_target(recipe: Recipe, info: DistInfo) -> tuple[Target, float]:
    """The target for online training (recipe.target), on this rank's GPU under torchrun as in
    capture; (target, load seconds). No tokenizer: the token shards are already tokenized."""
    t = recipe.target
    device_map = getattr(t, "device_map", None)
    if device_map and info.world_size > 1:
        raise DraftsmithError(f"target.device_map {device_map!r} with train.online under torchrun ({info.world_size} ranks): every rank "
                              "would spread its own copy of the target over all GPUs; unset target.device_map (one target per rank) "
                              "or capture offline (train.online: false)")
    t0 = time.time()
    target = load_target(t.path, rank_device(t.device, info), t.dtype, t.trust_remote_code, t.aux_layer_ids, with_tokenizer=False,
                         device_map=device_map, experts_implementation=t.experts_implementation)
    return target, round(time.time() - t0, 3)


class CaptureSource:
    """Offline: capture/'s shards hold the hidden states (CaptureIndex.batch reads them)."""

    online = False
    def __init__(self, recipe: Recipe, run_dir: Path):
        self.recipe, self.run_dir = recipe, run_dir
        self.nonfinite_fix = f"check capture/ for NaN/inf hidden states (rerun {rerun_command('capture', run_dir)})"
        self.dir, self.stage = stage_dir(run_dir, "capture"), "capture"
        self.manifest = require_complete(self.dir, self.stage)
        self.index: CaptureIndex | None = None
        self.packed_tokens, self.pin = None, False

    def fingerprinted_config(self) -> dict:
        return {}

    def open(self, shard_paths: list[Path], hidden: int, max_length: int, packed_tokens: int | None, pin: bool,
             info: DistInfo, manifest: dict) -> list[int]:
        """Index the samples; returns the aux layer ids whose states the source holds."""
        m = self.manifest
        if int(m.get("hidden_size", hidden)) != hidden:
            raise DraftsmithError(f"{self.dir / 'manifest.json'}: hidden_size {m['hidden_size']} differs from the target's {hidden}; "
                                  f"the capture is from another model, rerun {rerun_command('capture', self.run_dir)}")
        aux_layer_ids = list(m.get("aux_layer_ids") or [])
        if not aux_layer_ids:
            raise DraftsmithError(f"{self.dir / 'manifest.json'}: no aux_layer_ids recorded; rerun {rerun_command('capture', self.run_dir)}")
        self.index = CaptureIndex(shard_paths, max_length, hidden, len(aux_layer_ids))
        self.packed_tokens, self.pin = packed_tokens, pin
        return aux_layer_ids

    def load(self, sample_ids):
        return self.index.batch(sample_ids, self.packed_tokens, self.pin)

    def describe(self) -> str:
        return ""


class OnlineSource(CaptureSource):
    """Online (train.online): prepare's (or regenerate's) token shards, and the hidden states of
    the target's forward per micro-batch (target/online.py), batched by capture.batch_tokens and
    rounded to capture.storage_dtype as a capture shard would hold them."""

    online = True
    nonfinite_fix = "check target.dtype (float16 overflows: use bfloat16 or float32)"

    def __init__(self, recipe: Recipe, run_dir: Path):
        self.recipe, self.run_dir = recipe, run_dir
        self.dir, self.stage = token_stage(recipe, run_dir)
        self.manifest = require_complete(self.dir, self.stage)
        self.index: TokenIndex | None = None
        self.target: Target | None = None
        self.packed_tokens, self.pin = None, False

    def fingerprinted_config(self) -> dict:
        return {"capture": self.recipe.capture}  # the storage rounding and forward batching of the states

    def open(self, shard_paths, hidden, max_length, packed_tokens, pin, info, manifest):
        target, load_s = _load_online_target(self.recipe, info)
        manifest["timings"]["load_target_s"] = load_s
        if target.hidden_size != hidden:
            raise DraftsmithError(f"{self.recipe.target.path}: the loaded target's hidden size {target.hidden_size} differs from its "
                                  f"config's {hidden}; check target.path")
        aux_layer_ids = list(target.aux_layer_ids)
        manifest.update(aux_layer_ids=aux_layer_ids, hidden_size=hidden, storage_dtype=self.recipe.capture.storage_dtype,
                        source=self.stage)
        index = TokenIndex(shard_paths, max_length)
        top, where = index.max_token_id()
        if top >= target.vocab_size:
            si, j, _ = index.entries[where]
            raise DraftsmithError(f"{index.paths[si]}: sample {j}: token id {top} >= the target's vocab_size {target.vocab_size}; the "
                                  f"tokenizer in {self.recipe.target.path} does not belong to its model, fix the folder and rerun "
                                  f"{rerun_command(self.stage, self.run_dir)}")
        self.target, self.index, self.packed_tokens, self.pin = target, index, packed_tokens, pin
        return aux_layer_ids

    def load(self, sample_ids):
        c = self.recipe.capture
        b = online_batch(self.target, self.index.samples(sample_ids), c.storage_dtype, c.batch_tokens, self.packed_tokens)
        return b.pin_memory() if self.pin and b.input_ids.device.type == "cpu" else b

    def describe(self) -> str:
        return (f"; online: target forward on {self.target.device} ({str(self.target.dtype).replace('torch.', '')}), states rounded "
                f"to {self.recipe.capture.storage_dtype}, read from {self.dir}")


def data_source(recipe: Recipe, run_dir: Path) -> CaptureSource:
    """The one place that decides between offline captures and the online target forward."""
    return OnlineSource(recipe, run_dir) if recipe.train.online else CaptureSource(recipe, run_dir)

