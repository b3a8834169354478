"""The bad-input corpus (tests/badinput/cases.py) through the CLI: each case gives a one-line error
naming the file, the record and the fix, exit 2 and nothing half-written, or a counted skip."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from badinput.cases import CASES, SOURCES, Case, Ctx, base_recipe, doc_section, table
from draftsmith.artifacts import Ledger, load_manifest, stage_dir
from draftsmith.cli import main
from draftsmith.testing import make_model_dir

STAGE_DIRS = {"prepare": "data", "capture": "capture", "vocab": "vocab", "train": "train", "export": "export"}
FIX = re.compile(r"; \S|\((map|set|use) ")  # the fix follows "; " (or sits in brackets)
DOC = Path(__file__).parent.parent / "docs" / "reliability.md"


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def good_run(tmp_path_factory) -> tuple[Path, Path]:
    """(target, run folder) of a complete good run: prepare, capture, vocab, train, export."""
    import yaml

    tmp = tmp_path_factory.mktemp("badinput")
    target = make_model_dir(tmp / "target", num_layers=4, hidden_size=32)
    recipe = tmp / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(base_recipe(tmp / "run", target, SOURCES / "good.json")))
    for stage in STAGE_DIRS:
        assert main([stage, str(recipe)]) == 0, stage
    return target, tmp / "run"


def leftovers(root: Path) -> list[str]:
    """Temp files or folders of atomic writes still lying around."""
    return sorted(str(p.relative_to(root)) for p in root.rglob(".*") if ".tmp-" in p.name or ".old-" in p.name)


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=[pytest.mark.xfail(strict=True, reason=c.xfail)] if c.xfail else [])
                                  for c in CASES])
def test_case(case: Case, good_run, tmp_path, monkeypatch, capsys):
    target, base = good_run
    ctx = Ctx(tmp_path, base, target, monkeypatch)
    args = case.setup(ctx)
    capsys.readouterr()
    rc = main([case.command, *args])
    err = capsys.readouterr().err
    run_dir = ctx.run_dir
    if case.expect == "error":
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        assert rc == 2 and len(lines) == 1, f"rc {rc}, stderr:\n{err[-2000:]}"
        msg = lines[0]
        assert re.search(case.match, msg), msg
        assert FIX.search(msg), f"no fix in: {msg}"
        assert "Traceback" not in err
        assert not leftovers(tmp_path), leftovers(tmp_path)
        failed = [e["stage"] for e in Ledger(run_dir).read() if e["event"] == "stage_failed"] if run_dir.exists() else []
        for stage in {*failed, *([case.command] if case.command in STAGE_DIRS else [])}:
            m = load_manifest(stage_dir(run_dir, stage)) if (stage_dir(run_dir, stage) / "manifest.json").exists() else None
            assert m is None or m["status"] != "complete", f"{stage} marked complete after an error"
        if case.then_rerun_ok:
            monkeypatch.undo()
            assert main([case.command, *args]) == 0
            assert not leftovers(tmp_path)
    else:
        assert rc == 0, err[-2000:]
        m = load_manifest(stage_dir(run_dir, case.command))
        assert m["status"] == "complete"
        if case.expect.startswith("skip:"):
            assert m["counts"].get(case.expect[5:], 0) > 0, m["counts"]
        if case.expect == "truncated":
            assert m["truncated_source"] and m["truncated_source"]["complete_records"] == m["counts"]["read"] > 0
        assert not leftovers(tmp_path)


def test_corpus_is_large_and_ids_unique():
    ids = [c.id for c in CASES]
    assert len(ids) >= 40 and len(set(ids)) == len(ids)
    used = {p.name for p in SOURCES.iterdir()}
    assert all(any(name.split(".")[0] == c.id or name == "good.json" for c in CASES) for name in used), "orphan source file"


def test_doc_table_is_current():
    assert doc_section(DOC.read_text()) == table(), "regenerate: python tests/badinput/cases.py --write docs/reliability.md"


def test_nan_capture_stores_only_finite_states(good_run, tmp_path, monkeypatch):
    """The rejected samples are not in the shards, and every stored state is finite."""
    from safetensors.torch import load_file

    case = next(c for c in CASES if c.id == "nan_from_target_some")
    target, base = good_run
    ctx = Ctx(tmp_path, base, target, monkeypatch)
    assert main([case.command, *case.setup(ctx)]) == 0
    m = load_manifest(ctx.run_dir / "capture")
    data = load_manifest(ctx.run_dir / "data")
    kept = sum(s["num_samples"] for s in data["shards"])
    assert m["counts"]["samples"] + m["counts"]["rejected_nonfinite"] == kept
    for s in m["shards"]:
        t = load_file(str(ctx.run_dir / "capture" / s["file"]))
        assert torch.isfinite(t["aux_hidden"]).all() and torch.isfinite(t["final_hidden"]).all()
    assert json.loads((ctx.run_dir / "capture" / "manifest.json").read_text())["status"] == "complete"
