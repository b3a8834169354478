"""Online mode: hidden states from the target's forward, no disk, equal to the offline capture's;
a few training steps on each, in the same data order, give the same drafter."""
from __future__ import annotations

import json

import pytest
import torch
import yaml

from draftsmith.cli import parse_recipe
from draftsmith.data.shards import read_shard
from draftsmith.draft.build import drafter_config, init_drafter, read_target_embeddings
from draftsmith.pipeline import run_stage
from draftsmith.target.model import load_target
from draftsmith.target.online import online_batch, online_samples
from draftsmith.testing import make_model_dir
from draftsmith.train.data import CaptureIndex, epoch_plan
from draftsmith.train.ttt import ttt_loss
from draftsmith.vocab import VOCAB_FILE, draft_ids, load_vocab

MAX_LENGTH = 64


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


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
        out = ttt_loss(model, b.input_ids, b.loss_mask, b.aux_hidden, b.final_hidden, head, 3, 0.8)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(out.loss.detach()))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_online_training_equals_offline(bf16_run):
    recipe, run_dir = bf16_run
    index = CaptureIndex(sorted((run_dir / "capture").glob("shard-*.safetensors")), MAX_LENGTH, 64, 3)
    # the same samples in the same order from the token shards (CaptureIndex keeps samples with
    # 3+ tokens and a loss token at position >= 2; none is longer than MAX_LENGTH here)
    tokens = [s for s in _token_samples(run_dir) if len(s) >= 3 and bool(s.loss_mask[2:].any())]
    assert len(tokens) == len(index) and max(len(s) for s in tokens) <= MAX_LENGTH
    plan = epoch_plan(index.lengths, 160, seed=0, epoch=0)
    assert len(plan) >= 4 and any(len(b) > 1 for b in plan[:4])
    target = _target(recipe)
    offline = _train(recipe, run_dir, index.batch, plan)
    online = _train(recipe, run_dir, lambda ids: online_batch(target, [tokens[j] for j in ids], "bfloat16", 1), plan)
    assert offline[0] == online[0]
    assert offline[0][-1] < offline[0][0]  # it learns
    for name, w in offline[1].items():
        assert torch.equal(w, online[1][name]), name
