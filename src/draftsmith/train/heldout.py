"""Held-out evaluation during training: the split by conversation, the eval cadence, the
overfitting test, the `heldout` record of the train manifest and the learning curve.

    split_by_conversation(conversations, heldout, seed) -> (train ids, held-out ids)
    overfitting(evals)       -> {from_step, to_step, heldout_from, heldout_to, train_from, train_to} | None
    heldout_record(evals, best, samples, conversations) -> manifest["metrics"]["heldout"] (status.py reads it)
    plot_learning_curve(evals, steps) -> PNG bytes (held-out and train simulated tau vs tokens seen)

An eval record (train/eval.jsonl) is {step, tokens_seen, loss, acc, tau, weight, train_acc, train_tau}:
held-out teacher-forced accuracy per TTT position and its simulated tau, beside the training
figures of the same moment (the mean over the last log_every steps).
"""
from __future__ import annotations

import io
import math
from typing import Optional, Sequence, Union

import torch

from ..artifacts import DraftsmithError
from .ttt import simulated_tau

AUTO_MAX_SAMPLES = 256
AUTO_FRACTION = 0.05
AUTO_EVALS_PER_RUN = 10
# Held-out tau must sit this fraction below its best to count as falling (evaluation noise on a
# few hundred samples is well under it).
FALL_TOLERANCE = 0.01
FALLING_EVALS = 2


def heldout_count(setting: Union[int, str], num_samples: int) -> int:
    """Samples to hold out: `auto` = min(256, 5 % of the samples, rounded down); 0 = none."""
    if setting == "auto":
        return min(AUTO_MAX_SAMPLES, int(num_samples * AUTO_FRACTION))
    return int(setting)


def eval_interval(setting: Union[int, str], total_steps: int) -> int:
    """Steps between held-out evaluations: `auto` = about AUTO_EVALS_PER_RUN per run; 0 = only at the end."""
    if setting == "auto":
        return max(1, math.ceil(total_steps / AUTO_EVALS_PER_RUN))
    return int(setting)


def split_by_conversation(conversations: Sequence[int], heldout: int, seed: int) -> tuple[list[int], list[int]]:
    """(training sample ids, held-out sample ids). `conversations[j]` is sample j's conversation
    (its record in the source): whole conversations are held out, taken in a seeded permutation
    until at least `heldout` samples are out, so no conversation is on both sides. One sample per
    conversation gives the per-sample split of a seeded permutation."""
    n = len(conversations)
    if heldout <= 0:
        return list(range(n)), []
    groups: dict[int, list[int]] = {}
    for j, c in enumerate(conversations):
        groups.setdefault(int(c), []).append(j)
    keys = sorted(groups)
    order = torch.randperm(len(keys), generator=torch.Generator().manual_seed(int(seed) * 7919 + 17)).tolist()
    held: list[int] = []
    for g in order:
        if len(held) >= heldout:
            break
        held += groups[keys[g]]
    if len(held) >= n:
        raise DraftsmithError(f"train: heldout_samples {heldout} leaves nothing to train on ({n} samples in {len(keys)} "
                              "conversations); lower train.heldout_samples")
    out = set(held)
    return [j for j in range(n) if j not in out], sorted(held)


def best_of(evals: Sequence[dict]) -> Optional[dict]:
    """The first eval with the highest held-out simulated tau."""
    best = None
    for e in evals:
        if best is None or e["tau"] > best["tau"]:
            best = e
    return best


def overfitting(evals: Sequence[dict]) -> Optional[dict]:
    """Held-out simulated tau has fallen below its best for the last FALLING_EVALS evaluations
    (by more than FALL_TOLERANCE), while the training figure (simulated tau of the training
    accuracy) rose since the best: the drafter is memorizing. None otherwise."""
    best = best_of(evals)
    if best is None:
        return None
    after = [e for e in evals if e["step"] > best["step"]]
    last = evals[-1]
    if len(after) < FALLING_EVALS or any(e["tau"] >= best["tau"] * (1 - FALL_TOLERANCE) for e in after[-FALLING_EVALS:]):
        return None
    if last.get("train_tau") is None or best.get("train_tau") is None or last["train_tau"] <= best["train_tau"]:
        return None
    return {"from_step": best["step"], "to_step": last["step"], "heldout_from": best["tau"], "heldout_to": last["tau"],
            "train_from": best["train_tau"], "train_to": last["train_tau"]}


def heldout_record(evals: Sequence[dict], best: dict, samples: int, conversations: int) -> dict:
    """manifest["metrics"]["heldout"]: what status.py shows and its findings read. `best` is
    train/best/best.json (the drafter kept)."""
    last = evals[-1] if evals else {}
    return {"samples": samples, "conversations": conversations, "evaluations": len(evals),
            "best_step": best.get("step"), "best_tau_simulated": best.get("tau_simulated"),
            "best_acc_per_position": best.get("acc"), "last_step": last.get("step"),
            "last_tau_simulated": last.get("tau"), "last_acc_per_position": last.get("acc"),
            "still_improving": bool(evals) and best.get("step") == last.get("step"),
            "overfitting": overfitting(evals)}


def plot_learning_curve(evals: Sequence[dict], steps: Sequence[dict]) -> bytes:
    """Simulated tau against training tokens seen: held-out at each evaluation (the best marked),
    train as the mean over each evaluation's window and, faintly, per step."""
    # why here: matplotlib takes about 0.7 s to import, and only this function draws
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    seen, xs, ys = 0, [], []
    for r in steps:
        seen += r["tokens"]
        if not r.get("skipped"):
            xs.append(seen)
            ys.append(simulated_tau(r["acc"]))
    if xs:
        ax.plot(xs, ys, color="tab:blue", alpha=0.2, linewidth=0.8, label="train (per step)")
    ex = [e["tokens_seen"] for e in evals]
    ax.plot(ex, [e["train_tau"] for e in evals], "o-", color="tab:blue", markersize=3, label="train (window mean)")
    ax.plot(ex, [e["tau"] for e in evals], "o-", color="tab:orange", markersize=4, label="held-out")
    best = best_of(evals)
    if best is not None:
        ax.plot([best["tokens_seen"]], [best["tau"]], "*", color="tab:red", markersize=12,
                label=f"best held-out {best['tau']:.3f} (step {best['step']})")
    ax.set(xlabel="training tokens seen", ylabel="simulated τ (teacher-forced)", title="learning curve")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()
