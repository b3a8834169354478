"""draft.attention.decode_attention (the decoding steps' attention, kernel by row count) equals the
attention math on every branch, and the fast path's target runs it through transformers'
AttentionInterface (speculate.hfmodel.hf_decode_attention) with the same logits as transformers' sdpa.
draft/flash_decode.py's Triton kernel runs under Triton's interpreter (TRITON_INTERPRET=1, in a child
process; skipped without Triton): the math on every mask kind, split count and head shape, a row's
output independent of the rows beside it, and a tiny target and drafter decoding through it as through
SDPA; the GPU test (marker gpu) runs it compiled in bf16."""
from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

import draftsmith.speculate.fast as fast
import draftsmith.speculate.hfmodel as hfmodel
from draftsmith.draft import flash_decode as flash
from draftsmith.draft.attention import FLASH_ROWS, FOLD_ROWS, decode_attention, decode_kernel
from draftsmith.speculate.cache import additive
from draftsmith.speculate.tree import committed_columns, device_tree_mask
from draftsmith.target.model import load_target
from draftsmith.testing import interpreted_or_skip, make_model_dir, run_interpreted

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


@pytest.fixture
def no_flash(monkeypatch):
    """This process as a CPU machine sees it: no interpreter (whatever the environment says)."""
    monkeypatch.setattr(flash, "INTERPRET", False)


def test_the_rows_cover_every_kernel():
    """The parametrization above runs each branch (a threshold change would silently drop one)."""
    assert {decode_kernel(n, 4) for n in ROWS} == {"sdpa", "fold_mm"}
    assert {decode_kernel(n, 4, True) for n in ROWS} == {"flash"}  # 160 folded rows <= FLASH_ROWS
    assert decode_kernel(FLASH_ROWS // 4 + 1, 4, True) == "sdpa" and decode_kernel(FLASH_ROWS // 4, 4, True) == "flash"
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


def test_flash_applies_only_where_the_kernel_can_run(no_flash, monkeypatch):
    q, k, v = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 10, 16), torch.randn(1, 2, 10, 16)
    mask = torch.ones(1, 1, 3, 10, dtype=torch.bool)
    assert not flash.applies(q, k, v, mask)  # a CPU: no kernel, whatever Triton's presence
    monkeypatch.setattr(flash, "INTERPRET", True)  # as if the kernel could run on this CPU
    if flash.triton is None:
        monkeypatch.setattr(flash, "triton", object())
    assert flash.applies(q, k, v, mask) and flash.applies(q, k, v, None) and flash.applies(q, k, v, mask.expand(2, 1, 3, 10)[:1])
    assert not flash.applies(q, k, v, additive(mask[:, 0], q.dtype))              # HF's float mask: fold_mm
    assert not flash.applies(q, k, v, mask.expand(1, 4, 3, 10))                    # a mask per head: SDPA
    assert not flash.applies(q, k, v, mask[..., :9])                               # not the cache's width
    assert not flash.applies(q.double(), k.double(), v.double(), mask)
    assert not flash.applies(torch.randn(1, 4, 3, 272), torch.randn(1, 2, 10, 272), v, mask)  # head dim > 256
    assert not flash.applies(q.requires_grad_(), k, v, mask)                       # autograd: SDPA's backward
    monkeypatch.setattr(flash, "ENABLED", False)
    assert not flash.applies(q.detach(), k, v, mask)


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


# ----------------------------------------------------------------------------- flash_decode, interpreted

HAS_TRITON = importlib.util.find_spec("triton") is not None


@pytest.fixture
def interpreted():
    return interpreted_or_skip(flash, "test_flash_under_the_interpreter_in_a_child_process")


def test_flash_under_the_interpreter_in_a_child_process(tmp_path):
    """The interpreted tests below, in a pytest process started with TRITON_INTERPRET=1."""
    run_interpreted(__file__, "interpreted_", tmp_path / "child")


@pytest.mark.parametrize("heads,kv_heads,D,Dv", [(8, 2, 16, 16), (4, 4, 24, 16), (4, 1, 32, 32)])  # GQA, MLA-like, MQA
@pytest.mark.parametrize("N", [1, 5, 17])
@pytest.mark.parametrize("kind", ["bool", "tree", "none", "shared"])
def test_interpreted_flash_equals_the_math(interpreted, heads, kv_heads, D, Dv, N, kind):
    g = torch.Generator().manual_seed(N * 10 + heads + D)
    B, S = 2, 150  # 3 column tiles of 64, the last one partial
    q, k, v = torch.randn(B, heads, N, D, generator=g), torch.randn(B, kv_heads, S, D, generator=g), torch.randn(B, kv_heads, S, Dv, generator=g)
    mask = {"none": None, "shared": random_mask(B, N, S, g, tree=False)[:1]}.get(kind, random_mask(B, N, S, g, tree=kind == "tree"))
    assert decode_kernel(N, heads // kv_heads, interpreted.applies(q, k, v, mask)) == "flash"
    ref = reference(q, k, v, mask, 0.3)
    for split_blocks in (None, 1, 2, 3):  # the default choice, three splits, two (one partial), one (no combine)
        out = interpreted.flash_decode(q, k, v, mask, 0.3, split_blocks=split_blocks)
        assert out.shape == (B, heads, N, Dv)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(decode_attention(q, k, v, mask, 0.3), ref, rtol=1e-5, atol=1e-5)


def test_interpreted_flash_rows_do_not_depend_on_the_rows_beside_them(interpreted):
    """Row i of an N-row call equals a one-row call of that row with the same mask row, at every split
    count; a row that sees nothing is finite. (Within float rounding: the interpreter's dot is numpy's,
    whose result for a row depends on its place in the tile; bit for bit on the GPU, test_flash_on_the_gpu.)"""
    g = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(1, 8, 6, 16, generator=g), torch.randn(1, 2, 130, 16, generator=g), torch.randn(1, 2, 130, 16, generator=g)
    mask = random_mask(1, 6, 130, g, tree=True)
    mask[..., 2, :] = False
    for split_blocks in (None, 1, 3):
        full = interpreted.flash_decode(q, k, v, mask, 0.25, split_blocks=split_blocks)
        assert torch.isfinite(full).all()
        for i in (0, 3, 5):
            one = interpreted.flash_decode(q[:, :, i:i + 1], k, v, mask[:, :, i:i + 1], 0.25, split_blocks=split_blocks)
            torch.testing.assert_close(one[:, :, 0], full[:, :, i], rtol=1e-6, atol=1e-6)


def test_interpreted_flash_decodes_a_tiny_target(interpreted, tmp_path, monkeypatch):
    """A tiny Llama on static caches whose attention is flash_decode (one row and verify rows alike):
    plain decoding equals eager plain decoding, and speculative rounds over 5 verify rows equal it too."""
    from draftsmith.speculate.engine import generate, plain_generate
    from draftsmith.speculate.proposer import PerSequence
    from test_engine import PROMPTS, OracleProposer

    torch.manual_seed(0)
    target = load_target(make_model_dir(tmp_path, num_layers=2), device="cpu", dtype="float32")
    prompts = PROMPTS[:2]
    plains = [plain_generate(target, p, 10) for p in prompts]
    calls = []
    run = interpreted.flash_decode
    monkeypatch.setattr(interpreted, "flash_decode", lambda q, *a, **kw: calls.append(q.shape[2]) or run(q, *a, **kw))
    ft = fast.FastTarget(target, "static")
    assert [plain_generate(target, p, 10, fast=ft) for p in prompts] == plains
    assert 1 in calls
    prop = PerSequence([OracleProposer(p + r, error_rate=0.3, seed=i) for i, (p, r) in enumerate(zip(prompts, plains))])
    new, _ = generate(target, prop, prompts, 10, depth=4, fast=ft)
    assert new == plains and 5 in calls  # 5 verify rows in one call


# ----------------------------------------------------------------------------- on a GPU


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs CUDA and Triton")
@pytest.mark.parametrize("heads,kv_heads,D,Dv", [(32, 8, 128, 128), (16, 16, 192, 128)])  # Llama-8B, DeepSeek-V3 MLA
def test_flash_on_the_gpu(heads, kv_heads, D, Dv):
    """bf16 on the GPU: the math within bf16 rounding at several widths and split counts, and each row of
    a 16-row call bit for bit the one-row call of that row (a chain's verify rows round as plain steps)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    for S, N in ((256, 16), (2048, 6), (520, 3)):
        q = torch.randn(2, heads, N, D, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(2, kv_heads, S, D, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(2, kv_heads, S, Dv, device="cuda", dtype=torch.bfloat16, generator=g)
        cols, rows = torch.arange(S, device="cuda"), S - N + torch.arange(N, device="cuda")
        mask = (cols[None, :] <= rows[:, None])[None, None]  # a chain's verify rows
        assert flash.applies(q, k, v, mask)
        ref = reference(q.float(), k.float(), v.float(), mask, D ** -0.5)
        for split_blocks in (None, 4, 16):  # the default choice, several splits, one split at S = 256 (no combine)
            out = flash.flash_decode(q, k, v, mask, D ** -0.5, split_blocks=split_blocks)
            torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
            for i in (0, N - 1):
                one = flash.flash_decode(q[:, :, i:i + 1], k, v, mask[:, :, i:i + 1], D ** -0.5, split_blocks=split_blocks)
                assert torch.equal(one[:, :, 0], out[:, :, i]), (S, N, split_blocks, i)


def test_a_flash_kernel_that_fails_falls_back_once(monkeypatch, capsys):
    """Where the kernel cannot be built (an old Triton or GPU), decode_attention says so once and runs
    the other kernels from then on, with the same result."""
    monkeypatch.setattr(flash, "applies", lambda *a: flash.ENABLED)
    monkeypatch.setattr(flash, "ENABLED", True)

    def broken(*a, **kw):
        raise RuntimeError("PTX .version 8.7 does not support .target sm_70\nmore")

    monkeypatch.setattr(flash, "flash_decode", broken)
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(1, 4, 3, 8, generator=g), torch.randn(1, 2, 10, 8, generator=g), torch.randn(1, 2, 10, 8, generator=g)
    mask = random_mask(1, 3, 10, g, tree=True)
    out = decode_attention(q, k, v, mask, 0.5)
    torch.testing.assert_close(out, reference(q, k, v, mask, 0.5), rtol=1e-5, atol=1e-5)
    assert flash.ENABLED is False
    decode_attention(q, k, v, mask, 0.5)
    err = capsys.readouterr().err
    assert err.count("[flash_decode] the kernel failed (RuntimeError: PTX .version 8.7") == 1
