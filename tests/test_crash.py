"""kill -9 at random moments during prepare, capture and train; rerun; nothing lost, duplicated or corrupt.

Each stage runs as `python -m draftsmith.cli STAGE recipe.yaml` and is killed a seeded-random
delay after the ledger says the stage started, N_KILLS times (20; 3 under CI_SHORT=1). After every
kill the stage folder must hold only complete, listed, checksummed shards identical to an
uninterrupted run's; after the final rerun the whole output must equal that run's (capture byte
for byte, train step for step: same losses and batch sizes from the last checkpoint on).
When a rerun finishes before the kill lands, its output is checked and the stage folder removed,
so kills keep landing all through the stage.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest
import yaml

from draftsmith.manifests import load_manifest, verify_shards, write_manifest
from draftsmith.rundir import Ledger
from draftsmith.cli import main
from draftsmith.data.shards import read_shard
from draftsmith.testing import make_model_dir

N_KILLS = 3 if os.environ.get("CI_SHORT") else 20
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
STAGE_DIRS = {"prepare": "data", "capture": "capture", "train": "train"}
pytestmark = pytest.mark.slow


# ----------------------------------------------------------------------------- reusable helper


def kill_during(cmd: list[str], run_dir: Path, stage: str, delay_s: float, log_path: Path,
                ready: Callable[[], bool] = lambda: True, timeout_s: float = 300) -> tuple[bool, float]:
    """Run cmd; `delay_s` after the ledger of run_dir records a new start of `stage` and `ready()`
    holds (e.g. the stage has set up its folder: imports and model loads are over), kill -9 its
    whole process group. Returns (killed, seconds from that moment to the kill or exit); a command
    that finishes first must have succeeded. stderr goes to log_path."""
    ledger = Ledger(run_dir)
    started_before = sum(e["event"] == "stage_started" and e["stage"] == stage for e in ledger.read())
    with open(log_path, "wb") as err:
        proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
        t0 = time.time()
        try:
            while time.time() - t0 < timeout_s:
                if proc.poll() is not None:
                    assert proc.returncode == 0, log_path.read_text()[-3000:]
                    return False, 0.0
                if sum(e["event"] == "stage_started" and e["stage"] == stage for e in ledger.read()) > started_before \
                        and ready():
                    t_stage = time.time()
                    while time.time() < t_stage + delay_s and proc.poll() is None:
                        time.sleep(0.005)
                    if proc.poll() is not None:
                        assert proc.returncode == 0, log_path.read_text()[-3000:]
                        return False, time.time() - t_stage
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    return True, time.time() - t_stage
                time.sleep(0.02)
            raise AssertionError(f"{stage} did not start within {timeout_s} s: {log_path.read_text()[-2000:]}")
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


# ----------------------------------------------------------------------------- fixtures


def write_recipe(tmp: Path, target: Path, source: Path, run_dir: Path) -> Path:
    recipe = {
        "name": "crash", "run_dir": str(run_dir), "seed": 0,
        "target": {"path": str(target), "device": "cpu", "dtype": "float32"},
        "prepare": {"source": str(source), "max_length": 96, "samples_per_shard": 8},
        "capture": {"batch_tokens": 512, "storage_dtype": "bfloat16"},
        "vocab": {"draft_vocab_size": 128},
        "train": {"ttt_steps": 2, "max_steps": 40, "batch_tokens": 192, "lr": 3e-3, "warmup_steps": 2,
                  "save_every": 3, "log_every": 5, "device": "cpu", "dtype": "float32"},
    }
    path = tmp / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """A target, a conversation file and an uninterrupted run of prepare, capture, vocab, train."""
    tmp = tmp_path_factory.mktemp("crash")
    target = make_model_dir(tmp / "target", num_layers=4, hidden_size=64)
    convs = [{"id": str(i), "conversations": [
        {"from": "human", "value": f"Count from {i} to {i + 3 + i % 9}, please."},
        {"from": "gpt", "value": " ".join(str(j) for j in range(i, i + 4 + i % 9)) + ". Done!"}]} for i in range(400)]
    source = tmp / "convs.json"
    source.write_text(json.dumps(convs))
    run_dir = tmp / "ref"
    recipe = write_recipe(tmp, target, source, run_dir)
    for stage in ("prepare", "capture", "vocab", "train"):
        assert main([stage, str(recipe)]) == 0
    seconds = {e["stage"]: e["seconds"] for e in Ledger(run_dir).read() if e["event"] == "stage_finished"}
    return {"tmp": tmp, "target": target, "source": source, "run": run_dir, "seconds": seconds}


# ----------------------------------------------------------------------------- invariants


def shard_bytes(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.glob("shard-*.safetensors"))}


def check_shards(stage_dir: Path, ref_dir: Path, complete: bool) -> None:
    """Listed shards: present, checksummed, unique, disjoint samples, identical to the reference's."""
    m = load_manifest(stage_dir)  # raises on a torn or foreign manifest
    if m is None:
        assert not complete
        return
    assert m["status"] in ("running", "complete")
    paths = verify_shards(stage_dir, m)  # each exists and matches its sha256
    names = [p.name for p in paths]
    assert len(names) == len(set(names)), f"duplicated shard in {names}"
    ref = shard_bytes(ref_dir)
    seen: set[int] = set()
    for p in paths:
        assert p.read_bytes() == ref[p.name], f"{p.name} differs from the uninterrupted run"
        idx = {s.sample_index for s in read_shard(p, with_hidden=False)}
        assert not idx & seen, f"{p.name}: samples {sorted(idx & seen)[:5]} also in an earlier shard"
        seen |= idx
    if complete:
        assert m["status"] == "complete"
        assert shard_bytes(stage_dir) == ref, "final shards differ from the uninterrupted run"
        ref_m = load_manifest(ref_dir)
        assert m["counts"] == ref_m["counts"]
        assert [s["sha256"] for s in m["shards"]] == [s["sha256"] for s in ref_m["shards"]]
        assert not [p.name for p in stage_dir.glob(".*tmp-*")], "temp files left behind"


def metrics(run_dir: Path) -> list[tuple]:
    path = run_dir / "train" / "metrics.jsonl"
    recs = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            recs.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line torn by the kill; the rerun drops it
    return [(r["step"], r["loss"], r["tokens"]) for r in recs]


def check_train(run_dir: Path, ref_run: Path, complete: bool, log_text: str, latest_before: str | None) -> None:
    got, ref = metrics(run_dir), metrics(ref_run)
    assert [s for s, *_ in got] == list(range(1, len(got) + 1)), "steps lost or duplicated in metrics.jsonl"
    assert got == ref[:len(got)], "a step's loss or batch differs from the uninterrupted run"
    if latest_before and "resuming from" in log_text:
        assert f"resuming from {latest_before}" in log_text, "did not resume from the last checkpoint"
    latest = run_dir / "train" / "latest"
    if latest.exists():
        assert (run_dir / "train" / latest.read_text().strip() / "meta.json").exists()
    if complete:
        assert got == ref and load_manifest(run_dir / "train")["status"] == "complete"
        assert not [p.name for p in (run_dir / "train").glob(".*tmp-*")], "temp files left behind"


# ----------------------------------------------------------------------------- the test


def set_up(stage: str, out: Path, log_path: Path) -> Callable[[], bool]:
    """True once this run of the stage is past its imports and model loads: it (re)wrote its
    manifest or logged that it resumes."""
    t0 = time.time()
    manifest = out / "manifest.json"

    def ready() -> bool:
        return (manifest.exists() and manifest.stat().st_mtime >= t0) or b"resuming" in log_path.read_bytes()
    return ready



@pytest.mark.parametrize("stage", ["prepare", "capture", "train"])
def test_kill9_at_random_moments(stage, reference, tmp_path):
    ref_run: Path = reference["run"]
    run_dir = tmp_path / "run"
    recipe = write_recipe(tmp_path, reference["target"], reference["source"], run_dir)
    upstream = {"prepare": (), "capture": ("data",), "train": ("data", "capture", "vocab")}[stage]
    for d in upstream:
        shutil.copytree(ref_run / d, run_dir / d)
    out = run_dir / STAGE_DIRS[stage]
    cmd = [sys.executable, "-m", "draftsmith.cli", stage, str(recipe)]
    rng = random.Random(f"{stage}-9")
    # One uninterrupted run measures how long the stage takes in a fresh process (imports included);
    # kill delays are drawn uniformly over that span.
    killed, span = kill_during(cmd, run_dir, stage, float("inf"), tmp_path / "stderr-calibrate.txt",
                               set_up(stage, out, tmp_path / "stderr-calibrate.txt"))
    assert not killed
    check_train(run_dir, ref_run, True, "", None) if stage == "train" else check_shards(out, ref_run / STAGE_DIRS[stage], True)
    shutil.rmtree(out)
    kills = runs = mid = 0
    while kills < N_KILLS:
        latest = (out / "latest").read_text().strip() if (out / "latest").exists() else None
        log_path = tmp_path / f"stderr-{runs}.txt"
        killed, _ = kill_during(cmd, run_dir, stage, rng.uniform(0, span), log_path, set_up(stage, out, log_path))
        runs += 1
        if stage == "train":
            check_train(run_dir, ref_run, not killed, log_path.read_text(), latest)
        else:
            check_shards(out, ref_run / STAGE_DIRS[stage], complete=not killed)
        if killed:
            kills += 1
            mid += bool(metrics(run_dir)) if stage == "train" else bool((load_manifest(out) or {}).get("shards"))
        else:  # finished before the kill: start the stage over so the next kills land in it again
            shutil.rmtree(out)
        assert runs < 4 * N_KILLS + 10, "kills keep missing the stage"
    print(f"{stage}: {kills} kills ({mid} after some output was listed) in {runs} runs; stage takes {span:.1f} s")
    if N_KILLS >= 20:
        assert mid >= N_KILLS // 4, "too few kills landed mid-stage to mean anything"
    assert main([stage, str(recipe)]) == 0  # the final rerun, in-process
    if stage == "train":
        check_train(run_dir, ref_run, True, "", None)
    else:
        check_shards(out, ref_run / STAGE_DIRS[stage], complete=True)


def test_rerun_removes_files_half_written_by_a_killed_train(reference, tmp_path):
    """A kill -9 inside an atomic write leaves its temp file; the rerun of the stage removes it
    (the random-kill test above hits this window only now and then)."""
    run_dir = tmp_path / "run"
    shutil.copytree(reference["run"], run_dir)
    recipe = write_recipe(tmp_path, reference["target"], reference["source"], run_dir)
    m = load_manifest(run_dir / "train")
    m["status"] = "running"  # as if killed before the end
    write_manifest(run_dir / "train", m)
    stale = [run_dir / "train" / ".manifest.json.tmp-999999", run_dir / "train" / ".metrics.jsonl.tmp-999998"]
    for p in stale:
        p.write_text("{half")
    assert main(["train", str(recipe)]) == 0
    assert load_manifest(run_dir / "train")["status"] == "complete"
    assert not [p for p in stale if p.exists()]
