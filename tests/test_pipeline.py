"""The whole pipeline on a tiny model: run, skip when done, resume after kill -9."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from draftsmith.manifests import load_manifest
from draftsmith.rundir import Ledger
from draftsmith.cli import main
from draftsmith.status import collect
from draftsmith.testing import make_model_dir

CONVERSATIONS = [
    [{"from": "human", "value": f"Count from {i} to {i + 5}."},
     {"from": "gpt", "value": " ".join(str(j) for j in range(i, i + 6)) + ". Done!"}]
    for i in range(40)
] + [
    [{"from": "human", "value": "Say hello."}, {"from": "gpt", "value": "Hello! How can I help you today?"},
     {"from": "human", "value": "Write a poem."}, {"from": "gpt", "value": "The sea, the sky, the quick brown fox."}]
] * 10


def write_recipe(tmp: Path, target: Path, run_dir: Path, max_steps: int = 12, samples_per_shard: int = 16) -> Path:
    data = tmp / "convs.json"
    data.write_text(json.dumps([{"id": str(i), "conversations": c} for i, c in enumerate(CONVERSATIONS)]))
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["Count from 3 to 8.", "Say hello.", "Write a poem."]))
    recipe = {
        "name": "tiny", "run_dir": str(run_dir),
        "target": {"path": str(target), "device": "cpu", "dtype": "float32"},
        "prepare": {"source": str(data), "max_length": 128, "samples_per_shard": samples_per_shard},
        "capture": {"batch_tokens": 1024, "storage_dtype": "float32"},
        "vocab": {"draft_vocab_size": 128},
        "train": {"ttt_steps": 3, "max_steps": max_steps, "batch_tokens": 256, "lr": 3e-3, "warmup_steps": 2,
                  "save_every": 3, "log_every": 4, "device": "cpu", "dtype": "float32"},
        "evaluate": {"benchmarks": [str(prompts)], "max_new_tokens": 24, "draft_steps": 3},
        "export": {"formats": ["sglang"]},
    }
    path = tmp / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("target") / "tiny", num_layers=4, hidden_size=64)


def figures(run_dir: Path) -> dict:
    train = load_manifest(run_dir / "train")["metrics"]
    ev = load_manifest(run_dir / "eval")["metrics"]
    return {"loss": train["loss"], "tau": ev["tau"], "accept": ev["accept_rate_per_position"]}


def test_run_then_skip(tmp_path, target, capsys):
    recipe = write_recipe(tmp_path, target, tmp_path / "run")
    assert main(["run", str(recipe)]) == 0
    run_dir = tmp_path / "run"
    for stage in ("data", "capture", "vocab", "train", "eval", "export"):
        assert load_manifest(run_dir / stage)["status"] == "complete", stage
    assert (run_dir / "export" / "sglang" / "model.safetensors").exists()
    assert (run_dir / "recipe.yaml").exists()
    printed = capsys.readouterr()  # the default drafter is EAGLE-3.1: export says which servers load it right
    assert "norm_output (EAGLE-3.1) is on" in printed.out + printed.err
    first = figures(run_dir)
    assert first["tau"] >= 1.0
    # A second run redoes nothing and gives the same figures.
    n_events = len(Ledger(run_dir).read())
    assert main(["run", str(recipe)]) == 0
    new = Ledger(run_dir).read()[n_events:]
    assert [e["event"] for e in new if e["event"].startswith("stage_")] == ["stage_skipped"] * 6
    assert figures(run_dir) == first
    # Keys that never change the drafter (logging, checkpoint cadence, side measurements) are no
    # reason to retrain: every stage stays complete, and `run` reports it so.
    n_events = len(Ledger(run_dir).read())
    drafter = (run_dir / "train" / "drafter" / "model.safetensors").read_bytes()
    assert main(["run", str(recipe), "--train.log_every", "1", "--train.save_every", "7",
                 "--train.heldout_engine_prompts", "0", "--train.peak_tflops", "123"]) == 0
    new = Ledger(run_dir).read()[n_events:]
    assert [e["event"] for e in new if e["event"].startswith("stage_")] == ["stage_skipped"] * 6
    assert (run_dir / "train" / "drafter" / "model.safetensors").read_bytes() == drafter
    assert {s["stage"]: s["state"] for s in collect(run_dir)["stages"]}["train"] == "done"
    # Changing a train setting reruns train and what follows it, not what precedes it, and says what changed.
    capsys.readouterr()
    assert main(["train", str(recipe), "--train.lr", "0.001"]) == 0
    started = [e["stage"] for e in Ledger(run_dir).read() if e["event"] == "stage_started"]
    assert started[-1] == "train"
    assert "[train] changed since its output: train.lr 0.003 -> 0.001; starting the stage over" in capsys.readouterr().err
    assert main(["vocab", str(recipe), "--train.lr", "0.001", "--vocab.draft_vocab_size", "64"]) == 0
    assert main(["run", str(recipe), "--train.lr", "0.001", "--vocab.draft_vocab_size", "64"]) == 0
    printed = capsys.readouterr().err
    assert "[vocab] changed since its output: vocab.draft_vocab_size 128 -> 64; starting the stage over" in printed
    assert "[train] changed since its output: vocab's output; starting the stage over" in printed
    assert "[evaluate] changed since its output: train's output" in printed


def test_stage_table_is_what_the_cli_and_status_list(capsys):
    """One table: the pipeline runs its stages in config.STAGES order (what status reads without
    importing them), and `draftsmith --help` lists each with its help."""
    from draftsmith.config import STAGES
    from draftsmith.pipeline import STAGE_TABLE

    assert tuple(STAGE_TABLE) == STAGES
    assert all(set(s.upstream) <= set(STAGES[:STAGES.index(name)]) for name, s in STAGE_TABLE.items())
    assert main(["--help"]) == 0
    printed = capsys.readouterr().out
    assert all(f"  {name:<10} {s.help}" in printed for name, s in STAGE_TABLE.items()) and "  run " in printed


@pytest.mark.parametrize("command", ["run", "train", "plan", "doctor", "probe-layers", "status", "import-drafter", "bench-serve"])
def test_every_flag_has_help(command, capsys):
    """`draftsmith COMMAND --help` gives every flag a sentence, not only its type (jsonargparse shows a
    field's docstring; argparse-built tools pass help=), and names the positional arguments."""
    try:
        main([command, "--help"])
    except SystemExit:  # argparse's --help exits
        pass
    text = capsys.readouterr().out
    blocks: list[list[str]] = []
    for line in text.splitlines():
        if line.startswith("  -"):
            blocks.append([line.strip()])
        elif blocks and line.startswith("    ") and line.strip():
            blocks[-1].append(line.strip())
    bare = []
    for b in blocks:
        head = b[0].split("  ", 1)  # "--flag METAVAR  help text" or "--flag METAVAR" + lines below
        rest = " ".join(([head[1].strip()] if len(head) > 1 else []) + b[1:])
        if not rest or rest.startswith("(type:"):
            bare.append(b[0].split()[0])
    assert blocks and not bare, f"flags without help: {bare}"
    usage = " ".join(text.split("usage:", 1)[1].split())
    if command in ("probe-layers", "doctor"):
        assert "RECIPE.yaml" in usage


def test_bad_recipe_key_is_one_line_error(tmp_path, target, capsys):
    recipe = write_recipe(tmp_path, target, tmp_path / "run")
    assert main(["run", str(recipe), "--train.bogus", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err


def test_unknown_evaluate_method_is_refused_before_any_stage(tmp_path, target, capsys):
    """A typo in evaluate.methods is a one-line error at parse time (exit 2, nothing run), not a
    failure of the evaluate stage after training."""
    recipe = write_recipe(tmp_path, target, tmp_path / "run")
    assert main(["run", str(recipe), "--evaluate.methods", "[eagle3_chain, eagle3_chian]"]) == 2
    err = capsys.readouterr().err.strip()
    # the bad value came from the flag, not the file: the error says so
    assert err == ("error: command line --evaluate.methods: evaluate.methods 'eagle3_chian': not a method; "
                   "choose from eagle3_chain, eagle3_tree, ngram, hybrid, plain (on the command line)")
    assert not (tmp_path / "run").exists()
    bad = tmp_path / "bad.yaml"
    r = yaml.safe_load(recipe.read_text())
    r["evaluate"]["methods"] = ["ngram", "tree"]
    bad.write_text(yaml.safe_dump(r))
    assert main(["train", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {bad}: evaluate.methods 'tree': not a method") and err.endswith("(in the recipe)")


def test_unknown_export_format_is_refused_before_any_stage(tmp_path, target, capsys):
    """A typo in export.formats (or an empty list) is a one-line error at parse time (exit 2, nothing
    run), not a failure of the export stage after training."""
    recipe = write_recipe(tmp_path, target, tmp_path / "run")
    assert main(["run", str(recipe), "--export.formats", "[sglang, vlm]"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: command line --export.formats: export.formats 'vlm': not a format; choose from sglang, vllm (on the command line)"
    assert not (tmp_path / "run").exists()
    bad = tmp_path / "bad.yaml"
    r = yaml.safe_load(recipe.read_text())
    r["export"] = {"formats": []}
    bad.write_text(yaml.safe_dump(r))
    assert main(["prepare", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {bad}: export.formats is empty; choose from sglang, vllm (in the recipe)"
    assert not (tmp_path / "run").exists()


def test_force_is_a_plain_flag(tmp_path, target):
    """`--force` alone redoes a complete stage (docs/reliability.md writes it so), anywhere on the
    line; `--force true` / `--force false` still work (benchmarks/h200.sh passes `--force true`)."""
    from draftsmith.config import parse_recipe

    recipe = write_recipe(tmp_path, target, tmp_path / "run")
    for argv, force in (([str(recipe), "--force"], True), (["--force", str(recipe)], True), ([str(recipe), "--force", "true"], True),
                        ([str(recipe), "--force", "false"], False), ([str(recipe)], False)):
        assert parse_recipe(argv)[1] is force, argv
    r, force = parse_recipe([str(recipe), "--force", "--prepare.max_length", "96"])
    assert force and r.prepare.max_length == 96
    assert main(["prepare", str(recipe)]) == 0
    assert main(["prepare", str(recipe), "--force"]) == 0
    assert [e["event"] for e in Ledger(tmp_path / "run").read() if e["event"].startswith("stage_")][-2:] == ["stage_started", "stage_finished"]


def _run_until(cmd: list[str], run_dir: Path, stage: str, progressed, timeout: float = 240) -> int:
    """Start cmd; once `progressed(run_dir)` says the stage is part-way (work listed, not finished),
    freeze it (SIGSTOP, at once) and kill -9 it; returns its exit status. Fails when the process
    ends before that."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    t0 = time.time()
    try:
        while time.time() - t0 < timeout:
            if proc.poll() is not None:
                raise AssertionError(f"the process ended (status {proc.returncode}) before {stage} was killed")
            if progressed(run_dir):
                os.killpg(proc.pid, signal.SIGSTOP)
                os.killpg(proc.pid, signal.SIGKILL)
                return proc.wait()
            time.sleep(0.02)
        raise AssertionError(f"{stage} never got part-way")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _capture_part_way(run_dir: Path) -> bool:
    """capture has listed a shard (of 13)."""
    try:
        m = json.loads((run_dir / "capture" / "manifest.json").read_text())
    except (OSError, ValueError):
        return False
    return m.get("status") == "running" and len(m.get("shards", [])) >= 1


def _train_part_way(run_dir: Path) -> bool:
    """train has written its first checkpoint (step 3 of 30)."""
    return (run_dir / "train" / "latest").exists()


@pytest.mark.parametrize("stage,progressed", [("capture", _capture_part_way), ("train", _train_part_way)])
def test_kill_and_resume_gives_same_figures(tmp_path, target, stage, progressed):
    (tmp_path / "ref").mkdir()
    ref_recipe = write_recipe(tmp_path / "ref", target, tmp_path / "ref" / "run", max_steps=30, samples_per_shard=4)
    assert main(["run", str(ref_recipe)]) == 0
    (tmp_path / "k").mkdir()
    run_dir = tmp_path / "k" / "run"
    recipe = write_recipe(tmp_path / "k", target, run_dir, max_steps=30, samples_per_shard=4)
    cmd = [sys.executable, "-m", "draftsmith.cli", "run", str(recipe)]
    assert _run_until(cmd, run_dir, stage, progressed) == -signal.SIGKILL
    # the kill landed inside the stage: it started, never finished, and its manifest is not complete
    events = Ledger(run_dir).read()
    assert any(e["event"] == "stage_started" and e["stage"] == stage for e in events)
    assert not any(e["event"] == "stage_finished" and e["stage"] == stage for e in events)
    assert load_manifest(run_dir / stage)["status"] == "running"
    done_before = {e["stage"] for e in events if e["event"] == "stage_finished"}
    assert main(["run", str(recipe)]) == 0
    events = Ledger(run_dir).read()
    restarted = [e for e in events if e["event"] == "stage_started"]
    assert [e["resumed"] for e in restarted if e["stage"] == stage] == [False, True]
    for s in done_before:  # no finished stage is redone
        assert [e["stage"] for e in restarted].count(s) == 1, s
    assert figures(run_dir) == figures(tmp_path / "ref" / "run")
    # capture shards are byte-identical to the uninterrupted run
    shards = sorted((run_dir / "capture").glob("shard-*.safetensors"))
    assert len(shards) == 13
    for a in shards:
        assert a.read_bytes() == (tmp_path / "ref" / "run" / "capture" / a.name).read_bytes()


def _shards(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}


def test_failed_rerun_keeps_the_complete_output(tmp_path, target, monkeypatch, capsys):
    """A rerun of a complete stage for other inputs (or --force) that fails leaves the complete
    output as it was; one that succeeds replaces it, and nothing is left set aside."""
    run_dir = tmp_path / "run"
    recipe = write_recipe(tmp_path, target, run_dir)
    assert main(["prepare", str(recipe)]) == 0
    before = _shards(run_dir / "data")
    fp = load_manifest(run_dir / "data")["fingerprint"]
    # other inputs that the stage refuses (no sample fits): refused inside the stage run
    assert main(["prepare", str(recipe), "--prepare.min_loss_tokens", "100000"]) == 2
    assert "no sample kept" in capsys.readouterr().err
    assert _shards(run_dir / "data") == before and load_manifest(run_dir / "data")["fingerprint"] == fp
    assert not (run_dir / ".data.previous").exists()
    # --force and the disk fills up mid-stage
    fsync = os.fsync
    calls = {"n": 0}

    def full(fd):
        calls["n"] += 1
        if calls["n"] > 2:
            raise OSError(28, "No space left on device")
        return fsync(fd)

    monkeypatch.setattr(os, "fsync", full)
    assert main(["prepare", str(recipe), "--force", "true"]) == 2
    monkeypatch.undo()
    assert _shards(run_dir / "data") == before and not (run_dir / ".data.previous").exists()
    assert main(["capture", str(recipe)]) == 0  # downstream still reads it
    # a rerun that succeeds replaces it
    assert main(["prepare", str(recipe), "--prepare.max_length", "96"]) == 0
    assert load_manifest(run_dir / "data")["fingerprint"] != fp and not (run_dir / ".data.previous").exists()


def test_a_killed_replacement_gives_the_old_output_back(tmp_path, target):
    """kill -9 while a new run replaces a complete stage: the old output waits in .STAGE.previous
    and is back in place for the next command when the new run left nothing to resume."""
    run_dir = tmp_path / "run"
    recipe = write_recipe(tmp_path, target, run_dir)
    assert main(["prepare", str(recipe)]) == 0
    before = _shards(run_dir / "data")
    # what a kill -9 right after the set-aside leaves: the old output aside, no new folder
    (run_dir / "data").rename(run_dir / ".data.previous")
    assert main(["capture", str(recipe)]) == 0
    assert _shards(run_dir / "data") == before and not (run_dir / ".data.previous").exists()


def test_a_write_killed_in_the_run_folder_leaves_no_temp_file(tmp_path, target):
    """kill -9 while recipe.yaml was being written: the next command removes the temp file the atomic write left."""
    run_dir = tmp_path / "run"
    recipe = write_recipe(tmp_path, target, run_dir)
    assert main(["prepare", str(recipe)]) == 0
    stale = run_dir / ".recipe.yaml.tmp-11427-139725411658624"  # the soak's (benchmarks/soak.py) kill left this one
    stale.write_text("half a recipe")
    assert main(["prepare", str(recipe)]) == 0
    assert not stale.exists() and (run_dir / "recipe.yaml").exists()


LOCK_HOLDER = """
import sys, time
from draftsmith.rundir import RunLock
with RunLock(sys.argv[1]):
    print("locked", flush=True)
    time.sleep(float(sys.argv[2]))
"""


def test_run_dir_lock(tmp_path, target, capsys):
    """A second process on a locked run directory names the holder and exits 2; with --wait-lock
    it waits for the holder and then runs."""
    run_dir = tmp_path / "run"
    recipe = write_recipe(tmp_path, target, run_dir)
    run_dir.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, str(run_dir), "60"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert main(["prepare", str(recipe)]) == 2
        err = capsys.readouterr().err
        assert f"locked by pid {holder.pid}" in err and f"{sys.executable} -c" in err and "--wait-lock" in err
        assert not (run_dir / "data").exists()
    finally:
        holder.kill()
        holder.wait()
    holder = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, str(run_dir), "1.5"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        t0 = time.time()
        assert main(["prepare", str(recipe), "--wait-lock"]) == 0
        assert time.time() - t0 > 0.5 and holder.poll() is not None  # it ran after the holder let go
        assert load_manifest(run_dir / "data")["status"] == "complete"
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.parametrize("key,value", [("ttt_align_topk", 1), ("ttt_target_temperature", 0.0)])
def test_a_key_added_later_keeps_older_runs_complete(tmp_path, target, monkeypatch, key, value):
    """A train key added after runs existed (pipeline.ADDED_KEYS) is fingerprinted only off the value
    those runs trained at: the recipe serialised without it (as the code before it did) and with that
    value give the same train fingerprint, so a complete run stays complete; another value retrains,
    the config's default too once it differs from that value (a default changed later)."""
    from dataclasses import replace

    import draftsmith.pipeline as pl
    from draftsmith.config import parse_recipe

    run = tmp_path / "run"
    recipe, _ = parse_recipe([str(write_recipe(tmp_path, target, run))])
    at = lambda v: replace(recipe, train=replace(recipe.train, **{key: v}))  # noqa: E731
    fp = pl.stage_fingerprint("train", at(pl.ADDED_KEYS[f"train.{key}"]), run)
    assert pl.stage_fingerprint("train", at(value), run) != fp
    real = pl.to_jsonable

    def older(x):  # the config as the code before the key serialised it
        out = real(x)
        return {k: v for k, v in out.items() if k != key} if isinstance(out, dict) else out

    monkeypatch.setattr(pl, "to_jsonable", older)
    assert pl.stage_fingerprint("train", recipe, run) == fp
    monkeypatch.setattr(pl, "to_jsonable", real)
    # older runs had trained at `value` and the default moved away from it: the default retrains them
    monkeypatch.setitem(pl.ADDED_KEYS, f"train.{key}", value)
    assert pl.stage_fingerprint("train", at(value), run) == fp
    assert pl.stage_fingerprint("train", recipe, run) != fp


def test_keep_best_sampled_ties_train_to_the_serving_temperature(tmp_path, target, monkeypatch):
    """train.keep_best sampled picks the drafter by the held-out figure at evaluate.temperature, so
    that temperature enters train's fingerprint then, and only then: a greedy-kept run (older runs,
    the default) does not retrain when only evaluate's temperature changes."""
    from dataclasses import replace

    import draftsmith.pipeline as pl
    from draftsmith.config import parse_recipe

    run = tmp_path / "run"
    recipe, _ = parse_recipe([str(write_recipe(tmp_path, target, run))])

    def fp(keep_best, temperature):
        r = replace(recipe, train=replace(recipe.train, keep_best=keep_best),
                    evaluate=replace(recipe.evaluate, temperature=temperature))
        return pl.stage_fingerprint("train", r, run)

    assert fp("greedy", 0.0) == fp("greedy", 1.0) == fp("greedy", 0.7)
    assert len({fp("greedy", 0.0), fp("sampled", 1.0), fp("sampled", 0.7)}) == 3
    assert fp("sampled", 0.0) == fp("sampled", 1.0)  # a greedy evaluate: the sampled figure is at 1
    greedy, real = fp("greedy", 0.0), pl.to_jsonable  # a run written before the key (greedy then) stays complete
    monkeypatch.setattr(pl, "to_jsonable", lambda x: {k: v for k, v in real(x).items() if k != "keep_best"}
                        if isinstance(real(x), dict) else real(x))
    assert pl.stage_fingerprint("train", recipe, run) == greedy


def test_what_changed_reads_like_the_recipe(tmp_path, target):
    """A rerun names what changed since the complete output: keys as recipe flags (a key added later
    reads as the value older runs had), the target, upstream outputs, the stage's extra input."""
    import draftsmith.pipeline as pl
    from draftsmith.config import parse_recipe

    recipe, _ = parse_recipe([str(write_recipe(tmp_path, target, tmp_path / "run"))])
    parts = pl.fingerprint_parts("train", recipe, tmp_path / "run")
    assert pl.what_changed("train", parts, parts) == []
    new = {**parts, "config": {**parts["config"], "train": {**parts["config"]["train"], "lr": 1e-3, "keep_best": "sampled"}},
           "target": "another", "upstream": {u: "other" for u in parts["upstream"]}, "extra": ["sample_temperature", 0.7]}
    assert pl.what_changed("train", parts, new) == [
        "train.keep_best \"greedy\" -> \"sampled\"", "train.lr 0.003 -> 0.001", "the target (its files, aux_layer_ids or dtype)",
        *[f"{u}'s output" for u in parts["upstream"]],
        "the temperature train.keep_best sampled picks at (evaluate.temperature, 1 when greedy) null -> 0.7"]
    assert pl.what_changed("prepare", {**parts, "extra": "abc"}, {**parts, "extra": "def"}) == [
        "the source's content (prepare.source)"]
