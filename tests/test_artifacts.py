"""Run-directory artifacts: deterministic safetensors bytes; under torchrun only rank 0 writes
the ledger and the manifests, while the other ranks still read them to skip or resume."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from draftsmith import pipeline
from draftsmith.cli import main
from draftsmith.distributed.ranks import is_main_rank
from draftsmith.fileio import append_jsonl, atomic_save_safetensors, atomic_write_json, replace_dir, sha256_file, temp_dir
from draftsmith.manifests import MANIFEST, finish_manifest, load_manifest, new_manifest, write_manifest
from draftsmith.messages import DraftsmithError
from draftsmith.rundir import LEDGER, Ledger, stage_dir
from draftsmith.config import Recipe, TargetConfig

# ----------------------------------------------------------------------------- folders


def test_replace_dir_swaps_a_whole_folder_in_and_leaves_nothing_beside_it(tmp_path):
    final = tmp_path / "drafter"
    for version in ("one", "two"):  # a new folder, then over an existing one
        stale = temp_dir(final, clear=False)
        (stale / "half").mkdir(parents=True, exist_ok=True)  # what a killed writer left
        tmp = temp_dir(final)
        assert not tmp.exists()
        (tmp / "sub").mkdir(parents=True)
        (tmp / "sub" / "model.bin").write_text(version)
        replace_dir(tmp, final)
        assert (final / "sub" / "model.bin").read_text() == version and not (final / "half").exists()
        assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter"]  # no .drafter.tmp, no .drafter.old


# ----------------------------------------------------------------------------- safetensors


def test_safetensors_bytes_ignore_insertion_order(tmp_path):
    tensors = {"b": torch.arange(6).reshape(2, 3), "a": torch.ones(4, dtype=torch.bool), "c": torch.zeros(2, 2),
               "d": torch.ones(3, dtype=torch.bfloat16)}
    metadata = {k: str(i) for i, k in enumerate(["stage", "format", "zeta", "alpha", "target", "fingerprint", "x", "y"])}
    shas, blobs = set(), set()
    for i in range(6):  # safetensors writes metadata in Rust hash order, new for every call
        t_items, m_items = list(tensors.items()), list(metadata.items())
        if i % 2:
            t_items, m_items = t_items[::-1], m_items[::-1]
        elif i:
            t_items, m_items = t_items[i:] + t_items[:i], m_items[i:] + m_items[:i]
        path = tmp_path / f"{i}.safetensors"
        shas.add(atomic_save_safetensors(path, dict(t_items), dict(m_items)))
        blobs.add(path.read_bytes())
        assert sha256_file(path) in shas
    assert len(blobs) == 1 and len(shas) == 1
    with safe_open(str(tmp_path / "0.safetensors"), "pt") as f:  # still a valid file, same contents
        assert f.metadata() == metadata
        for k, v in tensors.items():
            t = f.get_tensor(k)
            assert t.dtype == v.dtype and torch.equal(t, v), k


def test_canonicalize_safetensors_gives_one_form_for_any_header_order(tmp_path):
    """A file written with its header keys in any order (as torch DCP's writer leaves them) ends
    byte-identical to atomic_save_safetensors' file of the same tensors, and still loads."""
    import json

    from draftsmith.fileio import canonicalize_safetensors

    tensors = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3)}
    metadata = {"format": "pt", "DCP_VERSION": "1.0", "DCP_SHARDING_INFO": json.dumps({"w": [0, 0]})}
    want = tmp_path / "want.safetensors"
    atomic_save_safetensors(want, tensors, metadata)
    blob = want.read_bytes()
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8:8 + n])
    for i, (order, pad) in enumerate([(list(header)[::-1], 0), (list(header)[1:] + list(header)[:1], 16)]):
        shuffled = {k: header[k] for k in order}
        shuffled["__metadata__"] = dict(reversed(list(header["__metadata__"].items())))
        head = json.dumps(shuffled, separators=(",", ":")).encode() + b" " * pad  # pad: a header of another length
        head += b" " * (-len(head) % 8)
        path = tmp_path / f"{i}.safetensors"
        path.write_bytes(len(head).to_bytes(8, "little") + head + blob[8 + n:])
        assert path.read_bytes() != blob
        canonicalize_safetensors(path)
        assert path.read_bytes() == blob, order
        with safe_open(str(path), "pt") as f:
            assert f.metadata() == metadata and torch.equal(f.get_tensor("w"), tensors["w"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0.safetensors", "1.safetensors", "want.safetensors"]


def test_a_checkpoint_saved_twice_has_the_same_bytes(tmp_path):
    """torch DCP writes the checkpoint's safetensors header in hash order: the same state saved by an
    unbroken run and by a resumed one differed in bytes (found by benchmarks/soak.py); save_checkpoint
    canonicalizes it, so the state files and their sha256 in meta.json are the same every time."""
    from draftsmith.distributed.group import DistInfo
    from draftsmith.train.checkpoint import save_checkpoint

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    names = {n: n for n, _ in model.named_parameters()}
    info = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    blobs, sums = set(), set()
    for i in range(4):
        folder = save_checkpoint(tmp_path / f"train{i}", 1, model, opt, names, {"x": 1}, info)
        files = sorted((folder / "state").glob("*.safetensors"))
        blobs.add(tuple(f.read_bytes() for f in files))
        meta = json.loads((folder / "meta.json").read_text())
        sums.add(json.dumps(meta["state_sha256"], sort_keys=True))
    assert len(blobs) == 1 and len(sums) == 1


# ----------------------------------------------------------------------------- rank 0 writes


@pytest.fixture(params=["env", "dist"])
def rank1(request, monkeypatch):
    """This process as rank 1 of 2: by torchrun's RANK (no process group), or by a process group
    (torch.distributed faked as initialized, RANK left at 0 to show the group wins)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    if request.param == "env":
        monkeypatch.setenv("RANK", "1")
    else:
        import torch.distributed as dist

        monkeypatch.setenv("RANK", "0")
        monkeypatch.setattr(dist, "is_available", lambda: True)
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    assert not is_main_rank()
    return request.param


def test_rank1_appends_and_writes_nothing(tmp_path, rank1):
    Ledger(tmp_path).append("stage_started", stage="prepare")
    assert not (tmp_path / LEDGER).exists()
    m = new_manifest("prepare", "fp", {}, {})
    write_manifest(tmp_path / "data", m)
    assert finish_manifest(tmp_path / "data", m)["status"] == "complete"
    assert not (tmp_path / "data" / MANIFEST).exists()


def _tiny_recipe(tmp_path: Path) -> Recipe:
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text("{}")  # all target_fingerprint reads
    return Recipe(run_dir=str(tmp_path / "run"), target=TargetConfig(path=str(target)))


@pytest.fixture
def fake_stage(monkeypatch):
    """`prepare`'s entry in the stage table replaced by a stage that records its calls, run on every rank under
    torchrun as capture and train are (distributed=True; test_pipeline_rank1_leaves_a_rank0_stage_to_rank0 sets it
    back); fingerprint fixed."""
    mod = types.SimpleNamespace()
    mod.calls = []
    mod.rank0 = None  # when set: called after this rank's writes, to stand for rank 0 finishing

    def run(recipe, run_dir, fp):
        out = stage_dir(run_dir, "prepare")
        m = new_manifest("prepare", fp, {}, {})
        write_manifest(out, m)
        mod.calls.append(("wrote", (out / MANIFEST).exists()))
        m = finish_manifest(out, m)
        mod.calls.append(("finished", (out / MANIFEST).exists()))
        if mod.rank0:
            mod.rank0(out, fp)
        return m

    mod.run = run
    monkeypatch.setitem(pipeline.STAGE_TABLE, "prepare", dataclasses.replace(pipeline.STAGE_TABLE["prepare"], run=run,
                                                                                         distributed=True))
    monkeypatch.setattr(pipeline, "stage_fingerprint", lambda stage, recipe, run_dir, parts=None: "fp-prepare")
    return mod


def rank0_event(run_dir, event: str, stage: str = "prepare", at: float | None = None, **fields) -> None:
    """A ledger line as rank 0 (another process) appends it."""
    append_jsonl(Path(run_dir) / LEDGER, {"time": round(time.time() if at is None else at, 3), "event": event,
                                          "stage": stage, **fields})


def test_pipeline_rank0_writes_ledger_and_manifest(tmp_path, fake_stage):
    recipe = _tiny_recipe(tmp_path)
    m = pipeline.run_stage("prepare", recipe)
    assert m["status"] == "complete" and fake_stage.calls == [("wrote", True), ("finished", True)]
    assert [e["event"] for e in Ledger(recipe.run_dir).read()] == ["stage_started", "stage_finished"]


@pytest.mark.parametrize("stage", ["vocab", "evaluate", "export"])
def test_a_stage_start_removes_temp_files_a_killed_run_left(stage, tmp_path, monkeypatch):
    """A kill -9 inside an atomic write leaves `.NAME.tmp-PID` beside NAME; the next run of the stage
    removes it before it starts, also in a subfolder (export/sglang/). vocab, evaluate and export did
    not (prepare, regenerate, capture and train clear their own); the complete run then kept the file."""
    from draftsmith.manifests import output_fingerprint

    recipe = _tiny_recipe(tmp_path)
    out = stage_dir(recipe.run_dir, stage)
    stale = [out / ".manifest.json.tmp-999999-1", out / "sub" / ".model.safetensors.tmp-999998-2"]
    seen = []

    def run(recipe, run_dir, fp):
        seen.extend(p.exists() for p in stale)
        return finish_manifest(out, new_manifest(stage, fp, {}, {}))

    monkeypatch.setattr(pipeline, "stage_status", lambda run_dir, u: "complete")
    monkeypatch.setattr(pipeline, "upstream_of", lambda stage, recipe: ())
    monkeypatch.setattr(pipeline, "stage_fingerprint", lambda stage, recipe, run_dir, parts=None: "fp")
    monkeypatch.setitem(pipeline.STAGE_TABLE, stage, dataclasses.replace(pipeline.STAGE_TABLE[stage], run=run, skipped=None))
    for p in stale:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"half")
    (out / "keep.json").write_text("{}")
    assert pipeline.run_stage(stage, recipe)["status"] == "complete"
    assert seen == [False, False] and (out / "keep.json").exists()
    assert output_fingerprint(load_manifest(out)) == "fp"


def test_pipeline_rank1_runs_but_appends_nothing(tmp_path, fake_stage, rank1):
    recipe = _tiny_recipe(tmp_path)
    run_dir = Path(recipe.run_dir)

    def rank0_finishes(out, fp):  # rank 0, in another process, writes the complete manifest, then its ledger line
        atomic_write_json(out / MANIFEST, {**new_manifest("prepare", fp, {}, {}), "status": "complete", "by": "rank0"})
        rank0_event(run_dir, "stage_finished")

    fake_stage.rank0 = rank0_finishes
    m = pipeline.run_stage("prepare", recipe)
    assert fake_stage.calls == [("wrote", False), ("finished", False)]  # rank 1 wrote no manifest
    assert m["by"] == "rank0" and m["status"] == "complete"  # it waited for and returns rank 0's
    assert [e["event"] for e in Ledger(run_dir).read()] == ["stage_finished"]  # rank 0's line only


def test_pipeline_rank1_skips_complete_stage_by_reading(tmp_path, fake_stage, rank1):
    recipe = _tiny_recipe(tmp_path)
    run_dir = Path(recipe.run_dir)
    out = stage_dir(run_dir, "prepare")
    atomic_write_json(out / MANIFEST, {**new_manifest("prepare", "fp-prepare", {}, {}), "status": "complete"})
    (run_dir / LEDGER).write_text('{"event": "stage_finished", "stage": "prepare"}\n')
    before = (run_dir / LEDGER).read_bytes()
    m = pipeline.run_stage("prepare", recipe)
    assert m["status"] == "complete" and fake_stage.calls == []  # skipped, from rank 0's manifest
    assert (run_dir / LEDGER).read_bytes() == before  # no stage_skipped line from rank 1
    assert load_manifest(out) == m


def test_a_refused_rerun_leaves_a_complete_stage_done(tmp_path, fake_stage, monkeypatch):
    """A rerun refused before it writes anything (the run-dir lock, a bad value at parse time, or the stage's own
    check of its input) leaves the complete stage done in `status`, its output and recipe.yaml unchanged. A rerun
    that fails after writing is still `failed`."""
    from draftsmith import status

    recipe = _tiny_recipe(tmp_path)
    run_dir, out = Path(recipe.run_dir), stage_dir(recipe.run_dir, "prepare")
    monkeypatch.setattr(pipeline, "stage_fingerprint", lambda stage, r, d, parts=None: f"fp-{r.prepare.max_length}")
    pipeline.run_stage("prepare", recipe)
    done = load_manifest(out)
    kept = {p: p.read_bytes() for p in (run_dir / "recipe.yaml", out / MANIFEST)}

    def state():
        return status.stage_state(run_dir, "prepare", Ledger(run_dir).read())

    # the run-dir lock, held by another process: refused before any ledger line
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                               "from draftsmith.rundir import RunLock; l = RunLock(Path(sys.argv[1])); l.__enter__(); "
                               "print('held', flush=True); time.sleep(60)", str(run_dir)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        recipe.prepare.max_length = 64
        with pytest.raises(DraftsmithError, match="run directory is locked"):
            pipeline.run_stage("prepare", recipe)
    finally:
        holder.kill()
        holder.wait()
    assert state()["state"] == "done"
    # a bad value on the command line: refused at parse time
    assert main(["prepare", str(run_dir / "recipe.yaml"), "--prepare.max_length", "0"]) == 2
    assert state()["state"] == "done"

    # other inputs the stage refuses before writing: the complete output is set aside, then back
    def refuse(recipe, run_dir, fp):
        raise DraftsmithError(f"{run_dir / 'recipe.yaml'}: prepare.max_length {recipe.prepare.max_length}: too short here")

    monkeypatch.setitem(pipeline.STAGE_TABLE, "prepare", dataclasses.replace(pipeline.STAGE_TABLE["prepare"], run=refuse))
    with pytest.raises(DraftsmithError, match="too short here"):
        pipeline.run_stage("prepare", recipe)
    assert Ledger(run_dir).read()[-1]["event"] == "stage_refused"
    assert state()["state"] == "done" and "too short here" in state()["refused"]
    assert load_manifest(out) == done and all(p.read_bytes() == b for p, b in kept.items())
    assert "a later command was refused: " in status.render(run_dir)

    def fail_after_writing(recipe, run_dir, fp):
        write_manifest(stage_dir(run_dir, "prepare"), new_manifest("prepare", fp, {}, {}))
        raise DraftsmithError("source.json record 3: not a conversation; fix the record")

    monkeypatch.setitem(pipeline.STAGE_TABLE, "prepare", dataclasses.replace(pipeline.STAGE_TABLE["prepare"], run=fail_after_writing))
    with pytest.raises(DraftsmithError, match="record 3"):
        pipeline.run_stage("prepare", recipe)
    assert Ledger(run_dir).read()[-1]["event"] == "stage_failed" and state()["state"] == "failed"
    assert load_manifest(out) == done  # the complete output is still put back; the stage's last run failed


def test_pipeline_rank1_resumes_running_stage(tmp_path, fake_stage, rank1, monkeypatch):
    """A `running` manifest of the same fingerprint resumes on rank 1 too (it reads, not deletes),
    and a rank 0 that never finishes is reported after DRAFTSMITH_RANK0_WAIT_S."""
    recipe = _tiny_recipe(tmp_path)
    out = stage_dir(recipe.run_dir, "prepare")
    atomic_write_json(out / MANIFEST, new_manifest("prepare", "fp-prepare", {}, {}))
    (out / "shard-00000.safetensors").write_bytes(b"kept")
    monkeypatch.setenv("DRAFTSMITH_RANK0_WAIT_S", "0.2")
    with pytest.raises(DraftsmithError, match="rank 1 waits for rank 0 to finish stage prepare, but rank 0 wrote nothing"):
        pipeline.run_stage("prepare", recipe)
    assert fake_stage.calls == [("wrote", True), ("finished", True)]  # rank 0's running manifest, untouched
    assert load_manifest(out)["status"] == "running" and (out / "shard-00000.safetensors").read_bytes() == b"kept"
    assert not (Path(recipe.run_dir) / LEDGER).exists()


def test_pipeline_rank1_leaves_a_rank0_stage_to_rank0(tmp_path, fake_stage, rank1, monkeypatch):
    """A stage that is not distributed (prepare, regenerate, vocab, evaluate, export) does not run on rank 1: it
    waits for rank 0's complete manifest (the limit counting from rank 0's last write in the stage folder), writes
    nothing, and returns rank 0's manifest."""
    monkeypatch.setitem(pipeline.STAGE_TABLE, "prepare", dataclasses.replace(pipeline.STAGE_TABLE["prepare"], distributed=False))
    recipe = _tiny_recipe(tmp_path)
    run_dir, out = Path(recipe.run_dir), stage_dir(recipe.run_dir, "prepare")
    monkeypatch.setenv("DRAFTSMITH_RANK0_WAIT_S", "1.5")
    with pytest.raises(DraftsmithError, match="rank 0 wrote nothing in .* or the ledger for 1.5 s"):
        pipeline.run_stage("prepare", recipe)
    assert fake_stage.calls == [] and list(run_dir.iterdir()) == []  # no recipe.yaml, ledger or manifest from rank 1

    def rank0():  # rank 0, in another process: writes its running manifest, works past rank 1's limit, finishes
        m = new_manifest("prepare", "fp-prepare", {}, {})
        for i in range(5):  # 2 s in all, a write every 0.4 s
            atomic_write_json(out / MANIFEST, {**m, "counts": {"done": i}})
            time.sleep(0.4)
        atomic_write_json(out / MANIFEST, {**m, "status": "complete", "by": "rank0"})
        rank0_event(run_dir, "stage_finished")

    worker = threading.Thread(target=rank0)
    worker.start()
    try:
        m = pipeline.run_stage("prepare", recipe)
    finally:
        worker.join()
    assert m["by"] == "rank0" and fake_stage.calls == []
    assert len(Ledger(run_dir).read()) == 1 and not (run_dir / "recipe.yaml").exists()  # rank 0's line only


def test_pipeline_rank1_waits_for_this_launch_of_a_forced_stage(tmp_path, fake_stage, rank1, monkeypatch):
    """`--force` under torchrun: rank 1 must not take the complete manifest of an earlier launch (same
    fingerprint) for rank 0's new run; it waits until rank 0's ledger says the stage finished in this
    launch. Rank 0 failing a stage stops rank 1 at once with rank 0's error, not after the wait limit."""
    monkeypatch.setitem(pipeline.STAGE_TABLE, "prepare", dataclasses.replace(pipeline.STAGE_TABLE["prepare"], distributed=False))
    recipe = _tiny_recipe(tmp_path)
    run_dir, out = Path(recipe.run_dir), stage_dir(recipe.run_dir, "prepare")
    atomic_write_json(out / MANIFEST, {**new_manifest("prepare", "fp-prepare", {}, {}), "status": "complete", "by": "old"})
    rank0_event(run_dir, "stage_finished", at=pipeline.LAUNCHED_AT - 60)  # the earlier launch's line

    def rank0():  # rank 0 reruns the stage: the old output set aside, the new one written, then its ledger line
        time.sleep(0.6)
        atomic_write_json(out / MANIFEST, {**new_manifest("prepare", "fp-prepare", {}, {}), "status": "complete", "by": "new"})
        rank0_event(run_dir, "stage_finished")

    worker = threading.Thread(target=rank0)
    worker.start()
    try:
        m = pipeline.run_stage("prepare", recipe, force=True)
    finally:
        worker.join()
    assert m["by"] == "new" and fake_stage.calls == []

    rank0_event(run_dir, "stage_failed", error="source.json record 3: not a conversation; fix the record")
    monkeypatch.setenv("DRAFTSMITH_RANK0_WAIT_S", "30")
    t0 = time.monotonic()
    with pytest.raises(DraftsmithError, match=r"rank 0's stage prepare failed \(source.json record 3: .*\); rank 1 stops too"):
        pipeline.run_stage("prepare", recipe, force=True)
    assert time.monotonic() - t0 < 5


def test_temp_names_are_made_in_one_place():
    """Every temp or set-aside name comes from fileio.aside_path (so fileio.is_temp_name, which
    the leftover checks use, knows them all): no other module spells one out with `with_name(f".`."""
    from draftsmith.fileio import TEMP_TAGS, aside_path, is_temp_name

    src = Path(__file__).resolve().parents[1] / "src" / "draftsmith"
    spelled = [str(p.relative_to(src)) for p in src.rglob("*.py")
               if p.name != "fileio.py" and 'with_name(f".' in p.read_text(encoding="utf-8")]
    assert not spelled, spelled
    assert all(is_temp_name(aside_path(Path("run/train"), tag, "1-2" if tag.endswith("-") else "").name) for tag in TEMP_TAGS)
    assert not any(map(is_temp_name, ["train", "manifest.json", ".rank-00000.json", ".tmpfile", "x.tmp"]))
    with pytest.raises(ValueError):
        aside_path(Path("run/train"), ".bak")
