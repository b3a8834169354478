"""`draftsmith status` and `plan --run_dir` on a real tiny run: every section, figures from the manifests."""
from __future__ import annotations

import json

import yaml

from draftsmith import status
from draftsmith.manifests import load_manifest
from draftsmith.cli import main
from draftsmith.testing import make_model_dir

CONVERSATIONS = [[{"from": "human", "value": f"Count from {i} to {i + 5}."},
                  {"from": "gpt", "value": " ".join(str(j) for j in range(i, i + 6)) + ". Done!"}] for i in range(24)]


def test_status_of_a_real_run(tmp_path, capsys):
    target = make_model_dir(tmp_path / "tiny", num_layers=4, hidden_size=64)
    data, prompts = tmp_path / "convs.json", tmp_path / "prompts.jsonl"
    data.write_text(json.dumps([{"id": str(i), "conversations": c} for i, c in enumerate(CONVERSATIONS)]))
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["Count from 3 to 8.", "Count from 1 to 6."]))
    run = tmp_path / "run"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "name": "tiny", "goal": "Measure tau on a tiny model.", "run_dir": str(run),
        "target": {"path": str(target), "device": "cpu", "dtype": "float32"},
        "prepare": {"source": str(data), "max_length": 64},
        "capture": {"storage_dtype": "float32"}, "vocab": {"draft_vocab_size": 64},
        "train": {"ttt_steps": 2, "max_steps": 4, "batch_tokens": 256, "warmup_steps": 1, "device": "cpu", "dtype": "float32"},
        "evaluate": {"benchmarks": [str(prompts)], "max_new_tokens": 12, "draft_steps": 2},
    }))
    assert main(["prepare", str(recipe)]) == 0
    st = status.collect(run)
    assert st["next_step"]["stage"] == "capture" and "draftsmith capture" in st["next_step"]["text"]

    assert main(["run", str(recipe)]) == 0
    capsys.readouterr()
    assert main(["plan", "--run_dir", str(run), "--hardware", "h200", "--batch_sizes", "[1, 4]"]) == 0
    assert "accept from" in capsys.readouterr().out and (run / "plan.json").exists()

    md = status.render(run)
    titles = [line[3:] for line in md.splitlines() if line.startswith("## ")]
    st = json.loads(status.render(run, as_json=True))
    assert titles == ["Goal", "Instructions", "Discoveries", "Accomplished", "Relevant files"] + \
        ["Findings"] * bool(st["findings"]) + ["Immediate next step", "Sources"]
    ev = load_manifest(run / "eval")["metrics"]
    facts = {f["label"]: f for f in st["discoveries"]}
    assert facts["τ (tokens per target verification)"]["value"] == ev["tau"]
    assert facts["measured speedup"]["value"] == ev["speedup"]
    assert facts["decoding path of every speedup (plain and speculative alike)"]["value"] == "off"  # CPU: eager
    assert facts["plain decoding, fraction of the memory-bandwidth limit"]["value"] == ev["plain_decode_bw_fraction"] > 0
    assert facts["decoder layers"]["value"] == 4 and facts["MTP layers"]["value"] == 0
    assert facts["aux layers captured"]["value"] == load_manifest(run / "capture")["aux_layer_ids"]
    assert "predicted speedup (batch 1, k=2)" in facts or "planner prediction" in facts
    assert all(s["state"] == "done" for s in st["stages"])
    # a random tiny drafter: whatever the figures say, the next step follows from them
    assert ("every stage is complete, but" if st["findings"] else "--speculative-algorithm EAGLE3") in st["next_step"]["text"]
    assert "plan.json" in st["relevant_files"] and "eval/report.md" in st["relevant_files"]
    assert "✅ done" in md and "Measure tau on a tiny model. [1]" in md
