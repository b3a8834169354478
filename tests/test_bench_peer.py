"""benchmarks/bench_peer.py and bench_ablation.py --smoke: the whole path on a tiny synthetic target
(CPU, under a minute): our trainer and speculators' trainer on the same capture, its checkpoint
imported with `draftsmith import-drafter`, both measured on a held-out capture."""
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def run_bench(script: str, tmp_path: Path) -> dict:
    out = tmp_path / f"{script}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src"), "TMPDIR": str(tmp_path)}
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--smoke", "--out", str(out)], env=env, check=True,
                   capture_output=True, timeout=600)
    return json.loads(out.read_text())


def test_bench_peer_smoke(tmp_path):
    r = run_bench("bench_peer.py", tmp_path)
    ours, theirs = r["ours"][0], r["theirs"][0]
    assert "partial" not in r  # the run went to its end
    assert len(ours["heldout_acc"]) == len(theirs["heldout_acc"]) == 3
    assert all(0 <= a <= 1 for a in ours["heldout_acc"] + theirs["heldout_acc"])
    # speculators' defaults travel through its checkpoint into our drafter
    assert theirs["imported"]["format"] == "vllm"
    assert theirs["imported"]["flags"] == {"norm_before_fc": True, "norm_before_residual": True, "norm_output": True}
    assert theirs["imported"]["sliding_window"] == 2048
    assert theirs["steps"] == theirs["steps_per_epoch"] >= 1  # one epoch, as our smoke recipe
    assert r["peer_tau_ratio_of"] == "tau_sim" and r["peer_tau_ratio"] == ours["tau_sim"] / theirs["tau_sim"]
    # the teacher-forced chain tau: 1 + the held-out chain acceptance over sim_depth positions
    assert ours["tau_tf"] == 1 + sum(ours["heldout_chain"][:r["sim_depth"]])
    assert all(0 <= c <= a for c, a in zip(ours["heldout_chain"], ours["heldout_acc"]))
    assert set(r["phases_s"]["0"]) == {"peer_trained", "ours_trained", "ours_measured", "peer_imported_and_measured"}


def test_bench_ablation_smoke(tmp_path):
    r = run_bench("bench_ablation.py", tmp_path)
    assert sorted(r["variants"]) == ["baseline", "eagle3"]
    for v in r["variants"].values():
        run = v["runs"][0]
        assert len(run["heldout_acc"]) == 3 and run["steps"] >= 1 and run["epochs_started"] == 1


def test_engine_taus_reuses_only_an_evaluation_by_the_same_code_and_config(tmp_path, monkeypatch):
    """bench_ablation.engine_taus reuses a complete evaluation of the same drafter and settings only
    when the same draftsmith code wrote it with the same evaluate config; one by other code is
    measured again, forced (the evaluate stage's own fingerprint, config and inputs, would call it
    complete), and so is one at another temperature (a sampled variant once reused the peer's greedy
    figures: H100, 2026-12-06)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_ablation as ab
    from draftsmith.fileio import atomic_write_json
    from draftsmith.manifests import code_fingerprint

    args = type("A", (), dict(eval_prompts=20, max_new_tokens=96, draft_steps=5, benchmark="mtbench"))()
    run = tmp_path / "run"
    atomic_write_json(run / "train" / "manifest.json", {"status": "complete", "fingerprint": "fp-train"})
    methods = {"eagle3_chain": {"tau": 1.5, "speedup": 1.2}, "eagle3_tree": {"tau": 1.75, "speedup": 1.3}}

    def evaluation(code: str) -> dict:
        return {"status": "complete", "inputs": {"train": "fp-train"}, "versions": {"draftsmith_code": code},
                "config": {**config, "methods": ["eagle3_chain", "eagle3_tree", "ngram"]},
                "metrics": {"methods": methods, "accept_rate_per_position": [0.5]}}

    config = {"max_prompts": 20, "max_new_tokens": 96, "draft_steps": 5, "tree_depth": 5, "benchmarks": ["mtbench"],
              "temperature": 0.0}
    want = {**config, "methods": ["eagle3_chain", "eagle3_tree"]}  # the evaluate config the flags give
    calls = []
    fresh = {**evaluation(code_fingerprint()), "metrics": {"methods": {m: {"tau": 2.0, "speedup": 1.4} for m in methods},
                                                           "accept_rate_per_position": [0.6]}}
    monkeypatch.setattr(ab.pipeline, "run_stage", lambda stage, recipe, force=False: calls.append((stage, force)) or fresh)
    monkeypatch.setattr(ab, "recipe_for", lambda *a, **k: SimpleNamespace(evaluate=dict(want)))
    atomic_write_json(run / "eval" / "manifest.json", evaluation(code_fingerprint()))
    turns = [("mtbench#0", (10, 5), (12, 4)), ("mtbench#0/turn2", (9, 3), (9, 3))]
    atomic_write_json(run / "eval" / "results.json", {"prompts": [
        {"key": k, "methods": {"eagle3_chain": {"emitted": c[0], "rounds": c[1], "lossless": k == "mtbench#0"},
                               "eagle3_tree": {"emitted": t[0], "rounds": t[1], "lossless": True}}}
        for k, c, t in turns]})
    row = ab.engine_taus(args, "r.yaml", run, 0, [])
    assert row["speedup_tree"] == 1.3 and calls == []
    assert row["per_turn"] == {"eagle3_chain": [["mtbench#0", 10, 5], ["mtbench#0/turn2", 9, 3]],
                               "eagle3_tree": [["mtbench#0", 12, 4], ["mtbench#0/turn2", 9, 3]]}
    assert row["identical_to_plain"] == {"eagle3_chain": 1, "eagle3_tree": 2}  # the second chain answer left plain's
    atomic_write_json(run / "eval" / "manifest.json", evaluation("older-code"))
    assert ab.engine_taus(args, "r.yaml", run, 0, [])["tau_tree"] == 2.0 and calls == [("evaluate", True)]
    atomic_write_json(run / "eval" / "manifest.json", evaluation(code_fingerprint()))
    want["temperature"] = 1.0
    assert ab.engine_taus(args, "r.yaml", run, 0, [])["tau_tree"] == 2.0 and calls[1:] == [("evaluate", True)]


def test_merge_of_seeds_run_apart(tmp_path, monkeypatch):
    """bench_peer --merge: seeds measured in separate calls become one result whose means and ratio
    are over all their rows; files of other settings or of another capture (the peer's setting: a
    target trained again), one seed twice, a missing file or another JSON are refused in one line
    naming the file."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_peer

    def result(seed: int, ours: float, theirs: float, flags=("--train.lr", "0.003"), capture="c0") -> Path:
        row = lambda tau: {"seed": seed, "tau_tree": tau, "tau_sim": tau + 0.1, "heldout_acc": [0.8, 0.7]}  # noqa: E731
        r = {"recipe": "r.yaml", "ours_flags": list(flags), "depth": 2, "sim_depth": 2, "eval_prompts": 16,
             "benchmark": "mt.jsonl", "peer_tau_ratio_of": "tau_tree", "ours": [row(ours)],
             "theirs": [row(theirs) | {"setting": {"capture": capture, "epochs": 4}}],
             "phases_s": {str(seed): {"peer_trained": 1.0}}}
        p = tmp_path / f"s{seed}-{len(flags)}-{capture}.json"
        p.write_text(json.dumps(r))
        return str(p)

    out = tmp_path / "all.json"
    assert bench_peer.main(["--merge", result(0, 4.5, 4.0), result(1, 4.3, 4.4), "--out", str(out)]) == 0
    m = json.loads(out.read_text())
    assert [r["seed"] for r in m["ours"]] == [0, 1] and sorted(m["phases_s"]) == ["0", "1"]
    assert m["ours_mean"]["tau_tree"] == 4.4 and m["theirs_mean"]["tau_tree"] == 4.2
    assert m["peer_tau_ratio"] == 4.4 / 4.2 and m["peer_tau_ratio_of"] == "tau_tree"
    with pytest.raises(SystemExit, match="ours_flags .* differs"):
        bench_peer.main(["--merge", result(0, 4.5, 4.0), result(2, 4.3, 4.4, flags=()), "--out", str(out)])
    with pytest.raises(SystemExit, match=r"seed\(s\) \[0\] in more than one"):
        bench_peer.main(["--merge", result(0, 4.5, 4.0), str(tmp_path / "s1-2-c0.json"), result(0, 4.1, 4.0),
                         "--out", str(tmp_path / "dup.json")])
    assert not (tmp_path / "dup.json").exists()
    with pytest.raises(SystemExit, match=r"different captures \(.*s0-2-c0.json: c0; .*s1-2-c1.json: c1\)"):
        bench_peer.main(["--merge", result(0, 4.5, 4.0), result(1, 4.3, 4.4, capture="c1"), "--out", str(tmp_path / "dup.json")])
    assert not (tmp_path / "dup.json").exists()
    (tmp_path / "other.json").write_text(json.dumps({"recipe": "r.yaml"}))
    for bad, why in (("missing.json", "file not found"), ("other.json", "not a bench_peer result")):
        with pytest.raises(SystemExit, match=f"--merge: .*{bad}: {why}"):
            bench_peer.main(["--merge", result(0, 4.5, 4.0), str(tmp_path / bad), "--out", str(tmp_path / "dup.json")])
    assert not (tmp_path / "dup.json").exists()


def test_ratios_by_temperature_each_from_the_recipe_that_serves_it(tmp_path, monkeypatch):
    """An evaluation at several temperatures gives a row per temperature (its own figures and turns,
    a record names its temperature); bench_peer's summary has one ratio per temperature both sides
    measured, with its interval over that temperature's turns; --by-temperature takes each temperature
    from the result whose recipe serves it and refuses, in one line, a temperature two results claim
    or one a result serves but never measured."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_ablation as ab
    import bench_peer

    eagle = ("eagle3_chain", "eagle3_tree")
    metrics = {"temperature": 0.0, "methods": {}, "by_temperature": {
        "0": {"eagle3_chain": {"tau": 3.0, "speedup": 2.0}, "eagle3_tree": {"tau": 4.0, "speedup": 2.5}},
        "1": {"eagle3_chain": {"tau": 2.0, "speedup": 1.5}, "eagle3_tree": {"tau": 2.5, "speedup": 1.6}}}}
    prompts = [{"key": f"T{T}/mtbench#0", "temperature": float(T),
                "methods": {m: {"emitted": 8 + T, "rounds": 2} for m in eagle}} for T in (0, 1)]
    by = ab.by_temperature(metrics, prompts, eagle)
    assert by["1"]["tau_tree"] == 2.5 and by["0"]["speedup_chain"] == 2.0
    assert by["1"]["per_turn"]["eagle3_tree"] == [["T1/mtbench#0", 9, 2]]  # that temperature's turns only
    assert ab.by_temperature({"temperature": 0.7, "methods": metrics["by_temperature"]["1"]},
                             [dict(prompts[1], temperature=0.7)], eagle)["0.7"]["tau_tree"] == 2.5  # one temperature

    def row(seed, t0, t1):
        turns = lambda tau: {"eagle3_tree": [["a", tau * 4, 4], ["b", tau * 2, 2]]}  # noqa: E731
        return {"seed": seed, "tau_tree": t0, "per_turn": turns(t0), "by_temperature": {
            "0": {"tau_tree": t0, "per_turn": turns(t0)}, "1": {"tau_tree": t1, "per_turn": turns(t1)}}}

    def result(name, ours, theirs, serves):
        r = {"ours": [row(0, *ours)], "theirs": [row(0, *theirs)], "serves": serves, "ours_flags": [name]}
        bench_peer.summarize(r, "tau_tree", None)
        (tmp_path / name).write_text(json.dumps(r))
        return r, str(tmp_path / name)

    greedy, g = result("greedy.json", (4.4, 2.0), (4.0, 4.0), [0.0])
    assert greedy["peer_tau_ratio_by_temperature"]["1"]["ratio"] == 0.5
    assert [round(x, 6) for x in greedy["peer_tau_ratio_by_temperature"]["0"]["ci95"]] == [1.1, 1.1]  # every turn has the same ratio
    _, sampled = result("sampled.json", (4.0, 4.4), (4.0, 4.0), [1.0])
    out = tmp_path / "temps.json"
    assert bench_peer.main(["--by-temperature", g, sampled, "--out", str(out)]) == 0
    t = json.loads(out.read_text())
    assert {T: round(v["ratio"], 6) for T, v in t["by_temperature"].items()} == {"0": 1.1, "1": 1.1}
    assert t["by_temperature"]["1"]["file"] == "sampled.json" and round(t["min_ratio"], 6) == 1.1
    with pytest.raises(SystemExit, match="temperature 0 is served by greedy.json and .*other.json"):
        bench_peer.main(["--by-temperature", g, result("other.json", (4.0, 4.4), (4.0, 4.0), [0.0])[1]])
    with pytest.raises(SystemExit, match="serves temperature 0.7 but did not measure it"):
        bench_peer.main(["--by-temperature", result("x.json", (4.0, 4.4), (4.0, 4.0), [0.7])[1]])


@pytest.mark.parametrize("script", ["bench_peer.py", "bench_ablation.py"])
def test_a_base_without_its_stages_is_one_line_and_links_nothing(tmp_path, script):
    """--base naming a run whose capture was never made: one line naming the stage's manifest and
    the command that makes it, exit 1, no run folder linked to the missing stages (a second try
    used to fail on the dangling links with a traceback)."""
    base, work = tmp_path / "base", tmp_path / "work"
    (base / "data").mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, str(ROOT / "benchmarks" / script), "--recipe", str(ROOT / "benchmarks" / "recipes" / "lab.yaml"),
           "--base", str(base), "--heldout", str(base), "--work", str(work), "--no-engine"]
    for _ in range(2):
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(script.removesuffix(".py") + ": ")
        assert str(base / "data" / "manifest.json") in lines[0] and "draftsmith prepare" in lines[0]
        assert not work.exists() or not any(work.rglob("*"))


def test_a_run_cut_after_our_side_keeps_its_row(tmp_path, monkeypatch):
    """A device call's limit can cut bench_peer between its sides: --out holds what was measured
    (our row, `partial` saying how far it got) from the moment it is measured, and --merge refuses
    that file in one line."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    import bench_ablation
    import bench_peer

    real, calls = bench_ablation.measure, []

    def cut_on_the_peer(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # the kill at the call's limit, while the peer is measured
        return real(*a, **k)

    monkeypatch.setattr(bench_ablation, "measure", cut_on_the_peer)
    out = tmp_path / "cut.json"
    with pytest.raises(KeyboardInterrupt):
        bench_peer.main(["--smoke", "--out", str(out)])
    r = json.loads(out.read_text())
    assert r["partial"] == "seed 0: ours measured, the peer not yet" and not r["theirs"]
    assert len(r["ours"]) == 1 and r["ours"][0]["seed"] == 0 and len(r["ours"][0]["heldout_acc"]) == 3
    assert "peer_tau_ratio" not in r
    with pytest.raises(SystemExit, match="cut.json: a partial result"):
        bench_peer.main(["--merge", str(out), "--out", str(tmp_path / "m.json")])


def test_heldout_rows_have_one_shape_and_the_padded_figures(tmp_path, monkeypatch):
    """bench_ablation.heldout_acceptance packs the held-out samples into rows of one shape (on a
    GPU the compiled TTT attention then compiles once, not once per length) and gives the figures
    of one sample a row: correct, chain and weight per position, summed by hand over samples."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_ablation

    import draftsmith.train.ttt as ttt
    from draftsmith import pipeline
    from draftsmith.manifests import require_complete, verify_shards
    from draftsmith.rundir import stage_dir
    from draftsmith.draft.io import load_drafter
    from draftsmith.target.model import read_target_embeddings
    from draftsmith.train.data import CaptureIndex
    from draftsmith.draft.vocab import draft_ids

    recipe_path, base, heldout = bench_ablation.make_smoke(tmp_path)
    recipe = bench_ablation.recipe_for(recipe_path, Path(base), 0, [])
    pipeline.run_stage("train", recipe)
    drafter = load_drafter(Path(base) / "train" / "drafter")
    shapes, real = [], ttt.ttt_loss
    monkeypatch.setattr(ttt, "ttt_loss", lambda *a, **k: shapes.append(tuple(a[1].shape)) or real(*a, **k))
    depth = 3
    got = bench_ablation.heldout_acceptance(drafter, stage_dir(heldout, "capture"), recipe.target.path, depth, 64,
                                            batch_tokens=128)
    assert len(shapes) > 1 and set(shapes) == {(1, 128)}
    cap = stage_dir(heldout, "capture")
    m = require_complete(cap, "capture")
    index = CaptureIndex(verify_shards(cap, m, check_hash=False), 64, int(m["hidden_size"]), len(m["aux_layer_ids"]))
    head = read_target_embeddings(recipe.target.path)[1][draft_ids(drafter.d2t)].float()
    sums = torch.zeros(3, depth, dtype=torch.float64)
    for j in range(len(index)):  # one sample a row, no padding
        b = index.batch([j])
        out = real(drafter.float(), b.input_ids, b.loss_mask, b.aux_hidden.float(), b.final_hidden.float(), head, depth, 1.0)
        sums += torch.stack([out.correct, out.chain, out.weight]).double()
    assert got["samples"] == len(index) and got["weight"] == sums[2].tolist()
    torch.testing.assert_close(torch.tensor(got["acc"], dtype=torch.float64), sums[0] / sums[2])
    torch.testing.assert_close(torch.tensor(got["chain"], dtype=torch.float64), sums[1] / sums[2])


def test_peer_ratio_interval_over_turns(tmp_path, monkeypatch):
    """bench_peer's 95% interval of peer_tau_ratio: a paired bootstrap over the evaluation's turns
    (the same turns drawn for every seed and side). It holds the ratio; a drafter that leads on every
    turn by the same factor gives that factor at both ends; it is left out when a row lacks its turns
    or the sides measured different turns; --merge computes it over the merged seeds."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_peer

    def row(seed, taus, keys=None):
        keys = keys or [f"q{i}" for i in range(len(taus))]
        return {"seed": seed, "tau_tree": None, "per_turn": {"eagle3_tree": [[k, round(t * 10), 10] for k, t in zip(keys, taus)]}}

    def result(ours, theirs):
        r = {"ours": ours, "theirs": theirs}
        for side in ("ours", "theirs"):
            for x in r[side]:
                x["tau_tree"] = sum(t[1] for t in x["per_turn"]["eagle3_tree"]) / sum(t[2] for t in x["per_turn"]["eagle3_tree"])
        return r

    g = torch.Generator().manual_seed(0)
    theirs = [row(s, (2 + 2 * torch.rand(30, generator=g)).tolist()) for s in (0, 1)]
    ours = [row(s, [t[1] / 10 * (1.2 if i % 2 else 0.9) for i, t in enumerate(r["per_turn"]["eagle3_tree"])]) for s, r in enumerate(theirs)]
    r = result(ours, theirs)
    point = (sum(x["tau_tree"] for x in ours) / 2) / (sum(x["tau_tree"] for x in theirs) / 2)
    (lo, hi), n = bench_peer.ratio_interval(r, "tau_tree")
    assert n == 30 and lo < point < hi and hi - lo > 0.05
    same = result([row(s, [t[1] / 10 * 1.1 for t in x["per_turn"]["eagle3_tree"]]) for s, x in enumerate(theirs)], theirs)
    (lo, hi), _ = bench_peer.ratio_interval(same, "tau_tree")
    assert abs(lo - 1.1) < 0.01 and abs(hi - 1.1) < 0.01
    assert bench_peer.ratio_interval(r, "tau_sim") is None
    other = result([row(0, [3.0] * 30, keys=[f"p{i}" for i in range(30)])], theirs[:1])
    assert bench_peer.ratio_interval(other, "tau_tree") is None
    files = []
    for s in (0, 1):
        f = tmp_path / f"s{s}.json"
        f.write_text(json.dumps({"recipe": "r", "ours_flags": [], "depth": 6, "sim_depth": 5, "eval_prompts": 15,
                                 "benchmark": "mt", "peer_tau_ratio_of": "tau_tree", "ours": [ours[s]], "theirs": [theirs[s]]}))
        files.append(str(f))
    assert bench_peer.main(["--merge", *files, "--out", str(tmp_path / "m.json")]) == 0
    m = json.loads((tmp_path / "m.json").read_text())
    assert m["peer_tau_ratio_ci95"] == list(bench_peer.ratio_interval(r, "tau_tree")[0]) and m["peer_tau_ratio_turns"] == 30


def test_the_peers_checkpoint_is_reused_only_at_the_same_setting(tmp_path, monkeypatch):
    """A finished peer checkpoint of this seed is reused when its defaults, data and equal-data
    settings are this run's; at other epochs (or another capture) the peer trains again."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_peer
    from draftsmith.fileio import atomic_write_json
    from draftsmith.config import Recipe, TrainConfig

    atomic_write_json(tmp_path / "base" / "capture" / "manifest.json", {"status": "complete", "fingerprint": "cap-1"})
    args = type("A", (), dict(base=str(tmp_path / "base"), total_seq_len=1024))()
    trainings = []
    monkeypatch.setattr(bench_peer, "train_peer", lambda args, recipe, seed, out: trainings.append(recipe.train.epochs) or
                        {"trained": recipe.train.epochs})
    out = tmp_path / "theirs" / "speculators"
    (out / "final").mkdir(parents=True)
    two = Recipe(train=TrainConfig(epochs=2))
    atomic_write_json(out / bench_peer.TRAINED, {"defaults": bench_peer.PEER_DEFAULTS, "steps": 7,
                                                  "setting": bench_peer.peer_setting(args, two)})
    assert bench_peer.trained_peer(args, two, 0, out)["steps"] == 7 and trainings == []      # reused
    assert bench_peer.trained_peer(args, Recipe(train=TrainConfig(epochs=4)), 0, out) == {"trained": 4}
    assert not out.exists()  # the older training's files went before the new one
    (out / "final").mkdir(parents=True)
    atomic_write_json(out / bench_peer.TRAINED, {"defaults": bench_peer.PEER_DEFAULTS, "steps": 7,
                                                  "setting": bench_peer.peer_setting(args, two)})
    atomic_write_json(tmp_path / "base" / "capture" / "manifest.json", {"status": "complete", "fingerprint": "cap-2"})
    assert bench_peer.trained_peer(args, two, 0, out) == {"trained": 2} and trainings == [4, 2]  # other data


def test_a_signal_during_the_peers_training_marks_nothing_complete(tmp_path, monkeypatch):
    """speculators' trainer catches SIGTERM (a device call's `timeout`), saves an `interrupted`
    checkpoint and returns as if done: bench_peer stops there with a one-line error, and writes
    neither the peer's final checkpoint nor its trained.json (a rerun must not reuse a partial peer)."""
    import signal
    import tempfile

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the smoke run's folder (mkdtemp) under tmp_path
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    import bench_peer
    from speculators.train.trainer import Trainer

    monkeypatch.setattr(Trainer, "train_epoch", lambda self, epoch: os.kill(os.getpid(), signal.SIGTERM))
    with pytest.raises(SystemExit, match="speculators' training was interrupted by a signal after 0 steps"):
        bench_peer.main(["--smoke", "--out", str(tmp_path / "r.json")])
    assert list(tmp_path.rglob("interrupted")) and not list(tmp_path.rglob(bench_peer.TRAINED))
    assert not [d for d in tmp_path.rglob("final") if d.parent.name == "speculators"]


def test_ablation_variant_links_regen_and_prints_its_temperature(tmp_path, monkeypatch, capsys):
    """A variant's run folder links the base's regen/ when the base regenerated (a recipe with
    regenerate on failed there at once: H100, 2026-12-06), not when it did not; --temperature puts
    evaluate.temperature in every variant's flags (the printed commands reproduce the run)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_ablation as ab
    from draftsmith.fileio import atomic_write_json

    base = tmp_path / "base"
    for d in ("data", "capture", "vocab"):
        atomic_write_json(base / d / "manifest.json", {"status": "complete", "fingerprint": "fp"})
    ab.link_stages(base, tmp_path / "plain")
    assert sorted(p.name for p in (tmp_path / "plain").iterdir()) == ["capture", "data", "vocab"]
    atomic_write_json(base / "regen" / "manifest.json", {"status": "running", "fingerprint": "fp"})  # a cut regenerate is not linked
    ab.link_stages(base, tmp_path / "cut")
    assert not (tmp_path / "cut" / "regen").exists()
    atomic_write_json(base / "regen" / "manifest.json", {"status": "complete", "fingerprint": "fp"})
    ab.link_stages(base, tmp_path / "regen")
    assert (tmp_path / "regen" / "regen").resolve() == (base / "regen").resolve()

    assert ab.main(["--recipe", "r.yaml", "--base", str(base), "--heldout", "h", "--work", "w", "--variants", "baseline,t1",
                    "--temperature", "0.7", "--print-commands"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("draftsmith evaluate")]
    assert len(lines) == 2 and all("--evaluate.temperature 0.7 " in ln for ln in lines)
    assert "--train.ttt_target_temperature 1 " in lines[1]
