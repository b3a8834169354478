"""Target loading and layer discovery for every architecture family, checked against the model's
own output_hidden_states: aux = hidden_states[i + 1] for each aux layer i, final = hidden_states[-1]."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from draftsmith.messages import DraftsmithError
from draftsmith.data.shards import Sample
from draftsmith.target.online import capture_samples
from draftsmith.target.model import load_target
from draftsmith.testing import ARCHS, make_model_dir

AUX = [0, 2, 1]  # deepseek_v3: layer 0 dense (first_k_dense_replace), 1 and 2 MoE; hidden_states[N] is after the norm
LAYER_LISTS = {"llava": "model.language_model.layers"}


def _samples(vocab: int) -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    lengths = [13, 5, 21, 9]  # longer than gpt_oss's sliding window (8); padded in one batch
    return [Sample(torch.randint(3, vocab - 1, (n,), generator=g), torch.ones(n, dtype=torch.bool), j)
            for j, n in enumerate(lengths)]


@pytest.mark.parametrize("arch", ARCHS)
def test_capture_matches_output_hidden_states(tmp_path, arch):
    path = make_model_dir(tmp_path / arch, arch=arch, num_layers=4, hidden_size=64)
    target = load_target(path, "cpu", "float32", aux_layer_ids=AUX, with_tokenizer=False)
    assert target.num_layers == 4 and target.hidden_size == 64
    name = next(n for n, m in target.model.named_modules() if m is target.layers)
    assert name == LAYER_LISTS.get(arch, "model.layers")
    samples = _samples(target.vocab_size - 1)
    got, rejected = capture_samples(target, samples, batch_tokens=4 * 21, storage_dtype="float32")
    assert rejected == 0 and [s.sample_index for s in got] == [0, 1, 2, 3]
    for s in got:
        with torch.no_grad():
            out = target.model(input_ids=s.input_ids[None], output_hidden_states=True)
        hs = out.hidden_states
        assert len(hs) == 5
        want_aux = torch.cat([hs[i + 1][0] for i in AUX], dim=-1)
        torch.testing.assert_close(s.aux_hidden, want_aux, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(s.final_hidden, hs[-1][0], atol=2e-5, rtol=1e-4)
        # final_hidden is after the final norm: the lm_head applied to it gives the model's logits
        logits = target.model.get_output_embeddings()(s.final_hidden)
        torch.testing.assert_close(logits, out.logits[0], atol=1e-4, rtol=1e-4)
    # Target.forward with logits returns the same states as the decoder-only path
    res = target.forward(got[0].input_ids[None], with_logits=True)
    torch.testing.assert_close(res.aux_hidden[0], got[0].aux_hidden, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(res.final_hidden[0], got[0].final_hidden, atol=2e-5, rtol=1e-4)


def test_deepseek_leading_dense_layers(tmp_path):
    path = make_model_dir(tmp_path / "ds", arch="deepseek_v3", num_layers=4, hidden_size=64)
    target = load_target(path, "cpu", "float32", with_tokenizer=False)
    kinds = [type(layer.mlp).__name__ for layer in target.layers]
    assert kinds == ["DeepseekV3MLP"] + ["DeepseekV3MoE"] * 3
    assert target.aux_layer_ids == [1, 1, 0]  # default [1, N//2-1, N-4] clamped for N = 4


def test_bad_aux_layer_ids(tmp_path):
    path = make_model_dir(tmp_path / "m", num_layers=4, hidden_size=64)
    with pytest.raises(DraftsmithError, match="outside 0..3"):
        load_target(path, "cpu", "float32", aux_layer_ids=[1, 4], with_tokenizer=False)


@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None and not os.environ.get("CI"),
                    reason="device_map needs accelerate (.ci/run installs it and sets CI, so CI never skips this)")
def test_device_map_cpu(tmp_path):
    path = make_model_dir(tmp_path / "m", num_layers=4, hidden_size=64)
    plain = load_target(path, "cpu", "float32", aux_layer_ids=AUX, with_tokenizer=False)
    mapped = load_target(path, "cpu", "float32", aux_layer_ids=AUX, with_tokenizer=False, device_map="cpu")
    assert mapped.device == torch.device("cpu")
    ids = torch.arange(3, 20)[None]
    a, b = plain.forward(ids, with_logits=False), mapped.forward(ids, with_logits=False)
    torch.testing.assert_close(a.aux_hidden, b.aux_hidden)
    torch.testing.assert_close(a.final_hidden, b.final_hidden)
