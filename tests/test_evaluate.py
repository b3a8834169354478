"""The evaluate stage end to end on a fake run directory: files, metrics, resume, lossless check."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from draftsmith import pipeline
from draftsmith.evaluate import measure, stage
from draftsmith.speculate import methods
from draftsmith.fileio import read_json
from draftsmith.manifests import load_manifest, new_manifest, finish_manifest
from draftsmith.messages import DraftsmithError
from draftsmith.rundir import Ledger
from draftsmith.config import DraftConfig, EvaluateConfig, Recipe, TargetConfig
from draftsmith.draft.build import drafter_config, init_drafter
from draftsmith.draft.io import save_drafter
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
    prompts.write_text(prompts.read_text() + json.dumps({"id": "mt", "turns": ["Hello!", "Write it again."]}) + "\n")
    return Recipe(run_dir=str(run_dir), target=TargetConfig(path=str(model_dir), device="cpu", dtype="float32"),
                  evaluate=EvaluateConfig(benchmarks=[str(prompts)], max_new_tokens=12, draft_steps=3, tree_depth=3,
                                          tree_topk=2, tree_budget=5, batch_sizes=[1, 2]))


def test_evaluate_stage(recipe, capsys):
    m = pipeline.run_stage("evaluate", recipe)
    out = recipe.run_dir + "/eval"
    assert m["status"] == "complete" and load_manifest(out)["status"] == "complete"
    met = m["metrics"]
    assert met["method"] == "eagle3_chain" and met["num_prompts"] == 5  # 3 prompts + both turns of `mt`
    assert len(met["accept_rate_per_position"]) == 3
    assert 1.0 <= met["tau"] <= 4.0 and met["speedup"] > 0 and met["tokens_per_s_plain"] > 0
    assert set(met["methods"]) == {"eagle3_chain", "eagle3_tree", "ngram", "hybrid"} and set(met["batches"]["2"]) == set(met["methods"])
    assert list(met["tau_per_benchmark"].values()) == [met["tau"]]
    sc = m["step_costs"]
    assert list(sc["target_forward_ms"]) == ["1", "2", "4", "8", "16", "32", "64"] and sc["draft_step_ms"] > 0
    res = read_json(out + "/results.json")
    assert [(p["id"], p["turn"]) for p in res["prompts"]] == [("q0", 1), ("q1", 1), ("q2", 1), ("mt", 1), ("mt", 2)]
    assert all(r["lossless"] for p in res["prompts"] for r in p["methods"].values())
    assert len(res["batches"]) == 2 and all(r["identical"] == 2 for b in res["batches"] for r in b["methods"].values())
    for name, s in res["summary"]["methods"].items():
        rounds = [p["methods"][name] for p in res["prompts"]]
        assert sum(s["accepted_length_histogram"]) == sum(d > 0 for r in rounds for d in r["drafted_per_round"])
        assert list(s["per_benchmark"]) == ["prompts"]
    report = open(out + "/report.md").read()
    assert "## eagle3_tree: acceptance per draft position" in report and "| ngram | all |" in report
    assert "eagle3_chain bs2" in report
    assert open(out + "/acceptance.png", "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "speedup" in printed and "plain" in printed
    assert Ledger(recipe.run_dir).read()[-1]["event"] == "stage_finished"


def test_turn_two_follows_the_targets_answer(recipe, monkeypatch):
    seen = []
    real = stage.render_prompt
    monkeypatch.setattr(stage, "render_prompt", lambda tok, msgs, where: seen.append(msgs) or real(tok, msgs, where))
    recipe.evaluate.methods, recipe.evaluate.batch_sizes, recipe.evaluate.step_costs = ["ngram"], [1], False
    pipeline.run_stage("evaluate", recipe)
    res = read_json(recipe.run_dir + "/eval/results.json")
    first = res["prompts"][3]
    turn2 = seen[-1]
    assert [m["role"] for m in turn2] == ["user", "assistant", "user"] and turn2[2]["content"] == "Write it again."
    assert turn2[1]["content"] == stage.answer_text(load_target(recipe.target.path).tokenizer, first["plain_tokens"],
                                                       res["eos_ids"])


def measured_turns(monkeypatch) -> list[str]:
    """The `where` of every turn evaluate measures from now on (stage.evaluate_prompt's calls), in order."""
    calls, real = [], stage.evaluate_prompt
    monkeypatch.setattr(stage, "evaluate_prompt", lambda *a, **kw: calls.append(a[-1]) or real(*a, **kw))
    return calls


def test_evaluate_resumes_after_finished_prompts(recipe, monkeypatch):
    recipe.evaluate.methods, recipe.evaluate.batch_sizes, recipe.evaluate.step_costs = ["eagle3_chain"], [1], False
    pipeline.run_stage("evaluate", recipe)
    eval_dir = f"{recipe.run_dir}/eval"
    m = read_json(eval_dir + "/manifest.json")
    m["status"] = "running"  # as if killed after the last prompt was appended
    json.dump(m, open(eval_dir + "/manifest.json", "w"))
    first = {r["key"]: r["prompt_ids"] for r in read_json(eval_dir + "/results.json")["prompts"]}
    lines = open(eval_dir + "/partial.jsonl").read().splitlines()
    old = [json.dumps({k: v for k, v in json.loads(line).items() if k != "prompt_ids"}) for line in lines[:2]]  # older code's
    open(eval_dir + "/partial.jsonl", "w").write("\n".join(old) + "\n" + lines[2][:20])  # torn last line
    calls = measured_turns(monkeypatch)
    m2 = pipeline.run_stage("evaluate", recipe)
    assert m2["status"] == "complete" and m2["metrics"]["num_prompts"] == 5
    assert [c.rsplit(": ", 1)[-1] for c in calls] == ["prompt q2", "prompt mt", "prompt mt turn 2"]
    # records resumed from a partial.jsonl without prompt ids get them: every record has the ids it was measured on
    assert {r["key"]: r["prompt_ids"] for r in read_json(eval_dir + "/results.json")["prompts"]} == first


def break_the_tree(monkeypatch, only_prompt: int | None = None):
    """The tree's output (not the warm-up's) made to leave plain decoding at new token 5: on every prompt,
    or only on the `only_prompt`-th (0-based) it decodes. Returns the real speculate.methods.generate."""
    real, seen = methods.generate, []

    def broken(target, proposer, prompts, n, *a, **kw):
        new, st = real(target, proposer, prompts, n, *a, **kw)
        if isinstance(proposer, methods.Eagle3Proposer) and proposer.topk > 1 and n > 8:  # the tree; not the warm-up
            if tuple(prompts[0]) not in seen:
                seen.append(tuple(prompts[0]))
            if only_prompt is None or seen.index(tuple(prompts[0])) == only_prompt:
                new[0][5] = (new[0][5] + 1) % target.vocab_size
        return new, st

    monkeypatch.setattr(methods, "generate", broken)
    return real


def test_evaluate_lossless_mismatch_names_prompt(recipe, monkeypatch):
    break_the_tree(monkeypatch)
    recipe.evaluate.methods, recipe.evaluate.batch_sizes, recipe.evaluate.step_costs = ["eagle3_tree"], [1], False
    with pytest.raises(DraftsmithError, match=r"prompt q0: eagle3_tree: speculative output differs .* at new token 5"):
        pipeline.run_stage("evaluate", recipe)
    assert Ledger(recipe.run_dir).read()[-1]["event"] == "stage_failed"


def test_evaluate_on_static_caches(recipe):
    """evaluate.fast: static (the fast path's caches and bookkeeping, no CUDA graphs) gives the same
    outputs as eager, and the report states the path and plain decoding's bandwidth fraction."""
    recipe.evaluate.fast = "static"
    m = pipeline.run_stage("evaluate", recipe)
    met = m["metrics"]
    assert met["path"] == "static" and m["step_costs"]["path"] == "static"
    sc = m["step_costs"]  # the engine's time beyond forwards, for the planner
    assert isinstance(sc["round_overhead_ms"], float) and isinstance(sc["plain_overhead_ms"], float)
    b2 = sc["by_batch"]["2"]  # measured at batch 2 too: forwards per sequence, drafting, both overheads
    assert list(b2["target_forward_ms"]) == ["1", "2", "4", "8", "16", "32"] and b2["draft_step_ms"] > 0
    assert list(b2["draft_step_ms_rows"]) == ["2", "4"]  # tree_topk 2, and 4 rows
    assert isinstance(b2["round_overhead_ms"], float) and isinstance(b2["plain_overhead_ms"], float)
    assert set(met["accept_rate_per_position_by_method"]) == {"eagle3_chain", "eagle3_tree", "ngram", "hybrid"}
    from draftsmith.plan import PlanConfig, plan
    p = plan(PlanConfig(run_dir=recipe.run_dir, batch_sizes=[1, 2]))
    engine = [r for r in p["rows"] if r["method"] == "eagle3-tree-engine"]
    assert [r["batch"] for r in engine] == [1, 2] and engine[0]["tokens_source"] == "measured tree acceptance"
    res = read_json(recipe.run_dir + "/eval/results.json")
    assert all(r["lossless"] for p in res["prompts"] for r in p["methods"].values())
    assert all(r["identical"] == 2 for b in res["batches"] for r in b["methods"].values())
    roof = res["summary"]["roofline"]
    assert roof["weight_bytes_per_step"] > 0 and 0 < met["plain_decode_bw_fraction"] == roof["fraction_of_measured_bw"]
    report = open(recipe.run_dir + "/eval/report.md").read()
    assert "static KV cache, no CUDA graphs" in report and "of the memory-bandwidth limit" in report


def test_evaluate_resident_rounds_measure_the_same_acceptance(recipe, tmp_path, capsys):
    """evaluate.resident: the stage on device-resident rounds gives the host loop's outputs and
    per-round statistics (its tau and acceptance per position), prompts and batches alike."""
    import shutil
    from dataclasses import replace

    recipe.evaluate.fast, recipe.evaluate.step_costs = "static", False
    runs = {}
    for resident in (False, True):
        r = replace(recipe, run_dir=str(tmp_path / f"run-{resident}"), evaluate=replace(recipe.evaluate, resident=resident))
        shutil.copytree(recipe.run_dir, r.run_dir)
        pipeline.run_stage("evaluate", r)
        runs[resident] = read_json(r.run_dir + "/eval/results.json")
    assert "EAGLE-3 rounds on the device" in capsys.readouterr().err
    keys = ("rounds", "emitted", "accepted_per_round", "drafted_per_round", "drafted", "reached", "accepted",
            "new_tokens", "lossless")
    for a, b in zip(runs[False]["prompts"], runs[True]["prompts"]):
        for m in ("eagle3_chain", "eagle3_tree"):
            assert {k: a["methods"][m][k] for k in keys} == {k: b["methods"][m][k] for k in keys}
            assert b["methods"][m]["lossless"] and b["methods"][m]["target_s"] is None  # one graph: not split
    for a, b in zip(runs[False]["batches"], runs[True]["batches"]):
        assert {m: (x["identical"], x["emitted"], x["rounds"]) for m, x in a["methods"].items()} == \
            {m: (x["identical"], x["emitted"], x["rounds"]) for m, x in b["methods"].items()}


@pytest.mark.parametrize("fast", ["off", "static"])
def test_evaluate_sampled(recipe, fast, capsys):
    """evaluate at temperature > 0, eager (the host loop) and on static caches (resident rounds for the chain
    and the tree): the stage completes with finite tau for every method at batch 1 and 2, and no lossless
    verdict (sampled outputs are draws; tests/test_sampling.py checks their law)."""
    recipe.evaluate.temperature, recipe.evaluate.fast, recipe.evaluate.step_costs = 0.8, fast, False
    m = pipeline.run_stage("evaluate", recipe)
    met = m["metrics"]
    assert m["status"] == "complete" and set(met["methods"]) == {"eagle3_chain", "eagle3_tree", "ngram", "hybrid"}
    assert all(1.0 <= r["tau"] <= 4.0 for r in met["methods"].values()) and set(met["batches"]["2"]) == set(met["methods"])
    res = read_json(recipe.run_dir + "/eval/results.json")
    assert all("lossless" not in r or r["lossless"] is None for p in res["prompts"] for r in p["methods"].values())
    # the greedy spot check: the first turns decoded greedily too, every method identical to plain decoding (float32)
    turns = min(len(res["prompts"]), stage.SPOT_CHECK_TURNS)
    for s in res["summary"]["methods"].values():
        assert s["lossless"] == {"checked": turns, "identical": turns, "near_tie_divergences": 0, "numeric_divergences": 0,
                                 "greedy_spot_check": True}
    err = capsys.readouterr().err
    assert f"greedy spot check of {turns} turn(s): eagle3_chain {turns}/{turns} identical" in err
    assert ("EAGLE-3 rounds on the device" in err) == (fast == "static")
    resident = [p["methods"][k]["target_s"] is None for p in res["prompts"] for k in ("eagle3_chain", "eagle3_tree")]
    assert all(resident) if fast == "static" else not any(resident)  # one graph per round: no target/draft split


def test_sampled_evaluate_spot_checks_greedy_decoding(recipe, monkeypatch):
    """Sampling gives no lossless verdict, so evaluate decodes the first turns greedily too: a method
    whose greedy output leaves plain decoding's (a token changed here) stops the stage with the
    lossless error naming the turn; with check_lossless off the spot check does not run."""
    recipe.evaluate.temperature, recipe.evaluate.step_costs, recipe.evaluate.batch_sizes = 0.8, False, [1]
    real = measure.run_method

    def broken(target, drafter, method, prompts, cfg, *a, **k):
        new, stats, s = real(target, drafter, method, prompts, cfg, *a, **k)
        if method == "eagle3_chain" and cfg.temperature == 0 and len(new[0]) > 2:
            new[0][2] = (new[0][2] + 1) % target.vocab_size
        return new, stats, s

    monkeypatch.setattr(measure, "run_method", broken)
    with pytest.raises(DraftsmithError, match=r"\(greedy spot check\): eagle3_chain: speculative output differs from plain greedy"):
        pipeline.run_stage("evaluate", recipe)
    recipe.evaluate.check_lossless = False
    m = pipeline.run_stage("evaluate", recipe, force=True)
    res = read_json(recipe.run_dir + "/eval/results.json")
    assert m["status"] == "complete" and all("lossless" not in s for s in res["summary"]["methods"].values())


def test_evaluate_graphs_on_cpu_is_a_clear_error(recipe):
    recipe.evaluate.fast = "graphs"
    with pytest.raises(DraftsmithError, match="evaluate.fast 'graphs' needs a CUDA device"):
        pipeline.run_stage("evaluate", recipe)


def test_a_lossless_stop_keeps_the_measured_turns(recipe, monkeypatch):
    """The lossless check stops on the second prompt; its own fix (the check off) resumes the evaluation
    with the first prompt's measurement kept. A half-done evaluation measured with the check off and resumed
    with it on stops on the divergence it recorded; a complete one measured off starts over when it is on."""
    real = break_the_tree(monkeypatch, only_prompt=1)
    recipe.evaluate.methods, recipe.evaluate.batch_sizes, recipe.evaluate.step_costs = ["eagle3_tree"], [1], False
    with pytest.raises(DraftsmithError, match=r"prompt q1: eagle3_tree: .* at new token 5 .*the turns measured so far are kept"):
        pipeline.run_stage("evaluate", recipe)
    eval_dir = Path(recipe.run_dir) / "eval"
    assert [json.loads(line)["id"] for line in (eval_dir / "partial.jsonl").read_text().splitlines()] == ["q0"]

    calls = measured_turns(monkeypatch)
    recipe.evaluate.check_lossless = False
    m = pipeline.run_stage("evaluate", recipe)
    assert m["status"] == "complete" and m["metrics"]["num_prompts"] == 5
    assert [c.rsplit(": ", 1)[-1] for c in calls] == ["prompt q1", "prompt q2", "prompt mt", "prompt mt turn 2"]
    q1 = read_json(eval_dir / "results.json")["prompts"][1]["methods"]["eagle3_tree"]
    assert (q1["lossless"], q1["first_difference"], q1["divergence"]) == (False, 5, "bug")

    monkeypatch.setattr(methods, "generate", real)  # from here only the recorded divergence can stop it
    done = read_json(eval_dir / "manifest.json")
    json.dump({**done, "status": "running"}, open(eval_dir / "manifest.json", "w"))  # as if killed at the end
    recipe.evaluate.check_lossless = True
    calls.clear()
    with pytest.raises(DraftsmithError, match=r"prompt q1 \(measured with evaluate.check_lossless off\): eagle3_tree: .* "
                                              r"at new token 5, .*logit gaps to its top: plain 0, speculative \d"):
        pipeline.run_stage("evaluate", recipe)
    assert calls == []  # nothing measured again

    json.dump(done, open(eval_dir / "manifest.json", "w"))  # complete, measured with the check off
    m = pipeline.run_stage("evaluate", recipe)  # the check is on: it starts over (and passes without the fault)
    assert m["config"]["check_lossless"] is True and len(calls) == 5
    recipe.evaluate.check_lossless = False
    assert pipeline.run_stage("evaluate", recipe)["config"]["check_lossless"] is True  # done: checked is enough
    assert Ledger(recipe.run_dir).read()[-1]["event"] == "stage_skipped"


def test_a_lossless_stop_after_a_change_keeps_its_turns_not_the_old_output(recipe, monkeypatch):
    """A complete evaluation, then another setting: the new run stops on the check at the second prompt. Its
    measured turn stays (not the old output put back), and the check off resumes it."""
    recipe.evaluate.methods, recipe.evaluate.batch_sizes, recipe.evaluate.step_costs = ["eagle3_tree"], [1], False
    pipeline.run_stage("evaluate", recipe)
    break_the_tree(monkeypatch, only_prompt=1)
    recipe.evaluate.max_new_tokens = 10
    with pytest.raises(DraftsmithError, match=r"prompt q1: eagle3_tree"):
        pipeline.run_stage("evaluate", recipe)
    eval_dir = Path(recipe.run_dir) / "eval"
    assert load_manifest(eval_dir)["status"] == "running" and pipeline.previous_dir(eval_dir).is_dir()
    calls = measured_turns(monkeypatch)
    recipe.evaluate.check_lossless = False
    m = pipeline.run_stage("evaluate", recipe)
    assert m["status"] == "complete" and m["config"]["max_new_tokens"] == 10 and "prompt q0" not in " ".join(calls)
    assert not pipeline.previous_dir(eval_dir).exists()


def test_divergence_classes():
    """A divergence is a bug only when an independent forward sides with plain decoding, beyond the
    tolerance measured for it (the third value)."""
    tol = 0.1
    assert measure.classify_divergence((0.0, tol / 2, tol), torch.bfloat16) == "tie"
    assert measure.classify_divergence((3 * tol, 2 * tol, tol), torch.bfloat16) == "numeric"
    assert measure.classify_divergence((0.0, 2 * tol, tol), torch.bfloat16) == "bug"
    assert measure.classify_divergence(None, torch.bfloat16) == "bug"  # one side ended early
    assert measure.classify_divergence((0.0, 1e-3), torch.float32) == "bug"  # no tolerance measured: fp32's floor 1e-5


class RowCountRounding:
    """A stand-in bf16 target whose logits at a position move with the number of rows in the forward,
    as a bf16 MoE target's do (routing and kernels by row count): token 1 sits `gap` below the top
    token 0, and gains `jitter` when the forward has an odd number of rows."""

    dtype, device = torch.bfloat16, torch.device("cpu")

    def __init__(self, gap: float, jitter: float):
        self.gap, self.jitter = gap, jitter

    def forward(self, ids):
        n = ids.shape[1]
        logits = torch.zeros(1, n, 8)
        logits[..., 0] = 10.0
        logits[..., 1] = 10.0 * (1 - self.gap) + self.jitter * (n % 2)
        logits[..., 2] = 5.0
        return type("Out", (), {"logits": logits})()


def test_the_tie_tolerance_is_the_targets_own_rounding():
    """The bf16 MoE false alarm: a speculative token 0.127 below the top where the target's own forwards
    move that row's logits by 0.05 when the row count changes is a tie (a fixed 0.1 called it a bug); a
    token far below the top (0.5) is still a bug, and on a target that rounds alike at every row count
    the same 0.127 is a bug too."""
    prompt, plain = [3, 4, 5], [0, 0, 0, 0]
    tie = measure.lossless_check(RowCountRounding(0.127, 0.5), prompt, plain, [0, 1, 0, 0], True, "p", "eagle3_chain")
    assert tie["divergence"] == "tie" and tie["tie_tolerance"] == pytest.approx(4 * 0.05, rel=1e-3)
    with pytest.raises(DraftsmithError, match=r"speculative 0\.5, tie tolerance 0\.2,"):
        measure.lossless_check(RowCountRounding(0.127, 0.5), prompt, plain, [0, 2, 0, 0], True, "p", "eagle3_chain")
    with pytest.raises(DraftsmithError, match="no rounding tie"):
        measure.lossless_check(RowCountRounding(0.127, 0.0), prompt, plain, [0, 1, 0, 0], True, "p", "eagle3_chain")


def test_lossless_check_stops_on_a_bug_and_names_the_gaps(tmp_path):
    """A speculative token that no forward picks is a bug: the check raises with both logit gaps;
    with check_lossless off it records the divergence instead."""
    from draftsmith.speculate.engine import plain_generate

    target = load_target(make_model_dir(tmp_path / "m", num_layers=2), device="cpu", dtype="float32")
    prompt = [5, 9, 13, 2, 7]
    plain = plain_generate(target, prompt, 8)
    spec = plain[:3] + [(plain[3] + 1) % 100] + plain[4:]  # not the argmax there
    with pytest.raises(DraftsmithError, match=r"at new token 3 .*logit gaps to its top: plain 0, speculative \d"):
        measure.lossless_check(target, prompt, plain, spec, True, "p1", "eagle3_tree")
    rec = measure.lossless_check(target, prompt, plain, spec, False, "p1", "eagle3_tree")
    assert (rec["lossless"], rec["first_difference"], rec["divergence"]) == (False, 3, "bug")
    assert measure.lossless_check(target, prompt, plain, list(plain), True, "p1", "ngram")["lossless"]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_bench_resident_smoke(recipe, tmp_path, temperature):
    """benchmarks/bench_resident.py on a CPU (static caches): both loops; greedy, every output equal to
    plain; sampled, both loops run (their outputs are draws: not compared)."""
    import subprocess
    import sys
    from pathlib import Path

    import yaml

    from draftsmith.fileio import to_jsonable

    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(to_jsonable(recipe)))
    out = tmp_path / "bench_resident.json"
    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, str(root / "benchmarks/bench_resident.py"), str(path), "--num_prompts", "2",
                    "--max_new_tokens", "10", "--batch_sizes", "1", "2", "--fast", "static", "--out", str(out),
                    "--temperature", str(temperature)],
                   check=True, capture_output=True, timeout=600)
    res = json.loads(out.read_text())
    assert res["path"] == "static" and set(res["batches"]) == {"1", "2"} and res["capture_fallbacks"] == []
    for B, row in res["batches"].items():
        for m in ("eagle3_chain", "eagle3_tree"):
            host, resident = row["methods"][m]["host"], row["methods"][m]["resident"]
            if temperature > 0:
                assert host["identical"] is resident["identical"] is None and (B != "1" or resident["tau"] >= 1)
                continue
            assert host["identical"] == resident["identical"] == ("2/2")
            assert host["tau"] == resident["tau"] and (B != "1" or resident["tau"] >= 1)
            assert resident["speedup"] > 0 and resident["ms_per_round"] > 0
    assert res["batches"]["1"]["plain_roofline"]["weight_bytes_per_step"] > 0


def test_prompts_past_the_targets_positions_are_refused_and_counted(tmp_path):
    """A prompt that cannot fit max_position_embeddings with max_new_tokens is skipped, counted in
    the manifest and listed in results.json; the others are measured."""
    import json as _json

    import yaml

    from draftsmith.manifests import load_manifest
    from draftsmith.cli import main
    from draftsmith.testing import make_model_dir

    target = make_model_dir(tmp_path / "t", num_layers=4, hidden_size=32, max_position_embeddings=128)
    data = Path(__file__).parent / "badinput" / "sources" / "good.json"
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(_json.dumps({"prompt": "hello there"}) + "\n" + _json.dumps({"prompt": "word " * 400}) + "\n")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({
        "run_dir": str(tmp_path / "run"), "target": {"path": str(target), "device": "cpu", "dtype": "float32"},
        "prepare": {"source": str(data), "max_length": 64}, "capture": {"storage_dtype": "float32"},
        "vocab": {"draft_vocab_size": 64},
        "train": {"ttt_steps": 2, "max_steps": 2, "batch_tokens": 128, "warmup_steps": 1, "device": "cpu", "dtype": "float32"},
        "evaluate": {"benchmarks": [str(prompts)], "max_new_tokens": 16, "draft_steps": 3, "step_costs": False,
                     "methods": ["eagle3_chain", "plain"]}}))
    assert main(["run", str(recipe)]) == 0
    m = load_manifest(tmp_path / "run" / "eval")
    assert m["counts"]["prompts"] == 1 and m["counts"]["prompts_too_long"] == 1
    res = _json.loads((tmp_path / "run" / "eval" / "results.json").read_text())
    assert res["prompts_too_long"][0]["prompt_tokens"] > res["prompts_too_long"][0]["limit"] == 128 - 16 - 3 - 1
    # max_new_tokens that leaves no room at all is one line
    assert main(["evaluate", str(recipe), "--evaluate.max_new_tokens", "200"]) == 2


def test_ngram_draft_length_is_its_own_setting():
    """evaluate.ngram_steps sets n-gram's drafts per round apart from the drafter's depth (unset: draft_steps),
    so evaluating a drafter at its trained depth does not shorten the baseline's drafts; 0 is refused."""
    from draftsmith.config import EvaluateConfig, Recipe, check_recipe
    from draftsmith.speculate.methods import method_depth

    assert method_depth(EvaluateConfig(draft_steps=2), "ngram") == 2
    cfg = EvaluateConfig(draft_steps=2, tree_depth=2, ngram_steps=3)
    assert [method_depth(cfg, m) for m in ("eagle3_chain", "eagle3_tree", "ngram")] == [2, 2, 3]
    with pytest.raises(DraftsmithError, match="evaluate.ngram_steps"):
        check_recipe(Recipe(evaluate=EvaluateConfig(ngram_steps=0)), "recipe.yaml")


@pytest.mark.capture_fallback
def test_evaluate_records_capture_fallbacks(recipe, monkeypatch):
    """A CUDA-graph capture that falls back to eager during evaluate is listed in results.json and
    counted in the manifest (its timings are eager ones); the outputs stay lossless. The graphs path
    runs on the CPU with emulated capture (test_fast.fast_mode); the verify forward's capture fails."""
    import test_fast
    from draftsmith.speculate import fast

    monkeypatch.setattr(fast, "resolve_mode", lambda mode, device, key="": mode)
    test_fast.fast_mode("emulated", monkeypatch)

    def capture(fn, args=(), state=None, generators=()):
        if getattr(fn, "__name__", "") == "verify_rows":
            raise RuntimeError("this call cannot be captured")
        return test_fast.emulated_capture(fn, args, state, generators)
    monkeypatch.setattr("draftsmith.speculate.cache.capture", capture)
    recipe.evaluate.fast, recipe.evaluate.methods, recipe.evaluate.batch_sizes = "graphs", ["eagle3_chain"], [1]
    m = pipeline.run_stage("evaluate", recipe)
    res = read_json(recipe.run_dir + "/eval/results.json")
    assert res["capture_fallbacks"] and all("verify_rows" in f for f in res["capture_fallbacks"])
    assert m["metrics"]["capture_fallbacks"] == len(res["capture_fallbacks"]) and m["metrics"]["path"] == "graphs"
    assert all(r["lossless"] for p in res["prompts"] for r in p["methods"].values())


def test_prompts_from_the_training_source_leave_out_every_part_of_a_trained_conversation(recipe, tmp_path):
    """Evaluate on the file prepare read measures only conversations the drafter never saw: no
    record of a trained conversation, ShareGPT's later parts (`b_1` after `b_0`) included."""
    from draftsmith.data import prepare
    from draftsmith.config import PrepareConfig

    def rec(i: str) -> dict:
        return {"id": i, "conversations": [{"from": "human", "value": f"Tell me about {i}."},
                                           {"from": "gpt", "value": f"Here is {i}."}]}

    source = tmp_path / "sharegpt.json"
    source.write_text(json.dumps([rec(i) for i in ["a_0", "a_1", "b_0", "c", "e", "b_1", "f", "g", "h"]]))
    run_dir = Path(recipe.run_dir)
    recipe.prepare = PrepareConfig(source=str(source), max_samples=5, max_length=64)
    prepare.run(recipe, run_dir, "prep-fp")
    recipe.evaluate = EvaluateConfig(benchmarks=[str(source)], max_prompts=2, max_new_tokens=4, draft_steps=2,
                                     step_costs=False, methods=["eagle3_chain", "plain"])
    stage.run(recipe, run_dir, "eval-fp")
    res = read_json(run_dir / "eval" / "results.json")
    assert [p["id"] for p in res["prompts"]] == ["f", "g"]
    assert load_manifest(run_dir / "eval")["counts"]["prompts_in_training"] == 6


def test_several_temperatures_in_one_run(recipe):
    """evaluate.temperatures [0, 1]: every record and batch names its temperature, results.json and the
    manifest hold each temperature's figures, the report one table per temperature, and the headline
    figures are the served temperature's (evaluate.temperature, measured even when the list omits it)."""
    recipe.evaluate.temperatures = [1.0]
    recipe.evaluate.temperature = 0.0
    recipe.evaluate.methods = ["eagle3_tree", "ngram", "hybrid"]
    m = pipeline.run_stage("evaluate", recipe)
    res = read_json(Path(recipe.run_dir) / "eval" / "results.json")
    assert set(res["by_temperature"]) == {"0", "1"} and res["summary"]["temperature"] == 0.0
    assert {r["temperature"] for r in res["prompts"]} == {0.0, 1.0} and {r["temperature"] for r in res["batches"]} == {0.0, 1.0}
    assert all(r["key"].startswith(("T0/", "T1/")) for r in res["prompts"] + res["batches"])
    by_t = m["metrics"]["by_temperature"]
    assert set(by_t) == {"0", "1"} and set(by_t["1"]) == {"eagle3_tree", "ngram", "hybrid"}
    assert m["metrics"]["temperature"] == 0.0 and m["metrics"]["methods"] == by_t["0"]
    greedy = [r for r in res["prompts"] if r["temperature"] == 0.0]
    assert all(r["methods"]["hybrid"]["lossless"] for r in greedy)  # the hybrid is lossless like the others
    report = (Path(recipe.run_dir) / "eval" / "report.md").read_text()
    assert "temperature 0 (served)" in report and "temperature 1" in report and "sampling at temperature 1" in report


@pytest.mark.parametrize("value,words", [("[]", "is empty"), ("[-0.5]", "is not a temperature"),
                                         ("[0, 1e999]", "is not a temperature")])
def test_bad_temperature_lists_are_one_line_naming_the_key(value, words):
    from draftsmith.config import parse_recipe
    with pytest.raises(DraftsmithError, match=rf"evaluate\.temperatures .*{words}"):
        parse_recipe(["recipes/quickstart.yaml", "--evaluate.temperatures", value])
