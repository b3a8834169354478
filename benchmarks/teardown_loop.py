"""Two-rank gloo teardown, N times in a row, under torchrun on CPU: `--command init` runs a script
that sets the group up with distributed.group.init_distributed, all-reduces once and exits without tearing
it down (as a benchmark or test calling stages directly does: before distributed._destroy_at_exit,
5 of 20 such runs aborted here); `train` / `capture` run `draftsmith.cli STAGE --force` (FSDP2 for
train) on a tiny CPU run (a 4-layer model, 64 conversations, prepared, captured and its vocab built
once on one rank). Each run is checked for exit 0 and for
no abort at exit ("terminate called", "Aborted", SIGABRT, c10d's warnings that a process group was
not destroyed). The issue's goal: 20 runs in a row, none aborted.

    python benchmarks/teardown_loop.py --runs 20 --out benchmarks/results/teardown-cpu.json

JSON: {runs, failed, aborted, seconds, failures: [{run, rc, tail}]}.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from draftsmith.fileio import atomic_write_json# noqa: E402
from draftsmith.testing import make_model_dir  # noqa: E402

ABORT = re.compile(r"terminate called|Aborted|SIGABRT|Signal 6|has NOT been destroyed|destroy_process_group\(\) was not called")


def tiny_run(root: Path) -> Path:
    """A recipe for a 4-layer model on 64 short conversations, its prepare stage done."""
    target = make_model_dir(root / "target", num_layers=4, hidden_size=64)
    convs = [[{"from": "human", "value": f"Count from {i} to {i + 3}."},
              {"from": "gpt", "value": " ".join(str(j) for j in range(i, i + 4)) + ". Done!"}] for i in range(64)]
    (root / "convs.json").write_text(json.dumps([{"id": str(i), "conversations": c} for i, c in enumerate(convs)]))
    recipe = root / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "run_dir": str(root / "run"), "target": {"path": str(target), "device": "cpu", "dtype": "float32"},
        "prepare": {"source": str(root / "convs.json"), "max_length": 64, "samples_per_shard": 4},
        "capture": {"batch_tokens": 96, "storage_dtype": "bfloat16"}, "vocab": {"draft_vocab_size": 64},
        "train": {"ttt_steps": 2, "max_steps": 4, "batch_tokens": 256, "micro_batch_tokens": 128, "warmup_steps": 1,
                  "heldout_samples": 0, "save_every": 2, "device": "cpu", "dtype": "float32"}}))
    for stage in ("prepare", "capture", "vocab"):
        subprocess.run([sys.executable, "-m", "draftsmith.cli", stage, str(recipe)], check=True, capture_output=True)
    return recipe


INIT_SCRIPT = """import torch
from draftsmith.distributed.group import all_reduce_sum, init_distributed
info = init_distributed("cpu")
assert all_reduce_sum(torch.ones(4), info).tolist() == [2.0] * 4
"""


def one_run(recipe: Path, env: dict, command: str = "train") -> subprocess.CompletedProcess:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    if command == "init":
        script = recipe.parent / "init_exit.py"
        script.write_text(INIT_SCRIPT)
        return subprocess.run([*torchrun, str(script)], env=env, capture_output=True, text=True, timeout=300)
    cmd = [*torchrun, "-m", "draftsmith.cli", command, str(recipe), "--force"]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--command", default="init", choices=["init", "train", "capture"],
                    help="init: set up, all-reduce, exit; train/capture: the stage each run redoes (--force)")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    failures, t0 = [], time.time()
    with tempfile.TemporaryDirectory(dir=a.dir) as d:
        recipe = tiny_run(Path(d)) if a.command != "init" else Path(d) / "recipe.yaml"
        for i in range(a.runs):
            out = one_run(recipe, env, a.command)
            aborted = bool(ABORT.search(out.stderr))
            print(f"[teardown] run {i + 1}/{a.runs}: exit {out.returncode}" + (", ABORT at exit" if aborted else ""), flush=True)
            if out.returncode or aborted:
                failures.append({"run": i + 1, "rc": out.returncode, "aborted": aborted, "tail": out.stderr[-1500:]})
    result = {"command": a.command, "runs": a.runs, "failed": sum(1 for f in failures if f["rc"]), "aborted": sum(1 for f in failures if f["aborted"]),
              "seconds": round(time.time() - t0, 1), "failures": failures}
    print(f"[teardown] {a.runs} runs: {result['failed']} non-zero exits, {result['aborted']} with an abort message", flush=True)
    if a.out:
        atomic_write_json(a.out, result)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
