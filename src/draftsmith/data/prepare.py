"""Prepare stage: conversations -> token shards with assistant-only loss masks.

Writes into RUN_DIR/data/:
    shard-NNNNN.safetensors   samples_per_shard kept samples each (format: data/shards.py);
                              sample_index is the record's index in the source file, the
                              metadata's source_ids its id (ShareGPT `id`, ...)
    token_counts.safetensors  `counts` int64 [len(tokenizer)]: how often each token is under the loss mask
    manifest.json             counts (read, kept, skipped_<reason>, truncated, tokens, loss_tokens, ...),
                              source, truncated_source

skip_samples and max_samples count source records. Resume: after every shard the running manifest
lists it with the counts so far and the next record to read; a rerun with the same fingerprint and
the same source file continues there, so the shards and token counts are byte-identical to an
uninterrupted run.
"""
from __future__ import annotations

import shutil
import sys
from collections import Counter
from pathlib import Path

import torch
from tqdm import tqdm

from ..fileio import atomic_save_safetensors, sha256_file
from ..manifests import finish_manifest, fingerprint_path, load_manifest, new_manifest, verify_shards, write_manifest
from ..messages import DraftsmithError, log
from ..rundir import RECIPE_FILE, stage_dir
from ..config import PrepareConfig, Recipe, check_recipe
from ..target.model import load_tokenizer
from .readers import SKIP_REASONS, ReadStats, read_conversations, resolve_source
from .shards import Sample, read_shard, shard_name, write_shard
from .template import render, tokenizer_name

COUNTS_FILE = "token_counts.safetensors"
COUNT_KEYS = ("read", "kept", *(f"skipped_{r}" for r in (*SKIP_REASONS, "no_loss_tokens")), "truncated", "tokens",
              "loss_tokens")


def _masked_counts(samples: list[Sample], vocab: int) -> torch.Tensor:
    counts = torch.zeros(vocab, dtype=torch.int64)
    for s in samples:
        counts += torch.bincount(s.input_ids[s.loss_mask], minlength=vocab)[:vocab]
    return counts


def _skips(counts: dict) -> str:
    return ", ".join(f"{k[8:]} {v:,}" for k, v in counts.items() if k.startswith("skipped_") and v) or "none"


def summary(counts: dict, truncated_source: dict | None) -> str:
    line = (f"[prepare] kept {counts['kept']:,} of {counts['read']:,} conversations (skipped: {_skips(counts)}); "
            f"{counts['truncated']:,} truncated; {counts['tokens']:,} tokens, {counts['loss_tokens']:,} under the loss mask")
    if truncated_source:
        line += f"; source cut off after {truncated_source['complete_records']:,} complete records"
    return line


EXTRA_NAME = "the source's content (prepare.source)"


def fingerprint_extra(recipe: Recipe) -> str:
    """The source's content: an edited file reruns prepare (stages.Stage.extra)."""
    return fingerprint_path(resolve_source(recipe.prepare.source, recipe.prepare.format)[0])


def run(recipe: Recipe, run_dir: Path, fp: str) -> dict:
    cfg = recipe.prepare
    check_recipe(recipe, str(Path(run_dir) / RECIPE_FILE), only=("prepare",))
    out = stage_dir(run_dir, "prepare")  # RUN_DIR/data
    path, fmt = resolve_source(cfg.source, cfg.format)
    source = {"name": cfg.source, "path": str(path), "format": fmt, "sha256": sha256_file(path)}
    tok = load_tokenizer(recipe.target.path, recipe.target.trust_remote_code)
    vocab = len(tok)

    m = load_manifest(out)
    same = m is not None and m["fingerprint"] == fp and m.get("source", {}).get("sha256") == source["sha256"]
    if same and m["status"] == "complete":
        verify_shards(out, m)
        return m
    token_counts = torch.zeros(vocab, dtype=torch.int64)
    if same and m["status"] == "running":
        for p in verify_shards(out, m):
            token_counts += _masked_counts(read_shard(p, with_hidden=False), vocab)
        log(f"[prepare] resuming after {len(m['shards'])} shard(s), at source record {m['state']['next_record']:,}")
    else:
        if m is not None:
            log(f"[prepare] {out}: a previous prepare for other inputs is there; starting over")
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        m = new_manifest("prepare", fp, cfg, {"source_sha256": source["sha256"], "tokenizer": tokenizer_name(tok)})
        m.update(source=source, truncated_source=None, tokenizer={"name": tokenizer_name(tok), "vocab_size": vocab},
                 state={"next_record": cfg.skip_samples})
        m["counts"] = {k: 0 for k in COUNT_KEYS}
        write_manifest(out, m)

    counts = Counter(m["counts"])
    stats = ReadStats(read=counts["read"], counts=counts, truncated_source=m.get("truncated_source"),
                      skipped_where=list(m.get("skipped_where") or []))
    stop = None if cfg.max_samples is None else cfg.skip_samples + cfg.max_samples
    start = m["state"]["next_record"]
    buf: list[Sample] = []

    def flush(next_record: int) -> None:
        entry = write_shard(out / shard_name(len(m["shards"])), buf, metadata={"stage": "prepare"})
        entry.update(first_record=buf[0].sample_index, last_record=buf[-1].sample_index)
        m["shards"].append(entry)
        counts["read"] = stats.read
        m["counts"] = dict(counts)
        m["truncated_source"] = stats.truncated_source
        m["skipped_where"] = stats.skipped_where
        m["state"] = {"next_record": next_record}
        write_manifest(out, m)
        buf.clear()

    bar = tqdm(total=None if stop is None else stop - cfg.skip_samples, initial=counts["read"], desc="prepare",
               unit="conv", file=sys.stderr, disable=None, mininterval=1.0)
    conversations = read_conversations(path, fmt, stats, cfg.role_map, cfg.on_unknown_role, start, stop)
    try:
        for conv in conversations:
            bar.update(stats.read - bar.n)
            try:
                r = render(tok, conv.messages, cfg.max_length)
            except DraftsmithError as e:
                raise DraftsmithError(f"{path}: record {conv.index} (id {conv.source_id}): {e}") from None
            n_loss = sum(r.loss_mask)
            if n_loss < cfg.min_loss_tokens:
                counts["skipped_no_loss_tokens"] += 1
                continue
            ids = torch.tensor(r.input_ids, dtype=torch.int64)
            mask = torch.tensor(r.loss_mask, dtype=torch.bool)
            buf.append(Sample(ids, mask, conv.index, source_id=conv.source_id))
            token_counts += torch.bincount(ids[mask], minlength=vocab)[:vocab]
            counts["kept"] += 1
            counts["truncated"] += int(r.truncated)
            counts["tokens"] += len(r.input_ids)
            counts["loss_tokens"] += n_loss
            counts["assistant_turns_without_eot"] += r.eot_missing
            if len(buf) == cfg.samples_per_shard:
                flush(conv.index + 1)
        bar.update(stats.read - bar.n)
    finally:
        conversations.close()
        bar.close()
    counts["read"] = stats.read
    if buf:
        flush(stats.next_index)
    m["counts"] = dict(counts)
    m["truncated_source"] = stats.truncated_source
    m["skipped_where"] = stats.skipped_where
    if counts["kept"] == 0:
        raise DraftsmithError(f"{path}: no sample kept out of {counts['read']:,} conversations "
                              f"(skipped: {_skips(counts)}); {_hint(counts, cfg)}")
    sha = atomic_save_safetensors(out / COUNTS_FILE, {"counts": token_counts}, metadata={"stage": "prepare"})
    m["files"] = [{"file": COUNTS_FILE, "sha256": sha}]
    m["metrics"] = {"mean_tokens_per_sample": round(counts["tokens"] / counts["kept"], 2),
                    "loss_token_fraction": round(counts["loss_tokens"] / max(counts["tokens"], 1), 4)}
    if counts["assistant_turns_without_eot"]:
        log(f"[prepare] {counts['assistant_turns_without_eot']:,} assistant turns have no end-of-turn token right after "
            f"their content in the chat template of {tokenizer_name(tok)}; the drafter will not learn to stop there")
    log(summary(m["counts"], stats.truncated_source))
    return finish_manifest(out, m)


def _hint(counts: Counter, cfg: PrepareConfig) -> str:
    if counts["read"] == 0:
        return "the source has no records after prepare.skip_samples; lower skip_samples or check the file"
    worst = max(("skipped_" + r for r in (*SKIP_REASONS, "no_loss_tokens")), key=lambda k: counts[k])
    return {"skipped_no_assistant": "the source has no assistant turns (a prompt set such as MT-Bench?); "
                                    "give a conversation data set (ShareGPT JSON or JSONL with messages)",
            "skipped_unknown_role": "map the source's roles to user/assistant/system with prepare.role_map",
            "skipped_no_loss_tokens": f"raise prepare.max_length ({cfg.max_length}) or lower prepare.min_loss_tokens",
            "skipped_empty": "every conversation is empty; check the file"}[worst]
