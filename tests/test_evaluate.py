"""The evaluate stage end to end on a fake run directory: files, metrics, resume, lossless check."""
from __future__ import annotations

import json

import pytest
import torch

from draftsmith import evaluate, pipeline
from draftsmith.artifacts import DraftsmithError, Ledger, load_manifest, new_manifest, finish_manifest, read_json
from draftsmith.config import DraftConfig, EvaluateConfig, Recipe, TargetConfig
from draftsmith.draft.build import drafter_config, init_drafter
from draftsmith.draft.model import save_drafter
from draftsmith.target.model import load_target
from draftsmith.testing import make_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("target"), num_layers=4)


@pytest.fixture
def recipe(model_dir, tmp_path):
    """A run dir whose train stage is complete with a random drafter, and a 3-prompt JSONL."""
    run_dir = tmp_path / "run"
    target = load_target(model_dir, device="cpu", dtype="float32")
    V = target.vocab_size
    cfg = drafter_config(target.config, DraftConfig(), V, target.aux_layer_ids)
    drafter = init_drafter(cfg, target.input_embeddings(), torch.zeros(V, dtype=torch.long),
                           torch.ones(V, dtype=torch.bool), seed=0, std=0.2)
    save_drafter(drafter, run_dir / "train" / "drafter")
    finish_manifest(run_dir / "train", new_manifest("train", "train-fp", {}, {}))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "prompt": text}) + "\n" for i, text in
                               enumerate(["Write a short poem about the sea.", "What is the capital of France?",
                                          "def add(a, b):"])))
    return Recipe(run_dir=str(run_dir), target=TargetConfig(path=str(model_dir), device="cpu", dtype="float32"),
                  evaluate=EvaluateConfig(benchmarks=[str(prompts)], max_new_tokens=12, draft_steps=3))


def test_evaluate_stage(recipe, capsys):
    m = pipeline.run_stage("evaluate", recipe)
    out = recipe.run_dir + "/eval"
    assert m["status"] == "complete" and load_manifest(out)["status"] == "complete"
    met = m["metrics"]
    assert met["num_prompts"] == 3 and len(met["accept_rate_per_position"]) == 3
    assert 1.0 <= met["tau"] <= 4.0 and met["speedup"] > 0 and met["tokens_per_s_plain"] > 0
    assert list(met["tau_per_benchmark"].values()) == [met["tau"]]
    res = read_json(out + "/results.json")
    assert [p["id"] for p in res["prompts"]] == ["q0", "q1", "q2"]
    assert all(p["lossless"] for p in res["prompts"])
    s = res["summary"]
    drafting_rounds = sum(d > 0 for p in res["prompts"] for d in p["drafted_per_round"])
    assert sum(s["accepted_length_histogram"]) == drafting_rounds
    assert list(s["per_benchmark"]) == ["prompts"]
    report = open(out + "/report.md").read()
    assert "| position | drafted | reached | accepted |" in report and "| all |" in report
    assert open(out + "/acceptance.png", "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert "speedup" in capsys.readouterr().out
    assert Ledger(recipe.run_dir).read()[-1]["event"] == "stage_finished"


def test_evaluate_resumes_after_finished_prompts(recipe, monkeypatch):
    pipeline.run_stage("evaluate", recipe)
    eval_dir = f"{recipe.run_dir}/eval"
    m = read_json(eval_dir + "/manifest.json")
    m["status"] = "running"  # as if killed after the last prompt was appended
    json.dump(m, open(eval_dir + "/manifest.json", "w"))
    lines = open(eval_dir + "/partial.jsonl").read().splitlines()
    open(eval_dir + "/partial.jsonl", "w").write("\n".join(lines[:2]) + "\n" + lines[2][:20])  # torn last line
    calls = []
    real = evaluate.evaluate_prompt
    monkeypatch.setattr(evaluate, "evaluate_prompt", lambda *a, **kw: calls.append(a[-1]) or real(*a, **kw))
    m2 = pipeline.run_stage("evaluate", recipe)
    assert m2["status"] == "complete" and m2["metrics"]["num_prompts"] == 3
    assert len(calls) == 1 and "prompt q2" in calls[0]


def test_evaluate_lossless_mismatch_names_prompt(recipe, monkeypatch):
    real = evaluate.speculative_generate

    def broken(target, drafter, ids, n, k, eos):
        tokens, st = real(target, drafter, ids, n, k, eos)
        if len(ids) > 1 and n > 8:  # leave the warm-up alone
            tokens[5] = (tokens[5] + 1) % target.vocab_size
        return tokens, st

    monkeypatch.setattr(evaluate, "speculative_generate", broken)
    with pytest.raises(DraftsmithError, match=r"prompt q0: speculative output differs .* at new token 5"):
        pipeline.run_stage("evaluate", recipe)
    assert Ledger(recipe.run_dir).read()[-1]["event"] == "stage_failed"
