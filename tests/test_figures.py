"""Each stage's figures (draftsmith/figures/) against the manifests a real tiny run writes: every key a
stage writes into a figures section is a field, every field is written (so a figure renamed in the
dataclass or in the writer fails here, not in a report), each section reads back to what was written,
and `status` shows every figure it reads. Then malformed manifests and ledger records: `status` names
the file in one line and goes on, never a traceback."""
from __future__ import annotations

import copy
import dataclasses
import json
import shutil
import subprocess
import sys
import types
import typing

import pytest
import yaml

from draftsmith import status
from draftsmith.cli import main
from draftsmith.figures.vocab import VocabMetrics
from draftsmith.manifests import Figures, ManifestHead
from draftsmith.rundir import LEDGER, stage_dir
from draftsmith.testing import make_model_dir

pytestmark = pytest.mark.usefixtures("one_thread")

CONVERSATIONS = [[{"from": "human", "value": f"Count from {i} to {i + 5}."},
                  {"from": "gpt", "value": " ".join(str(j) for j in range(i, i + 6)) + ". Done!"}] for i in range(24)]


@pytest.fixture(scope="module")
def one_thread():  # the module-scoped run below takes it too
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def run(tmp_path_factory, one_thread):
    """A complete tiny run of every stage: regenerated answers, held-out samples with the engine's tau,
    two evaluate temperatures and two batch sizes, so every section a stage can write is written."""
    root = tmp_path_factory.mktemp("figures")
    target = make_model_dir(root / "tiny", num_layers=4, hidden_size=64)
    (root / "convs.json").write_text(json.dumps([{"id": str(i), "conversations": c} for i, c in enumerate(CONVERSATIONS)]))
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["Count from 3 to 8.", "Count from 1 to 6."]))
    recipe = root / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "name": "tiny", "goal": "Every figure.", "run_dir": str(root / "run"),
        "target": {"path": str(target), "device": "cpu", "dtype": "float32"},
        "prepare": {"source": str(root / "convs.json"), "max_length": 64},
        "regenerate": {"enabled": True, "max_new_tokens": 8, "keep_truncated": True},
        "capture": {"storage_dtype": "float32"}, "vocab": {"draft_vocab_size": 64},
        "train": {"ttt_steps": 2, "max_steps": 4, "batch_tokens": 256, "warmup_steps": 1, "device": "cpu", "dtype": "float32",
                  "heldout_samples": 4, "eval_every": 2, "heldout_engine_prompts": 2},
        "evaluate": {"benchmarks": [str(root / "prompts.jsonl")], "max_new_tokens": 12, "draft_steps": 2,
                     "temperatures": [0.0, 1.0], "batch_sizes": [1, 2]},
    }))
    assert main(["run", str(recipe)]) == 0
    return root / "run"


def manifest(run_dir, stage):
    return json.loads((stage_dir(run_dir, stage) / "manifest.json").read_text())


def mismatches(cls, written: dict, where: str = "", top: bool = True) -> list[str]:
    """Fields of `cls` the stage did not write (absent_when_none ones may be absent) and, below the top level
    (which also holds the manifest's bookkeeping), keys it wrote that no field reads; into every section."""
    hints, names = typing.get_type_hints(cls), {f.name for f in dataclasses.fields(cls)}
    gathered = "skipped_" if cls.__name__ == "PrepareCounts" else None  # its skipped_<reason> keys: one field
    present = set(written) | ({"skipped"} if gathered and any(k.startswith(gathered) for k in written) else set())
    out = [f"{where}{f.name}: a field the stage does not write" for f in dataclasses.fields(cls)
           if f.name not in present and not f.metadata.get("absent_when_none")]
    if not top:
        out += [f"{where}{k}: written, read by no field" for k in written
                if k not in names and not (gathered and k.startswith(gathered))]
    for name in names & set(written):
        out += inside(hints[name], written[name], f"{where}{name}")
    return out


def inside(tp, v, where: str) -> list[str]:
    """mismatches of the sections a value of type tp holds (Optional, dict values, list items)."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    origin = typing.get_origin(tp)
    if isinstance(tp, type) and issubclass(tp, Figures):
        return mismatches(tp, v, f"{where}.", top=False) if isinstance(v, dict) else []
    if origin is dict and isinstance(v, dict):
        return [x for k, item in v.items() for x in inside(args[1], item, f"{where}.{k}")]
    if origin is list and isinstance(v, list):
        return [x for i, item in enumerate(v) for x in inside(args[0], item, f"{where}[{i}]")]
    if origin in (typing.Union, types.UnionType) and len(args) == 1:
        return inside(args[0], v, where)
    return []


@pytest.mark.parametrize("stage", list(status.FIGURES))
def test_every_figure_written_is_a_field_and_reads_back(run, stage):
    m = manifest(run, stage)
    cls = status.FIGURES[stage]
    problems: list[str] = []
    figures = cls.from_manifest(m, problems)
    assert problems == []  # every figure of the type its field says
    assert mismatches(cls, m) == []
    written = figures.to_dict()
    for name in written:  # what the stage wrote is what its figures give back
        assert json.dumps(written[name], sort_keys=True) == json.dumps(m[name], sort_keys=True), name
    head: list[str] = []
    ManifestHead.from_manifest(m, head)
    assert head == [] and mismatches(ManifestHead, m) == []


def test_a_renamed_figure_is_caught(run):
    """The check above on a dataclass with one figure renamed: the written key is read by no field, and
    the renamed field is written by no stage."""
    renamed = dataclasses.make_dataclass(
        "VocabMetrics", [("coverage_share" if f.name == "coverage" else f.name, f.type, dataclasses.field(default=None))
                         for f in dataclasses.fields(VocabMetrics)], bases=(Figures,), namespace={"__module__": VocabMetrics.__module__})
    found = mismatches(renamed, manifest(run, "vocab")["metrics"], "metrics.", top=False)
    assert found == ["metrics.coverage_share: a field the stage does not write", "metrics.coverage: written, read by no field"]
    assert renamed.from_manifest(manifest(run, "vocab")["metrics"]).coverage_share is None


def test_status_shows_every_figure_it_reads(run):
    """Every headline figure of every stage and every measured fact of Discoveries is there for a run
    that measured them all: a field status reads that no stage writes would be None and missing here."""
    st = status.collect(run)
    assert st["malformed"] == [] and all(s["state"] == "done" for s in st["stages"])
    for s in st["stages"]:
        shown = status.HEADLINES[s["stage"]](status.read_figures(s["stage"], manifest(run, s["stage"])))
        none = {k for k, v in shown.items() if v is None}
        assert none == ({"tau", "speedup"} if s["stage"] == "evaluate" else set()), s["stage"]  # evaluate: per method
        assert s["figures"] == {k: v for k, v in shown.items() if k not in none}
    ev = next(s for s in st["stages"] if s["stage"] == "evaluate")["figures"]
    assert {"tau eagle3_chain", "speedup eagle3_tree", "tau ngram", "tokens_per_s_plain", "prompts"} <= set(ev)
    labels = {f["label"] for f in st["discoveries"]}
    assert {label for _, label, _, _ in status.FIGURE_FACTS} <= labels
    assert {"hardware", "software", "eagle3_chain: τ / speedup / tokens/s", "predicted speedup (batch 1, k=2)"} <= labels
    ev_m = status.read_figures("evaluate", manifest(run, "evaluate"))
    assert set(ev_m.metrics.by_temperature) == {"0", "1"} and set(ev_m.metrics.batches) == {"2"}  # batch size 1 is the prompts themselves
    held = status.read_figures("train", manifest(run, "train")).metrics.heldout
    assert held.engine.tau_chain is not None and held.best_tau_sampled is not None and held.samples == 4


def leaves(d, path=()):
    """Every key path of a nested dict (the dicts themselves too)."""
    for k, v in d.items():
        yield path + (k,)
        if isinstance(v, dict):
            yield from leaves(v, path + (k,))


def figure_paths(stage, m):
    """The key paths of m that the stage's figures read (top-level fields and everything under a section)."""
    names = {f.name for f in dataclasses.fields(status.FIGURES[stage])}
    return [p for p in leaves(m) if p[0] in names]


def put(d, path, value):
    d = copy.deepcopy(d)
    at = d
    for k in path[:-1]:
        at = at[k]
    at[path[-1]] = value
    return d


def render_all(run_dir):
    """Every way status shows a run (no exception may escape any of them)."""
    st = status.collect(run_dir)
    status.to_markdown(st), status.to_brief(st), json.dumps(st, default=str)
    return st


@pytest.mark.parametrize("bad", ["x", [1, "y"], None, {"z": 1}], ids=["string", "list", "null", "object"])
def test_a_figure_of_the_wrong_type_is_named_not_a_traceback(run, tmp_path, bad):
    """Every figure of every stage's manifest replaced in turn by a value of another type: status runs
    to its end, and a wrong type is named in one line for that manifest."""
    copy_dir = tmp_path / "run"
    shutil.copytree(run, copy_dir, ignore=shutil.ignore_patterns("*.safetensors", "tensorboard", "step-*"))
    for stage in status.FIGURES:
        p = stage_dir(copy_dir, stage) / "manifest.json"
        good = json.loads(p.read_text())
        for path in figure_paths(stage, good):
            p.write_text(json.dumps(put(good, path, bad)))
            st = render_all(copy_dir)
            problems: list[str] = []
            status.read_figures(stage, json.loads(p.read_text()), problems)
            if problems:
                line = next(s for s in st["stages"] if s["stage"] == stage)["malformed"]
                assert line and line.startswith(f"{p.parent.name}/manifest.json: ") and "\n" not in line, (path, line)
        p.write_text(json.dumps(good))


CASES = {
    "metrics a string": lambda m: {**m, "metrics": "fast"},
    "metrics a list": lambda m: {**m, "metrics": [1, 2]},
    "counts not a dict": lambda m: {**m, "counts": [3]},
    "shards not a list": lambda m: {**m, "shards": 5},
    "timings a string": lambda m: {**m, "timings": "soon"},
    "hardware a list": lambda m: {**m, "hardware": ["h100"]},
    "times not numbers": lambda m: {**m, "started_at": "yesterday", "finished_at": [1]},
    "a time past the calendar": lambda m: {**m, "started_at": 1e300, "timings": {"wall_s": float("inf")}},
    "config not a dict": lambda m: {**m, "config": "x"},
}


@pytest.mark.parametrize("case", list(CASES))
def test_malformed_manifests_of_every_stage(run, tmp_path, case, capsys):
    copy_dir = tmp_path / "run"
    shutil.copytree(run, copy_dir, ignore=shutil.ignore_patterns("*.safetensors", "tensorboard", "step-*"))
    for stage in status.FIGURES:
        p = stage_dir(copy_dir, stage) / "manifest.json"
        p.write_text(json.dumps(CASES[case](json.loads(p.read_text()))))
    assert main(["status", str(copy_dir)]) == 0
    out = capsys.readouterr().out
    assert "Traceback" not in out and "## Immediate next step" in out
    # a manifest that is not an object at all: that stage is shown failed with the file named, the rest go on
    (stage_dir(copy_dir, "vocab") / "manifest.json").write_text("[1, 2]")
    st = render_all(copy_dir)
    vocab = next(s for s in st["stages"] if s["stage"] == "vocab")
    assert vocab["state"] == "failed" and "vocab/manifest.json: not a draftsmith manifest" in vocab["error"]


LEDGER_LINES = {
    "no event": {"time": 1.0, "stage": "train"},
    "event not a string": {"time": 1.0, "event": 3, "stage": "train"},
    "no time": {"event": "stage_failed", "stage": "train", "error": "boom"},
    "time not a number": {"event": "stage_started", "stage": "train", "time": "noon", "pid": "q"},
    "seconds not a number": {"event": "stage_failed", "stage": "train", "time": 2e9, "seconds": "long", "error": ["x"]},
    "a time past the calendar": {"event": "stage_started", "stage": "evaluate", "time": 1e300},
}


@pytest.mark.parametrize("case", list(LEDGER_LINES))
def test_malformed_ledger_records(run, tmp_path, case, capsys):
    copy_dir = tmp_path / "run"
    shutil.copytree(run, copy_dir, ignore=shutil.ignore_patterns("*.safetensors", "tensorboard", "step-*"))
    with open(copy_dir / LEDGER, "a") as f:
        f.write(json.dumps(LEDGER_LINES[case]) + "\n[1, 2]\n7\n")
    assert main(["status", str(copy_dir)]) == 0
    out = capsys.readouterr().out
    assert "Traceback" not in out and "## Immediate next step" in out
    st = render_all(copy_dir)
    if case != "a time past the calendar":
        assert len(st["malformed"]) == 1 and st["malformed"][0].startswith(f"{LEDGER}: record ")
        assert f"- malformed: {LEDGER}: record" in status.to_markdown(st)


def test_status_and_plan_import_no_torch():
    code = ("import sys, draftsmith.status, draftsmith.plan, draftsmith.figures.train, draftsmith.figures.evaluate, "
            "draftsmith.figures.data, draftsmith.figures.capture, draftsmith.figures.vocab, draftsmith.figures.export; "
            "print('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


def test_status_survives_deep_or_undecodable_side_files(run, tmp_path, capsys):
    """The files status reads beside the manifests (the target's config.json, plan.json,
    probe/results.json, recipe.yaml): nested past Python's recursion limit, or not UTF-8, they are
    shown as unreadable or left out, or (recipe.yaml) refused in one line, never a traceback."""
    import yaml
    copy_dir = tmp_path / "run"
    shutil.copytree(run, copy_dir, ignore=shutil.ignore_patterns("*.safetensors", "tensorboard", "step-*"))
    deep = "[" * 100_000 + "]" * 100_000
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(deep)
    recipe = yaml.safe_load((copy_dir / "recipe.yaml").read_text())
    recipe["target"]["path"] = str(target)
    (copy_dir / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    (copy_dir / "plan.json").write_text(deep)
    (copy_dir / "probe").mkdir(exist_ok=True)
    (copy_dir / "probe" / "results.json").write_text(deep)
    assert main(["status", str(copy_dir)]) == 0
    out = capsys.readouterr().out
    assert "Traceback" not in out and "## Immediate next step" in out
    (copy_dir / "recipe.yaml").write_bytes(b"name: \xff\xfe\n")
    assert main(["status", str(copy_dir)]) != 0
    err = capsys.readouterr().err
    assert "Traceback" not in err and "recipe.yaml" in err and len(err.strip().splitlines()) == 1
