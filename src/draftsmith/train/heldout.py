"""Held-out evaluation during training: the split by conversation, the eval cadence, the
overfitting test, the `heldout` record of the train manifest, the learning curve, and the
engine's measured tau on held-out prompts at the end.

    (the split groups samples by data/conversations.py's conversation_keys: ShareGPT parts joined)
    split_by_conversation(conversations, heldout, seed) -> (train ids, held-out ids)
    overfitting(evals, key)  -> {from_step, to_step, heldout_from, heldout_to, train_from, train_to} | None
    heldout_record(evals, best, samples, conversations, keep_best) -> manifest["metrics"]["heldout"] (status.py reads it)
    plot_learning_curve(evals, steps, key) -> PNG bytes (held-out and train simulated tau vs tokens seen)
    engine_prompts(...) / engine_record(...) -> metrics.heldout.engine: tau of evaluate's decoding (speculate.methods) on held-out prompts

An eval record (train/eval.jsonl) is {step, tokens_seen, loss, acc, tau, weight, accept, tau_sampled,
sample_temperature, train_acc, train_tau}: held-out teacher-forced accuracy per TTT position and its
simulated tau (greedy decoding), the expected acceptance of speculative sampling per position at
sample_temperature (evaluate.temperature, or 1 when evaluate is greedy) and its simulated tau, beside
the training figures of the same moment (the mean over the last log_every steps). train/best is the
evaluation with the best tau, or tau_sampled with train.keep_best sampled (BEST_FIGURES).
"""
from __future__ import annotations

import io
import math
from dataclasses import replace
from pathlib import Path
from typing import Hashable, Optional, Sequence, Union

import torch

from ..messages import DraftsmithError
from ..config import Recipe, heldout_sample_temperature
from ..draft.io import load_drafter
from ..figures.train import Engine, Heldout, Overfitting
from ..speculate.methods import decode, load_models, prompt_budget
from ..target.model import Target, eos_token_ids, load_tokenizer
from .ttt import simulated_tau

AUTO_MAX_SAMPLES = 256
AUTO_FRACTION = 0.05
AUTO_EVALS_PER_RUN = 10
# Held-out tau must sit this fraction below its best to count as falling (evaluation noise on a
# few hundred samples is well under it).
FALL_TOLERANCE = 0.01
FALLING_EVALS = 2
ENGINE_MAX_NEW_TOKENS = 64


EXTRA_NAME = "the temperature train.keep_best sampled picks at (evaluate.temperature, 1 when greedy)"


def fingerprint_extra(recipe: Recipe) -> Optional[tuple[str, float]]:
    """The train stage's extra fingerprint input (stages.Stage.extra): with train.keep_best sampled, the
    best drafter is picked at evaluate's temperature."""
    return ("sample_temperature", heldout_sample_temperature(recipe)) if recipe.train.keep_best == "sampled" else None


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


def split_by_conversation(conversations: Sequence[Hashable], heldout: int, seed: int) -> tuple[list[int], list[int]]:
    """(training sample ids, held-out sample ids). `conversations[j]` is sample j's conversation
    (conversation_keys): whole conversations are held out, taken in a seeded permutation of the
    sorted keys until at least `heldout` samples are out, so no conversation is on both sides. One
    sample per conversation gives the per-sample split of a seeded permutation."""
    n = len(conversations)
    if heldout <= 0:
        return list(range(n)), []
    groups: dict[Hashable, list[int]] = {}
    for j, c in enumerate(conversations):
        groups.setdefault(c, []).append(j)
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


BEST_FIGURES = {"greedy": ("tau", "tau_simulated", "simulated tau"),
                "sampled": ("tau_sampled", "tau_sampled", "sampled tau")}
"""train.keep_best -> (its key in an eval record, its key in best/best.json, its name in the log)."""


def best_of(evals: Sequence[dict], key: str = "tau") -> Optional[dict]:
    """The first eval with the highest held-out figure `key` (an eval record's tau or tau_sampled)."""
    best = None
    for e in evals:
        if best is None or e[key] > best[key]:
            best = e
    return best


def overfitting(evals: Sequence[dict], key: str = "tau") -> Optional[dict]:
    """The held-out figure `key` has fallen below its best for the last FALLING_EVALS evaluations
    (by more than FALL_TOLERANCE), while the training figure (simulated tau of the training
    accuracy) rose since the best: the drafter is memorizing. None otherwise."""
    best = best_of(evals, key)
    if best is None:
        return None
    after = [e for e in evals if e["step"] > best["step"]]
    last = evals[-1]
    if len(after) < FALLING_EVALS or any(e[key] >= best[key] * (1 - FALL_TOLERANCE) for e in after[-FALLING_EVALS:]):
        return None
    if last.get("train_tau") is None or best.get("train_tau") is None or last["train_tau"] <= best["train_tau"]:
        return None
    return {"from_step": best["step"], "to_step": last["step"], "heldout_from": best[key], "heldout_to": last[key],
            "train_from": best["train_tau"], "train_to": last["train_tau"]}


def heldout_record(evals: Sequence[dict], best: dict, samples: int, conversations: int, keep_best: str = "greedy") -> Heldout:
    """manifest["metrics"]["heldout"]: what status.py shows and its findings read. `best` is
    train/best/best.json (the drafter kept, by train.keep_best's figure)."""
    last = evals[-1] if evals else {}
    by_sampled = best_of([e for e in evals if e.get("tau_sampled") is not None], "tau_sampled") or {}
    over = overfitting(evals, BEST_FIGURES[keep_best][0])
    return Heldout(samples=samples, conversations=conversations, evaluations=len(evals), best_by=keep_best,
                   best_step=best.get("step"), best_tau_simulated=best.get("tau_simulated"),
                   best_acc_per_position=best.get("acc"), best_tau_sampled=best.get("tau_sampled"),
                   best_accept_sampled_per_position=best.get("accept_sampled"),
                   sample_temperature=best.get("sample_temperature"),
                   last_step=last.get("step"), last_tau_simulated=last.get("tau"), last_acc_per_position=last.get("acc"),
                   last_tau_sampled=last.get("tau_sampled"),
                   # the evaluation keep_best sampled would keep (status names it when evaluate samples and it differs)
                   sampled_best_step=by_sampled.get("step"), sampled_best_tau=by_sampled.get("tau_sampled"),
                   still_improving=bool(evals) and best.get("step") == last.get("step"),
                   overfitting=Overfitting(**over) if over else None)


def plot_learning_curve(evals: Sequence[dict], steps: Sequence[dict], key: str = "tau") -> bytes:
    """Simulated tau against training tokens seen: held-out at each evaluation (greedy, and of
    speculative sampling; the best by figure `key` marked), train as the mean over each
    evaluation's window and, faintly, per step."""
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
    if evals and all("tau_sampled" in e for e in evals):
        ax.plot(ex, [e["tau_sampled"] for e in evals], "s--", color="tab:green", markersize=3,
                label=f"held-out, sampling at T {evals[-1]['sample_temperature']:g}")
    best = best_of(evals, key)
    if best is not None:
        ax.plot([best["tokens_seen"]], [best[key]], "*", color="tab:red", markersize=12,
                label=f"best held-out {best[key]:.3f} (step {best['step']})")
    ax.set(xlabel="training tokens seen", ylabel="simulated τ (teacher-forced)", title="learning curve")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


# -- tau measured by the engine on held-out prompts, at the end of training --------------------

def engine_prompts(conversations: Sequence[Hashable], input_ids: Sequence[torch.Tensor], loss_mask: Sequence[torch.Tensor],
                   heldout_ids: Sequence[int]) -> list[tuple[Hashable, list[int]]]:
    """(conversation, prompt ids) of each held-out conversation, in the order of its first sample:
    that sample's tokens before its first loss token, i.e. the chat template's rendering of the
    conversation's first user turn (and any system turn before it) up to the assistant header,
    token for token the prompt the drafter trained on. Training samples are never read."""
    out, seen = [], set()
    for j in heldout_ids:
        key = conversations[j]
        if key in seen:
            continue
        seen.add(key)
        first = torch.nonzero(loss_mask[j]).flatten()
        if len(first) and first[0] > 0:
            out.append((key, input_ids[j][:int(first[0])].tolist()))
    return out


def engine_tau(target: Target, drafter, prompts: Sequence[tuple[Hashable, list[int]]], count: int, depth: int,
               evaluate_cfg, eos_ids: list[int]) -> Engine:
    """The engine's tau on the first `count` prompts that fit the target's positions: evaluate's
    greedy EAGLE-3 chain (speculate.methods.decode, batch 1, eager) drafting `depth` tokens per round,
    ENGINE_MAX_NEW_TOKENS new tokens per prompt; tau = emitted tokens / target verifications,
    over all prompts (evaluate's definition)."""
    cfg = replace(evaluate_cfg, draft_steps=depth, max_new_tokens=ENGINE_MAX_NEW_TOKENS, temperature=0.0, resident=False)
    budget = prompt_budget(target, cfg, ["eagle3_chain"])
    used = [(key, ids) for key, ids in prompts if budget is None or len(ids) <= budget][:count]
    if not used:
        return Engine(skipped=f"no held-out prompt fits the target's positions with {ENGINE_MAX_NEW_TOKENS} new tokens")
    emitted, rounds = 0, 0
    for _, ids in used:
        _, [stats] = decode(target, drafter, "eagle3_chain", [ids], cfg, eos_ids)
        emitted += sum(stats.emitted_per_round)
        rounds += stats.rounds
    if not rounds:  # every answer ended at the token prefill gave: no round to measure
        return Engine(skipped=f"no speculative round ran on {len(used)} held-out prompt(s): each answer ended at its first token")
    return Engine(tau_chain=emitted / rounds, prompts=len(used), depth=depth, max_new_tokens=ENGINE_MAX_NEW_TOKENS,
                  emitted=emitted, rounds=rounds, conversations=[key for key, _ in used])


def engine_record(recipe: Recipe, drafter_dir: Path, prompts: Sequence[tuple[Hashable, list[int]]],
                  online_target: Optional[Target]) -> Engine:
    """metrics.heldout.engine: engine_tau of the drafter in drafter_dir, on the target training ran
    (online) or, offline, the target loaded as evaluate loads it (speculate.methods.load_models);
    depth = train.ttt_steps capped by evaluate.draft_steps. Engine(skipped=reason) when the target
    cannot be loaded, the decoding fails (out of memory, too few positions) or no prompt is
    usable: the drafter is written by then, and a rerun would only meet the same failure."""
    count = int(recipe.train.heldout_engine_prompts)
    depth = min(int(recipe.train.ttt_steps), int(recipe.evaluate.draft_steps))
    if not prompts:
        return Engine(skipped="no held-out sample has prompt tokens before its first loss token")
    try:
        if online_target is not None:
            target = online_target
            drafter = load_drafter(drafter_dir, device=target.device, dtype=target.dtype)
            if target.tokenizer is None:  # loaded for training without one: its EOS ends an answer too
                target.tokenizer = load_tokenizer(recipe.target.path, recipe.target.trust_remote_code)
        else:
            target, drafter = load_models(recipe, drafter_dir)
    except (DraftsmithError, OSError, torch.OutOfMemoryError) as e:
        return Engine(skipped=f"target not loaded: {' '.join(str(e).split())[:300]}")
    try:
        return engine_tau(target, drafter, prompts, count, depth, recipe.evaluate, eos_token_ids(target))
    except (DraftsmithError, torch.OutOfMemoryError) as e:  # e.g. positions too few for the new tokens, memory
        return Engine(skipped=f"not measured: {' '.join(str(e).split())[:300]}")
