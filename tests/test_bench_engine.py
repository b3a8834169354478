"""benchmarks/bench_engine.py end to end on the CPU (tiny dims, static caches): it writes every key
the H200 collector reads, efficiencies are finite and positive, and the oracle really makes the
set τ happen (measured τ equals what τ gives under the token budget, every round accepting τ - 1)."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_engine  # noqa: E402


@pytest.mark.parametrize("tau", [3])
def test_bench_engine_small(tmp_path, tau):
    out = tmp_path / "engine.json"
    assert bench_engine.main(["--small", "--out", str(out), "--batch_sizes", "1", "2", "--repeats", "1",
                              "--tau", str(tau), "--max_new_tokens", "20"]) == 0
    d = json.loads(out.read_text())
    for B in (1, 2):
        for m in ("chain", "tree"):
            for suffix in ("", "_host"):
                e = d[f"engine_eff_small_bs{B}_{m}{suffix}"]
                assert math.isfinite(e) and e > 0
        assert 0 < d[f"plain_bw_fraction_small_bs{B}"] < 1
    assert d["drafter_step_over_target_small"] > 0
    assert math.isfinite(d["planner_max_abs_err_pct"])
    assert not d["skipped"]
    steps = d["weight_bound"]["by_draft_steps"]
    assert d["engine_eff_bound_small"] == steps["5"] and all(0 < steps[str(k + 1)] < steps[str(k)] < 1 for k in range(1, 5))
    assert d["capture_fallbacks"] == [] and d["target_attention"] == "decode_attention"
    assert all(int(s) >= d["prompt_len"] + d["max_new_tokens"] for s in d["cache_columns"].values())
    assert all(d["prompt_len"] + d["max_new_tokens"] < w <= d["cache_columns"][b] for b, w in d["attention_columns"].items())
    rounds_needed = math.ceil(19 / tau)  # 20 new tokens: the prefill's, then tau per round
    for row in d["runs"].values():
        for by_loop in row["methods"].values():
            for r in by_loop.values():
                assert r["tau"] == pytest.approx(19 / rounds_needed, abs=1e-3) == pytest.approx(d["tau_expected"], abs=1e-3)
                assert r["accept_per_position"] == [1.0] * (tau - 1) + [0.0] * (5 - tau + 1)
                assert r["equal_to_plain"].split("/")[0] == r["equal_to_plain"].split("/")[1]  # lossless
                assert math.isfinite(r["planner"]["err_pct"])


@pytest.mark.capture_fallback
@pytest.mark.parametrize("fail", [False, True])
def test_bench_engine_records_capture_fallbacks(tmp_path, monkeypatch, fail):
    """The graphs path under the emulated capture (test_fast.fast_mode): every graph captured, the JSON's
    capture_fallbacks is empty; a verify forward that cannot be captured (it raises only while being
    captured) runs eagerly, the output stays lossless, and both of its graphs are listed."""
    import functools

    from draftsmith.speculate import fast
    from test_fast import CAPTURING, fast_mode

    assert fast_mode("emulated", monkeypatch) == "graphs"
    monkeypatch.setattr(fast, "resolve_mode", lambda mode, device, key="": mode)  # graphs on a CPU
    if fail:
        real = fast.FastTarget.verify_rows

        @functools.wraps(real)
        def verify_rows(self, *args):
            if CAPTURING[0]:
                raise RuntimeError("operation not permitted when stream is capturing")
            return real(self, *args)
        monkeypatch.setattr(fast.FastTarget, "verify_rows", verify_rows)
    out = tmp_path / "engine.json"
    assert bench_engine.main(["--small", "--fast", "graphs", "--out", str(out), "--batch_sizes", "1", "--repeats", "1",
                              "--methods", "chain", "--max_new_tokens", "12"]) == 0
    d = json.loads(out.read_text())
    assert d["path"] == "graphs"
    for r in d["runs"]["1"]["methods"]["chain"].values():
        assert r["equal_to_plain"] == "1/1"
    if not fail:
        assert d["capture_fallbacks"] == []
        return
    what = {f.split(": RuntimeError: operation not permitted when stream is capturing")[0] for f in d["capture_fallbacks"]}
    assert {"FastTarget.verify_rows on inputs [(1, 6), (1, 6), (), (1,), (1,), (1, 6, 6), (256,)]",  # the host loop's rounds
            "the resident round (batch 1, topk 1, budget 5, depth 5)"} <= what, what
    # the rest: the step costs' verifies at other row counts
    assert all(w.startswith(("FastTarget.verify_rows on inputs", "the resident round")) for w in what), what


def test_oracle_tree_layout():
    """The oracle's tree: the true token on the first-child path down to depth tau - 1, everything
    else wrong, parents before children, scores falling along every path."""
    import torch

    table = torch.arange(100).repeat(2, 1)
    rows = torch.tensor([3, 10])
    K, D, tau = 3, 4, 3
    toks, scores, parents = bench_engine.oracle_tree(table, rows, K, D, tau, 512)
    assert toks.shape == scores.shape == parents.shape == (2, K + (D - 1) * K * K)
    for b in range(2):
        path, node = [], 0  # the first-child path: candidate 0, then the first of each next block
        start = K
        for depth in range(1, D + 1):
            path.append(int(toks[b, node]))
            if depth < D:
                assert int(parents[b, start]) == node
                node, start = start, start + K * K
        r = int(rows[b])
        assert path[:tau - 1] == [r + d for d in range(1, tau)]
        assert all(t != r + d for d, t in enumerate(path, 1) if d >= tau)
        for i in range(toks.shape[1]):
            p = int(parents[b, i])
            assert p < i and (p < 0 or scores[b, i] < scores[b, p])


@pytest.mark.parametrize("resident", [False, True])
def test_oracle_pays_the_drafting_cost(resident):
    """The oracle replaces the drafter's outputs, not its work: every round runs the drafter's D - 1
    expansion steps (and the committed-row feed), host loop and resident round alike."""
    import torch

    from draftsmith.speculate.engine import generate, plain_generate
    from draftsmith.speculate.eagle3 import FastDraft
    from draftsmith.speculate.fast import FastTarget

    dims = bench_engine.CONFIGS["small"]
    target = bench_engine.build_target(dims, torch.device("cpu"), torch.float32, 0)
    drafter = bench_engine.build_drafter(target, dims, 1)
    calls = []
    forward = drafter.forward
    drafter.forward = lambda *a, **k: calls.append(a[0].shape) or forward(*a, **k)
    ft = FastTarget(target, "static")
    prompt = [5, 6, 7, 8]
    ref = plain_generate(target, prompt, 16, fast=ft)
    table = torch.zeros(1, 40, dtype=torch.long)
    bench_engine.fill(table, [prompt + ref])
    prop = bench_engine.OracleEagle(drafter, table, 3, target.vocab_size, topk=2, budget=6, fast=FastDraft(drafter, False))
    new, [st] = generate(target, prop, [prompt], 16, depth=4, fast=ft, resident=resident)
    assert new == [ref] and st.accepted_per_round[:-1] == [2] * (st.rounds - 1)
    expansion_steps = sum(1 for s in calls if s[1] == 2)  # K = 2 frontier rows per step
    assert expansion_steps >= 3 * (st.rounds - 1)  # D - 1 = 3 steps every round (the last is cut by the budget)


def test_decisive_target_follows_its_permutation_in_bf16():
    """The benchmark target's greedy next token is perm[current token] at every position, also in
    bfloat16, with a margin far above rounding: what lets the oracle's truth survive any verify layout."""
    import torch

    dims = bench_engine.CONFIGS["small"]
    t = bench_engine.build_target(dims, torch.device("cpu"), torch.bfloat16, seed=0)
    emb, head = t.model.get_input_embeddings().weight, t.model.lm_head.weight
    ids = torch.randint(3, dims["vocab"], (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = t.model(ids).logits.float()
    top2 = logits.topk(2, dim=-1).values
    want = (head.float() @ emb.float().T).argmax(0)  # the token whose lm_head row is each embedding
    assert torch.equal(logits.argmax(-1), want[ids])
    assert ((top2[..., 0] - top2[..., 1]) > 0.3 * top2[..., 0].abs()).all()


def test_weight_bound_8b_golden(capsys):
    """The ceiling of speedup / τ for the 8B pair, by hand: the target reads 8.030B bf16 params a step
    (16.061 GB); a drafter step its layer and head: q/k/v 8192 x 6144 + o 4096^2 + MLP 3 x 4096 x 14336
    + lm_head 32000 x 4096 + norms = 374.4M params (0.7487 GB); fc 12288 x 4096 once a round (0.1007 GB).
    Five steps: 16.061 / (16.061 + 5 x 0.7487 + 0.1007) = 0.8069; three: 0.8725. On the meta device."""
    assert bench_engine.main(["--bound_only"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["engine_eff_bound_8b"] == pytest.approx(0.8069, abs=1e-4)
    b = d["weight_bound"]
    assert b["target_gb_per_step"] == pytest.approx(16.061, abs=1e-3)
    assert b["drafter_gb_per_step"] == pytest.approx(0.7487, abs=1e-4)
    assert b["by_draft_steps"]["3"] == pytest.approx(0.8725, abs=1e-4)


def test_project_golden(tmp_path, capsys):
    """--project: the chain's speedup / τ by draft steps from a run's measured costs, by hand. A target
    forward of 10 ms for one row and 11 ms for 2..8 rows, a drafter step of 0.5 ms, a round overhead of
    1 ms (no plain overhead): at τ 3 a chain of k steps costs 0.5 k + 11 + 1 ms a round for 3 tokens,
    plain decoding 10 ms a token, so speedup / τ = 10 / (12 + 0.5 k): k = 2 -> 0.7692, 5 -> 0.6897."""
    costs = {"target_forward_ms": {str(n): 10.0 if n == 1 else 11.0 for n in (1, 2, 4, 8)}, "draft_step_ms": 0.5,
             "round_overhead_ms": 1.0, "plain_overhead_ms": 0.0, "by_batch": {}}
    run = {"tau_set": 3, "draft_steps": 5, "planner_loop": "resident", "runs": {"1": {}},
           "planner_inputs": {"resident": {"planner": costs}}}
    (tmp_path / "run.json").write_text(json.dumps(run))
    assert bench_engine.main(["--project", str(tmp_path / "run.json")]) == 0
    got = json.loads(capsys.readouterr().out)["speedup_over_tau_by_draft_steps"]["bs1"]
    assert list(got) == ["2", "3", "4", "5"]  # a chain commits at most k + 1 tokens: k >= τ - 1
    for k, v in got.items():
        assert v == pytest.approx(10 / (12 + 0.5 * int(k)), abs=1e-4)
