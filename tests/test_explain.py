"""benchmarks/explain_turns.py on a finished evaluate stage (CPU, float32): every chain round the engine
decoded equals the drafter's teacher-forced prediction, no tree round falls below it, and the
teacher-forced chain tau is the engine's; a round that differs is named by turn and round, exit 1."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from draftsmith import pipeline
from draftsmith.fileio import atomic_write_json, read_json
from draftsmith.manifests import finish_manifest, new_manifest
from draftsmith.config import EvaluateConfig, Recipe, TargetConfig
from draftsmith.draft.io import save_drafter
from draftsmith.target.model import load_target
from draftsmith.testing import make_model_dir

from test_engine import fit_head, make_drafter

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import explain_turns  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A run evaluated with the chain and the tree, its drafter's head fitted to the very answers it is
    evaluated on (rounds accept 0..k drafts: a random head accepts none, and 0 == 0 proves nothing)."""
    tmp = tmp_path_factory.mktemp("explain")
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in [
        {"id": "a", "prompt": "Write a short poem about the sea."}, {"id": "b", "prompt": "What is the capital of France?"},
        {"id": "mt", "turns": ["Hello!", "Write it again."]}]))
    target_dir = make_model_dir(tmp / "target", num_layers=4)
    recipe = Recipe(run_dir=str(tmp / "run"), target=TargetConfig(path=str(target_dir), device="cpu", dtype="float32"),
                    evaluate=EvaluateConfig(benchmarks=[str(prompts)], max_new_tokens=32, draft_steps=3, tree_depth=3,
                                            tree_topk=2, tree_budget=5, batch_sizes=[1], methods=["eagle3_chain", "eagle3_tree"],
                                            step_costs=False, check_lossless=True))
    run = Path(recipe.run_dir)
    torch.manual_seed(0)
    target = load_target(target_dir, device="cpu", dtype="float32")
    drafter = make_drafter(target, seed=3)
    save_drafter(drafter, run / "train" / "drafter")
    finish_manifest(run / "train", new_manifest("train", "train-fp", {}, {}))
    pipeline.run_stage("evaluate", recipe)  # the target's plain answers, which the head is then fitted to
    records = read_json(run / "eval" / "results.json")["prompts"]
    fit_head(target, drafter, [rec["prompt_ids"] + rec["plain_tokens"] for rec in records], k=3)
    save_drafter(drafter, run / "train" / "drafter")
    pipeline.run_stage("evaluate", recipe, force=True)
    return run


def test_every_round_matches_teacher_forcing(run_dir, capsys):
    res = explain_turns.explain_run(run_dir)
    assert [t["key"].split("#")[1] for t in res["turns"]] == ["0", "1", "2", "2/turn2"]
    chain, tree = res["total"]["eagle3_chain"], res["total"]["eagle3_tree"]
    assert chain["bad_rounds"] == 0 and tree["bad_rounds"] == 0 and chain["rounds"] > 8
    assert res["total"]["teacher_forced_chain_tau"] == pytest.approx(chain["tau"])
    assert 1.3 < chain["tau"] <= tree["tau"]  # the fitted head accepts: the equality is not 0 == 0
    for t in res["turns"]:
        assert t["tau_teacher_forced"] == pytest.approx(t["eagle3_chain"]["tau"]), t
    assert explain_turns.main([str(run_dir), "--worst", "2"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 4  # header, two turns, the totals


def test_a_round_the_engine_lost_is_named(run_dir, tmp_path):
    """A copy of the results whose chain accepted one draft fewer in one round than the drafter predicts."""
    res_path = run_dir / "eval" / "results.json"
    saved = res_path.read_bytes()
    res = read_json(res_path)
    rec = next(p for p in res["prompts"] if any(a > 0 for a in p["methods"]["eagle3_chain"]["accepted_per_round"]))
    acc = rec["methods"]["eagle3_chain"]["accepted_per_round"]
    j = next(i for i, a in enumerate(acc) if a > 0)
    acc[j] -= 1  # (its later roots shift by one too; the round itself must be the first named)
    atomic_write_json(res_path, res)
    try:
        out = explain_turns.explain_run(run_dir, keys=[rec["key"]])
        [t] = out["turns"]
        assert t["eagle3_chain"]["check"] == "equal" and t["eagle3_chain"]["bad_rounds"] >= 1
        assert t["eagle3_chain"]["first_bad_round"] == j
        assert explain_turns.main([str(run_dir), "--out", str(tmp_path / "e.json")]) == 1
        assert read_json(tmp_path / "e.json")["total"]["eagle3_chain"]["bad_rounds"] >= 1
    finally:
        res_path.write_bytes(saved)


def test_rounds_past_a_divergence_are_not_checked(run_dir):
    """A chain whose answer left plain decoding's (a bf16 near-tie; evaluate records first_difference):
    the rounds that emitted the plain answer's tokens are checked, those from the divergence on decode
    other tokens than the teacher-forced sequence and are not; a changed round before it is still named."""
    res_path = run_dir / "eval" / "results.json"
    saved = res_path.read_bytes()
    res = read_json(res_path)
    rec = max(res["prompts"], key=lambda p: len(p["methods"]["eagle3_chain"]["accepted_per_round"]))
    chain = rec["methods"]["eagle3_chain"]
    acc, j0 = chain["accepted_per_round"], len(chain["accepted_per_round"]) // 2
    chain["first_difference"] = sum(a + 1 for a in acc[:j0]) + 1  # the first token round j0 emits
    acc[j0:] = [0 if a else 1 for a in acc[j0:]]  # every later round unlike its prediction
    atomic_write_json(res_path, res)
    try:
        [t] = explain_turns.explain_run(run_dir, keys=[rec["key"]])["turns"]
        c = t["eagle3_chain"]
        assert (c["diverged_at"], c["checked_rounds"], c["bad_rounds"]) == (chain["first_difference"], j0, 0)
        assert t["eagle3_tree"]["diverged_at"] is None and t["eagle3_tree"]["checked_rounds"] == t["eagle3_tree"]["rounds"]
        j1 = next(j for j in reversed(range(j0)) if acc[j] > 0)
        acc[j1] -= 1  # a round before the divergence that accepted one draft fewer is a bad round
        atomic_write_json(res_path, res)
        [t] = explain_turns.explain_run(run_dir, keys=[rec["key"]])["turns"]
        assert t["eagle3_chain"]["first_bad_round"] == j1
    finally:
        res_path.write_bytes(saved)


def test_an_unknown_key_is_one_line(run_dir, capsys):
    assert explain_turns.main([str(run_dir), "--keys", "mtbench#99"]) == 2
    err = capsys.readouterr().err
    assert "no measured turn has the key(s) mtbench#99" in err and err.count("\n") == 1


def test_results_without_prompt_ids_are_one_line(run_dir, capsys):
    """A results.json from before evaluate kept each turn's prompt ids: rerun evaluate, said in one line."""
    res_path = run_dir / "eval" / "results.json"
    saved = res_path.read_bytes()
    res = read_json(res_path)
    del res["prompts"][1]["prompt_ids"]
    atomic_write_json(res_path, res)
    try:
        assert explain_turns.main([str(run_dir)]) == 2
        err = capsys.readouterr().err
        assert "written before evaluate kept each turn's prompt ids; rerun evaluate" in err and err.count("\n") == 1
    finally:
        res_path.write_bytes(saved)


def test_a_sampled_evaluation_is_refused(run_dir, tmp_path, capsys):
    text = (run_dir / "recipe.yaml").read_text()
    try:
        (run_dir / "recipe.yaml").write_text(text.replace("temperature: 0.0", "temperature: 0.7"))
        assert explain_turns.main([str(run_dir)]) == 2
        assert "evaluate sampled (evaluate.temperature 0.7)" in capsys.readouterr().err
    finally:
        (run_dir / "recipe.yaml").write_text(text)
