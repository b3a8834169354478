"""The train stage: an EAGLE-3 drafter trained with training-time test on captured states.

Reads capture/ (hidden-state shards), vocab/ (d2t, t2d) and, from the target, only its input
embedding and lm_head (read_target_embeddings: no full model load). Writes
    train/step-NNNNNN/{model,optim}.safetensors + meta.json, train/latest   (checkpoint.py)
    train/metrics.jsonl     one record per optimizer step (loss, CE/acc per TTT position, lr, grad norm)
    train/tensorboard/      the same as TensorBoard scalars
    train/drafter/          the final drafter (config.json + model.safetensors, draft.model.save_drafter)
A rerun after a crash continues from `latest` and reproduces the uninterrupted run's losses:
the batch plan is a function of (seed, epoch), the cursor and the AdamW state are checkpointed,
and the learning rate is a function of the step.
"""
from __future__ import annotations

import json
import math
import time
from collections import deque
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path

import torch

from ..artifacts import (DraftsmithError, atomic_write_text, finish_manifest, load_manifest, log, new_manifest,
                         require_complete, stage_dir, to_jsonable, verify_shards, write_manifest)
from ..config import Recipe
from ..draft.build import drafter_config, init_drafter, read_target_embeddings
from ..draft.model import save_drafter
from ..target.model import resolve_device, resolve_dtype
from ..vocab import VOCAB_FILE, draft_ids, load_vocab
from .checkpoint import find_latest, load_checkpoint, load_optimizer_tensors, save_checkpoint, set_rng_state
from .data import CaptureIndex, epoch_plan
from .ttt import simulated_tau, ttt_loss

MAX_NONFINITE_IN_A_ROW = 10
ADAM_BETAS = (0.9, 0.95)
METRICS_FILE = "metrics.jsonl"


def lr_at(step: int, total_steps: int, lr: float, warmup_steps: int, min_lr_ratio: float) -> float:
    """Learning rate of optimizer step `step` (1-based): linear warmup, then cosine to lr*min_lr_ratio."""
    if warmup_steps > 0 and step <= warmup_steps:
        return lr * step / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def total_steps_of(recipe: Recipe, epoch_tokens: int) -> int:
    tc = recipe.train
    if tc.max_steps is not None:
        return int(tc.max_steps)
    return max(1, math.ceil(tc.epochs * epoch_tokens / tc.batch_tokens))


def _append_jsonl(f, record: dict) -> None:
    f.write(json.dumps(record) + "\n")
    f.flush()


def _fmt_s(s: float) -> str:
    s = int(max(0, s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _window_metrics(window: deque, k: int) -> dict:
    """Means over the recent non-skipped steps: loss, acc per position (row-weighted), tau."""
    recs = [r for r in window if not r["skipped"]]
    if not recs:
        return {"loss": float("nan"), "acc": [0.0] * k, "tau": 1.0, "grad_norm": float("nan")}
    correct = [sum(r["correct"][i] for r in recs) for i in range(k)]
    weight = [sum(r["weight"][i] for r in recs) for i in range(k)]
    acc = [c / w if w else 0.0 for c, w in zip(correct, weight)]
    return {"loss": sum(r["loss"] for r in recs) / len(recs), "acc": acc, "tau": simulated_tau(acc),
            "grad_norm": sum(r["grad_norm"] for r in recs) / len(recs)}


def run(recipe: Recipe, run_dir: Path, fp: str) -> dict:
    run_dir = Path(run_dir)
    tc = recipe.train
    k = int(tc.ttt_steps)
    if k < 1 or tc.batch_tokens < 1 or tc.max_length < 3:
        raise DraftsmithError(f"train: ttt_steps {k}, batch_tokens {tc.batch_tokens}, max_length {tc.max_length}: "
                              "need ttt_steps >= 1, batch_tokens >= 1, max_length >= 3")
    cap_dir, vocab_dir, out_dir = (stage_dir(run_dir, s) for s in ("capture", "vocab", "train"))
    cap_m = require_complete(cap_dir, "capture")
    vocab_m = require_complete(vocab_dir, "vocab")
    out_dir.mkdir(parents=True, exist_ok=True)
    latest = find_latest(out_dir)
    prev = load_manifest(out_dir)
    if prev is not None and prev.get("status") == "running" and prev["fingerprint"] == fp:
        manifest = prev
    else:
        manifest = new_manifest("train", fp, {"draft": recipe.draft, "train": tc, "seed": recipe.seed},
                                {"capture": cap_m["fingerprint"], "vocab": vocab_m["fingerprint"]})
    write_manifest(out_dir, manifest)
    # Hashing every shard costs a full read of the capture; do it once, not on each resume.
    shard_paths = verify_shards(cap_dir, cap_m, check_hash=latest is None)

    # -- target tensors, vocab, drafter ----------------------------------------------------
    device = resolve_device(tc.device)
    compute_dtype = resolve_dtype(tc.dtype, device)
    embed, lm_head, tcfg = read_target_embeddings(recipe.target.path, recipe.target.trust_remote_code)
    d2t, t2d = load_vocab(vocab_dir / VOCAB_FILE)
    if t2d.numel() != int(tcfg.vocab_size):
        raise DraftsmithError(f"{vocab_dir / VOCAB_FILE}: t2d covers {t2d.numel()} tokens, the target has {tcfg.vocab_size}; "
                              "rerun `draftsmith vocab --force`")
    hidden = int(tcfg.hidden_size)
    if int(cap_m.get("hidden_size", hidden)) != hidden:
        raise DraftsmithError(f"{cap_dir / 'manifest.json'}: hidden_size {cap_m['hidden_size']} differs from the target's {hidden}; "
                              "the capture is from another model, rerun `draftsmith capture --force`")
    aux_layer_ids = list(cap_m.get("aux_layer_ids") or [])
    if not aux_layer_ids:
        raise DraftsmithError(f"{cap_dir / 'manifest.json'}: no aux_layer_ids recorded; rerun `draftsmith capture --force`")
    cfg = drafter_config(tcfg, recipe.draft, d2t.numel(), aux_layer_ids)
    model = init_drafter(cfg, embed, d2t, t2d, recipe.seed).to(device)
    head_weight = lm_head[draft_ids(d2t)].to(device=device, dtype=compute_dtype)  # target lm_head rows of the draft vocab
    del embed, lm_head
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    # Parallelism goes here later (FSDP2 fully_shard applied to `model` from outside).
    decay = [(n, p) for n, p in named if p.dim() >= 2]
    no_decay = [(n, p) for n, p in named if p.dim() < 2]
    opt_names = [n for n, _ in decay + no_decay]
    params = [p for _, p in named]
    opt = torch.optim.AdamW([{"params": [p for _, p in decay], "weight_decay": tc.weight_decay},
                             {"params": [p for _, p in no_decay], "weight_decay": 0.0}],
                            lr=tc.lr, betas=ADAM_BETAS, eps=1e-8)
    autocast = torch.autocast(device.type, dtype=compute_dtype) if compute_dtype != torch.float32 else nullcontext()

    # -- data ------------------------------------------------------------------------------
    index = CaptureIndex(shard_paths, tc.max_length, hidden, len(aux_layer_ids))
    if len(index) == 0:
        raise DraftsmithError(f"{cap_dir / 'manifest.json'}: no sample has 3+ tokens and a loss token at position >= 2 "
                              f"({index.dropped} dropped); check prepare's loss masks and max_length")
    total_steps = total_steps_of(recipe, index.num_tokens)

    # -- resume ----------------------------------------------------------------------------
    step, epoch, position, skipped, in_a_row = 0, 0, 0, 0, 0
    metrics_path = out_dir / METRICS_FILE
    window: deque = deque(maxlen=max(1, tc.log_every))
    if latest is not None:
        meta, model_tensors, optim_tensors = load_checkpoint(latest)
        if meta.get("fingerprint") != fp:
            raise DraftsmithError(f"{latest / 'meta.json'}: checkpoint of other inputs or config (fingerprint {meta.get('fingerprint')}, "
                                  f"now {fp}); delete {out_dir} to start over")
        want = {n for n, _ in named}
        if set(model_tensors) != want or any(model_tensors[n].shape != p.shape for n, p in named):
            raise DraftsmithError(f"{latest / 'model.safetensors'}: parameters do not match the drafter; delete {out_dir} to start over")
        with torch.no_grad():
            for n, p in named:
                p.copy_(model_tensors[n])
        load_optimizer_tensors(opt, opt_names, optim_tensors, latest / "optim.safetensors")
        set_rng_state(meta["rng"])
        step, epoch, position = int(meta["step"]), int(meta["epoch"]), int(meta["position"])
        skipped, in_a_row = int(meta.get("skipped_nonfinite", 0)), int(meta.get("nonfinite_in_a_row", 0))
        kept = []
        if metrics_path.exists():
            for line in metrics_path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line torn by the crash
                if rec["step"] <= step:
                    kept.append(rec)
        atomic_write_text(metrics_path, "".join(json.dumps(r) + "\n" for r in kept))
        window.extend(kept)
        log(f"[train] resuming from {latest.name}: step {step}/{total_steps}, epoch {epoch}, batch {position}")
    else:
        metrics_path.unlink(missing_ok=True)
    plan = epoch_plan(index.lengths, tc.batch_tokens, recipe.seed, epoch)
    log(f"[train] drafter {sum(p.numel() for p in params) / 1e6:.1f}M trainable params, draft vocab {cfg.draft_vocab_size}, "
        f"{len(index)} samples ({index.dropped} dropped), {index.num_tokens} tokens/epoch, {len(plan)} batches/epoch, "
        f"{total_steps} steps, {device} {str(compute_dtype).replace('torch.', '')}")

    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(out_dir / "tensorboard"), purge_step=step + 1 if step else None)
    metrics_file = open(metrics_path, "a", encoding="utf-8")
    start_step, t_start = step, time.time()
    t_window, tokens_window, tokens_session = t_start, 0, 0

    def checkpoint_meta() -> dict:
        return {"fingerprint": fp, "epoch": epoch, "position": position, "total_steps": total_steps,
                "skipped_nonfinite": skipped, "nonfinite_in_a_row": in_a_row,
                "drafter": asdict(cfg), "recipe": to_jsonable(recipe)}

    try:
        model.train()
        while step < total_steps:
            if position >= len(plan):
                epoch, position = epoch + 1, 0
                plan = epoch_plan(index.lengths, tc.batch_tokens, recipe.seed, epoch)
            sample_ids = plan[position]
            position += 1
            batch = index.batch(sample_ids).to(device)
            step += 1
            lr = lr_at(step, total_steps, tc.lr, tc.warmup_steps, tc.min_lr_ratio)
            for group in opt.param_groups:
                group["lr"] = lr

            with autocast:
                out = ttt_loss(model, batch.input_ids, batch.loss_mask, batch.aux_hidden, batch.final_hidden,
                               head_weight, k, tc.ttt_decay)
            loss = float(out.loss.detach())
            grad_norm = float("nan")
            ok = math.isfinite(loss)
            if ok:
                out.loss.backward()
                grad_norm = float(torch.nn.utils.clip_grad_norm_(params, tc.grad_clip if tc.grad_clip > 0 else float("inf")))
                ok = math.isfinite(grad_norm)
                if ok:
                    opt.step()
            opt.zero_grad(set_to_none=True)
            if ok:
                in_a_row = 0
            else:
                skipped, in_a_row = skipped + 1, in_a_row + 1
                si, _, _ = index.entries[sample_ids[0]]
                log(f"[train] step {step}: non-finite loss/grad ({loss}, {grad_norm}); skipped ({in_a_row} in a row)")
                if in_a_row >= MAX_NONFINITE_IN_A_ROW:
                    raise DraftsmithError(f"{index.paths[si]}: {in_a_row} training steps in a row had a non-finite loss or gradient "
                                          f"(last at step {step}); check capture/ for NaN/inf hidden states (rerun `draftsmith capture --force`) "
                                          "or lower train.lr")

            ce, correct, weight = out.ce.tolist(), out.correct.tolist(), out.weight.tolist()
            rec = {"step": step, "loss": loss, "ce": ce, "correct": correct, "weight": weight,
                   "acc": [c / w if w else 0.0 for c, w in zip(correct, weight)], "lr": lr, "grad_norm": grad_norm,
                   "tokens": batch.num_tokens, "epoch": epoch, "skipped": not ok}
            _append_jsonl(metrics_file, rec)
            window.append(rec)
            tokens_window += batch.num_tokens
            tokens_session += batch.num_tokens
            if ok:
                writer.add_scalar("train/loss", loss, step)
                writer.add_scalar("train/lr", lr, step)
                writer.add_scalar("train/grad_norm", grad_norm, step)
                for i, a in enumerate(rec["acc"]):
                    writer.add_scalar(f"train/acc_{i}", a, step)
                writer.add_scalar("train/tau_simulated", simulated_tau(rec["acc"]), step)

            if step % max(1, tc.log_every) == 0 or step == total_steps:
                now = time.time()
                w = _window_metrics(window, k)
                tokens_per_s = tokens_window / max(now - t_window, 1e-9)
                eta = (now - t_start) / (step - start_step) * (total_steps - step)
                acc_txt = " ".join(f"{a:.2f}" for a in w["acc"])
                log(f"[train] step {step}/{total_steps} | loss {w['loss']:.4f} | acc {acc_txt} | tau {w['tau']:.2f} | "
                    f"lr {lr:.2e} | gnorm {w['grad_norm']:.2f} | {tokens_per_s:,.0f} tok/s | eta {_fmt_s(eta)}"
                    + (f" | skipped {skipped}" if skipped else ""))
                writer.add_scalar("train/tokens_per_s", tokens_per_s, step)
                writer.flush()
                t_window, tokens_window = now, 0

            if step % max(1, tc.save_every) == 0 or step == total_steps:
                folder = save_checkpoint(out_dir, step, dict(named), opt, opt_names, checkpoint_meta())
                manifest["checkpoint"] = folder.name
                write_manifest(out_dir, manifest)
    finally:
        metrics_file.close()
        writer.close()

    # -- final drafter and manifest -------------------------------------------------------
    model.eval()
    sha = save_drafter(model, out_dir / "drafter")
    wall = time.time() - t_start
    w = _window_metrics(window, k)
    manifest["drafter"] = {"dir": "drafter", "sha256": sha, "config": asdict(cfg)}
    manifest["device"], manifest["compute_dtype"] = device.type, str(compute_dtype).replace("torch.", "")
    manifest["counts"] = {"steps": step, "skipped_nonfinite": skipped, "samples": len(index), "samples_dropped": index.dropped,
                          "tokens_per_epoch": index.num_tokens, "batches_per_epoch": len(plan), "epochs_started": epoch + 1}
    manifest["metrics"] = {"loss": w["loss"], "acc_per_position": w["acc"], "tau_simulated": w["tau"],
                           "tokens_per_s": tokens_session / wall if wall > 0 and step > start_step else None,
                           "steps": step, "window_steps": len(window)}
    manifest["timings"]["train_s_this_session"] = round(wall, 3)
    log(f"[train] done: {step} steps, loss {w['loss']:.4f}, acc {' '.join(f'{a:.2f}' for a in w['acc'])}, "
        f"simulated tau {w['tau']:.2f}; drafter in {out_dir / 'drafter'}")
    return finish_manifest(out_dir, manifest)
