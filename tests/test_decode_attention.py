"""draft.attention.decode_attention (the decoding steps' attention, kernel by row count) equals the
attention math on every branch, and the fast path's target runs it through transformers'
AttentionInterface (speculate.hfmodel.hf_decode_attention) with the same logits as transformers' sdpa."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import draftsmith.speculate.fast as fast
import draftsmith.speculate.hfmodel as hfmodel
from draftsmith.draft.attention import FOLD_ROWS, decode_attention, decode_kernel
from draftsmith.speculate.cache import additive
from draftsmith.speculate.tree import committed_columns, device_tree_mask
from draftsmith.target.model import load_target
from draftsmith.testing import make_model_dir

ROWS = [1, 2, 5, 17, 40]  # at 4 query heads per KV head: sdpa, fold_mm x3, sdpa (160 folded rows > FOLD_ROWS)


def reference(q, k, v, mask, scale):
    """The math in float64: K/V repeated per query head, scores, mask, softmax."""
    n_rep = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(n_rep, 1), v.double().repeat_interleave(n_rep, 1)
    s = q.double() @ k.transpose(-1, -2) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.double()
    return (s.softmax(-1) @ v).to(q.dtype)


def random_mask(B, N, S, g, tree: bool) -> torch.Tensor:
    """bool [B, 1, N, S]: each row sees a random subset of columns and itself (column S - N + row);
    tree: the last N columns are a random tree's ancestry (a row sees its parent's rows and itself)."""
    m = torch.rand(B, N, S, generator=g) < 0.5
    if tree:
        anc = torch.zeros(B, N, N, dtype=torch.bool)
        for b in range(B):
            for i in range(N):
                p = int(torch.randint(0, i, (1,), generator=g)) if i else -1
                anc[b, i] = anc[b, p] if p >= 0 else False
                anc[b, i, i] = True
        m[:, :, S - N:] = anc
    m[:, torch.arange(N), S - N + torch.arange(N)] = True
    return m[:, None]


@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4)])  # GQA, MHA
@pytest.mark.parametrize("N", ROWS)
@pytest.mark.parametrize("kind", ["bool", "tree", "additive", "none", "shared"])
def test_decode_attention_equals_the_math(heads, kv_heads, N, kind):
    g = torch.Generator().manual_seed(N * 10 + heads)
    B, S, D = 2, 48, 16
    q = torch.randn(B, heads, N, D, generator=g)
    k = torch.randn(B, kv_heads, S, D, generator=g)
    v = torch.randn(B, kv_heads, S, D, generator=g)
    mask = random_mask(B, N, S, g, tree=kind == "tree")
    if kind == "additive":  # HF's float mask (finite lowest value, not -inf)
        mask = additive(mask[:, 0], q.dtype)
    elif kind == "none":
        mask = None
    elif kind == "shared":  # one mask for the whole batch [1, 1, N, S]
        mask = mask[:1]
    out = decode_attention(q, k, v, mask, 0.3)
    torch.testing.assert_close(out, reference(q, k, v, mask, 0.3), rtol=1e-5, atol=1e-5)
    # and SDPA's own math on the same inputs (the path transformers' sdpa took)
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(heads // kv_heads, 1),
                                         v.repeat_interleave(heads // kv_heads, 1), attn_mask=mask, scale=0.3)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_the_rows_cover_every_kernel():
    """The parametrization above runs each branch (a threshold change would silently drop one)."""
    assert {decode_kernel(n, 4) for n in ROWS} == {"sdpa", "fold_mm"}
    assert decode_kernel(1, 4) == "sdpa" and decode_kernel(2, 4) == "fold_mm" and decode_kernel(40, 4) == "sdpa"
    assert decode_kernel(FOLD_ROWS // 4, 4) == "fold_mm" and decode_kernel(FOLD_ROWS // 4 + 1, 4) == "sdpa"
    assert decode_kernel(6, 1) == "fold_mm"  # MHA: folded rows are the query rows


def test_value_head_dim_may_differ():
    """MLA (DeepSeek-V3): q/k head dim 24, v head dim 16, one KV head per query head."""
    g = torch.Generator().manual_seed(3)
    for N in (1, 4, 80):
        q, k, v = torch.randn(1, 4, N, 24, generator=g), torch.randn(1, 4, 90, 24, generator=g), torch.randn(1, 4, 90, 16, generator=g)
        mask = random_mask(1, N, 90, g, tree=True)
        out = decode_attention(q, k, v, mask, 24 ** -0.5)
        assert out.shape == (1, 4, N, 16)
        torch.testing.assert_close(out, reference(q, k, v, mask, 24 ** -0.5), rtol=1e-5, atol=1e-5)


def test_a_row_that_sees_nothing_is_finite():
    """fold_mm fills hidden columns with float32's lowest value: no NaN to spread through a cache."""
    q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8)
    mask = torch.ones(1, 1, 3, 10, dtype=torch.bool)
    mask[..., 1, :] = False
    assert decode_kernel(3, 2) == "fold_mm"
    assert torch.isfinite(decode_attention(q, k, v, mask)).all()


def test_bad_head_counts():
    with pytest.raises(ValueError, match="not a multiple"):
        decode_attention(torch.randn(1, 6, 2, 8), torch.randn(1, 4, 5, 8), torch.randn(1, 4, 5, 8))


# ----------------------------------------------------------------------------- the target's attention


@pytest.fixture(scope="module", params=["llama", "deepseek_v3", "llava"])
def target(request, tmp_path_factory):
    torch.manual_seed(0)
    return load_target(make_model_dir(tmp_path_factory.mktemp(request.param), arch=request.param, num_layers=2),
                       device="cpu", dtype="float32")


def forwards(ft, rows):
    """Logits of a prefill (7 rows) and then `rows` tree rows at past 7 (every shape's kernel)."""
    ids = torch.tensor([[1, 5, 17, 33, 8, 9, 10], [0, 0, 1, 44, 9, 12, 13]])
    pad = torch.tensor([0, 2])
    pos = (torch.arange(7)[None] - pad[:, None]).clamp(min=0)
    out = [ft.prefill(ids, pos, pad, 32, rows).logits]
    anc = random_mask(2, rows, rows, torch.Generator().manual_seed(rows), tree=True)[:, 0]
    start, end = pad, torch.tensor([7, 7])
    vids = torch.randint(3, 60, (2, rows), generator=torch.Generator().manual_seed(1))
    vpos = 7 - pad[:, None] + torch.arange(rows)[None]
    out.append(ft.fn(vids, vpos, torch.tensor(7), device_tree_mask(committed_columns(ft.cols, start, end), torch.tensor(7), anc))[0])
    return out


@pytest.mark.parametrize("rows", [1, 3, 40])
def test_fast_target_attention_equals_sdpa(target, rows):
    """FastTarget's forwards through hf_decode_attention (boolean mask) give transformers' sdpa
    logits (additive mask); the switch lasts one forward: the model's configs say sdpa after it."""
    ft = fast.FastTarget(target, "static")
    assert ft.attn_configs and all(c._attn_implementation == "sdpa" for c in ft.attn_configs)
    calls = hfmodel.DECODE_ATTENTION_CALLS[0]
    got = forwards(ft, rows)
    assert hfmodel.DECODE_ATTENTION_CALLS[0] > calls
    assert target.model.config._attn_implementation == "sdpa"
    assert all(c._attn_implementation == "sdpa" for c in ft.attn_configs)
    ref_ft = fast.FastTarget(target, "static")
    ref_ft.attn_configs = []  # transformers' sdpa, additive mask: the path before
    for a, b in zip(got, forwards(ref_ft, rows)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_unhandled_arguments_take_transformers_sdpa():
    """No mask (is_causal decides), sinks, dropout: transformers' sdpa function runs, not decode_attention."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    class Module(torch.nn.Module):
        num_key_value_groups, is_causal = 2, True
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 4, 5, 8, generator=g), torch.randn(1, 2, 5, 8, generator=g), torch.randn(1, 2, 5, 8, generator=g)
    calls = hfmodel.DECODE_ATTENTION_CALLS[0]
    out, _ = hfmodel.hf_decode_attention(Module(), q, k, v, None, scaling=0.5)
    torch.testing.assert_close(out, sdpa_attention_forward(Module(), q, k, v, None, scaling=0.5)[0])
    mask = torch.ones(1, 1, 5, 5, dtype=torch.bool).tril()
    hfmodel.hf_decode_attention(Module(), q, k, v, mask, scaling=0.5, s_aux=torch.zeros(4))
    assert hfmodel.DECODE_ATTENTION_CALLS[0] == calls
    out, _ = hfmodel.hf_decode_attention(Module(), q, k, v, mask, scaling=0.5)  # handled: the causal mask, same result
    assert hfmodel.DECODE_ATTENTION_CALLS[0] == calls + 1
    torch.testing.assert_close(out, sdpa_attention_forward(Module(), q, k, v, None, scaling=0.5)[0], rtol=1e-5, atol=1e-5)


def test_a_model_that_ignores_the_switch_keeps_its_attention(target, monkeypatch):
    """When the prefill's forward never reached hf_decode_attention (the model's attention does not
    use AttentionInterface; stood in for by switching a config no module reads), FastTarget goes
    back to the additive mask and redoes the prefill: same logits as the path before."""
    stray = type(target.model.config)()
    stray._attn_implementation_internal = "sdpa"
    monkeypatch.setattr(fast, "decode_attention_configs", lambda model: [stray])
    ft = fast.FastTarget(target, "static")
    got = forwards(ft, 3)
    assert ft.attn_configs == [] and ft.attn_checked
    ref_ft = fast.FastTarget(target, "static")
    ref_ft.attn_configs = []
    for a, b in zip(got, forwards(ref_ft, 3)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_model_transformers_cannot_switch_is_left_alone(target, monkeypatch):
    """Where transformers says a model's attention does not go through AttentionInterface (its source
    check, e.g. remote code with its own attention), nothing is switched and every config stays as loaded."""
    from transformers import PreTrainedModel

    monkeypatch.setattr(PreTrainedModel, "_can_set_attn_implementation", classmethod(lambda cls: False))
    assert hfmodel.decode_attention_configs(target.model) == []
    assert target.model.config._attn_implementation == "sdpa"
