"""Soak: the whole pipeline under kill -9 at random moments, resumed each time, must end byte-identical
to an unbroken run (issue 51 item 2).

    OMP_NUM_THREADS=1 python benchmarks/soak.py benchmarks/recipes/soak.yaml --kills 50 --out soak.json [--seed 0]

1. `draftsmith run RECIPE --run_dir WORK/ref/run` once, unbroken, in a fresh process: the reference.
   Its ledger gives each stage's duration.
2. A round: `draftsmith run RECIPE --run_dir WORK/soak/run` in its own process group, killed with
   SIGKILL (the whole group) at a random moment, rerun, killed again, ... until a run completes.
   A round's kills are planned at its start (`round_plan`, seeded): 1 to MAX_KILLS_PER_ROUND stages
   drawn with replacement, uniformly (so export and vocab, a fraction of a second each, get kills as
   often as train), in pipeline order, each kill a random delay into its stage up to the stage's
   reference duration; one kill in SIX_ANYWHERE lands anywhere from the process start (imports, the
   moments between stages). After every kill: every manifest loads, every listed shard matches its
   checksum, no stage that was complete went back, and the next run redoes no complete stage.
3. The completed round is compared with the reference file by file (`compare`): shards, token
   counts, vocab, checkpoints, the drafter folders and the export folders byte for byte; manifests,
   results.json and the JSONL logs as JSON with the timing, host and timestamp keys taken out
   (VOLATILE_KEY). The round's folder is removed and another round starts until `--kills` kills
   have landed.

Writes JSON (atomically) to --out: {kills, kills_by_stage, rounds, runs, files_compared, bytes_compared,
differences: [...], not_compared: {file: why}, ...}. Exit status 1 when any difference was found.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from draftsmith.fileio import atomic_write_json, is_temp_name  # noqa: E402
from draftsmith.manifests import load_manifest, verify_shards  # noqa: E402
from draftsmith.messages import DraftsmithError  # noqa: E402
from draftsmith.rundir import STAGE_DIRS, Ledger  # noqa: E402

STAGES = ("prepare", "regenerate", "capture", "vocab", "train", "evaluate", "export")
SIX_ANYWHERE = 6
"""One kill in this many lands at a uniform moment from the process start instead of inside a chosen stage."""

VOLATILE_KEY = re.compile(r"^(timings|hardware|step_costs|verified|started_at|finished_at|time|seconds|pid|pid_start|host"
                          r"|speedup|mfu|peak_memory_gib|budget|roofline)$|_s$|_ms$|per_s|_s_|speedup|bw_fraction")
"""Keys (at any depth of a JSON file) whose values are wall-clock measurements or where the run happened:
left out when JSON files are compared. Everything else must be equal."""

NOT_COMPARED = {
    "ledger.jsonl": "the run's history: the kills and resumes are in it, by design",
    ".lock": "the run-directory lock: the last holder's pid and start time",
    "STATUS.md": "rendered by `draftsmith status` from the manifests compared here",
    "eval/report.md": "prose with measured tokens/s and speedups; its figures are compared in eval/results.json",
    "train/tensorboard/": "TensorBoard event files carry wall-clock times in their name and records",
}
"""Files (or folders, ending in /) of a run directory that are not expected to be byte-identical."""

ENV = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONUNBUFFERED": "1",
       "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)}


def stage_folder(stage: str) -> str:
    return STAGE_DIRS.get(stage, stage)


def run_cmd(recipe: Path, run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "draftsmith.cli", "run", str(recipe), "--run_dir", str(run_dir)]


def stage_statuses(run_dir: Path) -> dict[str, str]:
    out = {}
    for s in STAGES:
        try:
            m = load_manifest(run_dir / stage_folder(s))
        except DraftsmithError:
            m = {"status": "unreadable"}
        out[s] = "pending" if m is None else str(m.get("status"))
    return out


def ledger_events(run_dir: Path) -> list[dict]:
    return Ledger(run_dir).read() if (run_dir / "ledger.jsonl").exists() else []


def stage_at(events: list[dict], pid: int) -> str:
    """The stage process `pid` was in when it was killed, from its ledger events: the last stage it started
    and did not end; `startup` before its first start, `between stages` after a stage ended."""
    started = [e for e in events if e.get("event") == "stage_started" and e.get("pid") == pid]
    if not started:
        return "startup"
    last = started[-1]
    after = events[events.index(last) + 1:]
    if any(e.get("stage") == last["stage"] and e.get("event") in ("stage_finished", "stage_failed", "stage_interrupted")
           for e in after):
        return "between stages"
    return last["stage"]


# ----------------------------------------------------------------------------- one run, one kill


def start(cmd: list[str], log_path: Path) -> subprocess.Popen:
    with open(log_path, "wb") as err:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(cmd, env=ENV, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def run_and_kill(cmd: list[str], run_dir: Path, log_path: Path, stage: Optional[str], delay_s: float,
                 timeout_s: float) -> tuple[bool, int]:
    """Start cmd; `delay_s` after it logs the start of `stage` (stage None: after the process starts),
    kill -9 its process group. Returns (killed, exit status); a run that ends first is not killed."""
    proc = start(cmd, log_path)
    t0 = time.time()
    try:
        t_start = t0 if stage is None else None
        before = sum(e.get("event") == "stage_started" and e.get("stage") == stage for e in ledger_events(run_dir)) \
            if stage else 0
        while time.time() - t0 < timeout_s:
            if proc.poll() is not None:
                return False, proc.returncode
            if t_start is None and sum(e.get("event") == "stage_started" and e.get("stage") == stage
                                       for e in ledger_events(run_dir)) > before:
                t_start = time.time()
            if t_start is not None and time.time() >= t_start + delay_s:
                kill_group(proc)
                return True, proc.returncode
            time.sleep(0.005 if t_start is not None else 0.02)
        raise RuntimeError(f"{' '.join(cmd)}: still running after {timeout_s:.0f} s; see {log_path}")
    finally:
        if proc.poll() is None:
            kill_group(proc)


def check_after_kill(run_dir: Path, complete_before: set[str]) -> list[str]:
    """What a kill may never do: leave a manifest that does not load, a listed shard that is missing or
    does not match its checksum, or a complete stage no longer complete."""
    problems = []
    for s in STAGES:
        d = run_dir / stage_folder(s)
        try:
            m = load_manifest(d)
            if m is not None and m.get("shards"):
                verify_shards(d, m)
        except DraftsmithError as e:
            problems.append(f"after a kill: {e}")
            continue
        if s in complete_before and (m is None or m.get("status") != "complete"):
            problems.append(f"after a kill: {s} was complete and is now {None if m is None else m.get('status')}")
    return problems


# ----------------------------------------------------------------------------- comparing two run dirs


def why_not_compared(rel: str) -> Optional[str]:
    for pattern, why in NOT_COMPARED.items():
        if rel == pattern or (pattern.endswith("/") and rel.startswith(pattern)):
            return why
    return None


def strip_volatile(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: strip_volatile(v) for k, v in obj.items() if not VOLATILE_KEY.search(str(k))}
    if isinstance(obj, list):
        return [strip_volatile(v) for v in obj]
    return obj


TEXT_WITH_RUN_DIR = (".yaml",)
"""Text files compared whole, the run directory's path replaced by RUN_DIR (recipe.yaml names it)."""


def with_run_dir(path: Path, run_dir: Path) -> str:
    return path.read_text(encoding="utf-8").replace(str(run_dir.resolve()), "RUN_DIR").replace(str(run_dir), "RUN_DIR")


def json_figures(path: Path, run_dir: Path) -> Any:
    """A JSON or JSONL file's content, volatile keys left out, the run directory's path replaced by RUN_DIR."""
    text = with_run_dir(path, run_dir)
    if path.suffix == ".jsonl":
        return [strip_volatile(json.loads(line)) for line in text.splitlines() if line.strip()]
    return strip_volatile(json.loads(text))


def first_difference(a: Any, b: Any, where: str = "") -> str:
    if type(a) is not type(b):
        return f"{where or '.'}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, dict):
        for k in sorted(a.keys() | b.keys()):
            if k not in a or k not in b:
                return f"{where}.{k}: only in the {'reference' if k in a else 'soaked run'}"
            if a[k] != b[k]:
                return first_difference(a[k], b[k], f"{where}.{k}")
    if isinstance(a, list):
        if len(a) != len(b):
            return f"{where or '.'}: {len(a)} items vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return first_difference(x, y, f"{where}[{i}]")
    return f"{where or '.'}: {json.dumps(a)[:120]} vs {json.dumps(b)[:120]}"


def files_of(run_dir: Path) -> dict[str, Path]:
    return {p.relative_to(run_dir).as_posix(): p for p in sorted(run_dir.rglob("*")) if p.is_file()}


def compare(ref: Path, got: Path) -> dict:
    """Every file of two run directories: {files_compared, bytes_compared, differences, not_compared}."""
    a, b = files_of(ref), files_of(got)
    out: dict[str, Any] = {"files_compared": 0, "bytes_compared": 0, "differences": [], "not_compared": {}}
    for rel in sorted(a.keys() | b.keys()):
        why = why_not_compared(rel)
        if why:
            out["not_compared"][rel] = why
            continue
        if is_temp_name(Path(rel).name) or any(is_temp_name(part) for part in Path(rel).parts):
            out["differences"].append({"file": rel, "what": "a temp or set-aside file left in a complete run"})
            continue
        if rel not in a or rel not in b:
            out["differences"].append({"file": rel, "what": f"only in the {'reference' if rel in a else 'soaked run'}"})
            continue
        if a[rel].suffix in (".json", ".jsonl"):
            x, y = json_figures(a[rel], ref), json_figures(b[rel], got)
            if x != y:
                out["differences"].append({"file": rel, "what": "figures differ: " + first_difference(x, y)})
        elif a[rel].suffix in TEXT_WITH_RUN_DIR:
            x, y = with_run_dir(a[rel], ref), with_run_dir(b[rel], got)
            if x != y:
                line = next((i for i, (p, q) in enumerate(zip(x.splitlines(), y.splitlines()), 1) if p != q), None)
                out["differences"].append({"file": rel, "what": f"text differs (first at line {line})"})
        else:
            x, y = a[rel].read_bytes(), b[rel].read_bytes()
            if x != y:
                at = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
                out["differences"].append({"file": rel, "what": f"bytes differ ({len(x)} vs {len(y)} bytes, first at byte {at})"})
        out["files_compared"] += 1
        out["bytes_compared"] += a[rel].stat().st_size
    return out


# ----------------------------------------------------------------------------- the soak


MAX_KILLS_PER_ROUND = 4
ANYWHERE = "anywhere"


def round_plan(rng: random.Random, stages: list[str], stage_s: dict[str, float], reference_s: float,
               most: int) -> list[tuple[str, float]]:
    """The kills of one round, in pipeline order: 1..`most` stages drawn with replacement (the same stage
    twice: a kill while it resumes), each with a delay uniform over its reference duration; one in
    SIX_ANYWHERE is a moment from the process start instead. Every stage gets kills as often as any
    other, however short it is."""
    n = rng.randint(1, max(1, most))
    order = {s: i for i, s in enumerate(stages)}
    picks = sorted(rng.choices(stages, k=n), key=order.__getitem__)
    plan = []
    for s in picks:
        if rng.randrange(SIX_ANYWHERE) == 0:
            plan.append((ANYWHERE, rng.uniform(0, reference_s)))
        else:
            plan.append((s, rng.uniform(0, stage_s[s])))
    return plan



def say_now(*args) -> None:
    print(*args, flush=True)


def soak(recipe: Path, kills: int, seed: int = 0, work: Optional[Path] = None, timeout_s: float = 600,
         say=say_now) -> dict:
    """Run the soak (module docstring); returns the JSON --out gets."""
    recipe = Path(recipe).resolve()
    rng = random.Random(seed)
    own_work = work is None
    work = Path(tempfile.mkdtemp(prefix="soak-")) if own_work else Path(work)
    work.mkdir(parents=True, exist_ok=True)
    logs = work / "logs"
    logs.mkdir(exist_ok=True)
    ref = work / "ref" / "run"
    shutil.rmtree(ref.parent, ignore_errors=True)
    t0 = time.time()
    killed, rc = run_and_kill(run_cmd(recipe, ref), ref, logs / "reference.txt", None, float("inf"), timeout_s)
    if rc != 0:
        raise RuntimeError(f"the unbroken reference run failed (exit {rc}): {(logs / 'reference.txt').read_text()[-3000:]}")
    reference_s = time.time() - t0
    stage_s = {e["stage"]: e["seconds"] for e in ledger_events(ref) if e.get("event") == "stage_finished"}
    stages = [s for s in STAGES if s in stage_s]
    say(f"reference: {reference_s:.1f} s; stages " + ", ".join(f"{s} {stage_s[s]:.1f} s" for s in stages))

    result: dict[str, Any] = {"recipe": str(recipe), "seed": seed, "kills_wanted": kills, "kills": 0,
                              "kills_by_stage": {}, "rounds": 0, "runs": 0, "files_compared": 0, "bytes_compared": 0,
                              "differences": [], "not_compared": {}, "reference_s": round(reference_s, 1),
                              "reference_stage_s": stage_s}
    got = work / "soak" / "run"
    t_soak = time.time()
    while result["kills"] < kills:
        shutil.rmtree(got.parent, ignore_errors=True)
        result["rounds"] += 1
        round_kills = 0
        plan = round_plan(rng, stages, stage_s, reference_s, min(MAX_KILLS_PER_ROUND, kills - result["kills"]))
        while True:
            statuses = stage_statuses(got)
            complete = {s for s, st in statuses.items() if st == "complete"}
            while plan and plan[0][0] in complete:  # a kill that overshot its stage: the stage is done
                plan.pop(0)
            target, delay = plan.pop(0) if plan else (None, float("inf"))  # the round's last run goes to the end
            if target == ANYWHERE:
                target = None
            n_events = len(ledger_events(got))
            log_path = logs / f"run-{result['runs']:03d}.txt"
            cmd = run_cmd(recipe, got)
            proc_killed, rc = run_and_kill(cmd, got, log_path, target, delay, timeout_s)
            if not proc_killed and delay != float("inf") and rc == 0:  # finished before an `anywhere` kill landed
                plan.clear()
            result["runs"] += 1
            events = ledger_events(got)
            new = events[n_events:]
            redone = [e["stage"] for e in new if e.get("event") == "stage_started" and e["stage"] in complete]
            if redone:
                result["differences"].append({"file": "ledger.jsonl", "what": f"run {result['runs']}: complete stage(s) "
                                              f"{', '.join(redone)} started again"})
            if not proc_killed:
                if rc != 0:
                    result["differences"].append({"file": str(log_path), "what": f"run {result['runs']} exited {rc}: "
                                                  + log_path.read_text()[-500:].strip().splitlines()[-1]})
                    return finish(result, work, own_work, t_soak)
                break
            pids = [e.get("pid") for e in new if e.get("event") == "stage_started"]
            where = stage_at(new, pids[-1]) if pids else "startup"
            result["kills"] += 1
            round_kills += 1
            result["kills_by_stage"][where] = result["kills_by_stage"].get(where, 0) + 1
            for p in check_after_kill(got, complete):
                result["differences"].append({"file": str(got), "what": p})
            say(f"kill {result['kills']}/{kills}: in {where} ({'aimed at ' + target if target else 'anywhere'}, "
                f"{delay:.2f} s)")
        cmp = compare(ref, got)
        result["files_compared"] += cmp["files_compared"]
        result["bytes_compared"] += cmp["bytes_compared"]
        result["not_compared"].update(cmp["not_compared"])
        for d in cmp["differences"]:
            result["differences"].append({**d, "round": result["rounds"]})
        say(f"round {result['rounds']}: {round_kills} kills, then complete; {cmp['files_compared']} files "
            f"({cmp['bytes_compared']:,} bytes) compared, {len(cmp['differences'])} differences")
        if cmp["differences"]:
            keep = work / f"round-{result['rounds']}"
            shutil.rmtree(keep, ignore_errors=True)
            shutil.copytree(got, keep)
    return finish(result, work, own_work, t_soak)


def finish(result: dict, work: Path, own_work: bool, t_soak: float) -> dict:
    result["soak_s"] = round(time.time() - t_soak, 1)
    result["work"] = str(work)
    if own_work and not result["differences"]:
        shutil.rmtree(work, ignore_errors=True)
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipe", help="a recipe of the whole pipeline (benchmarks/recipes/soak.yaml)")
    ap.add_argument("--kills", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True, help="JSON written here")
    ap.add_argument("--work", default=None, help="folder for the run directories and logs (default: a temp folder, "
                                                 "removed when no difference was found)")
    ap.add_argument("--timeout_s", type=float, default=600, help="longest one run may take")
    a = ap.parse_args(argv)
    result = soak(Path(a.recipe), a.kills, a.seed, Path(a.work) if a.work else None, a.timeout_s)
    atomic_write_json(a.out, result)
    print(f"{result['kills']} kills survived in {result['rounds']} rounds ({result['runs']} runs); "
          f"{result['files_compared']} files, {result['bytes_compared']:,} bytes compared; "
          f"{len(result['differences'])} differences -> {a.out}")
    for d in result["differences"][:20]:
        print(f"  {d['file']}: {d['what']}")
    return 1 if result["differences"] else 0


if __name__ == "__main__":
    sys.exit(main())
