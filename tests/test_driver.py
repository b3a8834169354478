"""benchmarks/h200.sh in a checkout without its gitignored inputs (.whl, build/gpu): one line naming
the fix, exit 2, and no step run (a device call is minutes of a fixed budget)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

DRIVER = Path(__file__).parent.parent / "benchmarks" / "h200.sh"
FIX = "run bash benchmarks/gpu_inputs.sh here, then carry .whl and build/gpu"


def drive(tmp_path: Path, steps: str, python: str = sys.executable) -> tuple[int, list[str]]:
    """Run the driver from an empty checkout folder with `python` as python3: (exit code, its h200.sh lines)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "python3").write_text(f'#!/bin/sh\nexec {python} "$@"\n')
    (bin_dir / "python3").chmod(0o755)
    shutil.copy(DRIVER, tmp_path / "h200.sh")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "STEPS": steps, "OUT": str(tmp_path / "out")}
    r = subprocess.run(["bash", "h200.sh"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    return r.returncode, [line for line in r.stdout.splitlines() if line.startswith(("h200.sh:", "["))]


def test_a_step_that_needs_build_gpu_stops_the_call_before_any_step(tmp_path):
    rc, lines = drive(tmp_path, "write reference")
    assert rc == 2
    assert lines == [f"h200.sh: step reference needs build/gpu, which is missing: {FIX}"]
    assert not (tmp_path / "out" / "write.log").exists()  # `write` needs nothing, yet did not run


def test_steps_that_need_no_data_run_without_build_gpu(tmp_path):
    rc, lines = drive(tmp_path, "write")
    assert rc == 0 and lines[0].startswith("[write] rc=")  # the step ran (and failed: no bench_write.py here)
    assert (tmp_path / "out" / "write.log").exists()


def test_no_jsonargparse_and_no_whl_stops_the_call(tmp_path):
    rc, lines = drive(tmp_path, "engine", python=f"{sys.executable} -S")  # -S: no site-packages
    assert rc == 2
    assert lines == [f"h200.sh: jsonargparse is not importable and .whl/site is missing: {FIX}"]
