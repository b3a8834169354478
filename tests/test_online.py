"""Online mode: hidden states from the target's forward, no disk, equal to the offline capture's;
a few training steps on each, in the same data order, give the same drafter; the train stage with
train.online: true skips capture, matches the offline stage step for step and resumes exactly."""
from __future__ import annotations

import json

import pytest
import torch
import yaml

from draftsmith.manifests import load_manifest
from draftsmith.messages import DraftsmithError
from draftsmith.cli import parse_recipe
from draftsmith.data.shards import read_shard
from draftsmith.draft.build import drafter_config, init_drafter
from draftsmith.pipeline import run_stage
from draftsmith.target.model import load_target, read_target_embeddings
from draftsmith.target.online import online_batch, online_samples
from draftsmith.testing import killed_at_step, make_model_dir
from draftsmith.train.data import CaptureIndex, epoch_plan
from draftsmith.train.ttt import ttt_loss
from draftsmith.draft.vocab import VOCAB_FILE, draft_ids, load_vocab

MAX_LENGTH = 64


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _run(tmp, storage: str):
    target = make_model_dir(tmp / "target", num_layers=4, hidden_size=64)
    convs = [[{"from": "human", "value": f"Count from {i} to {i + 2 + i % 5}."},
              {"from": "gpt", "value": " ".join(str(j) for j in range(i, i + 3 + i % 5)) + ". Done!"}] for i in range(24)]
    (tmp / "convs.json").write_text(json.dumps([{"id": str(i), "conversations": c} for i, c in enumerate(convs)]))
    recipe = {"run_dir": str(tmp / "run"), "target": {"path": str(target), "device": "cpu", "dtype": "float32"},
              "prepare": {"source": str(tmp / "convs.json"), "max_length": MAX_LENGTH, "samples_per_shard": 8},
              "capture": {"batch_tokens": 1, "storage_dtype": storage},  # one sample per forward, offline and online
              "vocab": {"draft_vocab_size": 64}}
    (tmp / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    r = parse_recipe([str(tmp / "recipe.yaml")])[0]
    for stage in ("prepare", "capture", "vocab"):
        run_stage(stage, r)
    return r, tmp / "run"


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("online"), "bfloat16")


def _token_samples(run_dir):
    return [s for p in sorted((run_dir / "data").glob("shard-*.safetensors")) for s in read_shard(p, with_hidden=False)]


def _target(recipe):
    return load_target(recipe.target.path, "cpu", "float32", aux_layer_ids=recipe.target.aux_layer_ids, with_tokenizer=False)


@pytest.mark.parametrize("storage", ["float8_e4m3", "float32"])
def test_online_samples_equal_capture_shards(tmp_path, storage):
    recipe, run_dir = _run(tmp_path, storage)
    offline = [s for p in sorted((run_dir / "capture").glob("shard-*.safetensors")) for s in read_shard(p)]
    online, rejected = online_samples(_target(recipe), _token_samples(run_dir), storage, recipe.capture.batch_tokens)
    assert rejected == 0 and len(online) == len(offline) == 24
    for a, b in zip(offline, online):
        assert a.sample_index == b.sample_index and torch.equal(a.input_ids, b.input_ids)
        assert a.aux_hidden.dtype == b.aux_hidden.dtype
        assert torch.equal(a.aux_hidden, b.aux_hidden) and torch.equal(a.final_hidden, b.final_hidden)


def _train(recipe, run_dir, next_batch, plan, steps=4):
    embed, lm_head, tcfg = read_target_embeddings(recipe.target.path)
    d2t, t2d = load_vocab(run_dir / "vocab" / VOCAB_FILE)
    cfg = drafter_config(tcfg, recipe.draft, d2t.numel(), [1, 1, 0])
    model = init_drafter(cfg, embed, d2t, t2d, seed=0)
    head = lm_head[draft_ids(d2t)]
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=3e-3, betas=(0.9, 0.95))
    losses = []
    for ids in plan[:steps]:
        b = next_batch(ids)
        out = ttt_loss(model, b.input_ids, b.loss_mask, b.aux_hidden, b.final_hidden, head, 3, 0.8,
                       position_ids=b.position_ids, doc_ids=b.doc_ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(out.loss.detach()))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("packed_tokens", [160, None])  # packed rows of 160 tokens, or padded batches
def test_online_training_equals_offline(bf16_run, packed_tokens):
    recipe, run_dir = bf16_run
    index = CaptureIndex(sorted((run_dir / "capture").glob("shard-*.safetensors")), MAX_LENGTH, 64, 3)
    # the same samples in the same order from the token shards (CaptureIndex keeps samples with
    # 3+ tokens and a loss token at position >= 2; none is longer than MAX_LENGTH here)
    tokens = [s for s in _token_samples(run_dir) if len(s) >= 3 and bool(s.loss_mask[2:].any())]
    assert len(tokens) == len(index) and max(len(s) for s in tokens) <= MAX_LENGTH
    plan = epoch_plan(index.lengths, 160, seed=0, epoch=0, layout="packed" if packed_tokens else "padded")
    assert len(plan) >= 4 and any(len(b) > 1 for b in plan[:4])
    target = _target(recipe)
    offline = _train(recipe, run_dir, lambda ids: index.batch(ids, packed_tokens), plan)
    online = _train(recipe, run_dir, lambda ids: online_batch(target, [tokens[j] for j in ids], "bfloat16", 1, packed_tokens), plan)
    assert offline[0] == online[0]
    assert offline[0][-1] < offline[0][0]  # it learns
    for name, w in offline[1].items():
        assert torch.equal(w, online[1][name]), name


# ----------------------------------------------------------------------------- the train stage online

TRAIN = {"ttt_steps": 3, "max_steps": 6, "batch_tokens": 160, "max_length": MAX_LENGTH, "lr": 3e-3, "warmup_steps": 1,
         "save_every": 2, "log_every": 1, "device": "cpu", "dtype": "float32", "heldout_samples": 3, "eval_every": 3}


def _recipe(tmp, target, online: bool, **train_kw):
    """24 short conversations, a float32 target, storage bfloat16, one sample per target forward
    (capture.batch_tokens 1) offline and online."""
    convs = [[{"from": "human", "value": f"Count from {i} to {i + 2 + i % 5}."},
              {"from": "gpt", "value": " ".join(str(j) for j in range(i, i + 3 + i % 5)) + ". Done!"}] for i in range(24)]
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "convs.json").write_text(json.dumps([{"id": str(i), "conversations": c} for i, c in enumerate(convs)]))
    recipe = {"run_dir": str(tmp / "run"), "target": {"path": str(target), "device": "cpu", "dtype": "float32"},
              "prepare": {"source": str(tmp / "convs.json"), "max_length": MAX_LENGTH, "samples_per_shard": 8},
              "capture": {"batch_tokens": 1, "storage_dtype": "bfloat16"},
              "vocab": {"draft_vocab_size": 64}, "train": {**TRAIN, **train_kw, "online": online}}
    (tmp / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    return parse_recipe([str(tmp / "recipe.yaml")])[0], tmp / "run"


def _run_to_train(recipe) -> dict[str, dict]:
    """The stages of `draftsmith run` up to train, in its order."""
    return {s: run_stage(s, recipe) for s in ("prepare", "regenerate", "capture", "vocab", "train")}


def _losses(run_dir):
    return [json.loads(line)["loss"] for line in (run_dir / "train" / "metrics.jsonl").read_text().splitlines()]


def _evals(run_dir):
    return [json.loads(line) for line in (run_dir / "train" / "eval.jsonl").read_text().splitlines()]


def _weights(run_dir):
    from safetensors.torch import load_file

    return load_file(str(run_dir / "train" / "drafter" / "model.safetensors"))


@pytest.fixture(scope="module")
def train_runs(tmp_path_factory):
    """(target dir, offline run dir, online run dir), each trained 6 steps from its own prepare."""
    target = make_model_dir(tmp_path_factory.mktemp("target") / "target", num_layers=4, hidden_size=64)
    dirs = []
    for online in (False, True):
        tmp = tmp_path_factory.mktemp("online" if online else "offline")
        recipe, run_dir = _recipe(tmp, target, online)
        out = _run_to_train(recipe)
        assert (out["capture"] == {}) == online
        dirs.append(run_dir)
    return target, *dirs


def test_online_train_stage_equals_offline(train_runs):
    """Same data, seed and storage dtype (float32 target, bfloat16 storage): the online train stage
    takes the offline one's steps exactly (torch.equal / == on every loss and weight)."""
    _, offline, online = train_runs
    assert not (online / "capture").exists()  # capture skipped: no hidden states on disk
    assert not [p for p in online.rglob("*") if "capture" in p.name]
    m_off, m_on = (load_manifest(d / "train") for d in (offline, online))
    assert m_on["status"] == "complete" and m_on["online"] is True and m_off["online"] is False
    assert set(m_on["inputs"]) == {"prepare", "vocab"} and set(m_off["inputs"]) == {"capture", "vocab"}
    assert m_on["aux_layer_ids"] == load_manifest(offline / "capture")["aux_layer_ids"]
    assert m_on["counts"] == m_off["counts"] and m_on["counts"]["samples_heldout"] == 3
    ls = _losses(online)
    assert len(ls) == 6 and ls == _losses(offline)
    assert ls[-1] < ls[0]
    assert _evals(online) == _evals(offline) and [e["step"] for e in _evals(online)] == [3, 6]
    a, b = _weights(offline), _weights(online)
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a), [n for n in a if not torch.equal(a[n], b[n])]
    # train reads data/ and vocab/ only: the ledger of the online run never started capture
    events = [json.loads(line) for line in (online / "ledger.jsonl").read_text().splitlines()]
    assert not [e for e in events if e.get("stage") == "capture"]
    # `draftsmith status` does not wait for a capture that online mode never runs
    from draftsmith.status import collect

    st = collect(online)
    assert "capture" not in [s["stage"] for s in st["stages"]] and st["next_step"]["stage"] == "evaluate"
    assert "capture" in [s["stage"] for s in collect(offline)["stages"]]


def test_heldout_engine_tau_offline_and_online(train_runs):
    """The best drafter's tau measured by the engine on the held-out conversations' first turns:
    offline (the target loaded as evaluate loads it) and online (the training target) give the
    same record, within [1, depth + 1], from held-out conversations only; capture's shards carry
    the source ids prepare read."""
    from draftsmith.data.conversations import conversation_keys
    from draftsmith.train.heldout import split_by_conversation

    _, offline, online = train_runs
    index = CaptureIndex(sorted((offline / "capture").glob("shard-*.safetensors")), MAX_LENGTH, 64, 3)
    assert index.source_id == [str(i) for i in range(24)]
    keys = conversation_keys(index.source_id, index.sample_index)
    train, held = split_by_conversation(keys, 3, 0)
    m_off, m_on = (load_manifest(d / "train") for d in (offline, online))
    eng = m_off["metrics"]["heldout"]["engine"]
    assert eng == m_on["metrics"]["heldout"]["engine"]
    assert eng["prompts"] == 3 and eng["depth"] == 3 and 1 <= eng["tau_chain"] <= 4
    assert sorted(eng["conversations"]) == sorted(keys[j] for j in held)
    assert not set(eng["conversations"]) & {keys[j] for j in train}


def test_online_train_resumes_exactly(train_runs, tmp_path, monkeypatch):
    """Killed at step 5 (checkpoint at 4), the rerun continues from the data cursor and takes the
    uninterrupted online run's steps exactly."""
    import draftsmith.train.loop as loop

    target, _, online = train_runs
    recipe, run_dir = _recipe(tmp_path, target, True)
    for s in ("prepare", "regenerate", "capture", "vocab"):
        run_stage(s, recipe)
    with killed_at_step(monkeypatch, 5), pytest.raises(KeyboardInterrupt):
        run_stage("train", recipe)
    assert (run_dir / "train" / "latest").read_text().strip() == "step-000004"
    assert load_manifest(run_dir / "train")["status"] == "running"
    m = run_stage("train", recipe)
    assert m["status"] == "complete" and m["online"] is True
    assert _losses(run_dir) == _losses(online)
    a, b = _weights(online), _weights(run_dir)
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_online_bad_config_is_one_line_error(train_runs, tmp_path):
    import draftsmith.train.loop as loop

    target, _, _ = train_runs
    # online train before prepare: it names the token shards it needs, not capture
    recipe, _ = _recipe(tmp_path / "a", target, True)
    with pytest.raises(DraftsmithError, match=r"data/manifest\.json: stage prepare is not complete") as e:
        run_stage("train", recipe)
    assert "\n" not in str(e.value) and "capture" not in str(e.value)
    # prepare and vocab done, then the target path points nowhere
    recipe, run_dir = _recipe(tmp_path / "b", target, True)
    for s in ("prepare", "vocab"):
        run_stage(s, recipe)
    recipe.target.path = str(tmp_path / "no-such-target")
    with pytest.raises(DraftsmithError, match=r"no-such-target/config\.json: target model not found; set target\.path") as e:
        run_stage("train", recipe)
    assert "\n" not in str(e.value)
    # aux layers the target does not have: the loop's target load (online only) names them
    recipe.target.path = str(target)
    recipe.target.aux_layer_ids = [1, 9]
    with pytest.raises(DraftsmithError, match=r"target\.aux_layer_ids \[1, 9\]: \[9\] outside 0\.\.3") as e:
        loop.run(recipe, run_dir, "fp-train")
    assert "\n" not in str(e.value)


def test_online_pipeline_dependencies(tmp_path):
    from draftsmith.config import Recipe, TrainConfig
    from draftsmith.pipeline import sections_of, skip_reason, upstream_of

    off, on = Recipe(), Recipe(train=TrainConfig(online=True))
    assert upstream_of("train", off) == ("capture", "vocab") and upstream_of("train", on) == ("prepare", "vocab")
    assert "capture" in sections_of("train", on) and "capture" not in sections_of("train", off)
    assert skip_reason("capture", on) and skip_reason("capture", off) is None
    on.regenerate.enabled = True
    assert upstream_of("train", on) == ("prepare", "regenerate", "vocab")


def test_online_two_ranks_match_one(train_runs, tmp_path):
    """2 CPU ranks (gloo, FSDP2), each running the target on its own micro-batches, take the
    1-rank online run's steps at the same global batches (fp32 sum order: RTOL as test_distributed)."""
    from test_distributed import RTOL, run_ranks

    target, _, _ = train_runs
    runs = []
    for world in (1, 2):
        recipe, run_dir = _recipe(tmp_path / f"w{world}", target, True, micro_batch_tokens=80, max_steps=4)
        for s in ("prepare", "vocab"):
            run_stage(s, recipe)
        run_ranks(world, recipe, run_dir)
        runs.append(run_dir)
    m = load_manifest(runs[1] / "train")
    assert m["world_size"] == 2 and m["online"] is True and m["counts"]["micro_batches_per_step"] == 2
    assert _losses(runs[1]) == pytest.approx(_losses(runs[0]), rel=RTOL)
    a, b = _weights(runs[0]), _weights(runs[1])
    for n in a:
        torch.testing.assert_close(b[n], a[n], rtol=1e-3, atol=1e-5, msg=n)
