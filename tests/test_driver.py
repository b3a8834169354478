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


def test_more_files_than_a_device_call_returns_come_back_as_one_archive(tmp_path):
    """A device call returns at most 8 files of $OUT: with more, the driver packs them all into
    bundle.tar.gz, every file inside, and leaves nothing else (a loose file could be the one dropped)."""
    import tarfile

    steps = "engine engine2 verifyattn consistency fasttests residenttests write train kimi"
    rc, lines = drive(tmp_path, steps)  # each fails at once (no scripts here), leaving its log: 9 logs + gpu.txt
    assert rc == 0
    assert lines[-1] == f"h200.sh: {tmp_path / 'out'} packed into bundle.tar.gz (more than the 8 files a device call returns)"
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["bundle.tar.gz"]
    with tarfile.open(tmp_path / "out" / "bundle.tar.gz") as tar:
        names = sorted(n.removeprefix("./") for n in tar.getnames() if n != ".")
    assert names == sorted(["gpu.txt"] + [f"{s}.log" for s in steps.split()])
    few = tmp_path / "few"
    few.mkdir()
    rc, _ = drive(few, "write")
    assert rc == 0 and sorted(p.name for p in (few / "out").iterdir()) == ["gpu.txt", "write.log"]  # left loose
