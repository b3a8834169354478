"""Training on 2 CPU ranks (gloo, FSDP2) equals training on 1 at the same global batch, and a
run resumes exactly at another world size. Ranks are torch.multiprocessing spawns."""
import contextlib
import json
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

import draftsmith.train.loop as loop
from draftsmith.artifacts import read_json
from draftsmith.draft.io import load_drafter
from draftsmith.testing import make_model_dir
from draftsmith.distributed import destroy_distributed
from test_train import losses, make_run, toy_samples

# fp32 on CPU: 2 ranks differ from 1 only by the order of float sums (gradient reduce-scatter,
# loss all-reduce); over 9 AdamW steps that stays far below this.
RTOL = 1e-4
KW = dict(max_steps=9, batch_tokens=128, micro_batch_tokens=64, save_every=3)  # 2 micro-batches per step


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
