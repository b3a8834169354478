"""Drafter rotary embeddings against transformers' LlamaRotaryEmbedding (default, linear,
llama3, yarn), through the config path the drafter really takes (draft/build.py)."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from draftsmith.messages import DraftsmithError
from draftsmith.config import DraftConfig
from draftsmith.draft.build import drafter_config
from draftsmith.draft.model import DraftKVCache, Eagle3Drafter
from draftsmith.draft import rope
from draftsmith.draft.rope import rope_cos_sin

SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 1024},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
}


def target_config(scaling):
    params = {"rope_type": "default", "rope_theta": 5e5} if scaling is None else {**scaling, "rope_theta": 5e5}
    return LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=8192, rope_parameters=params)


@pytest.mark.parametrize("kind", list(SCALINGS))
def test_matches_hf_rotary_embedding(kind):
    t = target_config(SCALINGS[kind])
    cfg = drafter_config(t, DraftConfig(), 32, [1, 2, 3])
    assert (cfg.rope_scaling or {}).get("rope_type") == (None if kind == "default" else kind)
    hf = LlamaRotaryEmbedding(t)
    pos = torch.tensor([[0, 1, 5, 1000, 3000, 8000]])
    want_cos, want_sin = hf(torch.zeros(1, dtype=torch.float32), pos)
    cos, sin = rope_cos_sin(pos, cfg, torch.float32)
    torch.testing.assert_close(cos, want_cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, want_sin, rtol=0, atol=1e-6)
    if kind != "default":  # the scaling really changes the rotation (the bug this file fixes)
        plain, _ = rope_cos_sin(pos, drafter_config(target_config(None), DraftConfig(), 32, [1, 2, 3]), torch.float32)
        assert not torch.allclose(plain, cos, atol=1e-3)
    if kind == "yarn":
        assert hf.attention_scaling > 1.0  # YaRN scales cos/sin; we must too


def test_drafter_forward_uses_scaling():
    """The drafter's attention output changes with rope_scaling (positions far apart)."""
    outs = []
    for kind in ("default", "llama3"):
        cfg = drafter_config(target_config(SCALINGS[kind]), DraftConfig(), 32, [1, 2, 3])
        torch.manual_seed(0)
        m = Eagle3Drafter(cfg).eval()
        ids = torch.tensor([[3, 4, 5, 6]])
        h = torch.randn(1, 4, 64, generator=torch.Generator().manual_seed(1))
        outs.append(m(ids, h, torch.tensor([[0, 2000, 4000, 6000]]), DraftKVCache()))
    assert not torch.allclose(outs[0], outs[1], atol=1e-4)


def test_dynamic_rope_is_refused():
    cfg = drafter_config(target_config({"rope_type": "dynamic", "factor": 2.0}), DraftConfig(), 32, [1, 2, 3])
    with pytest.raises(DraftsmithError, match="dynamic"):
        rope_cos_sin(torch.arange(4)[None], cfg, torch.float32)


def test_tables_made_under_inference_mode_serve_training():
    """The process-wide tables, first made by an engine's forward under torch.inference_mode, are
    ordinary tensors: a training step after it may save them for backward (on the H200 a compiled
    TTT loss failed with 'Inference tensors cannot be saved for backward' after a decoding test)."""
    cfg = drafter_config(target_config(None), DraftConfig(), 32, [1, 2, 3])
    cfg.rope_theta = 12345.0  # a setting no other test made: the table is made here, under inference mode
    pos = torch.arange(6)[None]
    with torch.inference_mode():
        rope_cos_sin(pos, cfg, torch.float32)
    assert not any(t.is_inference() for t, _ in rope._TABLES.values())
    x = torch.randn(1, 6, cfg.head_dim, requires_grad=True)
    cos, sin = rope_cos_sin(pos, cfg, torch.float32)
    (x * cos + x * sin).sum().backward()
    assert x.grad is not None


@pytest.mark.parametrize("kind", ["default", "yarn"])
def test_table_rows_are_the_computed_rotation(kind):
    """A decoding step looks its rotation up in rope_table (one gather, no cos/sin kernels); the rows
    are rope_cos_sin's values at those positions (YaRN: scaled too), in the table's dtype."""
    cfg = drafter_config(target_config(SCALINGS[kind]), DraftConfig(), 32, [1, 2, 3])
    pos = torch.tensor([[0, 1, 7, 1000], [3, 4095, 5, 6]])
    for dtype in (torch.float32, torch.bfloat16):
        table = rope.rope_table(cfg, 4096, dtype, "cpu")
        assert table.shape == (2, 4096, cfg.head_dim) and table.dtype == dtype
        cos, sin = table[:, pos].unbind(0)
        want_cos, want_sin = rope_cos_sin(pos, cfg, dtype)
        torch.testing.assert_close(cos, want_cos, rtol=0, atol=2e-6)
        torch.testing.assert_close(sin, want_sin, rtol=0, atol=2e-6)


def test_drafter_step_with_a_table_equals_the_computed_one():
    """Eagle3Drafter.forward rotates by its cache's table when the cache has one (the static cache of
    the fast path), by rope_cos_sin otherwise: the same step either way."""
    cfg = drafter_config(target_config(SCALINGS["llama3"]), DraftConfig(), 32, [1, 2, 3])
    torch.manual_seed(0)
    m = Eagle3Drafter(cfg).eval()
    ids, pos = torch.tensor([[3, 4, 5]]), torch.tensor([[0, 700, 2000]])
    h = torch.randn(1, 3, 64, generator=torch.Generator().manual_seed(1))
    plain = m(ids, h, pos, DraftKVCache())
    tabled = DraftKVCache()
    tabled.rope = rope.rope_table(cfg, 2048, torch.float32, "cpu")
    torch.testing.assert_close(m(ids, h, pos, tabled), plain, rtol=0, atol=1e-5)
    tabled.rope = torch.zeros_like(tabled.rope)  # the table is really what rotates
    assert not torch.allclose(m(ids, h, pos, DraftKVCache()), m(ids, h, pos, tabled), atol=1e-3)


def test_q_and_k_rotated_together_keep_their_bits():
    """Eagle3Attention.qkv rotates q and k as one tensor (fewer kernels a step): the same bits as rotating
    each by itself."""
    from draftsmith.draft.model import apply_rope

    cfg = drafter_config(target_config(SCALINGS["yarn"]), DraftConfig(), 32, [1, 2, 3])
    torch.manual_seed(0)
    attn = Eagle3Drafter(cfg).eval().midlayer.self_attn
    x, pos = torch.randn(2, 5, 2 * cfg.hidden_size), torch.tensor([[0, 1, 2, 900, 3000]] * 2)
    q, k, v = attn.qkv(x, pos)
    cos, sin = rope_cos_sin(pos, cfg, torch.float32)
    B, T = 2, 5
    q0 = attn.q_proj(x).view(B, T, cfg.num_attention_heads, cfg.head_dim).transpose(1, 2)
    k0 = attn.k_proj(x).view(B, T, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
    assert torch.equal(q, apply_rope(q0, cos, sin)) and torch.equal(k, apply_rope(k0, cos, sin))
    assert q.shape == (B, cfg.num_attention_heads, T, cfg.head_dim) and k.shape == (B, cfg.num_key_value_heads, T, cfg.head_dim)
