"""What a run reports and writes beside its steps, and its end (finish):

    header(trainer, epoch)                  the run's first log line
    window_metrics / log_window / scalars   the figures of the last log_every steps, the log line, TensorBoard
    full_drafter                            the whole drafter on rank 0 (a collective when sharded)
    save_drafter_atomic / copy_drafter_atomic   a drafter folder put into place atomically
    finish(trainer, progress, ...)          train/drafter (the best by held-out figure, else the last), the
                                            held-out engine tau beside it, and the complete manifest
"""
from __future__ import annotations

import shutil
import time
from collections import deque
from dataclasses import asdict
from pathlib import Path

import torch

from ..fileio import atomic_write_json, replace_dir, sha256_file, temp_dir
from ..manifests import finish_manifest, fingerprint
from ..messages import log
from ..distributed.group import DistInfo, barrier, is_sharded
from ..draft.io import save_drafter
from ..draft.model import Eagle3Drafter
from ..figures.train import Budget, TrainCounts, TrainFigures, TrainMetrics
from .heldout import engine_prompts, engine_record, heldout_record
from .state import Progress, read_json_safe
from .ttt import TTTLoss, simulated_tau


def _fmt_s(s: float) -> str:
    s = int(max(0, s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def window_metrics(window: deque, k: int) -> dict:
    """Means over the recent non-skipped steps: loss, acc per position (row-weighted), tau."""
    recs = [r for r in window if not r["skipped"]]
    if not recs:
        return {"loss": float("nan"), "acc": [0.0] * k, "tau": 1.0, "grad_norm": float("nan")}
    correct = [sum(r["correct"][i] for r in recs) for i in range(k)]
    weight = [sum(r["weight"][i] for r in recs) for i in range(k)]
    acc = [c / w if w else 0.0 for c, w in zip(correct, weight)]
    return {"loss": sum(r["loss"] for r in recs) / len(recs), "acc": acc, "tau": simulated_tau(acc),
            "grad_norm": sum(r["grad_norm"] for r in recs) / len(recs)}


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource  # why here: a Unix-only module, needed only off CUDA

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux: the process's peak RSS


def full_drafter(model: TTTLoss, cfg, info: DistInfo):
    """The whole drafter (float32, CPU) on rank 0, None elsewhere; a collective when sharded."""
    if not is_sharded(model):
        return model.drafter
    # why here: torch.distributed.checkpoint takes ~1.5 s to import; one rank never needs it
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not info.is_main:
        return None
    d = Eagle3Drafter(cfg)
    d.load_state_dict({n.removeprefix("drafter."): t for n, t in sd.items()})
    return d


def save_drafter_atomic(drafter: Eagle3Drafter, folder: Path, extra: dict | None = None) -> str:
    """Save a drafter folder into place atomically; returns its model.safetensors' sha256."""
    tmp = temp_dir(folder)
    sha = save_drafter(drafter, tmp)
    if extra:
        atomic_write_json(tmp / "best.json", extra)
    replace_dir(tmp, folder)
    return sha


def copy_drafter_atomic(src: Path, folder: Path) -> str:
    """Copy a drafter folder into place atomically; returns its model.safetensors' sha256."""
    tmp = temp_dir(folder)
    shutil.copytree(src, tmp)
    replace_dir(tmp, folder)
    return sha256_file(folder / "model.safetensors")


def scalars(writer, rec: dict) -> None:
    """A step's figures in TensorBoard."""
    step = rec["step"]
    writer.add_scalar("train/loss", rec["loss"], step)
    writer.add_scalar("train/lr", rec["lr"], step)
    writer.add_scalar("train/grad_norm", rec["grad_norm"], step)
    for i, (a, c) in enumerate(zip(rec["acc"], rec["ce"])):
        writer.add_scalar(f"train/acc_{i}", a, step)
        writer.add_scalar(f"train/ce_{i}", c, step)
    writer.add_scalar("train/tau_simulated", simulated_tau(rec["acc"]), step)


def log_window(writer, window: deque, t, prog: Progress, tokens_per_s: float, eta: float) -> None:
    """The log line every log_every steps: the window's figures, throughput, MFU, memory."""
    w, step = window_metrics(window, t.k), prog.step
    mfu = tokens_per_s * t.flops_per_token / (t.peak * t.info.world_size) if t.peak else None
    mem = peak_memory_gib(t.info.device)
    log(f"[train] step {step}/{t.total_steps} | loss {w['loss']:.4f} | acc {' '.join(f'{a:.2f}' for a in w['acc'])} | "
        f"tau {w['tau']:.2f} | lr {window[-1]['lr']:.2e} | gnorm {w['grad_norm']:.2f} | {tokens_per_s:,.0f} tok/s"
        + (f" | mfu {100 * mfu:.1f}%" if mfu is not None else "") + f" | mem {mem:.1f} GiB | eta {_fmt_s(eta)}"
        + (f" | skipped {prog.skipped}" if prog.skipped else ""))
    writer.add_scalar("train/tokens_per_s", tokens_per_s, step)
    writer.add_scalar("train/peak_memory_gib", mem, step)
    if mfu is not None:
        writer.add_scalar("train/mfu", mfu, step)
    writer.flush()


def header(t, epoch: int) -> str:
    """The run's first log line (`t`: the Trainer): what trains on what, in which steps, on what."""
    tc, index, plan = t.tc, t.index, t.plan_of(epoch)
    fill = sum(t.train_lengths) / max(1, len(plan) * t.micro_tokens)
    held = t.heldout_ids
    return (f"[train] drafter {sum(p.numel() for p in t.tr.params) / 1e6:.1f}M trainable params, draft vocab "
            f"{t.cfg.draft_vocab_size}, {len(t.train_ids)} samples ({index.dropped} dropped, {len(held)} held out"
            + (f" in {len({t.conversations[j] for j in held})} conversations, evaluated every {t.eval_every} steps" if held else "")
            + f"), {sum(t.train_lengths)} tokens/epoch, "
            f"{len(plan)} micro-batches/epoch x {t.micro_per_step} per step over {t.info.world_size} rank(s), "
            f"{t.total_steps} steps, "
            + (f"packed [1, {t.micro_tokens}] ({100 * fill:.1f}% real tokens), " if tc.batch_layout == "packed" else "padded, ")
            + f"{t.info.device} {str(t.compute_dtype).replace('torch.', '')}, attention {tc.attention}"
            + (", compiled loss" if t.tr.compiled else "") + t.source.describe())


def finish(t, prog: Progress, stopped: str, window: deque, evals: list[dict], wall: float, train_s: float,
           tokens_per_s: float | None) -> dict:
    """The run's drafter (the best by held-out figure when there are held-out samples, else the
    last) in train/drafter, the held-out engine tau beside it, and the complete manifest; `t` is
    the run's Trainer (train/loop.py)."""
    tc, info, out_dir, manifest, step = t.tc, t.info, t.out_dir, t.manifest, prog.step
    device = info.device
    if stopped == "budget" and info.is_main:
        log(f"[train] budget of {tc.max_minutes:g} min spent after {prog.train_s / 60:.1f} min: stopped at step {step} of "
            f"{t.total_steps}, checkpoint saved")
    final = full_drafter(t.tr.model, t.cfg, info)
    barrier(info)
    if not info.is_main:
        return manifest
    final.eval()
    best_rec = read_json_safe(out_dir / "best" / "best.json") if t.heldout_ids else {}
    if best_rec:  # the drafter downstream stages use is the best by held-out figure; the last one stays beside it
        last_sha = save_drafter_atomic(final, out_dir / "last")
        sha = copy_drafter_atomic(out_dir / "best", out_dir / "drafter")
        manifest["last"] = {"dir": "last", "sha256": last_sha, "step": step}
    else:
        sha = save_drafter_atomic(final, out_dir / "drafter")
        manifest.pop("last", None)
        shutil.rmtree(out_dir / "last", ignore_errors=True)
    w = window_metrics(window, t.k)
    manifest["output_fingerprint"] = fingerprint(t.fp, sha)  # downstream reruns when a continued run changed the drafter
    manifest["drafter"] = {"dir": "drafter", "sha256": sha, "config": asdict(t.cfg),
                           "from": f"best held-out {t.best_figure[2]} (step {best_rec['step']})" if best_rec else f"last step ({step})"}
    heldout = None
    if best_rec:
        held = t.heldout_ids
        heldout = heldout_record(evals, best_rec, len(held), len({t.conversations[j] for j in held}), t.tc.keep_best)
        if tc.heldout_engine_prompts > 0:
            t0 = time.time()
            prompts = engine_prompts(t.conversations, t.index.input_ids, t.index.loss_mask, held)
            eng = heldout.engine = engine_record(t.recipe, out_dir / "drafter", prompts,
                                                 t.source.target if t.source.online else None)
            manifest["timings"]["heldout_engine_s"] = round(time.time() - t0, 3)
            log(f"[train] held-out tau measured by the engine {eng.tau_chain:.3f} on {eng.prompts} held-out prompts "
                f"(greedy chain, depth {eng.depth}, {eng.max_new_tokens} new tokens, {time.time() - t0:.1f} s); "
                f"held-out simulated tau of this drafter {best_rec['tau_simulated']:.3f}" if eng.skipped is None
                else f"[train] held-out tau by the engine skipped: {eng.skipped}")
    figures = TrainFigures(
        device=device.type, compute_dtype=str(t.compute_dtype).replace("torch.", ""), world_size=info.world_size,
        stopped=stopped,
        budget=Budget(max_tokens=tc.max_tokens, max_minutes=tc.max_minutes, total_steps=t.total_steps, train_s=train_s),
        counts=TrainCounts(steps=step, skipped_nonfinite=prog.skipped, samples=len(t.train_ids),
                           samples_heldout=len(t.heldout_ids), samples_dropped=t.index.dropped,
                           tokens_per_epoch=sum(t.train_lengths), batches_per_epoch=len(t.plan_of(prog.epoch)),
                           micro_batches_per_step=t.micro_per_step, epochs_started=prog.epoch + 1,
                           batch_layout=tc.batch_layout, micro_batch_tokens=t.micro_tokens),
        metrics=TrainMetrics(loss=w["loss"], acc_per_position=w["acc"], tau_simulated=w["tau"], tokens_per_s=tokens_per_s,
                             steps=step, window_steps=len(window),
                             mfu=tokens_per_s * t.flops_per_token / (t.peak * info.world_size) if t.peak and tokens_per_s else None,
                             peak_memory_gib=round(peak_memory_gib(device), 3), train_flops_per_token=t.flops_per_token,
                             heldout_tau_simulated_best=best_rec["tau_simulated"] if best_rec else None, heldout=heldout))
    manifest.update(figures.to_dict())
    if best_rec:
        manifest["best"] = {"dir": "best", **best_rec}
    manifest["timings"]["train_s_this_session"] = round(wall, 3)
    log(f"[train] done: {step} steps, loss {w['loss']:.4f}, acc {' '.join(f'{a:.2f}' for a in w['acc'])}, "
        f"simulated tau {w['tau']:.2f}; drafter in {out_dir / 'drafter'} ({manifest['drafter']['from']})"
        + (f"; held-out simulated tau best {best_rec['tau_simulated']:.3f}, last {evals[-1]['tau']:.3f}" if best_rec and evals else ""))
    return finish_manifest(out_dir, manifest)
