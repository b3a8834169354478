"""`draftsmith status` on fake run directories: every stage state, figures, next step, JSON, STATUS.md."""
from __future__ import annotations

import json
import os
import subprocess

import yaml

from draftsmith import status
from draftsmith.fileio import to_jsonable
from draftsmith.manifests import finish_manifest, new_manifest, write_manifest
from draftsmith.rundir import Ledger, stage_dir
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
    assert "## Goal" in md and "Check that status reads a run." in md and "## Immediate next step" in md
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


SECTIONS = ["Goal", "Instructions", "Discoveries", "Accomplished", "Relevant files", "Immediate next step", "Sources"]
# (a Findings section comes before the next step when the figures hold one: test_findings_...)


def test_seven_sections_every_figure_sourced(tmp_path):
    run, _ = make_run(tmp_path, done=("prepare", "capture", "vocab", "train", "evaluate", "export"))
    ev = json.loads((run / "eval" / "manifest.json").read_text())
    ev["metrics"].update(accept_rate_per_position=[0.8, 0.6, 0.5], draft_steps=3, ngram_tau=1.4, ngram_speedup=1.1)
    ev["step_costs"] = {"target_forward_ms": {"1": 10.0, "4": 11.0, "8": 12.0}, "draft_step_ms": 0.5}
    ev["metrics"]["methods"] = {"eagle3_chain": {"tau": 3.21, "speedup": 2.05, "tokens_per_s": 81.5},
                                "ngram": {"tau": 1.5, "speedup": 1.2, "tokens_per_s": 48.0}}
    ev["metrics"]["batches"] = {"1": {"eagle3_chain": 2.05, "ngram": 1.2}, "2": {"eagle3_chain": 1.9}}
    (run / "eval" / "manifest.json").write_text(json.dumps(ev))
    st = status.collect(run)
    md = status.to_markdown(st)
    assert [line[3:] for line in md.splitlines() if line.startswith("## ")] == SECTIONS
    facts = {f["label"]: f for f in st["discoveries"] + st["instructions"]}
    assert facts["τ (tokens per target verification)"] == {"label": "τ (tokens per target verification)", "value": 3.21,
                                                          "source": "eval/manifest.json: metrics.tau"}
    assert facts["n-gram tau"]["value"] == 1.4 and facts["n-gram speedup"]["source"] == "eval/manifest.json: metrics.ngram_speedup"
    assert facts["draft vocab"]["source"] == "recipe.yaml: vocab.draft_vocab_size"
    # planner: E = 1 + .8 + .48 + .24 = 2.52 tokens per (3 x 0.5 + 11) ms vs 10 ms a token -> 2.016x
    pred = facts["predicted speedup (batch 1, k=3)"]
    assert pred["value"].startswith("2.02x (-1.7% vs measured 2.05x)") and "step_costs" in pred["source"]
    assert facts["ngram: τ / speedup / tokens/s"]["value"] == "1.5 / 1.2x / 48"
    # batch 2: verify 8 tokens 12 ms, plain 2 tokens 10.33 ms, drafter 0.5 * 10.33 / 10: 2.52 * 10.33 / (1.55 + 12) = 1.92
    assert facts["speedup per batch size (chain)"]["value"] == ("b=1: 2.05x measured, 2.02x predicted; "
                                                               "b=2: 1.9x measured, 1.92x predicted")
    # Every figure line carries a marker, and every marker resolves to a file in Sources.
    sources = md.split("## Sources")[1]
    for line in md.split("## Discoveries")[1].split("## Accomplished")[0].strip().splitlines():
        n = line.rsplit("[", 1)[1].rstrip("]")
        assert f"[{n}] `" in sources, line
    assert "`eval/manifest.json`: " in sources and "metrics.tau" in sources
    assert "| evaluate | ✅ done |" in md


def test_failure_hint(tmp_path):
    run, ledger = make_run(tmp_path)
    start(run, ledger, "train", os.getpid())
    ledger.append("stage_failed", stage="train", error="RuntimeError: CUDA out of memory. Tried to allocate 2 GiB", seconds=1)
    st = status.collect(run)
    assert "lower the stage's batch_tokens" in st["next_step"]["text"]
    assert next(s for s in st["stages"] if s["stage"] == "train")["fix_hint"].startswith("lower")
    # the hint's command names this run's recipe, so it can be pasted
    assert f"`draftsmith doctor {run / 'recipe.yaml'}`" in st["next_step"]["text"] and "RECIPE`" not in st["next_step"]["text"]
    assert f"`draftsmith doctor {run / 'recipe.yaml'}`" in next(s for s in st["stages"] if s["stage"] == "train")["fix_hint"]


def _set(run, stage, **kw):
    """Overwrite fields of a stage's manifest (dicts are merged one level deep)."""
    p = stage_dir(run, stage) / "manifest.json"
    m = json.loads(p.read_text())
    for k, v in kw.items():
        m[k] = {**m.get(k, {}), **v} if isinstance(v, dict) else v
    p.write_text(json.dumps(m))


def test_a_drafter_capped_by_the_round_cost_is_not_told_to_train_longer(tmp_path):
    """When even an all-accepted round could not pass n-gram's speedup (the quickstart on 2 CPU
    cores: a depth-2 tree round costs 2.4 plain steps, so at most 3 / 2.4 = 1.25x against n-gram's
    1.69x), the finding says so from the measured τ ÷ speedup and gives no rerun as the next step;
    a drafter that could still win by acceptance keeps the training advice."""
    run, _ = make_run(tmp_path, done=("prepare", "capture", "vocab", "train", "evaluate", "export"))
    _set(run, "train", metrics={"heldout": {"samples": 26, "best_step": 90, "best_tau_simulated": 1.49,
                                             "last_tau_simulated": 1.49, "still_improving": True}})
    _set(run, "evaluate", config={"draft_steps": 2, "tree_depth": 2},
         metrics={"methods": {"eagle3_chain": {"tau": 1.23, "speedup": 0.63}, "eagle3_tree": {"tau": 1.42, "speedup": 0.59},
                              "ngram": {"tau": 2.60, "speedup": 1.69}, "hybrid": {"tau": 3.09, "speedup": 1.25}}})
    st = status.collect(run)
    lose = next(f for f in st["findings"] if f["kind"] == "loses_to_ngram")
    assert lose["fix"].startswith("training longer cannot pass n-gram on this device")
    assert "eagle3_tree round costs 2.4 plain decoding steps" in lose["fix"] and "at most 1.2x" in lose["fix"]
    assert "hybrid" in lose["fix"] and "train longer" not in lose["fix"]
    assert st["next_step"]["command"] is None and "then rerun" not in st["next_step"]["text"]
    _set(run, "evaluate", config={"draft_steps": 5, "tree_depth": 5})  # 6 / 2.4 = 2.5x > 1.69x: acceptance could win
    lose = next(f for f in status.collect(run)["findings"] if f["kind"] == "loses_to_ngram")
    assert "train longer" in lose["fix"]


def test_findings_name_what_stands_between_the_drafter_and_a_win(tmp_path):
    """Once every stage is done, the next step comes from the figures: a drafter that loses to n-gram
    lookup, a held-out figure falling while the training one rises, a drafter evaluated deeper than
    it was trained. Without such a finding the next step is to serve it."""
    run, _ = make_run(tmp_path, done=("prepare", "capture", "vocab", "train", "evaluate", "export"))
    st = status.collect(run)
    assert st["findings"] == [] and "serve the drafter" in st["next_step"]["text"]

    _set(run, "evaluate", config={"draft_steps": 5, "tree_depth": 6},
         metrics={"accept_rate_per_position": [0.6, 0.5, 0.4, 0.05, 0.01],
                  "methods": {"eagle3_chain": {"tau": 1.7, "speedup": 0.8}, "eagle3_tree": {"tau": 2.07, "speedup": 0.97},
                              "ngram": {"tau": 2.67, "speedup": 1.88}, "plain": {"tau": 1.0, "speedup": 1.0}}})
    _set(run, "train", config={"train": {"ttt_steps": 3}})
    st = status.collect(run)
    kinds = [f["kind"] for f in st["findings"]]
    assert kinds == ["deeper_than_trained", "loses_to_ngram"]
    deep, lose = st["findings"]
    assert "eagle3_chain drafts to depth 5, eagle3_tree drafts to depth 6" in deep["text"]
    assert "trained with 3 TTT steps" in deep["text"] and "0.05 0.01" in deep["text"] and "ttt_steps >= 6" in deep["fix"]
    assert "norm_output" not in deep["fix"]  # the drafter has it (the default)
    _set(run, "train", config={"draft": {"norm_output": False}})  # a plain EAGLE-3 drafter loses most past its depth
    assert "train with draft.norm_output true" in status.collect(run)["findings"][0]["fix"]
    _set(run, "train", config={"draft": {"norm_output": True}})
    assert "eagle3_tree τ 2.07 / 0.97x" in lose["text"] and "n-gram lookup's τ 2.67 / 1.88x" in lose["text"]
    assert "train.heldout_samples" in lose["fix"]  # no held-out figures: the run cannot tell data from steps
    assert st["next_step"]["text"].startswith("every stage is complete, but eagle3_chain drafts to depth 5")

    held = {"samples": 200, "best_step": 300, "best_tau_simulated": 2.4, "last_tau_simulated": 2.1, "still_improving": False,
            "overfitting": {"from_step": 300, "to_step": 500, "heldout_from": 2.4, "heldout_to": 2.1, "train_from": 4.0,
                            "train_to": 5.8},
            "engine": {"prompts": 16, "tau_chain": 1.6, "depth": 3}}
    _set(run, "train", metrics={"heldout": held})
    st = status.collect(run)
    assert [f["kind"] for f in st["findings"]] == ["overfitting", "deeper_than_trained", "loses_to_ngram"]
    assert "fell from 2.4 (step 300) to 2.1 (step 500)" in st["findings"][0]["text"]
    assert "more data helps more than more steps" in st["findings"][2]["fix"]
    assert "the drafter is memorizing" in st["next_step"]["text"]
    md = status.to_markdown(st)
    assert "## Findings" in md and md.index("## Findings") < md.index("## Immediate next step")
    facts = {f["label"]: f["value"] for f in st["discoveries"]}
    assert facts["held-out simulated τ: best (step) / last"] == "2.4 (step 300) / 2.1 on 200 held-out samples"
    assert facts["held-out τ measured by the engine (greedy chain)"] == "1.6 at depth 3 on 16 held-out prompts"
    _set(run, "train", metrics={"heldout": {**held, "engine": {"skipped": "target not loaded: no such folder"}}})
    facts = {f["label"]: f["value"] for f in status.collect(run)["discoveries"]}
    assert facts["held-out τ measured by the engine (greedy chain)"] == "skipped: target not loaded: no such folder"

    # a drafter that wins, evaluated within its trained depth: back to serving it
    _set(run, "train", config={"train": {"ttt_steps": 7}}, metrics={"heldout": {
        "samples": 200, "best_step": 500, "best_tau_simulated": 3.9, "last_tau_simulated": 3.9, "still_improving": True,
        "overfitting": None}})
    _set(run, "evaluate", metrics={"methods": {"eagle3_tree": {"tau": 3.4, "speedup": 2.3}, "ngram": {"tau": 2.6, "speedup": 1.9}}})
    st = status.collect(run)
    assert st["findings"] == [] and "serve the drafter" in st["next_step"]["text"]

    # the same drafter, but two of evaluate's CUDA-graph captures fell back to eager: its speed figures are not the graphs path's
    _set(run, "evaluate", metrics={"capture_fallbacks": 2})
    st = status.collect(run)
    assert [f["kind"] for f in st["findings"]] == ["capture_fallbacks"]
    assert "2 CUDA-graph capture(s) of evaluate fell back to eager" in st["findings"][0]["text"]
    assert "capture_fallbacks" in st["findings"][0]["fix"] and "2 CUDA-graph" in st["next_step"]["text"]


def test_serve_command_takes_the_shape_evaluate_measured_fastest(tmp_path):
    """The next step's SGLang flags are those of the faster EAGLE-3 method evaluate measured: the tree's
    top-k, depth and budget + 1 verified tokens when the tree won, the chain's k otherwise; and a run
    that regenerated its answers shows what training read."""
    run, _ = make_run(tmp_path, done=("prepare", "capture", "vocab", "train", "evaluate", "export"))
    cfg = {"draft_steps": 5, "tree_depth": 5, "tree_topk": 4, "tree_budget": 16}
    fast_tree = {"eagle3_chain": {"tau": 3.78, "speedup": 1.66}, "eagle3_tree": {"tau": 3.87, "speedup": 1.98},
                 "ngram": {"tau": 2.39, "speedup": 1.63}}
    _set(run, "evaluate", config=cfg, metrics={"methods": fast_tree})
    step = status.collect(run)["next_step"]
    assert step["command"].endswith("--speculative-num-steps 5 --speculative-eagle-topk 4 --speculative-num-draft-tokens 17")
    assert "as the tree evaluate measured fastest (1.98x)" in step["text"]
    fast_tree["eagle3_chain"]["speedup"] = 2.5
    _set(run, "evaluate", config={**cfg, "draft_steps": 3}, metrics={"methods": fast_tree})
    assert status.collect(run)["next_step"]["command"].endswith(
        "--speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4")

    m = new_manifest("regenerate", "fp", {}, {})
    m["counts"].update(kept=5196, tokens=4_099_707, loss_tokens=3_110_875)
    stage_dir(run, "regenerate").mkdir(parents=True)
    finish_manifest(stage_dir(run, "regenerate"), m)
    facts = {f["label"]: f["value"] for f in status.collect(run)["discoveries"]}
    assert facts["regenerated conversations kept / tokens (loss tokens): what training read"] == \
        "5196 / 4,099,707 (3,110,875)"


def test_engine_far_below_its_simulated_tau_is_a_finding(tmp_path):
    """The engine's held-out tau against the tau teacher forcing predicts at the same depth: far below it
    (decoding does not see what training saw) is a finding; close to it is not."""
    run, _ = make_run(tmp_path, done=("prepare", "capture", "vocab", "train", "evaluate", "export"))
    held = {"samples": 256, "best_step": 240, "best_tau_simulated": 4.2, "last_tau_simulated": 4.2,
            "best_acc_per_position": [0.8] * 6, "still_improving": False, "overfitting": None,
            "engine": {"prompts": 16, "depth": 5, "tau_chain": 3.4}}  # 1 + .8 + .64 + .512 + .41 + .328 = 3.69 at depth 5
    _set(run, "train", metrics={"heldout": held})
    assert status.collect(run)["findings"] == []
    facts = {f["label"]: f["value"] for f in status.collect(run)["discoveries"]}
    assert "held-out simulated τ of speculative sampling (best drafter)" not in facts  # a run from before the figure
    _set(run, "train", metrics={"heldout": {**held, "best_tau_sampled": 2.345, "sample_temperature": 0.7}})
    facts = {f["label"]: f["value"] for f in status.collect(run)["discoveries"]}
    assert facts["held-out simulated τ of speculative sampling (best drafter)"] == "2.35 at temperature 0.7"
    _set(run, "train", metrics={"heldout": {**held, "best_tau_sampled": 2.345, "sample_temperature": 0.7, "best_by": "sampled",
                                            "overfitting": {"from_step": 240, "to_step": 400, "heldout_from": 2.345,
                                                            "heldout_to": 2.1, "train_from": 4.0, "train_to": 5.8}}})
    st = status.collect(run)
    facts = {f["label"]: f["value"] for f in st["discoveries"]}
    assert facts["held-out simulated τ of speculative sampling (best drafter)"] == (
        "2.35 at temperature 0.7 (train.keep_best: sampled, train/best chosen by it)")
    assert st["findings"][0]["text"].startswith("held-out sampled τ fell from 2.35 (step 240)")
    held["engine"]["tau_chain"] = 1.5
    _set(run, "train", metrics={"heldout": held})
    (found,) = status.collect(run)["findings"]
    assert found["kind"] == "engine_below_simulated"
    assert "(1.5) is far below" in found["text"] and "at depth 5 (3.69)" in found["text"]


def test_commands_paste_as_is_with_a_space_in_the_run_dir(tmp_path):
    """A run folder with a space: every command status names is one shell word per argument."""
    import shlex

    (tmp_path / "my runs").mkdir()
    (tmp_path / "done runs").mkdir()
    run, ledger = make_run(tmp_path / "my runs")
    start(run, ledger, "train", os.getpid())
    ledger.append("stage_failed", stage="train", error="boom", seconds=1.0)
    cmd = status.collect(run)["next_step"]["command"]
    assert shlex.split(cmd) == ["draftsmith", "train", str(run / "recipe.yaml")]
    done, _ = make_run(tmp_path / "done runs", done=("prepare", "capture", "vocab", "train", "evaluate", "export"))
    serve = shlex.split(status.collect(done)["next_step"]["command"])
    assert serve[serve.index("--speculative-draft-model-path") + 1] == str(done / "export" / "sglang")


def test_a_drafter_trained_for_greedy_decoding_but_evaluated_by_sampling_is_a_finding(tmp_path):
    """Speculative sampling accepts by the overlap of the drafter's and the target's laws at the serving
    temperature; a drafter learned at T != 1 matches the target at no temperature, so a sampling evaluate
    of it is a finding; greedy evaluate (or a T 1 drafter, or a run from before the key) is not. So is
    one trained on answers regenerated greedily (sampled text goes elsewhere), unless evaluate is greedy."""
    run, _ = make_run(tmp_path, done=("prepare", "capture", "vocab", "train", "evaluate", "export"))
    wins = {"eagle3_tree": {"tau": 2.2, "speedup": 1.3}, "ngram": {"tau": 1.02, "speedup": 0.82}}
    _set(run, "evaluate", config={"temperature": 0.7}, metrics={"methods": wins})
    assert status.collect(run)["findings"] == []  # a run from before the key learned at T 1
    _set(run, "evaluate", config={"temperature": 0.0})
    _set(run, "train", config={"train": {"ttt_target_temperature": 0.5}})
    assert status.collect(run)["findings"] == []  # greedy: a sharper law is the benchmark recipe's choice
    _set(run, "evaluate", config={"temperature": 0.7})
    st = status.collect(run)
    (found,) = st["findings"]
    assert found["kind"] == "law_unlike_served"
    assert "samples at temperature 0.7, but the drafter learned the target's law at a sharper T 0.5" in found["text"]
    assert "train.ttt_target_temperature 1" in found["fix"] and "the drafter learned" in st["next_step"]["text"]
    _set(run, "train", config={"train": {"ttt_target_temperature": 1.0}})
    assert status.collect(run)["findings"] == []

    # answers regenerated greedily, served by sampling: the drafter never saw sampled text
    regen = stage_dir(run, "regenerate")
    regen.mkdir(parents=True)
    finish_manifest(regen, new_manifest("regenerate", "fp", {"temperature": 0.0}, {}))
    (found,) = status.collect(run)["findings"]
    assert found["kind"] == "trained_on_greedy_text" and "regenerated greedily" in found["text"]
    assert "regenerate.temperature 0.7" in found["fix"] and found["source"].startswith("regen/manifest.json")
    _set(run, "evaluate", config={"temperature": 0.0})
    assert status.collect(run)["findings"] == []  # greedy answers for a greedy server
    _set(run, "evaluate", config={"temperature": 0.7})
    _set(run, "regenerate", config={"temperature": 0.7})
    assert status.collect(run)["findings"] == []
    # sampled answers, evaluated greedily: the figures are a greedy server's (last: any real problem comes first)
    _set(run, "evaluate", config={"temperature": 0.0})
    (found,) = status.collect(run)["findings"]
    assert found["kind"] == "greedy_eval_of_sampled_answers" and "sampled at temperature 0.7" in found["text"]
    assert "evaluate.temperature" in found["fix"]
    _set(run, "evaluate", metrics={"methods": {**wins, "ngram": {"tau": 2.6, "speedup": 2.0}}})
    assert [f["kind"] for f in status.collect(run)["findings"]] == ["loses_to_ngram", "greedy_eval_of_sampled_answers"]


def test_a_drafter_kept_by_its_greedy_figure_but_served_by_sampling_is_a_finding(tmp_path):
    """train.keep_best greedy keeps the step with the best held-out greedy figure; when evaluate samples
    and another step had a better held-out sampled figure, status names both steps and keep_best sampled.
    Not when evaluate is greedy, the drafter was kept by the sampled figure, both figures pick the same
    step, or the run is from before the record had the sampled best."""
    run, _ = make_run(tmp_path, done=("prepare", "capture", "vocab", "train", "evaluate", "export"))
    wins = {"eagle3_tree": {"tau": 3.9, "speedup": 2.0}, "ngram": {"tau": 1.02, "speedup": 0.85}}
    _set(run, "train", config={"train": {"ttt_target_temperature": 1.0}})
    _set(run, "evaluate", config={"temperature": 1.0}, metrics={"methods": wins})
    held = {"samples": 256, "best_step": 300, "best_tau_simulated": 4.5, "last_tau_simulated": 4.4, "best_tau_sampled": 3.61,
            "sample_temperature": 1.0, "best_acc_per_position": [0.8] * 3, "still_improving": False, "overfitting": None}
    _set(run, "train", metrics={"heldout": held})
    assert status.collect(run)["findings"] == []  # a run from before the record had the sampled best
    _set(run, "train", metrics={"heldout": {**held, "best_by": "greedy", "sampled_best_step": 400, "sampled_best_tau": 3.74}})
    st = status.collect(run)
    (found,) = st["findings"]
    assert found["kind"] == "kept_for_greedy_decoding"
    assert ("train/best kept step 300 by held-out greedy simulated τ (its held-out sampled τ at T 1: 3.61); step 400 had "
            "the best held-out sampled τ, 3.74") in found["text"]
    assert "train.keep_best sampled" in found["fix"] and "train/best kept step 300" in st["next_step"]["text"]
    _set(run, "evaluate", config={"temperature": 0.0})
    assert status.collect(run)["findings"] == []  # a greedy server: the greedy figure is the one to keep by
    _set(run, "evaluate", config={"temperature": 1.0})
    for other in ({"best_by": "sampled", "sampled_best_step": 300, "sampled_best_tau": 3.61},
                  {"best_by": "greedy", "sampled_best_step": 300, "sampled_best_tau": 3.61}):
        _set(run, "train", metrics={"heldout": {**held, **other}})
        assert status.collect(run)["findings"] == []
