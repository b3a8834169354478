"""Draft vocabulary: the target tokens the drafter can propose (DESIGN.md §4).

The draft vocab is the `draft_vocab_size` most frequent target tokens under the loss mask
(prepare's `data/token_counts.safetensors`), ties broken by lower id; when fewer tokens were
seen, the lowest unseen ids fill it up so the size is exact. Stored sorted by target id as
    d2t  int64 [Vd]  offset: target_id = i + d2t[i]
    t2d  bool  [V]   t2d[target_id] is True iff the token is in the draft vocab
in `vocab/vocab.safetensors` (its reader, load_vocab, is draft/vocab.py's: train and export read it
without this stage). V is the target config's vocab_size (the embedding rows),
which may exceed the tokenizer's vocab: counts are zero-padded to V.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from .fileio import atomic_save_safetensors
from .manifests import finish_manifest, new_manifest, require_complete, verify_listed_file, write_manifest
from .messages import DraftsmithError, log
from .rundir import RECIPE_FILE, rerun_command, stage_dir, token_stage
from .config import Recipe, check_recipe
from .draft.vocab import VOCAB_FILE, draft_ids
from .figures.vocab import VocabCounts, VocabFigures, VocabMetrics
from .target.model import read_text_config

COUNTS_FILE = "token_counts.safetensors"


def build_vocab(counts: torch.Tensor, vocab_size: int, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t int64 [Vd], t2d bool [V]) for the `draft_vocab_size` most frequent ids of `counts`.

    `counts` may be shorter than `vocab_size` (zero-padded); Vd = min(draft_vocab_size, V).
    Ties (including the unseen, all 0) go to the lower id, so unseen ids fill up in id order."""
    V = int(vocab_size)
    if counts.numel() > V:
        raise ValueError(f"counts has {counts.numel()} entries but the vocab has {V}")
    full = torch.zeros(V, dtype=torch.int64)
    full[:counts.numel()] = counts.to(torch.int64)
    size = min(int(draft_vocab_size), V)
    # Stable descending sort: equal counts keep ascending id order.
    order = torch.sort(full, descending=True, stable=True).indices[:size]
    ids = order.sort().values
    d2t = ids - torch.arange(size, dtype=torch.int64)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    return d2t, t2d


def target_vocab_size(recipe: Recipe) -> int:
    return int(read_text_config(recipe.target.path, recipe.target.trust_remote_code).vocab_size)


def run(recipe: Recipe, run_dir: Path, fp: str) -> dict:
    run_dir = Path(run_dir)
    check_recipe(recipe, str(run_dir / RECIPE_FILE), only=("vocab",))
    t0 = time.time()
    data_dir, upstream = token_stage(recipe, run_dir)
    data_manifest = require_complete(data_dir, upstream)
    out_dir = stage_dir(run_dir, "vocab")
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest = new_manifest("vocab", fp, recipe.vocab, {upstream: data_manifest["fingerprint"]})
    write_manifest(out_dir, manifest)

    counts_path = data_dir / COUNTS_FILE
    verify_listed_file(counts_path)
    try:
        counts = load_file(str(counts_path))["counts"].to(torch.int64)
    except FileNotFoundError:
        raise DraftsmithError(f"{counts_path}: not found; rerun {rerun_command('prepare', run_dir)}") from None
    except (SafetensorError, OSError, ValueError, KeyError) as e:
        raise DraftsmithError(f"{counts_path}: unreadable or lacks `counts` ({e}); rerun {rerun_command('prepare', run_dir)}") from None
    V = target_vocab_size(recipe)
    if counts.numel() > V:
        if counts[V:].any():
            raise DraftsmithError(f"{counts_path}: tokens with ids >= {V} (the target's vocab_size) were counted; "
                                  "the tokenizer does not match the model in target.path")
        counts = counts[:V]
    counts = torch.nn.functional.pad(counts, (0, V - counts.numel()))  # ids past the tokenizer's (never seen) count 0

    d2t, t2d = build_vocab(counts, V, recipe.vocab.draft_vocab_size)
    size = d2t.numel()
    total = int(counts.sum())
    covered = int(counts[draft_ids(d2t)].sum())
    coverage = covered / total if total else 0.0
    sha = atomic_save_safetensors(out_dir / VOCAB_FILE, {"d2t": d2t, "t2d": t2d})
    if size < recipe.vocab.draft_vocab_size:
        log(f"[vocab] draft_vocab_size {recipe.vocab.draft_vocab_size} clipped to the target vocab {V}")
    log(f"[vocab] {size} of {V} tokens cover {coverage:.2%} of {total} loss tokens "
        f"({int((counts > 0).sum())} distinct seen)")

    figures = VocabFigures(draft_vocab_size=size, target_vocab_size=V,
                           counts=VocabCounts(loss_tokens=total, distinct_tokens=int((counts > 0).sum()), draft_vocab_size=size),
                           metrics=VocabMetrics(coverage=coverage, draft_vocab_size=size))
    manifest.update(figures.to_dict())
    manifest["files"] = [{"file": VOCAB_FILE, "sha256": sha}]
    manifest["timings"]["wall_s"] = round(time.time() - t0, 3)
    return finish_manifest(out_dir, manifest)
