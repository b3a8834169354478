"""`draftsmith doctor`: version ranges, disk and memory estimates, stale PIDs from the run's own ledger."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import yaml

from draftsmith import doctor
from draftsmith.rundir import Ledger, process_cmdline, process_start_time
from draftsmith.cli import main
from draftsmith.testing import make_model_dir


def test_version_ranges():
    assert doctor._within("2.11.0+cu128", "2.11", "2.13") and doctor._within("2.13.1", "2.11", "2.13")
    assert not doctor._within("2.10.2", "2.11", "2.13") and not doctor._within("2.14.0", "2.11", "2.13")
    assert doctor._within("5.17.0", "5.17", "5.17") and not doctor._within("5.18.0", "5.17", "5.17")
    names = {c["check"]: c for c in doctor.check_versions()}
    assert set(names) == {"python", "torch", "transformers"} and all(c["status"] in ("ok", "warn") for c in names.values())


def _recipe(tmp_path, **prepare):
    target = make_model_dir(tmp_path / "tiny", num_layers=2, hidden_size=32)
    run = tmp_path / "run"
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({"run_dir": str(run), "target": {"path": str(target), "device": "cpu", "dtype": "float32"},
                                    "prepare": prepare}))
    return path, run


def test_doctor_recipe_disk_and_memory(tmp_path, capsys):
    path, _ = _recipe(tmp_path, max_samples=1000, max_length=512)
    assert main(["doctor", str(path), "--json"]) == 0
    checks = {c["check"]: c for c in json.loads(capsys.readouterr().out)}
    # 512k tokens x (3 aux + final) x 32 hidden x 2 bytes (bfloat16) + 5 (ids and mask)
    assert checks["disk"]["need"] == 1000 * 512 * (4 * 32 * 2 + 5) and checks["disk"]["status"] == "ok"
    assert checks["memory"]["status"] == "ok" and checks["memory"]["need"] > 0
    assert checks["gpus"]["status"] == "info" or checks.get("gpu 0")
    # A capture that cannot fit on the disk fails the check (exit status 1).
    path, _ = _recipe(tmp_path / "big", max_samples=10**12, max_length=4096)
    assert main(["doctor", str(path)]) == 1
    assert "❌ disk" in capsys.readouterr().out


def _started(ledger: Ledger, run, stage: str, proc, **override) -> None:
    """A stage_started event as the pipeline writes it for `proc` (pid, start time, command line, run dir)."""
    ledger.append("stage_started", stage=stage, **{"pid": proc.pid, "pid_start": process_start_time(proc.pid),
                                                   "cmdline": process_cmdline(proc.pid), "run_dir": str(run.resolve()),
                                                   **override})


def _wait_exec(*procs) -> None:
    """Until each child has exec'd its command (its /proc cmdline is no longer the parent's)."""
    for p in procs:
        for _ in range(200):
            if "sleep" in (process_cmdline(p.pid) or ""):
                break
            time.sleep(0.01)


def test_stale_processes_only_from_the_ledger(tmp_path, capsys):
    path, run = _recipe(tmp_path)
    run.mkdir()
    # A draftsmith process whose stage finished but which lives on, one still running its stage,
    # an unrelated process whose PID was recorded without its identity, a process holding a PID
    # the ledger recorded for an earlier process (reused PID: same PID and command line, another
    # start time), one whose command line changed, and one recorded by another run directory:
    # only the first is stale, only it is killed.
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)", "draftsmith"]
    stale = subprocess.Popen([*sleeper, "train"])
    running = subprocess.Popen([*sleeper, "evaluate"])
    reused = subprocess.Popen([*sleeper, "capture"])
    changed = subprocess.Popen([*sleeper, "vocab"])
    elsewhere = subprocess.Popen([*sleeper, "prepare"])
    other = subprocess.Popen(["sleep", "60"])
    procs = (stale, running, reused, changed, elsewhere, other)
    _wait_exec(*procs)
    try:
        ledger = Ledger(run)
        _started(ledger, run, "train", stale)
        ledger.append("stage_finished", stage="train")
        ledger.append("stage_started", stage="export", pid=other.pid)  # no identity recorded: never matched
        _started(ledger, run, "capture", reused, pid_start=process_start_time(reused.pid) - 5)
        ledger.append("stage_finished", stage="capture")
        _started(ledger, run, "vocab", changed, cmdline="python -m draftsmith vocab other.yaml")
        ledger.append("stage_finished", stage="vocab")
        _started(ledger, run, "prepare", elsewhere, run_dir=str(tmp_path / "another_run"))
        ledger.append("stage_finished", stage="prepare")
        _started(ledger, run, "evaluate", running)
        listed = {p["pid"]: p for p in doctor.recorded_processes(run)}
        assert set(listed) == {stale.pid, running.pid}
        assert listed[stale.pid]["stale"] and not listed[running.pid]["stale"]

        assert main(["doctor", str(path)]) == 0
        out = capsys.readouterr().out
        assert f"pid {stale.pid} (train) outlived its stage" in out and f"pid {running.pid} is running evaluate" in out
        assert stale.poll() is None  # reporting kills nothing

        assert main(["doctor", str(path), "--kill-stale"]) == 0
        assert f"sent SIGTERM to stale pid {stale.pid}" in capsys.readouterr().out
        assert stale.wait(timeout=10) != 0
        time.sleep(0.1)
        assert all(p.poll() is None for p in (running, reused, changed, elsewhere, other))
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_pipeline_records_the_process_identity(tmp_path):
    """The ledger's stage_started carries what doctor matches: pid, start time, command line, run dir."""
    import os

    from pathlib import Path

    path, run = _recipe(tmp_path, source=str(Path(__file__).parent / "badinput" / "sources" / "good.json"), max_length=64)
    assert main(["prepare", str(path)]) == 0
    e = next(x for x in Ledger(run).read() if x["event"] == "stage_started")
    assert e["pid"] == os.getpid() and e["pid_start"] == process_start_time(os.getpid())
    assert e["cmdline"] == process_cmdline(os.getpid()) and e["run_dir"] == str(run.resolve())


def test_doctor_without_recipe(capsys):
    assert main(["doctor"]) == 0
    assert "torch" in capsys.readouterr().out
