"""`draftsmith probe-layers` on a tiny model: every triple probed, the default compared, files written."""
from __future__ import annotations

import json

import yaml

from draftsmith import probe
from draftsmith.rundir import Ledger
from draftsmith.cli import main
from draftsmith.testing import make_model_dir

CONVERSATIONS = [[{"from": "human", "value": f"Count from {i} to {i + 6}."},
                  {"from": "gpt", "value": " ".join(str(j) for j in range(i, i + 7)) + ". Done!"}] for i in range(30)]


def test_candidates():
    assert probe.candidate_layers(61, 8, [1, 29, 57]) == [0, 1, 9, 17, 26, 29, 34, 43, 51, 57, 60]
    assert probe.candidate_triples([0, 1, 2, 3], [1, 1, 0]) == [(1, 1, 0), (0, 1, 2), (0, 1, 3), (0, 2, 3), (1, 2, 3)]
    assert len(probe.candidate_triples([0, 1, 2, 3], [0, 1, 3])) == 4  # the default is one of them


def test_probe_layers_tiny(tmp_path, capsys):
    target = make_model_dir(tmp_path / "tiny", num_layers=5, hidden_size=32)
    data = tmp_path / "convs.json"
    data.write_text(json.dumps([{"id": str(i), "conversations": c} for i, c in enumerate(CONVERSATIONS)]))
    run = tmp_path / "run"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"name": "probe", "run_dir": str(run),
                                      "target": {"path": str(target), "device": "cpu", "dtype": "float32"},
                                      "prepare": {"source": str(data), "max_length": 64}}))
    assert main(["probe-layers", str(recipe)]) == 2  # prepare first: a one-line error
    assert "prepare stage is missing" in capsys.readouterr().err
    assert main(["prepare", str(recipe)]) == 0
    argv = ["probe-layers", str(recipe), "--steps", "40", "--rank", "8", "--top-tokens", "64", "--batch", "128"]
    assert main(argv + ["--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    # 5 layers: default [1, 1, 1] (clamped) plus all C(5,3) = 10 distinct triples, ranked
    assert res["default"]["layers"] == [1, 1, 1] and len(res["candidates"]) == 11
    assert [r["rank"] for r in res["candidates"]] == list(range(1, 12))
    accs = [r["accuracy"] for r in res["candidates"]]
    assert accs == sorted(accs, reverse=True) and all(0 <= a <= 1 for a in accs)
    assert res["best"] == res["candidates"][0] and res["positions"] > 100
    assert res["recommendation"].startswith("target.aux_layer_ids" if res["significant"] else "keep the default")
    assert json.loads((run / "probe" / "results.json").read_text())["candidates"] == res["candidates"]
    assert "(default)" in (run / "probe" / "report.md").read_text()
    ev = [e for e in Ledger(run).read() if e["event"] == "probe_layers"][-1]
    assert ev["best"] == res["best"]["layers"] and ev["default"] == [1, 1, 1]
    # Same seed, same answer.
    assert main(argv + ["--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert [r["layers"] for r in again["candidates"]] == [r["layers"] for r in res["candidates"]]
    assert main(["probe-layers", str(recipe), "--layers", "0", "1"]) == 2
    assert "at least 3 distinct" in capsys.readouterr().err
    assert main(["probe-layers", str(recipe), "--layers", "0", "1", "9"]) == 2
    assert "outside 0..4" in capsys.readouterr().err


def test_probe_holds_out_whole_conversations(tmp_path):
    """The probe's held-out positions are grouped by conversation: ShareGPT's parts `a_0`, `a_1` of one
    conversation share one owner, so the split never puts part of it on both sides."""
    import torch

    from draftsmith.data.shards import Sample
    from draftsmith.probe import gather
    from draftsmith.target.model import load_target

    target = load_target(make_model_dir(tmp_path / "tiny", num_layers=3, hidden_size=32), device="cpu", dtype="float32")
    ids = ["a_0", "a_1", "b", "c", "d"]
    samples = [Sample(torch.arange(3, 13), torch.ones(10, dtype=torch.bool), j, source_id=i) for j, i in enumerate(ids)]
    owner = gather(target, samples, 10_000)["owner"]
    per_sample = owner.view(len(ids), -1)[:, 0].tolist()
    assert per_sample[0] == per_sample[1] and len(set(per_sample)) == 4
