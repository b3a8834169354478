"""The bad-input corpus (tests/badinput/cases.py) through the CLI: each case gives a one-line error
naming the file, the record and the fix, exit 2 and nothing half-written, or a counted skip."""
from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import torch

from badinput.cases import CASES, SOURCES, Case, Ctx, base_recipe, doc_section, table
from draftsmith.fileio import TEMP_FILE_TAG, TEMP_TAGS, aside_path, is_temp_name
from draftsmith.manifests import load_manifest, verify_shards
from draftsmith.rundir import stage_dir
from draftsmith.cli import main
from draftsmith.testing import make_model_dir

STAGE_DIRS = {"prepare": "data", "capture": "capture", "vocab": "vocab", "train": "train", "export": "export"}
FIX = re.compile(r"; \S|\((map|set|use) ")  # the fix follows "; " (or sits in brackets)
DOC = Path(__file__).parent.parent / "docs" / "reliability.md"


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


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
    """Temp files or folders of atomic writes, or stage outputs set aside, still lying around:
    every name fileio.aside_path makes (fileio.is_temp_name)."""
    return sorted(str(p.relative_to(root)) for p in root.rglob(".*") if is_temp_name(p.name))


def test_leftovers_sees_every_temp_name(tmp_path):
    """The check sees each name the code writes while replacing something (fileio.TEMP_TAGS:
    `.NAME.tmp-PID-THREAD`, `.NAME.tmp`, `.NAME.old`, `.STAGE.previous`), not only the first."""
    made = [aside_path(tmp_path / "run" / "train" / "drafter", tag) for tag in TEMP_TAGS]
    made.append(aside_path(tmp_path / "run" / "data" / "manifest.json", TEMP_FILE_TAG, "123-456"))
    for p in made:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("")
    for name in (".data.previous", ".drafter.tmp", ".drafter.old", ".manifest.json.tmp-1-2"):
        (tmp_path / name).mkdir()
    (tmp_path / "run" / "data" / "manifest.json").write_text("{}")
    (tmp_path / "run" / ".hidden.json").write_text("{}")
    assert leftovers(tmp_path) == sorted([*(str(p.relative_to(tmp_path)) for p in made),
                                          ".data.previous", ".drafter.tmp", ".drafter.old", ".manifest.json.tmp-1-2"])


def complete_manifests(run_dir: Path) -> dict[str, str]:
    """Stage -> text of its complete manifest, for every stage folder of a run."""
    out = {}
    for stage in (*STAGE_DIRS, "evaluate"):
        p = stage_dir(run_dir, stage) / "manifest.json"
        if p.is_file() and not p.parent.is_symlink():
            text = p.read_text(errors="replace")
            if '"status": "complete"' in text:
                out[stage] = text
    return out


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=[pytest.mark.xfail(strict=True, reason=c.xfail)] if c.xfail else [])
                                  for c in CASES])
def test_case(case: Case, good_run, tmp_path, monkeypatch, capsys):
    target, base = good_run
    ctx = Ctx(tmp_path, base, target, monkeypatch)
    try:
        _run_case(case, ctx, tmp_path, monkeypatch, capsys)
    finally:
        for fn in ctx.finalizers:
            fn()


def _run_case(case: Case, ctx: Ctx, tmp_path: Path, monkeypatch, capsys) -> None:
    args = case.setup(ctx)
    run_dir = ctx.run_dir
    before = complete_manifests(run_dir) if run_dir.is_dir() else {}
    capsys.readouterr()
    rc = main([case.command, *args])
    captured = capsys.readouterr()
    err = captured.err
    assert "Traceback" not in err + captured.out
    if case.expect == "error":
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        assert rc == 2 and len(lines) == 1, f"rc {rc}, stderr:\n{err[-2000:]}"
        msg = lines[0]
        assert re.search(case.match, msg), msg
        assert FIX.search(msg), f"no fix in: {msg}"
        assert not leftovers(tmp_path), leftovers(tmp_path)
        # nothing faked: no stage became complete by failing; nothing lost: what was complete still is, unchanged
        after = complete_manifests(run_dir) if run_dir.is_dir() else {}
        assert after == {k: v for k, v in before.items() if k in after} and set(before) <= set(after), \
            f"complete stages before {sorted(before)}, after {sorted(after)}"
        if case.then_rerun_ok:
            monkeypatch.undo()
            assert main([case.command, *args]) == 0
            assert not leftovers(tmp_path)
    elif case.check is not None:
        assert rc == 0, err[-2000:]
        case.check(ctx, captured.out)
    else:
        assert rc == 0, err[-2000:]
        d = stage_dir(run_dir, case.command)
        m = load_manifest(d)
        assert m["status"] == "complete"
        verify_shards(d, m)  # every listed shard is there and matches its checksum
        if case.command == "prepare":
            assert m["counts"]["kept"] > 0 and m["shards"], m["counts"]
        if case.expect.startswith("skip:"):
            assert m["counts"].get(case.expect[5:], 0) > 0, m["counts"]
        if case.expect == "truncated":
            assert m["truncated_source"] and m["truncated_source"]["complete_records"] == m["counts"]["read"] > 0
        assert not leftovers(tmp_path)


def test_corpus_is_large_and_ids_unique():
    ids = [c.id for c in CASES]
    assert len(ids) >= 60 and len(set(ids)) == len(ids)
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


@pytest.mark.parametrize("case_id", ["vocab_map_disagrees", "capture_shard_lacks_key"])
def test_fix_hint_commands_run_and_fix_the_run(case_id, good_run, tmp_path, monkeypatch, capsys):
    """The fix a stage names is whole commands, pasted as they are: each names the run's recipe.yaml
    (shell-quoted), runs with exit 0, and after them the stage the error came from is complete."""
    case = next(c for c in CASES if c.id == case_id)
    target, base = good_run
    ctx = Ctx(tmp_path, base, target, monkeypatch)
    args = case.setup(ctx)
    capsys.readouterr()
    assert main([case.command, *args]) == 2
    msg = capsys.readouterr().err.strip()
    commands = re.findall(r"`(draftsmith [^`]+)`", msg.split("; ", 1)[1])
    assert len(commands) == 2, msg
    recipe = ctx.run_dir / "recipe.yaml"
    for cmd in commands:
        argv = shlex.split(cmd)
        assert argv[0] == "draftsmith" and argv[2] == str(recipe), cmd
        assert main(argv[1:]) == 0, cmd
    assert load_manifest(ctx.run_dir / case.command)["status"] == "complete"
    assert not leftovers(tmp_path)


def test_rerun_command_quotes_a_path_with_spaces(tmp_path):
    from draftsmith.rundir import fix_command, rerun_command

    run_dir = tmp_path / "my runs" / "a b"
    cmd = rerun_command("vocab", run_dir)[1:-1]
    assert shlex.split(cmd) == ["draftsmith", "vocab", str(run_dir / "recipe.yaml"), "--force"]
    # outside a run directory (no recipe.yaml up the path) the fix cannot name the recipe: it says so
    assert "RECIPE.yaml" in fix_command("vocab", run_dir / "vocab" / "vocab.safetensors")
    run_dir.mkdir(parents=True)
    (run_dir / "recipe.yaml").write_text("name: x\n")
    assert fix_command("vocab", run_dir / "vocab" / "vocab.safetensors", then=("train",)) == \
        f"{rerun_command('vocab', run_dir)}, then {rerun_command('train', run_dir)}"
    # a damaged stage folder: the stage its manifest names, only when that is the stage of this folder
    from draftsmith.rundir import redo_stage_hint

    assert redo_stage_hint(run_dir / "data", {"stage": "prepare"}).startswith(
        f"redo the stage with {rerun_command('prepare', run_dir)}, then")
    for edited in ({"stage": "capture"}, {"stage": "prepare; rm -rf ~"}, {"stage": 3}, None):
        assert redo_stage_hint(run_dir / "data", edited) == f"delete {run_dir / 'data'} and rerun its stage"
