"""`draftsmith status` on fake run directories: every stage state, figures, next step, JSON, STATUS.md."""
from __future__ import annotations

import json
import os
import subprocess

import yaml

from draftsmith import status
from draftsmith.artifacts import Ledger, finish_manifest, new_manifest, stage_dir, to_jsonable, write_manifest
from draftsmith.cli import main
from draftsmith.config import Recipe


def make_run(tmp_path, done=("prepare", "capture", "vocab")):
    run = tmp_path / "run"
    run.mkdir()
    recipe = Recipe(name="tiny", goal="Check that status reads a run.", run_dir=str(run))
    (run / "recipe.yaml").write_text(yaml.safe_dump(to_jsonable(recipe), sort_keys=False))
    ledger = Ledger(run)
    extras = {
        "prepare": dict(counts={"read": 1200, "kept": 1000, "skipped_no_loss_tokens": 150, "skipped_bad_role": 50,
                                "truncated": 7, "tokens": 1_234_567, "loss_tokens": 600_000}),
        "capture": dict(counts={"tokens": 1_234_567}, bytes_per_token=1536, storage_dtype="bfloat16", aux_layer_ids=[1, 1, 0]),
        "vocab": dict(metrics={"coverage": 0.9712, "draft_vocab_size": 32000}),
        "train": dict(counts={"steps": 500}, metrics={"loss": 1.234, "acc_per_position": [0.71, 0.6, 0.52],
                                                      "tau_simulated": 2.81, "tokens_per_s": 15234.5}),
        "evaluate": dict(metrics={"tau": 3.21, "speedup": 2.05, "tokens_per_s_spec": 81.5, "tokens_per_s_plain": 39.8,
                                  "num_prompts": 80}),
        "export": dict(formats={"sglang": {"dir": "sglang", "files": []}}),
    }
    for stage in done:
        ledger.append("stage_started", stage=stage, fingerprint="fp", resumed=False, pid=os.getpid())
        m = new_manifest(stage, "fp", {}, {})
        for k, v in extras[stage].items():
            m[k] = {**m[k], **v} if isinstance(v, dict) and k in ("counts", "metrics") else v
        stage_dir(run, stage).mkdir(parents=True, exist_ok=True)
        finish_manifest(stage_dir(run, stage), m)
        ledger.append("stage_finished", stage=stage, fingerprint="fp", seconds=1.0)
    return run, ledger


def start(run, ledger, stage, pid):
    ledger.append("stage_started", stage=stage, fingerprint="fp2", resumed=False, pid=pid)
    stage_dir(run, stage).mkdir(parents=True, exist_ok=True)
    write_manifest(stage_dir(run, stage), new_manifest(stage, "fp2", {}, {}))


def states(st):
    return {s["stage"]: s["state"] for s in st["stages"]}


def test_failed_stage_and_next_step(tmp_path):
    run, ledger = make_run(tmp_path)
    start(run, ledger, "train", os.getpid())
    ledger.append("stage_failed", stage="train", error="capture/shard-00003.safetensors: checksum mismatch; rerun capture",
                  seconds=12.5)
    st = status.collect(run)
    assert states(st) == {"prepare": "done", "capture": "done", "vocab": "done", "train": "failed",
                          "evaluate": "pending", "export": "pending"}
    assert st["next_step"]["stage"] == "train" and "checksum mismatch" in st["next_step"]["text"]
    md = status.render(run)
    assert (run / "STATUS.md").read_text() == md
    assert "## Goal" in md and "Check that status reads a run." in md and "## Next step" in md
    assert "✅ done" in md and "❌ failed" in md and "⏳ pending" in md
    assert "kept 1,000" in md and "skipped 200" in md and "bytes per token 1,536" in md and "coverage 97.1%" in md
    assert f"draftsmith train {run}/recipe.yaml" in md


def test_running_and_interrupted(tmp_path):
    run, ledger = make_run(tmp_path)
    start(run, ledger, "train", os.getpid())
    assert states(status.collect(run))["train"] == "running"
    assert "🔄 train" in status.render(run, brief=True)

    dead = subprocess.Popen(["true"])
    dead.wait()
    start(run, ledger, "train", dead.pid)
    st = status.collect(run)
    assert states(st)["train"] == "interrupted" and "resumes it" in st["next_step"]["text"]

    start(run, ledger, "train", os.getpid())
    ledger.append("stage_interrupted", stage="train", seconds=3.0)
    assert states(status.collect(run))["train"] == "interrupted"


def test_all_done_json_and_brief(tmp_path, capsys):
    run, _ = make_run(tmp_path, done=("prepare", "capture", "vocab", "train", "evaluate", "export"))
    data = json.loads(status.render(run, as_json=True))
    assert set(states(data).values()) == {"done"}
    ev = next(s for s in data["stages"] if s["stage"] == "evaluate")
    assert ev["dir"] == "eval" and ev["figures"]["tau"] == 3.21 and ev["figures"]["speedup"] == 2.05
    tr = next(s for s in data["stages"] if s["stage"] == "train")
    assert tr["figures"]["tau_simulated"] == 2.81 and tr["figures"]["acc_per_position"] == [0.71, 0.6, 0.52]
    assert "--speculative-algorithm EAGLE3" in data["next_step"]["command"]
    assert "export/sglang" in data["next_step"]["command"]

    (run / "STATUS.md").unlink()
    brief = status.render(run, brief=True)
    assert not (run / "STATUS.md").exists()
    assert len(brief.splitlines()) == 7 and "tau 3.21" in brief and "speedup 2.05" in brief

    assert main(["status", str(run)]) == 0
    assert "# Status: tiny" in capsys.readouterr().out
    assert main(["status", str(tmp_path / "nope")]) == 2
