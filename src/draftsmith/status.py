"""`draftsmith status RUN_DIR`: the state of a run, from its recipe, manifests and ledger only.

    collect(run_dir)  -> a JSON-able dict (what `--json` prints)
    to_markdown(state) -> STATUS.md, one section per entry of SECTIONS

A stage is done (complete manifest), failed (a stage_failed event after its last start),
interrupted (a stage_interrupted event, or a `running` manifest whose process is gone),
running, or pending. New sections (instructions, discoveries, ...) are one function each
added to SECTIONS, reading what `collect` gathered.
"""
from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any, Callable, Optional

from .artifacts import DraftsmithError, LEDGER, Ledger, atomic_write_text, load_manifest, stage_dir
from .config import STAGES

ICONS = {"done": "✅", "running": "🔄", "pending": "⏳", "failed": "❌", "interrupted": "⏸️"}


# ----------------------------------------------------------------------------- headline figures


def _skipped(counts: dict) -> int:
    return sum(v for k, v in counts.items() if k.startswith("skipped_") and isinstance(v, int))


HEADLINES: dict[str, Callable[[dict], dict]] = {
    "prepare": lambda m: {"kept": m["counts"].get("kept"), "read": m["counts"].get("read"),
                          "skipped": _skipped(m["counts"]), "truncated": m["counts"].get("truncated"),
                          "tokens": m["counts"].get("tokens"), "loss_tokens": m["counts"].get("loss_tokens")},
    "capture": lambda m: {"tokens": m["counts"].get("tokens"), "bytes_per_token": m.get("bytes_per_token"),
                          "storage_dtype": m.get("storage_dtype"), "aux_layer_ids": m.get("aux_layer_ids"),
                          "tokens_per_s": m["metrics"].get("capture_tokens_per_s")},
    "vocab": lambda m: {"draft_vocab_size": m["metrics"].get("draft_vocab_size"), "coverage": m["metrics"].get("coverage")},
    "train": lambda m: {"steps": m["counts"].get("steps", m["metrics"].get("steps")), "loss": m["metrics"].get("loss"),
                        "acc_per_position": m["metrics"].get("acc_per_position"),
                        "tau_simulated": m["metrics"].get("tau_simulated"), "tokens_per_s": m["metrics"].get("tokens_per_s")},
    "evaluate": lambda m: {"tau": m["metrics"].get("tau"), "speedup": m["metrics"].get("speedup"),
                           "tokens_per_s_spec": m["metrics"].get("tokens_per_s_spec"),
                           "tokens_per_s_plain": m["metrics"].get("tokens_per_s_plain"),
                           "prompts": m["metrics"].get("num_prompts")},
    "export": lambda m: {"formats": sorted(m.get("formats", {}))},
}


def _fmt(key: str, v: Any) -> str:
    if isinstance(v, float):
        if key in ("coverage",):
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
    except (PermissionError, OSError):
        return True
    return True


def stage_state(run_dir: Path, stage: str, events: list[dict]) -> dict:
    folder = stage_dir(run_dir, stage)
    out: dict[str, Any] = {"stage": stage, "dir": folder.name, "state": "pending", "started_at": None,
                           "finished_at": None, "seconds": None, "error": None, "figures": {}}
    try:
        m = load_manifest(folder)
    except DraftsmithError as e:  # an unreadable manifest is a failure to show, not to crash on
        return {**out, "state": "failed", "error": str(e)}
    mine = [e for e in events if e.get("stage") == stage]
    starts = [i for i, e in enumerate(mine) if e["event"] == "stage_started"]
    after = mine[starts[-1] + 1:] if starts else []
    last_start = mine[starts[-1]] if starts else None
    ended = {e["event"]: e for e in after}

    if m is not None:
        out["started_at"] = m.get("started_at")
        out["finished_at"] = m.get("finished_at")
        out["figures"] = {k: v for k, v in HEADLINES[stage](m).items() if v is not None}
    elif last_start:
        out["started_at"] = last_start["time"]
    failed = ended.get("stage_failed")
    if m is not None and m.get("status") == "complete" and not (failed and failed["time"] > (m.get("finished_at") or 0)):
        out["state"] = "done"
        out["seconds"] = (m.get("timings") or {}).get("wall_s")
    elif failed:
        out.update(state="failed", error=failed.get("error"), finished_at=failed["time"], seconds=failed.get("seconds"))
    elif "stage_interrupted" in ended:
        out.update(state="interrupted", seconds=ended["stage_interrupted"].get("seconds"))
    elif (m is not None and m.get("status") == "running") or (last_start and "stage_finished" not in ended):
        same_host = m is not None and (m.get("hardware") or {}).get("host") == socket.gethostname()
        gone = same_host and not _pid_alive(last_start.get("pid") if last_start else None)
        out["state"] = "interrupted" if gone else "running"
        if out["started_at"]:
            out["seconds"] = round(time.time() - out["started_at"], 1) if not gone else None
    return out


def _read_recipe(run_dir: Path) -> dict:
    import yaml

    p = run_dir / "recipe.yaml"
    if not p.exists():
        return {}
    try:
        r = yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise DraftsmithError(f"{p}: not valid YAML ({' '.join(str(e).split())[:200]}); rerun a stage to rewrite it") from None
    return r if isinstance(r, dict) else {}


def next_step(stages: list[dict], run_dir: Path, recipe: dict) -> dict:
    recipe_path = run_dir / "recipe.yaml"
    for s in stages:
        name, state = s["stage"], s["state"]
        if state == "done":
            continue
        cmd = f"draftsmith {name} {recipe_path}"
        text = {
            "failed": f"{name} failed: {s['error']}. Fix that, then rerun `{cmd}`.",
            "interrupted": f"{name} was interrupted; `{cmd}` resumes it after what it finished.",
            "running": f"{name} is running; `draftsmith status {run_dir}` to follow it.",
            "pending": f"run `{cmd}` (or `draftsmith run {recipe_path}` for every remaining stage).",
        }[state]
        return {"stage": name, "state": state, "text": text, "command": None if state == "running" else cmd}
    target = (recipe.get("target") or {}).get("path", "TARGET")
    k = (recipe.get("evaluate") or {}).get("draft_steps", 5)
    cmd = (f"python -m sglang.launch_server --model-path {target} --speculative-algorithm EAGLE3 "
           f"--speculative-draft-model-path {stage_dir(run_dir, 'export') / 'sglang'} "
           f"--speculative-num-steps {k} --speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}")
    return {"stage": None, "state": "done", "text": f"every stage is complete; serve the drafter with `{cmd}`", "command": cmd}


RELEVANT_FILES = ["recipe.yaml", LEDGER, "eval/report.md", "eval/acceptance.png", "train/drafter", "export/sglang"]


def collect(run_dir: str | Path) -> dict:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise DraftsmithError(f"{run_dir}: no such run directory; give the run_dir of a recipe (runs/NAME)")
    recipe = _read_recipe(run_dir)
    events = Ledger(run_dir).read()
    stages = [stage_state(run_dir, s, events) for s in STAGES]
    return {
        "run_dir": str(run_dir), "name": recipe.get("name", run_dir.name), "goal": recipe.get("goal"),
        "generated_at": time.time(), "stages": stages, "next_step": next_step(stages, run_dir, recipe),
        "relevant_files": [f for f in RELEVANT_FILES if (run_dir / f).exists()],
    }


# ----------------------------------------------------------------------------- render


def _when(t: Optional[float]) -> str:
    return "-" if not t else time.strftime("%Y-%m-%d %H:%M", time.localtime(t))


def _dur(s: Optional[float]) -> str:
    if s is None:
        return "-"
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def _section_goal(st: dict) -> Optional[str]:
    return st["goal"]


def _section_stages(st: dict) -> str:
    rows = ["| stage | state | started | took | figures |", "|---|---|---|---|---|"]
    for s in st["stages"]:
        figures = figures_text(s["figures"])
        if s["error"]:
            figures = (figures + " · " if figures else "") + f"error: {s['error']}"
        rows.append(f"| {s['stage']} | {ICONS[s['state']]} {s['state']} | {_when(s['started_at'])} | "
                    f"{_dur(s['seconds'])} | {figures.replace('|', '/')} |")
    return "\n".join(rows)


def _section_files(st: dict) -> Optional[str]:
    return "\n".join(f"- `{st['run_dir']}/{f}`" for f in st["relevant_files"]) or None


def _section_next(st: dict) -> str:
    return st["next_step"]["text"]


SECTIONS: list[tuple[str, Callable[[dict], Optional[str]]]] = [
    ("Goal", _section_goal),
    ("Stages", _section_stages),
    ("Relevant files", _section_files),
    ("Next step", _section_next),
]


def to_markdown(st: dict) -> str:
    parts = [f"# Status: {st['name']}", f"_{st['run_dir']} · generated {_when(st['generated_at'])}_"]
    for title, fn in SECTIONS:
        body = fn(st)
        if body:
            parts += [f"## {title}", body]
    return "\n\n".join(parts) + "\n"


def to_brief(st: dict) -> str:
    lines = []
    for s in st["stages"]:
        detail = s["error"] if s["state"] == "failed" else figures_text(s["figures"])
        lines.append(f"{ICONS[s['state']]} {s['stage']:<9} {_dur(s['seconds']):>7}  {detail}".rstrip())
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
    import argparse

    p = argparse.ArgumentParser(prog="draftsmith status")
    p.add_argument("run_dir", help="run directory (runs/NAME)")
    p.add_argument("--json", action="store_true", help="print JSON instead of Markdown")
    a = p.parse_args(argv)
    if not Path(a.run_dir).is_dir():
        raise DraftsmithError(f"{a.run_dir}: no such run directory; give the run_dir of a recipe (e.g. runs/quickstart)")
    print(render(Path(a.run_dir), as_json=a.json))
    return 0
