"""`draftsmith doctor`: version ranges, disk and memory estimates, stale PIDs from the run's own ledger."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import yaml

from draftsmith import doctor
from draftsmith.artifacts import Ledger
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


def test_stale_processes_only_from_the_ledger(tmp_path, capsys):
    path, run = _recipe(tmp_path)
    run.mkdir()
    # A draftsmith process whose stage finished but which lives on, one still running its stage,
    # and an unrelated process whose PID was recorded: only the first is stale, only it is killed.
    stale = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "draftsmith", "train"])
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "draftsmith", "evaluate"])
    other = subprocess.Popen(["sleep", "60"])
    try:
        ledger = Ledger(run)
        ledger.append("stage_started", stage="train", pid=stale.pid)
        ledger.append("stage_finished", stage="train")
        ledger.append("stage_started", stage="export", pid=other.pid)
        ledger.append("stage_started", stage="evaluate", pid=running.pid)
        procs = {p["pid"]: p for p in doctor.recorded_processes(run)}
        assert set(procs) == {stale.pid, running.pid}
        assert procs[stale.pid]["stale"] and not procs[running.pid]["stale"]

        assert main(["doctor", str(path)]) == 0
        out = capsys.readouterr().out
        assert f"pid {stale.pid} (train) outlived its stage" in out and f"pid {running.pid} is running evaluate" in out
        assert stale.poll() is None  # reporting kills nothing

        assert main(["doctor", str(path), "--kill-stale"]) == 0
        assert f"sent SIGTERM to stale pid {stale.pid}" in capsys.readouterr().out
        assert stale.wait(timeout=10) != 0
        time.sleep(0.1)
        assert running.poll() is None and other.poll() is None
    finally:
        for p in (stale, running, other):
            p.kill()
            p.wait()


def test_doctor_without_recipe(capsys):
    assert main(["doctor"]) == 0
    assert "torch" in capsys.readouterr().out
