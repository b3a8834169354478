"""Capture stage: run the target over the prepared samples and store its aux hidden states.

One capture shard per data shard (same name), so resume is per shard and a rerun after a
kill writes byte-identical files. Within a shard, samples are sorted by length and batched
up to `capture.batch_tokens` (padded tokens included), then written back in source order.
"""
from __future__ import annotations

import shutil
import time
from pathlib import Path

import torch
from tqdm import tqdm

from ..artifacts import (DraftsmithError, finish_manifest, load_manifest, log, new_manifest, require_complete,
                         verify_shards, write_manifest)
from ..config import Recipe
from ..data.shards import Sample, read_shard, write_shard
from .model import DTYPES, Target, load_target


def bytes_per_token(num_aux: int, hidden_size: int, storage_dtype: torch.dtype) -> int:
    """Disk bytes per captured token: aux + final hidden states, ids (4) and mask (1)."""
    return (num_aux + 1) * hidden_size * torch.empty(0, dtype=storage_dtype).element_size() + 5


def length_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Indices grouped into batches of similar length whose padded size fits batch_tokens."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches, cur, cur_max = [], [], 0
    for i in order:
        new_max = max(cur_max, lengths[i])
        if cur and new_max * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur, new_max = [], lengths[i]
        cur.append(i)
        cur_max = new_max
    if cur:
        batches.append(cur)
    return batches


def capture_samples(target: Target, samples: list[Sample], batch_tokens: int,
                    storage_dtype: torch.dtype) -> tuple[list[Sample], int]:
    """Fill aux_hidden / final_hidden of each sample. Returns (good samples, rejected count):
    a sample whose hidden states hold NaN or inf is rejected, not stored."""
    dev = target.device
    pad_id = 0
    out: list[Sample | None] = [None] * len(samples)
    for batch in length_batches([len(s) for s in samples], batch_tokens):
        L = max(len(samples[i]) for i in batch)
        ids = torch.full((len(batch), L), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), L), dtype=torch.long)
        for r, i in enumerate(batch):
            n = len(samples[i])
            ids[r, :n] = samples[i].input_ids
            mask[r, :n] = 1
        res = target.forward(ids.to(dev), attention_mask=mask.to(dev), with_logits=False)
        aux, final = res.aux_hidden.to(storage_dtype).cpu(), res.final_hidden.to(storage_dtype).cpu()
        for r, i in enumerate(batch):
            n = len(samples[i])
            s = samples[i]
            out[i] = Sample(s.input_ids, s.loss_mask, s.sample_index, aux[r, :n].clone(), final[r, :n].clone())
    good = [s for s in out if s is not None and torch.isfinite(s.aux_hidden).all() and torch.isfinite(s.final_hidden).all()]
    return good, len(samples) - len(good)


def run(recipe: Recipe, run_dir: Path, fp: str) -> dict:
    data_dir, out_dir = run_dir / "data", run_dir / "capture"
    data_m = require_complete(data_dir, "prepare")
    data_shards = verify_shards(data_dir, data_m)
    cfg = recipe.capture
    storage = DTYPES[cfg.storage_dtype]

    m = load_manifest(out_dir)
    if m is None or m["status"] != "running" or m["fingerprint"] != fp:
        shutil.rmtree(out_dir, ignore_errors=True)
        out_dir.mkdir(parents=True)
        m = new_manifest("capture", fp, cfg, {"prepare": data_m["fingerprint"]})
    done = {s["file"] for s in m["shards"]}

    t_load = time.time()
    target = load_target(recipe.target.path, recipe.target.device, recipe.target.dtype,
                         recipe.target.trust_remote_code, recipe.target.aux_layer_ids, with_tokenizer=False)
    m["timings"]["load_target_s"] = round(time.time() - t_load, 3)
    bpt = bytes_per_token(len(target.aux_layer_ids), target.hidden_size, storage)
    m.update(aux_layer_ids=target.aux_layer_ids, num_layers=target.num_layers, hidden_size=target.hidden_size,
             target_vocab_size=target.vocab_size, storage_dtype=cfg.storage_dtype, bytes_per_token=bpt,
             target_architecture=type(target.model).__name__)

    todo_tokens = sum(s["num_tokens"] for s in data_m["shards"] if s["file"] not in done)
    need = todo_tokens * bpt
    free = shutil.disk_usage(out_dir).free
    log(f"[capture] {todo_tokens:,} tokens x {bpt:,} bytes/token = {need / 2**30:.2f} GiB to write; {free / 2**30:.1f} GiB free")
    if need > free * 0.95:
        raise DraftsmithError(f"{out_dir}: capture needs {need / 2**30:.2f} GiB but only {free / 2**30:.2f} GiB is free; "
                              "free disk, use capture.storage_dtype with fewer bytes, or capture fewer samples")
    write_manifest(out_dir, m)

    counts = m["counts"]
    t0, fwd_tokens = time.time(), 0
    for path in tqdm(data_shards, desc="capture", unit="shard", disable=None):
        if path.name in done:
            continue
        samples = read_shard(path, with_hidden=False)
        good, rejected = capture_samples(target, samples, cfg.batch_tokens, storage)
        entry = write_shard(out_dir / path.name, good, metadata={"stage": "capture", "source": path.name})
        fwd_tokens += sum(len(s) for s in samples)
        m["shards"].append(entry)
        counts["samples"] = counts.get("samples", 0) + len(good)
        counts["tokens"] = counts.get("tokens", 0) + entry["num_tokens"]
        counts["rejected_nonfinite"] = counts.get("rejected_nonfinite", 0) + rejected
        write_manifest(out_dir, m)
    dt = time.time() - t0
    if fwd_tokens:
        m["metrics"]["capture_tokens_per_s"] = round(fwd_tokens / max(dt, 1e-9), 1)
    if counts.get("rejected_nonfinite"):
        log(f"[capture] rejected {counts['rejected_nonfinite']} samples with NaN/inf hidden states")
    m["timings"]["capture_s"] = round(m["timings"].get("capture_s", 0) + dt, 3)
    log(f"[capture] {counts.get('samples', 0)} samples, {counts.get('tokens', 0):,} tokens, {bpt:,} bytes/token")
    return finish_manifest(out_dir, m)
