"""Two writers and a reader on one run directory, as real processes: `draftsmith run` on the tiny
reference target (assets/tiny-llama-sharegpt) beside a second `run`, an `export`, a `train` and
`status`. A second writer refuses with one line and writes nothing, or waits (--wait-lock) and then
finds the work done; a reader never sees a half-written file.

No test depends on timing: the running `run` is held still with SIGSTOP at the moment under test
(the lock stays held, nothing moves) and let go with SIGCONT; waits are for ledger events or
lines, each with a generous bound.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from draftsmith.manifests import load_manifest, verify_shards
from draftsmith.rundir import Ledger
from draftsmith.status import collect

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "assets" / "tiny-llama-sharegpt"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
       "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)}
STAGE_DIRS = {"prepare": "data", "capture": "capture", "vocab": "vocab", "train": "train", "evaluate": "eval",
              "export": "export"}
BOUND_S = 300  # generous: the whole run takes about 10 s on this 2-core machine


def end_for_good(p) -> None:
    """A test's held writer, still running after a failure: resumed and killed with its process group."""
    if p.poll() is None:
        resume(p)
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


@pytest.fixture
def recipe(tmp_path) -> Path:
    """A whole pipeline in seconds: 64 short conversations, 6 training steps, 2 evaluation prompts."""
    convs = [{"id": str(i), "conversations": [
        {"from": "human", "value": f"Count from {i} to {i + 3 + i % 9}, please."},
        {"from": "gpt", "value": " ".join(str(j) for j in range(i, i + 4 + i % 9)) + ". Done!"}]} for i in range(64)]
    (tmp_path / "convs.json").write_text(json.dumps(convs))
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["Count from 3 to 8.", "Say hi."]))
    r = {"name": "tiny", "run_dir": str(tmp_path / "run"),
         "target": {"path": str(TARGET), "device": "cpu", "dtype": "float32"},
         "prepare": {"source": str(tmp_path / "convs.json"), "max_length": 64, "samples_per_shard": 16},
         "capture": {"batch_tokens": 512, "storage_dtype": "float32"},
         "vocab": {"draft_vocab_size": 128},
         "train": {"ttt_steps": 2, "max_steps": 6, "batch_tokens": 256, "lr": 3e-3, "warmup_steps": 2, "save_every": 3,
                   "log_every": 2, "heldout_samples": 0, "device": "cpu", "dtype": "float32"},
         "evaluate": {"benchmarks": [str(tmp_path / "prompts.jsonl")], "max_new_tokens": 8, "draft_steps": 2, "max_prompts": 2},
         "export": {"formats": ["sglang"]}}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(r))
    return path


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "draftsmith.cli", *args]


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    with open(log, "wb") as err:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)


def wait_for(cond, what: str, proc: subprocess.Popen | None = None) -> None:
    t0 = time.time()
    while not cond():
        assert proc is None or proc.poll() is None, f"exited with {proc.returncode} before {what}"
        assert time.time() - t0 < BOUND_S, f"no {what} within {BOUND_S} s"
        time.sleep(0.02)


def started(run_dir: Path, stage: str) -> int:
    return sum(e["event"] == "stage_started" and e.get("stage") == stage for e in Ledger(run_dir).read())


def pause(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGSTOP)


def resume(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGCONT)


def finish(proc: subprocess.Popen, log: Path) -> None:
    try:
        assert proc.wait(timeout=BOUND_S) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def snapshot(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*"))
            if p.is_file() and p.name != "STATUS.md"}


def assert_complete(run_dir: Path) -> None:
    for stage, d in STAGE_DIRS.items():
        assert load_manifest(run_dir / d)["status"] == "complete", stage
    assert not [p for p in run_dir.rglob("*") if ".tmp" in p.name or p.name.endswith(".previous")]


def test_a_second_writer_refuses_with_one_line_and_writes_nothing(recipe, tmp_path):
    """While `run` is in capture: a second `run`, an `export` and a `train` each stop with one line
    naming the holder's pid and --wait-lock, exit 2, and leave every byte of the run dir as it was;
    `status` beside it answers. The first run then finishes as if alone."""
    run_dir = tmp_path / "run"
    log = tmp_path / "run1.log"
    first = start(cli("run", str(recipe)), log)
    try:
        wait_for(lambda: started(run_dir, "capture") > 0, "capture start", first)
        pause(first)
        before = snapshot(run_dir)
        for cmd in (["run", str(recipe)], ["export", str(recipe)], ["train", str(recipe), "--train.max_steps", "9"]):
            p = subprocess.run(cli(*cmd), env=ENV, capture_output=True, text=True, timeout=BOUND_S)
            lines = [line for line in p.stderr.splitlines() if line.strip()]
            assert p.returncode == 2 and len(lines) == 1, (cmd, p.stderr)
            assert lines[0].startswith(f"error: {run_dir}: run directory is locked by pid {first.pid}"), lines
            assert "--wait-lock" in lines[0] and p.stdout == ""
            assert snapshot(run_dir) == before, f"{cmd[0]} wrote into the locked run dir"
        p = subprocess.run(cli("status", str(run_dir), "--json"), env=ENV, capture_output=True, text=True, timeout=BOUND_S)
        assert p.returncode == 0, p.stderr
        states = {s["stage"]: s["state"] for s in json.loads(p.stdout)["stages"]}
        assert states["prepare"] == "done" and states["capture"] in ("running", "done"), states  # capture may be quick
        resume(first)
        finish(first, log)
    finally:
        end_for_good(first)
    assert_complete(run_dir)
    assert all(started(run_dir, s) == 1 for s in STAGE_DIRS), Ledger(run_dir).read()
    assert not [e for e in Ledger(run_dir).read() if e["event"] in ("stage_refused", "stage_failed")]


def test_writers_that_wait_run_after_the_holder_and_find_the_work_done(recipe, tmp_path):
    """`run --wait-lock` and `export --wait-lock` started while `run` is in train say they wait,
    start nothing until it is done, then skip every stage: each stage ran once."""
    run_dir = tmp_path / "run"
    log = tmp_path / "run1.log"
    first = start(cli("run", str(recipe)), log)
    waiters = []
    try:
        wait_for(lambda: started(run_dir, "train") > 0, "train start", first)
        pause(first)
        for name, cmd in (("run2", ["run", str(recipe), "--wait-lock"]), ("export", ["export", str(recipe), "--wait-lock"])):
            wlog = tmp_path / f"{name}.log"
            waiters.append((start(cli(*cmd), wlog), wlog))
            wait_for(lambda: "waiting (--wait-lock)" in wlog.read_text(), f"{name} saying it waits", waiters[-1][0])
            assert f"held by pid {first.pid}" in wlog.read_text()
        resume(first)
        finish(first, log)
        for proc, wlog in waiters:
            finish(proc, wlog)
    finally:
        for proc in [first] + [w for w, _ in waiters]:
            if proc.poll() is None:
                resume(proc)
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    assert_complete(run_dir)
    events = Ledger(run_dir).read()
    assert all(started(run_dir, s) == 1 for s in STAGE_DIRS), events
    skipped = [e["stage"] for e in events if e["event"] == "stage_skipped"]
    assert sorted(skipped) == sorted([*STAGE_DIRS, "export"]), skipped  # run2: every stage; export: itself


def test_two_runs_started_together_on_a_new_run_dir(recipe, tmp_path):
    """Two `run --wait-lock` started at once on a run dir that does not exist yet: both end with
    exit 0, one after the other, and each stage ran once (the other run skipped it)."""
    run_dir = tmp_path / "run"
    procs = [(start(cli("run", str(recipe), "--wait-lock"), tmp_path / f"run{i}.log"), tmp_path / f"run{i}.log")
             for i in (1, 2)]
    try:
        for proc, log in procs:
            finish(proc, log)
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    assert_complete(run_dir)
    events = Ledger(run_dir).read()
    assert all(started(run_dir, s) == 1 for s in STAGE_DIRS), events
    assert sorted(e["stage"] for e in events if e["event"] == "stage_skipped") == sorted(STAGE_DIRS)


def check_readable(run_dir: Path) -> None:
    """What a reader finds in the run dir is whole: every JSON and YAML file parses, every complete
    JSONL line parses, every safetensors file loads, every listed shard matches its checksum, every
    PNG ends in IEND. Names starting with `.` are writers' temp files and folders, not for readers."""
    for p in sorted(run_dir.rglob("*")):
        rel = p.relative_to(run_dir)
        if any(part.startswith(".") for part in rel.parts) or not p.is_file():
            continue
        try:
            data = p.read_bytes()
        except FileNotFoundError:  # renamed or removed since the listing: gone whole, not half-written
            continue
        if p.suffix == ".json":
            json.loads(data)
        elif p.suffix in (".yaml", ".yml"):
            assert isinstance(yaml.safe_load(data), dict), rel
        elif p.suffix == ".jsonl":
            for line in data.split(b"\n")[:-1]:
                json.loads(line)
        elif p.suffix == ".safetensors":
            try:
                load_file(str(p))
            except FileNotFoundError:
                continue
        elif p.suffix == ".png":
            assert data.endswith(b"IEND\xaeB`\x82"), rel
    for d in STAGE_DIRS.values():
        m = load_manifest(run_dir / d)
        if m and m.get("shards"):
            verify_shards(run_dir / d, m)


def test_a_reader_never_sees_a_half_written_file(recipe, tmp_path):
    """`run` is stopped at seeded-random moments all through the pipeline; at each, every file a
    reader can find is whole and status renders, and a stage once done stays done."""
    run_dir = tmp_path / "run"
    log = tmp_path / "run1.log"
    rng = random.Random(0)
    first = start(cli("run", str(recipe)), log)
    seen_complete: set[str] = set()
    stops = 0
    try:
        wait_for(lambda: (run_dir / "ledger.jsonl").exists(), "the ledger", first)
        while first.poll() is None:
            pause(first)
            stops += 1
            check_readable(run_dir)
            states = {s["stage"]: s["state"] for s in collect(run_dir)["stages"]}
            assert seen_complete <= {s for s, st in states.items() if st == "done"}, (seen_complete, states)
            seen_complete |= {s for s, st in states.items() if st == "done"}
            resume(first)
            time.sleep(rng.uniform(0.0, 0.3))  # where the next stop lands, not what it must find
        finish(first, log)
    finally:
        end_for_good(first)
    check_readable(run_dir)
    assert_complete(run_dir)
    assert stops >= 5 and seen_complete, (stops, seen_complete)  # stops landed while stages were running and done
