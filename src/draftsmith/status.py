"""`draftsmith status RUN_DIR`: the state of a run, from its recipe, manifests and ledger only.

    collect(run_dir)  -> a JSON-able dict (what `--json` prints)
    to_markdown(state) -> STATUS.md, one section per entry of SECTIONS

A stage is done (complete manifest; a later command that the stage refused before writing anything,
a stage_refused event, leaves it done and is shown beside it), failed (a stage_failed event after its last start),
interrupted (a stage_interrupted event, or a `running` manifest whose process is gone),
running, or pending. The document has eight sections (SECTIONS): Goal, Instructions (constraints
in force), Discoveries (hardware, versions, target facts, measured figures, held-out figures,
planner prediction vs measurement), Accomplished (per stage), Relevant files, Findings (what the
figures say stands between the drafter and a win: it loses to n-gram lookup, its held-out figure
falls while the training figure rises, the engine's held-out τ falls far below the simulated one,
it is evaluated deeper than it was trained), Immediate next
step (computed from the findings once every stage is done), and Sources: every figure carries a
[n] marker naming the file (and key) it was read from.

Each stage's figures are read by attribute from its manifest through draftsmith/figures/ (the
dataclasses the stage writes). A malformed manifest or ledger record never stops `status`: a
figure of the wrong type reads as missing, a ledger record without an event is left out, and each
such file is named in one line under Accomplished (`malformed` in the JSON).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import socket
import time
from pathlib import Path
from typing import Any, Callable, Optional

import yaml

from .fileio import JSON_ERRORS, atomic_write_text, read_json
from .manifests import Figures, ManifestHead, load_manifest
from .messages import DraftsmithError
from .rundir import RECIPE_FILE, LEDGER, Ledger, stage_command, stage_dir
from .compat import TESTED, mtp_layers
from .config import STAGES
from .costmodel import target_spec, text_config_dict
from .figures.capture import CaptureFigures
from .figures.data import PrepareFigures, RegenerateFigures
from .figures.evaluate import EvaluateFigures, MethodRow
from .figures.export import ExportFigures
from .figures.train import Engine, Heldout, TrainFigures
from .figures.vocab import VocabFigures
from .plan import expected_tokens, predict, speedup_at

ICONS = {"done": "✅", "running": "🔄", "pending": "⏳", "failed": "❌", "interrupted": "⏸️"}

FIGURES: dict[str, type[Figures]] = {"prepare": PrepareFigures, "regenerate": RegenerateFigures, "capture": CaptureFigures,
                                     "vocab": VocabFigures, "train": TrainFigures, "evaluate": EvaluateFigures,
                                     "export": ExportFigures}
"""Each stage's figures (draftsmith/figures/): what status reads of its manifest."""


def read_figures(stage: str, m: Any, problems: Optional[list[str]] = None) -> Any:
    """A stage's figures from its manifest (None or a malformed one: the figures it has, the rest None)."""
    return FIGURES[stage].from_manifest(m if m is not None else {}, problems)


# ----------------------------------------------------------------------------- headline figures


HEADLINES: dict[str, Callable[[Any], dict]] = {
    "prepare": lambda f: {"kept": f.counts.kept, "read": f.counts.read, "skipped": f.counts.skipped_total(),
                          "truncated": f.counts.truncated, "tokens": f.counts.tokens, "loss_tokens": f.counts.loss_tokens},
    "capture": lambda f: {"tokens": f.counts.tokens, "bytes_per_token": f.bytes_per_token, "storage_dtype": f.storage_dtype,
                          "aux_layer_ids": f.aux_layer_ids, "tokens_per_s": f.metrics.capture_tokens_per_s},
    "regenerate": lambda f: {"kept": f.counts.kept, "conversations": f.counts.conversations,
                             "truncated": f.counts.truncated, "failed": f.counts.failed},
    "vocab": lambda f: {"draft_vocab_size": f.metrics.draft_vocab_size, "coverage": f.metrics.coverage},
    "train": lambda f: {"steps": f.counts.steps if f.counts.steps is not None else f.metrics.steps,
                        "loss": f.metrics.loss, "acc_per_position": f.metrics.acc_per_position,
                        "tau_simulated": f.metrics.tau_simulated, "tokens_per_s": f.metrics.tokens_per_s},
    "evaluate": lambda f: {**{f"tau {k}": v.tau for k, v in f.metrics.methods.items() if k != "plain"},
                           **{f"speedup {k}": v.speedup for k, v in f.metrics.methods.items() if k != "plain"},
                           "tau": None if f.metrics.methods else f.metrics.tau,
                           "speedup": None if f.metrics.methods else f.metrics.speedup,
                           "tokens_per_s_plain": f.metrics.tokens_per_s_plain, "prompts": f.metrics.num_prompts},
    "export": lambda f: {"formats": sorted(f.formats)},
}


def _fmt(key: str, v: Any) -> str:
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        if "coverage" in key:
            return f"{v:.1%}"
        return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    if isinstance(v, list):
        return "[" + " ".join(_fmt(key, x) for x in v) + "]"
    return str(v)


def figures_text(figures: dict) -> str:
    return " · ".join(f"{k.replace('_', ' ')} {_fmt(k, v)}" for k, v in figures.items() if v not in (None, [], ""))


# ----------------------------------------------------------------------------- collect


def _pid_alive(pid: Optional[int]) -> bool:
    if not pid:
        return True  # unknown: do not call it dead
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError, OverflowError, ValueError):
        return True
    return True


def _number(v: Any) -> Optional[float]:
    """v when it is a number (not a bool), else None."""
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def read_events(records: list[dict]) -> tuple[list[dict], list[str]]:
    """The ledger's records as status reads them, and what was wrong with them (one line each): a record
    without an `event` string is left out; a `time`, `seconds` or `pid` that is not a number reads as
    missing, an `error` that is not a string as its text."""
    out, problems = [], []
    for i, e in enumerate(records, 1):
        if not isinstance(e, dict) or not isinstance(e.get("event"), str):
            problems.append(f"record {i}: no `event` string; left out")
            continue
        bad = [k for k in ("time", "seconds", "pid") if k in e and e[k] is not None and _number(e[k]) is None]
        if bad:
            problems.append(f"record {i} ({e['event']}): {', '.join(bad)} not a number; read as missing")
        e = {**e, **{k: None for k in bad}}
        if "time" not in e:
            problems.append(f"record {i} ({e['event']}): no time")
        if e.get("error") is not None and not isinstance(e["error"], str):
            e["error"] = json.dumps(e["error"], default=str)
        out.append(e)
    return out, problems


def malformed_line(file: str, problems: list[str], what: str) -> Optional[str]:
    """One line naming a malformed file and its first problems, or None."""
    if not problems:
        return None
    more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
    return f"{file}: {'; '.join(problems[:3])}{more}; {what}"


def stage_state(run_dir: Path, stage: str, events: list[dict]) -> dict:
    folder = stage_dir(run_dir, stage)
    out: dict[str, Any] = {"stage": stage, "dir": folder.name, "state": "pending", "started_at": None,
                           "finished_at": None, "seconds": None, "error": None, "figures": {}, "malformed": None}
    try:
        m = load_manifest(folder)
    except DraftsmithError as e:  # an unreadable manifest is a failure to show, not to crash on
        return {**out, "state": "failed", "error": str(e)}
    events, _ = read_events(events)
    mine = [e for e in events if e.get("stage") == stage]
    starts = [i for i, e in enumerate(mine) if e["event"] == "stage_started"]
    after = mine[starts[-1] + 1:] if starts else []
    last_start = mine[starts[-1]] if starts else None
    ended = {e["event"]: e for e in after}

    head = ManifestHead()
    if m is not None:
        problems: list[str] = []
        head = ManifestHead.from_manifest(m, problems)
        out["started_at"], out["finished_at"] = head.started_at, head.finished_at
        out["figures"] = {k: v for k, v in HEADLINES[stage](read_figures(stage, m, problems)).items() if v is not None}
        out["malformed"] = malformed_line(f"{folder.name}/manifest.json", problems, "read as missing (the file was edited? "
                                          f"`{stage_command(stage, run_dir, force=True)}` writes it again)")
    elif last_start:
        out["started_at"] = last_start.get("time")
    failed = ended.get("stage_failed")
    if m is not None and head.status == "complete" and not (failed and (failed.get("time") or 0) > (head.finished_at or 0)):
        out["state"] = "done"
        out["seconds"] = head.timings.get("wall_s")
        if "stage_refused" in ended:
            out["refused"] = ended["stage_refused"].get("error")
    elif failed:
        out.update(state="failed", error=failed.get("error") or "(no error recorded)", finished_at=failed.get("time"),
                   seconds=failed.get("seconds"))
    elif "stage_interrupted" in ended:
        out.update(state="interrupted", seconds=ended["stage_interrupted"].get("seconds"))
    elif (m is not None and head.status == "running") or (last_start and "stage_finished" not in ended):
        same_host = m is not None and head.hardware.host == socket.gethostname()
        gone = same_host and not _pid_alive(last_start.get("pid") if last_start else None)
        out["state"] = "interrupted" if gone else "running"
        if out["started_at"]:
            out["seconds"] = round(time.time() - out["started_at"], 1) if not gone else None
    return out


def _read_recipe(run_dir: Path) -> dict:
    p = run_dir / RECIPE_FILE
    if not p.exists():
        return {}
    try:
        r = yaml.safe_load(p.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError, RecursionError, OSError) as e:
        raise DraftsmithError(f"{p}: not valid YAML ({' '.join(str(e).split())[:200]}); rerun a stage to rewrite it") from None
    return r if isinstance(r, dict) else {}


def _token_counts(f: PrepareFigures | RegenerateFigures) -> Optional[str]:
    """A data stage's "tokens (loss tokens)", or None where its manifest has no counts."""
    c = f.counts
    if c.tokens is None or c.loss_tokens is None:
        return None
    return f"{c.tokens:,} ({c.loss_tokens:,})"


def _engine_fact(e: Optional[Engine]) -> Optional[str]:
    """train's metrics.heldout.engine: the best drafter's τ measured by the engine on held-out prompts."""
    if e is None or (e.skipped is None and e.tau_chain is None):
        return None
    if e.skipped is not None:
        return f"skipped: {e.skipped}"
    return f"{_fmt('', e.tau_chain)} at depth {e.depth} on {e.prompts} held-out prompts"


def _setting(m: Any, path: str) -> Optional[float]:
    """A number in a manifest (its config), None when absent or not a number."""
    return _number(_get(m, path))


def _depth(method: str, ev: Any) -> Optional[int]:
    """How deep evaluate drafted `method` (its config), from the raw evaluate manifest."""
    key = {"eagle3_chain": "config.draft_steps", "eagle3_tree": "config.tree_depth"}.get(method)
    return _setting(ev, key) if key else None


ENGINE_FLOOR = 0.8
"""A finding when the engine's held-out tau is below this share of the simulated tau at its depth (the
quickstart: 1.268 against 1.286, 0.99; teacher forcing is an estimate, hence the margin)."""


def findings(recipe: dict, manifests: dict[str, dict]) -> list[dict]:
    """What the measured figures say stands between this drafter and a win, most pressing first.
    Each: {kind, text, fix, source}. Read from the train and evaluate manifests only."""
    out: list[dict] = []
    train_m, ev_m = manifests.get("train"), manifests.get("evaluate")
    train, ev = read_figures("train", train_m), read_figures("evaluate", ev_m)
    held = train.metrics.heldout or Heldout()
    over = held.overfitting
    if over and None not in (over.heldout_from, over.heldout_to, over.train_from, over.train_to):
        out.append({"kind": "overfitting", "source": f"{_mf('train')}: metrics.heldout.overfitting",
                    "text": f"held-out {'sampled' if held.best_by == 'sampled' else 'simulated'} τ fell from "
                            f"{over.heldout_from:.3g} (step {over.from_step}) to "
                            f"{over.heldout_to:.3g} (step {over.to_step}) while the training figure rose from "
                            f"{over.train_from:.3g} to {over.train_to:.3g}: the drafter is memorizing its data",
                    "fix": "train on more conversations (raise prepare.max_samples, with regenerate on) or for fewer "
                           "epochs; train/best holds the checkpoint with the best held-out figure"})
    engine = held.engine or Engine()
    acc = held.best_acc_per_position or []
    if engine.tau_chain is not None and engine.depth and engine.depth > 0 and len(acc) >= engine.depth:
        sim = expected_tokens(acc[:engine.depth])  # the simulated tau at the depth the engine drafted
        if engine.tau_chain < ENGINE_FLOOR * sim:
            out.append({"kind": "engine_below_simulated", "source": f"{_mf('train')}: metrics.heldout.engine, "
                                                                     "metrics.heldout.best_acc_per_position",
                        "text": f"the engine's τ on {engine.prompts} held-out prompts ({engine.tau_chain:.3g}) is "
                                f"far below the τ its teacher-forced held-out accuracy predicts at depth {engine.depth} "
                                f"({sim:.3g}): decoding does not see what training saw",
                        "fix": "check that capture and evaluate use the same aux layers, chat template, draft vocab "
                               "and dtype; tests/test_consistency.py checks the engine against teacher forcing"})
    trained_k = _setting(train_m, "config.train.ttt_steps")
    trained_k = int(trained_k) if trained_k and trained_k > 0 and trained_k == int(trained_k) else None
    methods = ev.metrics.methods
    if trained_k and ev_m:
        deep = {m: _depth(m, ev_m) for m in methods if (_depth(m, ev_m) or 0) > trained_k}
        if deep:
            past = [r for r in ev.metrics.accept_rate_per_position[trained_k:] if r is not None]
            seen = f"; measured acceptance past depth {trained_k}: {' '.join(f'{r:.2f}' for r in past)}" if past else ""
            out.append({"kind": "deeper_than_trained", "source": f"{_mf('evaluate')}: config, metrics.accept_rate_per_position",
                        "text": ", ".join(f"{m} drafts to depth {d:g}" for m, d in deep.items())
                                + f", but the drafter was trained with {trained_k} TTT steps{seen}",
                        "fix": f"train with train.ttt_steps >= {max(deep.values()):g} or evaluate with evaluate.draft_steps / "
                               f"evaluate.tree_depth <= {trained_k}"
                               + ("; or train with draft.norm_output true (the default since 2026-12-05), which holds "
                                  "acceptance past the trained depth (BENCHMARKS.md \"New defaults\")"
                                  if _get(train_m, "config.draft.norm_output") is False else "")})
    t_learned = _setting(train_m, "config.train.ttt_target_temperature")
    t_served = _setting(ev_m, "config.temperature") or 0
    if t_served > 0 and t_learned is not None and t_learned != 1:
        out.append({"kind": "law_unlike_served", "source": f"{_mf('train')}: config.train.ttt_target_temperature; "
                                                          f"{_mf('evaluate')}: config.temperature",
                    "text": f"evaluate samples at temperature {t_served:g}, but the drafter learned the target's law at "
                            f"{'a sharper' if t_learned < 1 else 'a flatter'} T {t_learned:g}: speculative sampling accepts "
                            "by the overlap of the two laws at the serving temperature, which a drafter matches at T 1 only "
                            "(on an H100, T 0.5 lost 26 % chain τ against T 1 at temperature 1; BENCHMARKS.md, nineteenth session)",
                    "fix": "train with train.ttt_target_temperature 1 (as recipes/gpu.yaml does); a sharper T helps greedy "
                           "decoding only"})
    regen = manifests.get("regenerate")
    # None: not regenerated
    t_regen = (_setting(regen, "config.temperature") or 0) if _get(regen, "status") == "complete" else None
    if t_served > 0 and t_regen == 0:
        out.append({"kind": "trained_on_greedy_text", "source": f"{_mf('regenerate')}: config.temperature; "
                                                               f"{_mf('evaluate')}: config.temperature",
                    "text": f"evaluate samples at temperature {t_served:g}, but the drafter trained on answers the target "
                            "regenerated greedily: sampled text goes where greedy text never does (on an H100, 160 "
                            "MT-Bench turns, one training seed: a drafter trained on answers sampled at T 1 reached 1.73x "
                            "the tree τ of one trained on greedy answers under sampling at 1, 1.59x at 0.7, and 0.87x "
                            "under greedy decoding; BENCHMARKS.md, twenty-first session)",
                    "fix": f"for a server that samples, regenerate at its temperature (regenerate.temperature {t_served:g}); "
                           "keep greedy answers for a greedy server"})
    s_step, s_tau, kept_tau = held.sampled_best_step, held.sampled_best_tau, held.best_tau_sampled
    if (t_served > 0 and (held.best_by or "greedy") == "greedy" and None not in (s_step, s_tau, kept_tau)
            and held.sample_temperature is not None and s_step != held.best_step and s_tau > kept_tau):
        out.append({"kind": "kept_for_greedy_decoding", "source": f"{_mf('train')}: metrics.heldout; "
                                                                 f"{_mf('evaluate')}: config.temperature",
                    "text": f"evaluate samples at temperature {t_served:g}, but train/best kept step {held.best_step} by "
                            f"held-out greedy simulated τ (its held-out sampled τ at T {held.sample_temperature:g}: "
                            f"{kept_tau:.3g}); step {s_step} had the best held-out sampled τ, {s_tau:.3g}",
                    "fix": "train with train.keep_best sampled (as recipes/gpu.yaml does): train/best is then chosen by "
                           "held-out τ of speculative sampling at evaluate.temperature"})
    fallbacks = ev.metrics.capture_fallbacks
    if fallbacks:  # those calls ran eagerly: the speedups are not the graphs path's
        out.append({"kind": "capture_fallbacks", "source": f"{_mf('evaluate')}: metrics.capture_fallbacks",
                    "text": f"{fallbacks} CUDA-graph capture(s) of evaluate fell back to eager, so part of its timings are "
                            "eager ones and its speedups understate the graphs path",
                    "fix": "read why in eval/results.json (capture_fallbacks) and the evaluate log; fix that or set "
                           "evaluate.fast: static to time every method on one path"})
    ngram = methods.get("ngram") or MethodRow()
    if ngram.tau is not None:
        lose = {m: v for m, v in methods.items() if m.startswith("eagle3") and v.tau is not None
                and (v.tau < ngram.tau or (v.speedup or 0) < (ngram.speedup or 0))}
        if lose:
            capped = _drafting_ceilings(lose, ev_m, ev, ngram)
            if capped:
                fix = capped
            elif held.still_improving:
                fix = "the held-out figure was still rising at the last evaluation: train longer (raise train.epochs)"
            elif train.metrics.heldout is not None:
                fix = "the held-out figure had levelled off: more data helps more than more steps (raise prepare.max_samples, regenerate on)"
            else:
                fix = "hold samples out (train.heldout_samples) to see whether more data or more steps would help"
            out.append({"kind": "loses_to_ngram", "source": f"{_mf('evaluate')}: metrics.methods",
                        "text": "; ".join(f"{m} τ {v.tau:.3g} / {_fmt('', v.speedup)}x" for m, v in lose.items())
                                + f" against n-gram lookup's τ {ngram.tau:.3g} / {_fmt('', ngram.speedup)}x, "
                                  "which costs nothing to train",
                        "fix": fix, "rerun": not capped})  # capped: rerunning the same recipe cannot change it
    if ev_m and t_served == 0 and t_regen:  # last: the figures hold, for greedy decoding
        out.append({"kind": "greedy_eval_of_sampled_answers", "source": f"{_mf('regenerate')}: config.temperature; "
                                                                       f"{_mf('evaluate')}: config.temperature",
                    "text": f"the drafter trained on answers the target sampled at temperature {t_regen:g}, made for a server "
                            "that samples, but evaluate decoded greedily, so these are a greedy server's figures (on an H100 "
                            "such a drafter had 0.87x the greedy tree τ of one trained on greedy answers, and 1.73x its τ "
                            "sampling at 1; BENCHMARKS.md, twenty-first session)",
                    "fix": f"measure it as it will be served: set evaluate.temperature to the server's (e.g. {t_regen:g}); "
                           "for a server that decodes greedily, regenerate greedily (regenerate.temperature 0)"})
    return out


def _drafting_ceilings(lose: dict[str, MethodRow], ev_m: Any, ev: EvaluateFigures, ngram: MethodRow) -> Optional[str]:
    """When no drafter could pass n-gram's speedup at the measured depth, say so instead of
    advising more training. A round's cost in plain decoding steps is τ ÷ speedup (both measured
    on the same prompts); with every draft accepted a depth-d round emits d + 1 tokens, so the
    method's speedup is at most (d + 1) ÷ that cost (a ceiling: an all-accepted round feeds the
    drafter a few more rows). None when some losing method could still win by acceptance alone."""
    s_ngram, caps = ngram.speedup or 0, []
    for m, v in lose.items():
        d, tau, sp = _depth(m, ev_m), v.tau, v.speedup
        if not (d and tau and sp):
            return None
        cost = tau / sp
        if (d + 1) / cost >= s_ngram:
            return None
        caps.append(f"a {m} round costs {cost:.2g} plain decoding steps here (τ ÷ speedup), so even with every draft "
                    f"accepted its depth {d:g} gives at most {(d + 1) / cost:.2g}x")
    hybrid = ev.metrics.methods.get("hybrid") or MethodRow()
    best = (f"; the hybrid method verifies n-gram's continuation inside the drafter's tree (τ {hybrid.tau:.3g}, "
            f"{_fmt('', hybrid.speedup)}x here)" if hybrid.tau else "")
    return ("training longer cannot pass n-gram on this device: " + "; ".join(caps) + f", below n-gram's "
            f"{s_ngram:.3g}x. Drafting pays where a verify forward costs about one decoding step (a GPU, where the "
            "weights' bytes bound a step: docs/fast-paths.md); here serve n-gram lookup" + best)


def next_step(stages: list[dict], run_dir: Path, recipe: dict, found: Optional[list[dict]] = None,
              ev: Optional[dict] = None) -> dict:
    run_all = stage_command("run", run_dir)
    for s in stages:
        name, state = s["stage"], s["state"]
        if state == "done":
            continue
        cmd = stage_command(name, run_dir)
        text = {
            "failed": f"{name} failed: {s['error']}. " + (f"Hint: {s['fix_hint']}. " if s.get("fix_hint") else "")
                      + f"Fix that, then rerun `{cmd}`.",
            "interrupted": f"{name} was interrupted; `{cmd}` resumes it after what it finished.",
            "running": f"{name} is running; `draftsmith status {shlex.quote(str(run_dir))}` to follow it.",
            "pending": f"run `{cmd}` (or `{run_all}` for every remaining stage).",
        }[state]
        return {"stage": name, "state": state, "text": text, "command": None if state == "running" else cmd}
    if found:  # every stage is done, but the figures say the drafter is not worth serving yet
        first = found[0]
        rerun = first.get("rerun", True)
        return {"stage": None, "state": "done", "command": run_all if rerun else None,
                "text": f"every stage is complete, but {first['text']}. Next: {first['fix']}"
                        + (f"; then rerun `{run_all}`." if rerun else ".")}
    cmd, why = serve_command(run_dir, recipe, ev)
    return {"stage": None, "state": "done", "text": f"every stage is complete; serve the drafter{why} with `{cmd}`",
            "command": cmd}


def serve_command(run_dir: Path, recipe: dict, ev: Optional[dict]) -> tuple[str, str]:
    """SGLang's command for the exported drafter, shaped as the EAGLE-3 method evaluate measured fastest:
    the tree (--speculative-eagle-topk tree_topk, num-steps tree_depth, num-draft-tokens budget + 1, the
    rows one verification holds) or the chain (top-k 1, k steps, k + 1 tokens). Returns (command, why)."""
    target = _get(recipe, "target.path") or "TARGET"
    cfg = _get(ev, "config") or _get(recipe, "evaluate")  # read through _setting: any shape reads as the defaults
    shape = lambda key, default: int(v) if (v := _setting(cfg, key)) is not None and v == int(v) else default  # noqa: E731
    methods = read_figures("evaluate", ev).metrics.methods
    speed = {m: methods[m].speedup or 0 for m in ("eagle3_chain", "eagle3_tree") if m in methods}
    best = max(speed, key=speed.get) if speed else "eagle3_chain"
    if best == "eagle3_tree":
        steps, topk, tokens = shape("tree_depth", 5), shape("tree_topk", 4), shape("tree_budget", 16) + 1
    else:
        steps = shape("draft_steps", 5)
        topk, tokens = 1, steps + 1
    why = f" as the {best.split('_')[1]} evaluate measured fastest ({speed[best]:.2f}x)" if speed else ""
    cmd = (f"python -m sglang.launch_server --model-path {shlex.quote(str(target))} --speculative-algorithm EAGLE3 "
           f"--speculative-draft-model-path {shlex.quote(str(stage_dir(run_dir, 'export') / 'sglang'))} "
           f"--speculative-num-steps {steps} --speculative-eagle-topk {topk} --speculative-num-draft-tokens {tokens}")
    return cmd, why


RELEVANT_FILES = [RECIPE_FILE, LEDGER, "data/manifest.json", "capture/manifest.json", "vocab/vocab.safetensors",
                  "train/drafter", "train/learning_curve.png", "train/tensorboard", "eval/results.json", "eval/report.md", "eval/acceptance.png",
                  "export/sglang", "export/vllm", "plan.json", "probe/report.md"]

# Substrings of an error -> what usually fixes it (DraftsmithErrors already carry their fix).
FIX_HINTS = [
    ("out of memory", "lower the stage's batch_tokens (or max_length), or free the GPU: `draftsmith doctor RECIPE`"),
    ("no space left", "free disk space or move run_dir; `draftsmith doctor RECIPE` compares free disk with the capture size"),
    ("cuda", "check the GPU with `draftsmith doctor RECIPE`"),
]


def fix_hint(error: Optional[str], recipe_path: Optional[Path] = None) -> Optional[str]:
    """What usually fixes a failure without a fix of its own; its `draftsmith doctor RECIPE` names the
    run's recipe.yaml when given, so the command can be pasted."""
    if not error or ";" in error:  # a DraftsmithError names its own fix after the ';'
        return None
    low = error.lower()
    hint = next((hint for key, hint in FIX_HINTS if key in low),
                "see the traceback in ledger.jsonl (event stage_failed); `draftsmith doctor RECIPE` checks the setup")
    return hint.replace(" RECIPE`", f" {shlex.quote(str(recipe_path))}`") if recipe_path is not None else hint


# ----------------------------------------------------------------------------- facts with sources


def fact(label: str, value: Any, source: str) -> Optional[dict]:
    """One figure and where it was read: `source` is 'FILE: key.path' relative to the run dir."""
    return None if value in (None, [], {}, "") else {"label": label, "value": value, "source": source}




def _get(d: Any, path: str) -> Any:
    for k in path.split("."):
        d = d.get(k) if isinstance(d, dict) else None
    return d


def _manifests(run_dir: Path) -> dict[str, dict]:
    out = {}
    for s in STAGES:
        try:
            m = load_manifest(stage_dir(run_dir, s))
        except DraftsmithError:
            m = None
        if m is not None:
            out[s] = m
    return out


def _mf(stage: str) -> str:
    return f"{stage_dir('', stage).as_posix().lstrip('/')}/manifest.json"


def _words(v: Any) -> str:
    """A recipe list as 'a, b' (a hand-edited scalar as itself)."""
    return ", ".join(map(str, v)) if isinstance(v, list) else str(v)


def instructions(recipe: dict) -> list[dict]:
    """Constraints in force: tested versions, precision, hardware, options (recipe.yaml)."""
    r = lambda key: _get(recipe, key)  # noqa: E731
    aux = r("target.aux_layer_ids")
    facts = [
        fact("tested versions", ", ".join(f"{k} {lo}" + (f"–{hi}" if hi != lo else "") for k, (lo, hi) in TESTED.items()),
             "draftsmith.compat.TESTED"),
        fact("target", r("target.path"), "recipe.yaml: target.path"),
        fact("target device / dtype", f"{r('target.device')} / {r('target.dtype')}" if recipe else None,
             "recipe.yaml: target.device, target.dtype"),
        fact("trust remote code", r("target.trust_remote_code"), "recipe.yaml: target.trust_remote_code"),
        fact("aux layers", aux if aux else "default [1, N//2-1, N-4]" if recipe else None, "recipe.yaml: target.aux_layer_ids"),
        fact("capture storage dtype", r("capture.storage_dtype"), "recipe.yaml: capture.storage_dtype"),
        fact("train device / dtype", f"{r('train.device')} / {r('train.dtype')}" if r("train") else None,
             "recipe.yaml: train.device, train.dtype"),
        fact("draft vocab", r("vocab.draft_vocab_size"), "recipe.yaml: vocab.draft_vocab_size"),
        fact("TTT steps", r("train.ttt_steps"), "recipe.yaml: train.ttt_steps"),
        fact("train budget", f"max_steps {r('train.max_steps')}" if r("train.max_steps") else
             (f"{r('train.epochs')} epochs" if r("train") else None), "recipe.yaml: train.max_steps, train.epochs"),
        fact("max length", r("prepare.max_length"), "recipe.yaml: prepare.max_length"),
        fact("evaluation", f"k={r('evaluate.draft_steps')} on {_words(r('evaluate.benchmarks') or [])}, "
             f"max_new_tokens {r('evaluate.max_new_tokens')}" if r("evaluate") else None,
             "recipe.yaml: evaluate.draft_steps, evaluate.benchmarks, evaluate.max_new_tokens"),
        fact("export", f"{_words(r('export.formats') or [])} in {r('export.dtype')}" if r("export") else None,
             "recipe.yaml: export.formats, export.dtype"),
    ]
    return [f for f in facts if f]


def _target_facts(recipe: dict, run_dir: Path) -> list[Optional[dict]]:
    path = _get(recipe, "target.path")
    if not path:
        return []
    p = Path(path) if Path(path).is_absolute() or Path(path).exists() else run_dir / path
    cfg_path = p / "config.json"
    if not cfg_path.exists():
        return [fact("target config", f"not found at {cfg_path}", "recipe.yaml: target.path")]
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
        spec = target_spec(cfg)
    except (*JSON_ERRORS, OSError, DraftsmithError) as e:
        return [fact("target config", f"unreadable ({e})", str(cfg_path))]
    c, src = text_config_dict(cfg), f"{cfg_path}"
    return [
        fact("architecture", ", ".join(cfg.get("architectures") or []) or c.get("model_type"), f"{src}: architectures"),
        fact("decoder layers", spec.num_layers, f"{src}: num_hidden_layers"),
        fact("hidden size", spec.hidden_size, f"{src}: hidden_size"),
        fact("vocab", spec.vocab_size, f"{src}: vocab_size"),
        fact("routed experts", f"{spec.num_experts} (top-{spec.experts_per_token}, {spec.moe_layers} MoE layers)"
             if spec.num_experts else "none (dense)", f"{src}: n_routed_experts/num_experts, num_experts_per_tok"),
        fact("MTP layers", mtp_layers(cfg), f"{src}: num_nextn_predict_layers (compat.mtp_layers)"),
        fact("parameters", f"{spec.total_params() / 1e9:.3g}B, {spec.weight_bytes() / 1e9:.3g} GB of weights",
             f"{src}: parameters via costmodel.target_spec"),
    ]




def _prediction_facts(run_dir: Path, ev_m: dict) -> list[Optional[dict]]:
    """Planner prediction at batch 1 and the evaluated k, next to the measured speedup."""
    ev = read_figures("evaluate", ev_m)
    k = ev.metrics.draft_steps or _setting(ev_m, "config.draft_steps")
    k = int(k) if k and k > 0 and k == int(k) else None
    measured, accept = ev.metrics.speedup, ev.metrics.accept_rate_per_position
    step_costs = ev.step_costs or ev.metrics.step_costs
    predicted, src = None, None
    if step_costs and accept and k:
        try:
            res = predict(accept, step_costs, [1], [k], tree_budgets=[])
            predicted = speedup_at(res, 1, k)
            src = f"{_mf('evaluate')}: step_costs + accept_rate_per_position (plan.predict)"
        except (DraftsmithError, TypeError, ValueError):  # hand-edited acceptance or costs: no prediction
            predicted = None
    elif (run_dir / "plan.json").exists() and k:
        try:
            predicted = speedup_at(read_json(run_dir / "plan.json"), 1, k)
            src = f"plan.json: rows[batch 1, k={k}]"
        except (DraftsmithError, KeyError, TypeError, AttributeError):
            predicted = None
    if _number(predicted) is None:
        return [fact("planner prediction", "none yet (no step_costs in the eval manifest, no plan.json); "
                     "run `draftsmith plan --run_dir RUN_DIR`", "plan.json")] if measured is not None else []
    err = f" ({(predicted - measured) / measured:+.1%} vs measured {measured:.3g}x)" if measured else ""
    out = [fact(f"predicted speedup (batch 1, k={k})", f"{predicted:.3g}x{err}", src)]
    batches = ev.metrics.batches
    if step_costs and accept and k and batches:  # measured speedup per batch size (eagle3_chain) vs predicted
        sizes = sorted(int(b) for b, row in batches.items() if b.isdigit() and row.get("eagle3_chain") is not None)
        try:
            res = predict(accept, step_costs, sizes, [k], tree_budgets=[])
            pairs = [f"b={b}: {batches[str(b)]['eagle3_chain']:.3g}x measured, "
                     f"{speedup_at(res, b, k):.3g}x predicted" for b in sizes]
        except (DraftsmithError, TypeError, ValueError):
            pairs = []
        out.append(fact("speedup per batch size (chain)", "; ".join(pairs),
                        f"{_mf('evaluate')}: metrics.batches, step_costs (plan.predict)"))
    return out


def _heldout_fact(h: Optional[Heldout]) -> Optional[str]:
    if h is None or None in (h.best_tau_simulated, h.best_step, h.last_tau_simulated, h.samples):
        return None
    return f"{h.best_tau_simulated:.3g} (step {h.best_step}) / {h.last_tau_simulated:.3g} on {h.samples:,} held-out samples"


def _sampled_fact(h: Optional[Heldout]) -> Optional[str]:
    if h is None or h.best_tau_sampled is None or h.sample_temperature is None:
        return None
    return (f"{h.best_tau_sampled:.3g} at temperature {h.sample_temperature:g}"
            + (" (train.keep_best: sampled, train/best chosen by it)" if h.best_by == "sampled" else ""))


def _speeds(f: EvaluateFigures) -> Optional[str]:
    spec, plain = f.metrics.tokens_per_s_spec, f.metrics.tokens_per_s_plain
    return None if spec is None or plain is None else f"{_fmt('', spec)} vs {_fmt('', plain)}"


FIGURE_FACTS: list[tuple[str, str, Callable[[Any], Any], str]] = [
    ("prepare", "conversations kept / read", lambda f: f"{f.counts.kept} / {f.counts.read}" if f.counts.read is not None
     else None, "counts.kept, counts.read"),
    ("prepare", "training tokens (loss tokens)", _token_counts, "counts.tokens, counts.loss_tokens"),
    ("regenerate", "regenerated conversations kept / tokens (loss tokens): what training read",
     lambda f: f"{f.counts.kept} / {t}" if (t := _token_counts(f)) else None, "counts.kept, counts.tokens, counts.loss_tokens"),
    ("capture", "aux layers captured", lambda f: f.aux_layer_ids, "aux_layer_ids"),
    ("capture", "capture bytes per token", lambda f: f.bytes_per_token, "bytes_per_token"),
    ("capture", "capture throughput (tokens/s)", lambda f: f.metrics.capture_tokens_per_s, "metrics.capture_tokens_per_s"),
    ("vocab", "draft vocab coverage", lambda f: f.metrics.coverage, "metrics.coverage"),
    ("train", "training throughput (tokens/s)", lambda f: f.metrics.tokens_per_s, "metrics.tokens_per_s"),
    ("train", "final loss", lambda f: f.metrics.loss, "metrics.loss"),
    ("train", "train accuracy per TTT position", lambda f: f.metrics.acc_per_position, "metrics.acc_per_position"),
    ("train", "simulated τ", lambda f: f.metrics.tau_simulated, "metrics.tau_simulated"),
    ("train", "held-out simulated τ: best (step) / last", lambda f: _heldout_fact(f.metrics.heldout), "metrics.heldout"),
    ("train", "held-out simulated τ of speculative sampling (best drafter)", lambda f: _sampled_fact(f.metrics.heldout),
     "metrics.heldout.best_tau_sampled"),
    ("train", "held-out τ measured by the engine (greedy chain)",
     lambda f: _engine_fact(f.metrics.heldout.engine if f.metrics.heldout else None), "metrics.heldout.engine"),
    ("evaluate", "τ (tokens per target verification)", lambda f: f.metrics.tau, "metrics.tau"),
    ("evaluate", "acceptance per draft position", lambda f: f.metrics.accept_rate_per_position,
     "metrics.accept_rate_per_position"),
    ("evaluate", "tokens/s speculative vs plain", _speeds, "metrics.tokens_per_s_spec, metrics.tokens_per_s_plain"),
    ("evaluate", "measured speedup", lambda f: f.metrics.speedup, "metrics.speedup"),
    ("evaluate", "decoding path of every speedup (plain and speculative alike)", lambda f: f.metrics.path, "metrics.path"),
    ("evaluate", "plain decoding, fraction of the memory-bandwidth limit", lambda f: f.metrics.plain_decode_bw_fraction,
     "metrics.plain_decode_bw_fraction"),
]
"""(stage, label, the figure from the stage's figures, the manifest keys it reads): the measured figures of Discoveries."""


def discoveries(run_dir: Path, recipe: dict, manifests: dict[str, dict]) -> list[dict]:
    """What the run found out: hardware, versions, target facts, throughput, acceptance, predictions."""
    facts: list[Optional[dict]] = []
    last = next((s for s in reversed(STAGES) if s in manifests), None)
    if last:
        head, src = ManifestHead.from_manifest(manifests[last]), _mf(last)
        hw = head.hardware
        facts.append(fact("hardware", f"{hw.host}: " + (", ".join(hw.gpus) if hw.gpus else f"CPU, {hw.cpu_count} cores"),
                          f"{src}: hardware"))
        facts.append(fact("software", ", ".join(f"{k} {v}" for k, v in head.versions.items()), f"{src}: versions"))
    facts += _target_facts(recipe, run_dir)
    figures = {s: read_figures(s, m) for s, m in manifests.items()}
    for stage, label, get, key in FIGURE_FACTS:
        if stage in figures:
            facts.append(fact(label, get(figures[stage]), f"{_mf(stage)}: {key}"))
    if "evaluate" in manifests:
        ev_m = manifests["evaluate"]
        for name, row in sorted(figures["evaluate"].metrics.methods.items()):  # EAGLE-3 chain/tree vs n-gram
            facts.append(fact(f"{name}: τ / speedup / tokens/s", f"{_fmt('', row.tau)} / {_fmt('', row.speedup)}x / "
                              f"{_fmt('', row.tokens_per_s)}", f"{_mf('evaluate')}: metrics.methods.{name}"))
        legacy = _get(ev_m, "metrics")
        for key, v in sorted((legacy if isinstance(legacy, dict) else {}).items()):  # older manifests: ngram_* keys
            if "ngram" in key:
                facts.append(fact(f"n-gram {key.replace('ngram', '').strip('_').replace('_', ' ') or 'baseline'}", v,
                                  f"{_mf('evaluate')}: metrics.{key}"))
        facts += _prediction_facts(run_dir, ev_m)
    probe = run_dir / "probe" / "results.json"
    if probe.exists():
        try:
            pr = read_json(probe)
            facts.append(fact("aux layers by measurement",
                              f"best {pr['best']['layers']} (probe accuracy {pr['best']['accuracy']:.3f}) "
                              f"vs default {pr['default']['layers']} ({pr['default']['accuracy']:.3f})",
                              "probe/results.json: best, default"))
        except (DraftsmithError, KeyError, TypeError):
            pass
    return [f for f in facts if f]


def collect(run_dir: str | Path) -> dict:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise DraftsmithError(f"{run_dir}: no such run directory; give the run_dir of a recipe (runs/NAME)")
    recipe = _read_recipe(run_dir)
    events, ledger_problems = read_events(Ledger(run_dir).read())
    # regenerate is optional: shown only when the run has used it; capture is skipped with train.online
    optional = {"regenerate"} | ({"capture"} if _get(recipe, "train.online") else set())
    stages = [stage_state(run_dir, s, events) for s in STAGES if s not in optional or stage_dir(run_dir, s).exists()]
    for s in stages:
        s["fix_hint"] = fix_hint(s["error"], run_dir / RECIPE_FILE) if s["state"] == "failed" else None
    manifests = _manifests(run_dir)
    found = findings(recipe, manifests)
    malformed = [malformed_line(LEDGER, ledger_problems, "status read the rest")] + [s["malformed"] for s in stages]
    goal = recipe.get("goal")
    return {
        "run_dir": str(run_dir), "name": str(recipe.get("name", run_dir.name)),
        "goal": None if goal is None else str(goal), "goal_source": "recipe.yaml: goal",
        "generated_at": time.time(),
        "instructions": instructions(recipe),
        "discoveries": discoveries(run_dir, recipe, manifests),
        "findings": found,
        "stages": stages, "next_step": next_step(stages, run_dir, recipe, found, manifests.get("evaluate")),
        "relevant_files": [f for f in RELEVANT_FILES if (run_dir / f).exists()],
        "malformed": [line for line in malformed if line],
    }


# ----------------------------------------------------------------------------- render


def _when(t: Optional[float]) -> str:
    try:
        return "-" if not t else time.strftime("%Y-%m-%d %H:%M", time.localtime(t))
    except (OverflowError, ValueError, OSError):  # a hand-edited time past the calendar
        return "-"


def _dur(s: Optional[float]) -> str:
    if s is None or not math.isfinite(s):
        return "-"
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class Footnotes:
    """Numbers each source file once; `mark("FILE: key")` gives the marker to put after a figure,
    and the Sources section lists each file with the keys read from it."""

    def __init__(self, run_dir: str):
        self.run_dir, self.files = run_dir, {}

    def mark(self, source: Optional[str]) -> str:
        if not source:
            return ""
        file, _, key = source.partition(": ")
        keys = self.files.setdefault(file, [])
        if key and key not in keys:
            keys.append(key)
        return f" [{list(self.files).index(file) + 1}]"


def _facts(facts: list[dict], notes: Footnotes) -> Optional[str]:
    return "\n".join(f"- {f['label']}: {_fmt(f['label'], f['value'])}{notes.mark(f['source'])}" for f in facts) or None


def _section_goal(st: dict, notes: Footnotes) -> Optional[str]:
    return st["goal"] and st["goal"] + notes.mark(st["goal_source"])


def _section_instructions(st: dict, notes: Footnotes) -> Optional[str]:
    return _facts(st["instructions"], notes)


def _section_discoveries(st: dict, notes: Footnotes) -> Optional[str]:
    return _facts(st["discoveries"], notes)


def _section_stages(st: dict, notes: Footnotes) -> str:
    rows = ["| stage | state | started | took | figures |", "|---|---|---|---|---|"]
    for s in st["stages"]:
        figures = figures_text(s["figures"])
        if figures:
            figures += notes.mark(f"{s['dir']}/manifest.json")
        if s["error"]:
            figures = (figures + " · " if figures else "") + f"error: {s['error']}" + notes.mark(f"{LEDGER}: stage_failed")
        if s.get("refused"):
            figures = (figures + " · " if figures else "") + f"a later command was refused: {s['refused']}" \
                + notes.mark(f"{LEDGER}: stage_refused")
        rows.append(f"| {s['stage']} | {ICONS[s['state']]} {s['state']} | {_when(s['started_at'])} | "
                    f"{_dur(s['seconds'])} | {figures.replace('|', '/')} |")
    return "\n".join(rows + [""] * bool(st.get("malformed")) + [f"- malformed: {line}" for line in st.get("malformed") or []])


def _section_files(st: dict, notes: Footnotes) -> Optional[str]:
    return "\n".join(f"- `{st['run_dir']}/{f}`" for f in st["relevant_files"]) or None


def _section_findings(st: dict, notes: Footnotes) -> Optional[str]:
    return "\n".join(f"- {f['text']}{notes.mark(f['source'])}. Fix: {f['fix']}." for f in st.get("findings") or []) or None


def _section_next(st: dict, notes: Footnotes) -> str:
    return st["next_step"]["text"]


def _section_sources(st: dict, notes: Footnotes) -> Optional[str]:
    """Where every figure above was read: paths relative to the run directory unless absolute."""
    return "\n".join(f"[{i}] `{file}`" + (f": {', '.join(keys)}" if keys else "") + "  "
                     for i, (file, keys) in enumerate(notes.files.items(), 1)).rstrip() or None


SECTIONS: list[tuple[str, Callable[[dict, Footnotes], Optional[str]]]] = [
    ("Goal", _section_goal),
    ("Instructions", _section_instructions),
    ("Discoveries", _section_discoveries),
    ("Accomplished", _section_stages),
    ("Relevant files", _section_files),
    ("Findings", _section_findings),
    ("Immediate next step", _section_next),
    ("Sources", _section_sources),  # last: it lists the sources the sections above cited
]


def to_markdown(st: dict) -> str:
    parts = [f"# Status: {st['name']}", f"_{st['run_dir']} · generated {_when(st['generated_at'])}_"]
    notes = Footnotes(st["run_dir"])
    for title, fn in SECTIONS:
        body = fn(st, notes)
        if body:
            parts += [f"## {title}", body]
    return "\n\n".join(parts) + "\n"


def to_brief(st: dict) -> str:
    lines = []
    for s in st["stages"]:
        detail = s["error"] if s["state"] == "failed" else figures_text(s["figures"])
        lines.append(f"{ICONS[s['state']]} {s['stage']:<9} {_dur(s['seconds']):>7}  {detail}".rstrip())
    lines += [f"malformed: {line}" for line in st.get("malformed") or []]
    lines.append(f"next: {st['next_step']['text']}")
    return "\n".join(lines)


def render(run_dir: Path, as_json: bool = False, brief: bool = False) -> str:
    """The run's status as Markdown (or JSON); unless brief, also written to RUN_DIR/STATUS.md."""
    st = collect(run_dir)
    if not brief:
        atomic_write_text(Path(run_dir) / "STATUS.md", to_markdown(st))
    if as_json:
        return json.dumps(st, indent=2, default=str)
    return to_brief(st) if brief else to_markdown(st)


def main(argv: list[str]) -> int:
    """`draftsmith status RUN_DIR [--json]`."""
    p = argparse.ArgumentParser(prog="draftsmith status")
    p.add_argument("run_dir", help="run directory (runs/NAME)")
    p.add_argument("--json", action="store_true", help="print JSON instead of Markdown")
    a = p.parse_args(argv)
    if not Path(a.run_dir).is_dir():
        raise DraftsmithError(f"{a.run_dir}: no such run directory; give the run_dir of a recipe (e.g. runs/quickstart)")
    print(render(Path(a.run_dir), as_json=a.json))
    return 0
