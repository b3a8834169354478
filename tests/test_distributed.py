"""Training on 2 CPU ranks (gloo, FSDP2) equals training on 1 at the same global batch, and a
run resumes exactly at another world size; a CLI command tears its process group down once, at
its end, and the next command in the same process sets up a new one. Ranks are
torch.multiprocessing spawns."""
import contextlib
import json
import os
import socket
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import draftsmith.train.loop as loop
from draftsmith import cli
from draftsmith.fileio import read_json, read_jsonl
from draftsmith.manifests import load_manifest
from draftsmith.draft.io import load_drafter
from draftsmith.testing import make_model_dir
from draftsmith.distributed.group import destroy_distributed
from test_pipeline import write_recipe
from test_train import losses, make_run, toy_samples

# fp32 on CPU: 2 ranks differ from 1 only by the order of float sums (gradient reduce-scatter,
# loss all-reduce); over 9 AdamW steps that stays far below this.
RTOL = 1e-4
KW = dict(max_steps=9, batch_tokens=128, micro_batch_tokens=64, save_every=3)  # 2 micro-batches per step
ROOT = Path(__file__).resolve().parents[1]
RUNS_AT_EXIT = 3 if os.environ.get("CI_SHORT") else 8  # an abort came 1 run in 4: 8 runs miss one 10 % of the time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def stop_at(step_to_stop):
    """Every rank raises KeyboardInterrupt when step `step_to_stop` begins (as after a node
    failure; all ranks stop at the same point so none waits in a collective)."""
    real = loop.lr_at

    def lr_at(step, *a):
        if step == step_to_stop:
            raise KeyboardInterrupt
        return real(step, *a)

    loop.lr_at = lr_at
    try:
        yield
    except KeyboardInterrupt:
        pass
    finally:
        loop.lr_at = real


def _train(recipe, run_dir, crash_at):
    with stop_at(crash_at):
        loop.run(recipe, run_dir, "fp-train")


def _worker(rank, world, port, recipe, run_dir, crash_at):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    ok = False
    try:
        _train(recipe, run_dir, crash_at)
        ok = True
    finally:
        destroy_distributed(sync=ok)
    # The work is done and the group torn down: leave without the interpreter's finalization, where
    # gloo's worker threads, still holding tensors, now and then abort a spawned rank with SIGABRT
    # (CI, 2026-12-05: test_online_two_ranks_match_one, rank 1 aborted while rank 0 still ran; the log
    # does not say where; not reproduced locally; pytorch/pytorch#179291 describes the teardown race).
    # What the test checks is on disk already; a rank that fails still raises above and spawn reports it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(world, recipe, run_dir, crash_at=0):
    """Train on `world` ranks (1: in this process, no process group), all stopping at crash_at."""
    if world == 1:
        _train(recipe, run_dir, crash_at)
    else:
        mp.spawn(_worker, args=(world, _free_port(), recipe, run_dir, crash_at), nprocs=world, join=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    torch.set_num_threads(1)
    target = make_model_dir(tmp_path_factory.mktemp("target"))
    samples = toy_samples(target)
    recipe, run_dir = make_run(tmp_path_factory.mktemp("ref"), target, samples, **KW)
    loop.run(recipe, run_dir, "fp-train")
    return target, samples, run_dir


def test_two_ranks_match_one(tmp_path, setup):
    target, samples, ref = setup
    recipe, run_dir = make_run(tmp_path, target, samples, **KW)
    run_ranks(2, recipe, run_dir)
    assert losses(run_dir) == pytest.approx(losses(ref), rel=RTOL)
    m = read_json(run_dir / "train" / "manifest.json")
    assert m["world_size"] == 2 and m["counts"]["micro_batches_per_step"] == 2
    a, b = load_drafter(ref / "train" / "drafter"), load_drafter(run_dir / "train" / "drafter")
    for (n, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        torch.testing.assert_close(y, x, rtol=1e-3, atol=1e-5, msg=n)
    # each rank wrote its own shard files (DCP, safetensors only)
    assert len(list((run_dir / "train" / "step-000009" / "state").glob("*.safetensors"))) == 2


def test_muon_two_ranks_match_one(tmp_path, setup):
    """train.optimizer muon (the GPU recipes') under FSDP2: torch.optim.Muon orthogonalises each
    sharded matrix as a whole (DTensor ops are global; on each rank's half alone the updates differ by
    ~50 %), so 2 ranks train as 1 up to the rounding of its bfloat16 Newton-Schulz iteration (measured:
    5e-4 relative over 9 steps at lr 1e-2, against 1e-4 for AdamW)."""
    target, samples, _ = setup
    kw = dict(KW, optimizer="muon", lr=1e-2)
    recipe, ref = make_run(tmp_path / "one", target, samples, **kw)
    run_ranks(1, recipe, ref)
    recipe, run_dir = make_run(tmp_path / "two", target, samples, **kw)
    run_ranks(2, recipe, run_dir)
    assert losses(run_dir) == pytest.approx(losses(ref), rel=3e-3)
    assert losses(ref)[-1] < losses(ref)[0] - 1  # it trains


def test_resume_at_another_world_size(tmp_path, setup):
    """1 rank stops after step 4 (checkpoint 3), 2 ranks continue and stop after step 7
    (checkpoint 6), 1 rank finishes: the losses are those of the uninterrupted run."""
    target, samples, ref = setup
    recipe, run_dir = make_run(tmp_path, target, samples, **KW)
    train = run_dir / "train"
    run_ranks(1, recipe, run_dir, crash_at=5)
    assert (train / "latest").read_text().strip() == "step-000003"
    run_ranks(2, recipe, run_dir, crash_at=8)
    assert (train / "latest").read_text().strip() == "step-000006"
    assert read_json(train / "step-000006" / "meta.json")["world_size"] == 2
    run_ranks(1, recipe, run_dir)
    assert losses(run_dir) == pytest.approx(losses(ref), rel=RTOL)


def test_checkpoint_after_an_eval_that_is_not_the_best(tmp_path, setup):
    """FSDP leaves the root module's parameters gathered after a forward with no backward (the
    held-out evaluation); a checkpoint must still see the sharded ones the optimizer holds.
    lr 0: the second evaluation equals the first, so no best-drafter gather runs in between."""
    target, samples, _ = setup
    recipe, run_dir = make_run(tmp_path, target, samples, **{**KW, "max_steps": 2, "save_every": 2, "lr": 0.0,
                                                             "heldout_samples": 3, "eval_every": 1})
    run_ranks(2, recipe, run_dir)
    assert (run_dir / "train" / "latest").read_text().strip() == "step-000002"
    evals = [json.loads(line) for line in (run_dir / "train" / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [1, 2] and evals[0]["tau"] == evals[1]["tau"]



def _cli_worker(rank, world, port, argv, out_dir):
    """Rank `rank` runs one CLI command, as a torchrun rank does, and records its exit status, how
    many process groups it set up, and whether one is still up after it. Its stderr (fd 2, so
    torch's C++ warnings at exit too) goes to out_dir/stderr-RANK.txt, its stdout to stdout-RANK.txt."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    for fd, name in ((1, "stdout"), (2, "stderr")):
        os.dup2(os.open(os.path.join(out_dir, f"{name}-{rank}.txt"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    inits, real_init = [], dist.init_process_group

    def counting_init(*a, **k):
        inits.append(k.get("backend", a[0] if a else None))
        return real_init(*a, **k)

    dist.init_process_group = counting_init
    rc = cli.main(argv)
    sys.stdout.flush()
    with open(os.path.join(out_dir, f"result-{rank}.json"), "w") as f:
        json.dump({"rc": rc, "inits": inits, "group_up": dist.is_initialized()}, f)


def run_cli_ranks(world, argv, out_dir, timeout_s=600):
    """`draftsmith ARGV` on `world` ranks (one command per process, as under torchrun); returns
    (result, stderr text, stdout text) per rank. A rank left waiting in a collective fails the test after
    timeout_s instead of hanging it."""
    out_dir.mkdir()
    ctx = mp.start_processes(_cli_worker, args=(world, _free_port(), argv, str(out_dir)), nprocs=world, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=5):
            assert time.monotonic() < deadline, f"ranks still running after {timeout_s} s"
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.kill()
    # read after join: a warning at exit (a group never destroyed) is written when the process ends
    return [(read_json(out_dir / f"result-{r}.json"), (out_dir / f"stderr-{r}.txt").read_text(), (out_dir / f"stdout-{r}.txt").read_text())
            for r in range(world)]


def check_torn_down(results, rc):
    for rank, (res, stderr, _) in enumerate(results):
        assert res["rc"] == rc, (rank, stderr[-3000:])
        assert res["inits"] == ["gloo"], res  # one group for the whole command, however many stages use it
        assert not res["group_up"], rank
        # NCCL warns at exit about a group never destroyed (and can hang); a rank whose peer tore
        # gloo down under it aborts ("terminate called ...")
        assert "has NOT been destroyed" not in stderr and "terminate called" not in stderr, stderr[-3000:]


def test_cli_commands_destroy_their_process_group(tmp_path):
    """Under torchrun (2 gloo ranks): `draftsmith run` on a fresh run directory runs prepare, vocab,
    evaluate and export on rank 0 alone (rank 1 waits for each complete manifest) and capture and
    train on both; it sets up one group, which capture and then train use in the same process, and
    tears it down when it ends; rank 0 alone prints the status table. A command that fails after
    the group is up (train refuses a batch that does not divide over the ranks: every rank raises,
    exit 2) tears it down too, without a barrier."""
    target = make_model_dir(tmp_path / "target", num_layers=4, hidden_size=64)
    run_dir = tmp_path / "run"
    recipe = str(write_recipe(tmp_path, target, run_dir, max_steps=4))
    results = run_cli_ranks(2, ["run", recipe], tmp_path / "run-ranks")
    check_torn_down(results, rc=0)
    for stage in ("data", "capture", "vocab", "train", "eval", "export"):
        assert load_manifest(run_dir / stage)["status"] == "complete", stage
    assert load_manifest(run_dir / "capture")["world_size"] == 2
    assert load_manifest(run_dir / "train")["world_size"] == 2
    events = [(e["event"], e["stage"]) for e in read_jsonl(run_dir / "ledger.jsonl") if "stage" in e]
    for stage in ("prepare", "capture", "vocab", "train", "evaluate", "export"):  # each ran once, from start to end
        assert [ev for ev, st in events if st == stage] == ["stage_started", "stage_finished"], (stage, events)
    (_, err0, out0), (_, err1, out1) = results
    for stage in ("prepare", "vocab", "evaluate", "export"):  # rank 1 ran none of them: it waited, or found it done
        said = [line for line in err1.splitlines() if line.startswith(f"[{stage}]")]
        assert said in ([f"[{stage}] runs on rank 0 only; rank 1 waits for its complete manifest"],
                         [f"[{stage}] complete for these inputs; skipped"]), (stage, said)
        assert f"[{stage}] runs on rank 0 only" not in err0 and f"[{stage}] complete" not in err0, stage
    assert out0.strip() and not out1.strip()  # the status table, once
    # 256 tokens in micro-batches of 256: one micro-batch per step, which 2 ranks cannot share
    failed = run_cli_ranks(2, ["train", recipe, "--train.micro_batch_tokens", "256"], tmp_path / "fail-ranks")
    check_torn_down(failed, rc=2)
    assert all("not a multiple of the world size 2" in stderr for _, stderr, _ in failed)
    assert load_manifest(run_dir / "train")["status"] == "complete"  # the refused run put the complete output back


def test_cli_command_on_one_process_needs_no_group(tmp_path):
    """No torchrun environment: the stages that call init_distributed run without a process group,
    and the CLI's teardown has nothing to do."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        assert var not in os.environ
    target = make_model_dir(tmp_path / "target", num_layers=4, hidden_size=64)
    recipe = str(write_recipe(tmp_path, target, tmp_path / "run", max_steps=2))
    for stage in ("prepare", "capture", "vocab", "train"):
        assert cli.main([stage, recipe]) == 0, stage
        assert not dist.is_initialized()
    assert load_manifest(tmp_path / "run" / "train")["world_size"] == 1


def test_a_group_set_up_before_the_command_is_left_to_its_owner(tmp_path):
    """process_group_scope tears down only a group that came up inside it: a caller's own group
    (here a 1-rank gloo group) is still up after the scope, after an error too."""
    from draftsmith.distributed.group import process_group_scope

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with process_group_scope():
            dist.barrier()
        assert dist.is_initialized()
        with pytest.raises(ValueError), process_group_scope():
            raise ValueError
        assert dist.is_initialized()
    finally:
        destroy_distributed(sync=False)
    assert not dist.is_initialized()
    with process_group_scope():  # a group set up inside the scope goes with it
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store2'}", rank=0, world_size=1)
    assert not dist.is_initialized()


def test_a_failed_end_of_command_barrier_is_a_one_line_error(monkeypatch):
    """The barrier at a command's end fails when another rank died: a DraftsmithError (the CLI's
    one-line error, exit 2), not a traceback; after an error of the command itself that error is
    the one raised, and the group is torn down either way."""
    from draftsmith.distributed import group as distributed
    from draftsmith.messages import DraftsmithError

    state = {"up": False, "destroyed": 0}

    def barrier():
        raise RuntimeError("Connection closed by peer [rank 1]")

    def destroy():
        state["destroyed"] += 1
        state["up"] = False
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: state["up"])
    monkeypatch.setattr(distributed.dist, "barrier", barrier)
    monkeypatch.setattr(distributed.dist, "destroy_process_group", destroy)
    with pytest.raises(DraftsmithError, match="barrier at its end failed .*Connection closed.*another rank"):
        with distributed.process_group_scope():
            state["up"] = True  # a stage set the group up
    assert state["destroyed"] == 1
    with pytest.raises(ValueError, match="the stage's own error"):
        with distributed.process_group_scope():
            state["up"] = True
            raise ValueError("the stage's own error")
    assert state["destroyed"] == 2


def test_two_gloo_ranks_that_never_tear_down_exit_cleanly(tmp_path):
    """torchrun, 2 gloo ranks that set the group up with init_distributed, all-reduce and exit without
    destroying it (a script or benchmark calling stages directly): each ends with exit 0 and no abort
    at exit (init_distributed destroys a group still up at exit while Python is whole; without that,
    about 1 run in 4 aborted here with "terminate called without an active exception")."""
    import subprocess

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import teardown_loop

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    for run in range(RUNS_AT_EXIT):
        out = teardown_loop.one_run(tmp_path / "recipe.yaml", env, "init")
        assert out.returncode == 0 and not teardown_loop.ABORT.search(out.stderr), (run, out.stderr[-2000:])
