"""Capture stage: run the target over the prepared samples and store its aux hidden states.

One capture shard per data shard (same name), so resume is per shard and a rerun after a
kill -9 writes byte-identical files. Within a shard, samples are sorted by length and batched
up to `capture.batch_tokens` (padded tokens included), then written back in source order.

Data parallel under torchrun: rank r captures the data shards i with i % world == r, lists
each shard it finished in `capture/.rank-RRRRR.json` (its resume state), and rank 0 merges
every rank's list into the one manifest, in data-shard order. Counts are sums over the
shard entries, so the manifest does not depend on the number of ranks.
Reads `regen/` instead of `data/` when regenerate is enabled.
"""
from __future__ import annotations

import json
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tqdm import tqdm

from ..fileio import JSON_ERRORS, atomic_write_json, checksum_matches, file_stamp, remove_temp_files
from ..manifests import finish_manifest, load_manifest, new_manifest, require_complete, safe_join, verify_shards, write_manifest
from ..messages import DraftsmithError, log
from ..rundir import rerun_command, stage_dir, token_stage
from ..config import Recipe
from ..distributed.group import barrier, from_rank0, init_distributed, rank_device
from ..data.shards import bytes_per_token, read_shard, write_shard
from ..figures.capture import CaptureCounts
from .model import load_target
from .online import capture_samples


def _rank_file(out_dir: Path, rank: int) -> Path:
    return out_dir / f".rank-{rank:05d}.json"


def _listed(out_dir: Path, m: dict, fp: str) -> dict[str, dict]:
    """Shard entries finished so far: the manifest's and those in every rank's file of this fingerprint
    (whose checksum stamps join the manifest's `verified`)."""
    entries = {s["file"]: s for s in m["shards"]}
    for p in sorted(out_dir.glob(".rank-*.json")):
        try:
            part = json.loads(p.read_text())
        except (OSError, *JSON_ERRORS):
            continue  # written atomically, so only a foreign file lands here
        if part.get("fingerprint") == fp:
            entries.update({s["file"]: s for s in part["shards"]})
            m.setdefault("verified", {}).update(part.get("verified", {}))
    return entries


def _drop_damaged(out_dir: Path, entries: dict[str, dict], m: dict) -> None:
    """Unlist (from `entries`, the manifest and every rank file) and delete the listed shards whose
    file is missing or does not match its sha256, so this run captures them again instead of
    marking a capture complete over them. A shard whose size and mtime_ns are those stamped when its
    checksum was computed (manifest `verified`) is not hashed again (fileio.checksum_matches):
    resuming a complete capture costs milliseconds, not a read of every byte."""
    verified = m.setdefault("verified", {})
    bad = [n for n, e in entries.items() if not checksum_matches(safe_join(out_dir, n), str(e.get("sha256")), verified)]
    if not bad:
        return
    for n in bad:
        entries.pop(n)
        safe_join(out_dir, n).unlink(missing_ok=True)
    m["shards"] = [e for e in m["shards"] if e.get("file") not in bad]
    for p in sorted(out_dir.glob(".rank-*.json")):
        try:
            part = json.loads(p.read_text())
        except (OSError, *JSON_ERRORS):
            continue
        part["shards"] = [e for e in part.get("shards", []) if e.get("file") not in bad]
        atomic_write_json(p, part)
    log(f"[capture] {len(bad)} listed shard(s) missing or not matching their checksum ({', '.join(bad[:3])}); capturing them again")


def _merge(m: dict, entries: dict[str, dict], order: list[str]) -> None:
    m["shards"] = [entries[n] for n in order if n in entries]
    m["verified"] = {n: v for n, v in sorted(m.get("verified", {}).items())
                     if n in entries and v.get("sha256") == entries[n]["sha256"]}
    m["counts"] = CaptureCounts(samples=sum(s["num_samples"] for s in m["shards"]),
                                tokens=sum(s["num_tokens"] for s in m["shards"]),
                                rejected_nonfinite=sum(s.get("rejected_nonfinite", 0) for s in m["shards"])).to_dict()


def skip_reason(recipe: Recipe) -> str | None:
    """Why the stage does not run (stages.Stage.skipped): online training runs the target itself."""
    if getattr(recipe.train, "online", False):
        return ("train.online is true; skipped (train runs the target on the token shards itself, nothing is written to disk); "
                "set train.online: false to capture")
    return None


def run(recipe: Recipe, run_dir: Path, fp: str) -> dict:
    cfg = recipe.capture
    info = init_distributed(recipe.target.device)
    data_dir, upstream = token_stage(recipe, run_dir)
    out_dir = stage_dir(run_dir, "capture")
    data_m = require_complete(data_dir, upstream)
    data_shards = verify_shards(data_dir, data_m, check_hash=info.is_main)
    names = [p.name for p in data_shards]

    t_load = time.time()
    target = load_target(recipe.target.path, rank_device(recipe.target.device, info), recipe.target.dtype, recipe.target.trust_remote_code,
                         recipe.target.aux_layer_ids, with_tokenizer=False,
                         device_map=getattr(recipe.target, "device_map", None),
                         experts_implementation=recipe.target.experts_implementation)
    load_s = round(time.time() - t_load, 3)
    bpt = bytes_per_token(len(target.aux_layer_ids), target.hidden_size, cfg.storage_dtype)

    error = None
    if info.is_main:  # rank 0 alone sets up the folder; the others wait for its verdict
        m = load_manifest(out_dir)
        if m is None or m["status"] != "running" or m["fingerprint"] != fp:
            shutil.rmtree(out_dir, ignore_errors=True)
            out_dir.mkdir(parents=True)
            m = new_manifest("capture", fp, cfg, {upstream: data_m["fingerprint"]})
        remove_temp_files(out_dir)  # half-written files of a killed run
        m["timings"]["load_target_s"] = load_s
        m.update(aux_layer_ids=target.aux_layer_ids, num_layers=target.num_layers, hidden_size=target.hidden_size,
                 target_vocab_size=target.vocab_size, storage_dtype=cfg.storage_dtype, bytes_per_token=bpt,
                 target_architecture=type(target.model).__name__, world_size=info.world_size, source=upstream)
        entries = _listed(out_dir, m, fp)
        _drop_damaged(out_dir, entries, m)  # a resume rewrites listed shards that are gone or changed
        todo_tokens = sum(s["num_tokens"] for s in data_m["shards"] if s["file"] not in entries)
        need, free = todo_tokens * bpt, shutil.disk_usage(out_dir).free
        log(f"[capture] {todo_tokens:,} tokens x {bpt:,} bytes/token = {need / 2**30:.2f} GiB to write; "
            f"{free / 2**30:.1f} GiB free; {info.world_size} rank(s)")
        if need > free * 0.95:
            error = (f"{out_dir}: capture needs {need / 2**30:.2f} GiB but only {free / 2**30:.2f} GiB is free; free disk, "
                     "use capture.storage_dtype float8_e4m3 (about half of bfloat16), or capture fewer samples")
        else:
            _merge(m, entries, names)
            write_manifest(out_dir, m)
    error = from_rank0(error, info)
    if error:
        raise DraftsmithError(error)
    m = load_manifest(out_dir)
    entries = _listed(out_dir, m, fp)
    mine = [p for i, p in enumerate(data_shards) if i % info.world_size == info.rank]
    done_mine = [entries[p.name] for p in mine if p.name in entries]
    stamps = {n: v for n, v in m.get("verified", {}).items() if n in {e["file"] for e in done_mine}}

    def record(write, rejected: int) -> None:
        """A shard's write finished: list it in this rank's file (and the manifest, for `status`)."""
        entry = write.result()
        entry["rejected_nonfinite"] = rejected
        done_mine.append(entry)
        stamps[entry["file"]] = {"sha256": entry["sha256"], **file_stamp(out_dir / entry["file"])}  # hashed as written
        atomic_write_json(_rank_file(out_dir, info.rank), {"fingerprint": fp, "shards": done_mine, "verified": stamps})
        if info.is_main and info.world_size == 1:
            m.setdefault("verified", {}).update(stamps)
            _merge(m, {**entries, **{e["file"]: e for e in done_mine}}, names)
            write_manifest(out_dir, m)

    # Shard i is written (packed, fp8-encoded, serialised, hashed, fsynced) by one writer thread
    # while shard i + 1 is captured; a shard is listed only once its file is whole. A crash
    # waits for the write in flight and leaves it unlisted: the resumed run rewrites it.
    t0, fwd_tokens, pending = time.time(), 0, None
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="capture-writer") as writer:
        for path in tqdm(mine, desc=f"capture[{info.rank}]" if info.world_size > 1 else "capture", unit="shard", disable=None):
            if path.name in entries:
                continue
            samples = read_shard(path, with_hidden=False)
            top = max((int(s.input_ids.max()) for s in samples if len(s)), default=-1)
            if top >= target.vocab_size:
                raise DraftsmithError(f"{path}: token id {top} >= the target's vocab_size {target.vocab_size}; the tokenizer in "
                                      f"{recipe.target.path} does not belong to its model, fix the folder and rerun {rerun_command('prepare', run_dir)}")
            good, rejected = capture_samples(target, samples, cfg.batch_tokens, cfg.storage_dtype)
            fwd_tokens += sum(len(s) for s in samples)
            if pending is not None:
                record(*pending)
            # The metadata: the stage, and write_shard adds the samples' source ids (keys written sorted,
            # fileio.atomic_save_safetensors, so a rerun's shard is byte-identical).
            pending = (writer.submit(write_shard, out_dir / path.name, good, metadata={"stage": "capture"},
                                     storage_dtype=cfg.storage_dtype), rejected)
        if pending is not None:
            record(*pending)
    dt = time.time() - t0
    barrier(info)  # every rank's shards are written before rank 0 merges

    if info.is_main:
        _merge(m, _listed(out_dir, m, fp), names)
        missing = [n for n in names if n not in {s["file"] for s in m["shards"]}]
        if missing:
            raise DraftsmithError(f"{out_dir}: shards {missing[:3]} were not captured by any rank; rerun {rerun_command('capture', run_dir, force=False)}")
        if fwd_tokens:
            # rank 0's rate x ranks: the ranks share the shards evenly
            m["metrics"]["capture_tokens_per_s"] = round(fwd_tokens / max(dt, 1e-9) * info.world_size, 1)
        m["timings"]["capture_s"] = round(m["timings"].get("capture_s", 0) + dt, 3)
        counts = m["counts"]
        if counts["rejected_nonfinite"]:
            log(f"[capture] rejected {counts['rejected_nonfinite']} samples with NaN/inf hidden states")
        if counts["samples"] == 0:
            raise DraftsmithError(f"{out_dir}: the target gave NaN/inf hidden states for every sample ({counts['rejected_nonfinite']} "
                                  "rejected); check target.dtype (float16 overflows: use bfloat16 or float32) and the target's weights")
        log(f"[capture] {counts['samples']} samples, {counts['tokens']:,} tokens, {bpt:,} bytes/token ({cfg.storage_dtype})")
        # The merged list goes into the manifest before the rank files go, and they go before the
        # manifest says complete: a kill between any two steps leaves a resumable, tidy folder.
        write_manifest(out_dir, m)
        for p in out_dir.glob(".rank-*.json"):
            p.unlink()
        m = finish_manifest(out_dir, m)
    barrier(info)
    return load_manifest(out_dir)
