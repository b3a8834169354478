from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftsmith.messages import DraftsmithError
from draftsmith.config import DraftConfig
from draftsmith.draft.build import default_intermediate_size, drafter_config, init_drafter, rope_settings
from draftsmith.draft.io import load_drafter, save_drafter
from draftsmith.draft.model import DraftKVCache, Eagle3Config
from draftsmith.testing import tiny_config

H, V, VD = 32, 50, 20


FLAGS = ("norm_before_fc", "norm_before_residual", "norm_output")
ALL_FLAGS = {f: True for f in FLAGS}


def make_drafter(seed=0, **flags):
    cfg = Eagle3Config(hidden_size=H, target_hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                       intermediate_size=48, vocab_size=V, draft_vocab_size=VD, aux_layer_ids=[1, 2, 3], target_num_layers=6,
                       **flags)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(V, generator=g)[:VD].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    m = init_drafter(cfg, torch.randn(V, H, generator=g), ids - torch.arange(VD), t2d, seed).eval()
    with torch.no_grad():  # norms away from 1, so that a norm applied in the wrong place shows
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
    return m


def inputs(B=2, T=9, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, V, (B, T), generator=g), torch.randn(B, T, 3 * H, generator=g),
            torch.arange(T)[None].expand(B, T))


@torch.no_grad()
def test_shapes_and_vocab_mapping():
    m = make_drafter()
    ids, aux, pos = inputs()
    h = m.project(aux)
    g = m(ids, h, pos)
    assert h.shape == g.shape == (2, 9, H)
    assert m.logits(g).shape == (2, 9, VD)
    assert not m.embed_tokens.weight.requires_grad
    tgt = m.draft_to_target(torch.arange(VD))
    assert bool(m.t2d[tgt].all()) and int(m.t2d.sum()) == VD


@torch.no_grad()
@pytest.mark.parametrize("flags", [{}, ALL_FLAGS], ids=["plain", "all_norms"])
def test_cached_inference_equals_full_forward(flags):
    m = make_drafter(**flags)
    ids, aux, pos = inputs()
    h = m.project(aux)
    full = m(ids, h, pos)
    cache = DraftKVCache()
    parts = [m(ids[:, :4], h[:, :4], pos[:, :4], cache)]
    for t in range(4, ids.shape[1]):
        parts.append(m(ids[:, t:t + 1], h[:, t:t + 1], pos[:, t:t + 1], cache))
    assert cache.length == ids.shape[1]
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-5, atol=1e-5)
    cache.crop(3)
    assert cache.length == 3


@torch.no_grad()
@pytest.mark.parametrize("flags", [{}, ALL_FLAGS], ids=["plain", "all_norms"])
def test_ttt_steps_match_inference_with_masks(flags):
    m = make_drafter(**flags)
    ids, aux, pos = inputs(B=1)
    L = ids.shape[1]
    h0 = m.project(aux)
    ttt_cache = []
    g0 = m.ttt_step(ids, h0, pos, ttt_cache)
    torch.testing.assert_close(g0, m(ids, h0, pos), rtol=1e-5, atol=1e-5)
    # Step 1: row t attends to step-0 keys <= t and to its own step-1 key.
    ids1 = torch.roll(ids, -1, 1)
    g1 = m.ttt_step(ids1, g0, pos + 1, ttt_cache)
    cache = DraftKVCache()
    m(ids, h0, pos, cache)
    mask = torch.cat([torch.ones(L, L, dtype=torch.bool).tril(), torch.eye(L, dtype=torch.bool)], 1)[None]
    torch.testing.assert_close(g1, m(ids1, g0, pos + 1, cache, attn_mask=mask), rtol=1e-5, atol=1e-5)


def _rms(x, w, eps=1e-6):
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@torch.no_grad()
@pytest.mark.parametrize("flag", [None, *FLAGS])
def test_architecture_flags_follow_their_formulas(flag):
    """One drafter step written out by hand for each flag (DESIGN.md §4 and the flags' meaning in
    speculators): the flag changes exactly the piece it names, and nothing else."""
    flags = {flag: True} if flag else {}
    m = make_drafter(**flags)
    ids, aux, pos = inputs(B=1)
    layer, attn = m.midlayer, m.midlayer.self_attn
    x = _rms(aux, m.input_norm.weight) if flag == "norm_before_fc" else aux
    h = x @ m.fc.weight.T
    torch.testing.assert_close(m.project(aux), h)
    hn = _rms(h, layer.hidden_norm.weight)
    q_in = torch.cat([_rms(m.embed_tokens(ids), layer.input_layernorm.weight), hn], -1)
    q, k, v = attn.qkv(q_in, pos)
    o = attn.out(torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                                  is_causal=True))
    r = (hn if flag == "norm_before_residual" else h) + o
    y = _rms(r, layer.post_attention_layernorm.weight)
    g = r + layer.mlp["down_proj"](torch.nn.functional.silu(layer.mlp["gate_proj"](y)) * layer.mlp["up_proj"](y))
    out = m(ids, h, pos)
    want_next = _rms(g, m.norm.weight) if flag == "norm_output" else g
    torch.testing.assert_close(out, want_next, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(m.logits(out), _rms(g, m.norm.weight) @ m.lm_head.weight.T, rtol=1e-5, atol=1e-5)
    assert hasattr(m, "input_norm") == (flag == "norm_before_fc")


@pytest.mark.parametrize("flags", [{}, ALL_FLAGS], ids=["plain", "all_norms"])
def test_save_load_roundtrip(tmp_path, flags):
    m = make_drafter(**flags)
    save_drafter(m, tmp_path / "d")
    m2 = load_drafter(tmp_path / "d")
    assert m2.cfg == m.cfg
    for k, v in m.state_dict().items():
        assert torch.equal(v, m2.state_dict()[k]), k
    ids, aux, pos = inputs()
    with torch.no_grad():
        torch.testing.assert_close(m2(ids, m2.project(aux), pos), m(ids, m.project(aux), pos))


@pytest.mark.parametrize("edit,what", [
    (lambda s: s.pop("fc.weight"), "missing: fc.weight"),
    (lambda s: s.__setitem__("extra.weight", torch.zeros(1)), "unexpected: extra.weight"),
    (lambda s: s.__setitem__("lm_head.weight", torch.zeros(VD + 1, H)), "wrong shape: lm_head.weight"),
])
def test_load_drafter_rejects_bad_weights(tmp_path, edit, what):
    save_drafter(make_drafter(), tmp_path / "d")
    path = tmp_path / "d" / "model.safetensors"
    state = load_file(str(path))
    edit(state)
    save_file(state, str(path))
    with pytest.raises(DraftsmithError, match=what):
        load_drafter(tmp_path / "d")


def test_drafter_config_from_targets():
    llama = tiny_config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    c = drafter_config(llama, DraftConfig(), 100, [1, 1, 0])
    assert (c.hidden_size, c.target_hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
            c.intermediate_size, c.vocab_size, c.draft_vocab_size, c.num_aux_layers) == (64, 64, 4, 2, 16, 128, llama.vocab_size, 100, 3)
    assert (c.rope_theta, c.rope_scaling, c.max_position_embeddings, c.target_num_layers) == (10000.0, None, 2048, 4)
    c = drafter_config(llama, DraftConfig(num_attention_heads=8, intermediate_size=96), 100, [0, 1, 2])
    assert (c.num_attention_heads, c.num_key_value_heads, c.intermediate_size) == (8, 2, 96)

    from transformers import DeepseekV3Config, Qwen3MoeConfig

    moe = Qwen3MoeConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=300,
                         num_hidden_layers=4, max_position_embeddings=4096,
                         rope_parameters={"rope_type": "yarn", "rope_theta": 5e5, "factor": 4.0,
                                          "original_max_position_embeddings": 1024})
    pure_moe = SimpleNamespace(**{k: v for k, v in moe.to_dict().items() if k != "intermediate_size"})  # no dense width
    c = drafter_config(pure_moe, DraftConfig(), 100, [1, 1, 0])
    assert c.intermediate_size == default_intermediate_size(64) == 192
    assert c.rope_theta == 5e5 and c.rope_scaling["rope_type"] == "yarn" and c.rope_scaling["factor"] == 4.0

    mla = DeepseekV3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, vocab_size=300, num_hidden_layers=4,
                           kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16)
    c = drafter_config(mla, DraftConfig(), 100, [1, 1, 0])
    assert c.head_dim == 16 and c.num_attention_heads == 4


def test_rope_settings_old_style():
    class Old:
        rope_theta = 1e6
        rope_scaling = {"type": "linear", "factor": 2.0}
    assert rope_settings(Old()) == (1e6, {"type": "linear", "factor": 2.0})


def test_rms_norm_in_one_dtype_and_under_autocast():
    """RMSNorm: input and weight of one dtype take torch's rms_norm (one fused kernel on CUDA): float32
    exactly the formula, bf16 within one rounding of it; a bf16 input with float32 weights (autocast
    training) keeps transformers' form, a float32 product."""
    from draftsmith.draft.model import RMSNorm
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 64, generator=g)
    norm = RMSNorm(64, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(64, generator=g) + 0.5)
    want = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(norm(x), want, rtol=1e-6, atol=1e-6)
    xb = x.bfloat16()
    want = norm.weight * (xb.float() * torch.rsqrt(xb.float().pow(2).mean(-1, keepdim=True) + 1e-6))
    mixed = norm(xb)
    assert mixed.dtype == torch.float32
    torch.testing.assert_close(mixed, want, rtol=2 ** -8, atol=1e-6)
    low = norm.to(torch.bfloat16)(xb)
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), want, rtol=2 ** -7, atol=1e-6)
