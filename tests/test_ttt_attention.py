"""The memory-lean TTT attention kernels match the naive reference (values and gradients)."""
import pytest
import torch

import draftsmith.draft.ttt_attention as ta
from draftsmith.draft.model import Eagle3Config, Eagle3Drafter


def inputs(B=2, nh=4, nkv=2, L=37, hd=8, steps=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, nh, L, hd, generator=g, dtype=torch.float64).requires_grad_()
    ks = [torch.randn(B, nkv, L, hd, generator=g, dtype=torch.float64).requires_grad_() for _ in range(steps)]
    vs = [torch.randn(B, nkv, L, hd, generator=g, dtype=torch.float64).requires_grad_() for _ in range(steps)]
    return q, ks, vs


def value_and_grads(fn, q, ks, vs):
    o = fn(q, ks, vs)
    w = torch.randn(o.shape, generator=torch.Generator().manual_seed(1), dtype=o.dtype).to(o.device)
    grads = torch.autograd.grad((o * w).sum(), [q, *ks, *vs])
    return o.detach(), grads


@pytest.mark.parametrize("steps", [1, 2, 4])
@pytest.mark.parametrize("block_scores", [ta.CHUNK_SCORES, 2 * 4 * 37 * 5])  # one block / 5-row blocks
def test_chunked_matches_reference(steps, block_scores, monkeypatch):
    monkeypatch.setattr(ta, "CHUNK_SCORES", block_scores)
    q, ks, vs = inputs(steps=steps)
    scale = 8 ** -0.5
    ref_o, ref_g = value_and_grads(lambda *a: ta.ttt_attention_reference(*a, scale), q, ks, vs)
    o, g = value_and_grads(lambda *a: ta.ttt_attention(*a, scale, "chunked"), q, ks, vs)
    # float64 inputs: the two differ only by summation order
    torch.testing.assert_close(o, ref_o, rtol=1e-10, atol=1e-10)
    for a, b in zip(g, ref_g):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


def test_chunked_gradcheck():
    q, ks, vs = inputs(B=1, nh=2, nkv=1, L=6, hd=4, steps=3)
    kd, vd = torch.stack(ks[1:], 3).repeat_interleave(2, 1), torch.stack(vs[1:], 3).repeat_interleave(2, 1)
    k0, v0 = ks[0].repeat_interleave(2, 1), vs[0].repeat_interleave(2, 1)
    fn = lambda q, k0, v0, kd, vd: ta._ChunkedTTTAttention.apply(q, k0, v0, kd, vd, 0.5)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k0, v0, kd, vd))


def test_flex_mask_matches_reference():
    """The flex block mask gives the reference result (eager flex on CPU: forward only, torch
    has no CPU flex backward; the compiled CUDA kernel's gradients are checked in the gpu test)."""
    q, ks, vs = inputs(B=1, nh=2, nkv=1, L=21, hd=8, steps=3)
    q, ks, vs = q.detach().float(), [k.detach().float() for k in ks], [v.detach().float() for v in vs]
    scale = 8 ** -0.5
    o = ta.ttt_attention_flex(q, ks, vs, scale, compiled=False)
    torch.testing.assert_close(o, ta.ttt_attention_reference(q, ks, vs, scale), rtol=1e-5, atol=1e-5)


def test_drafter_ttt_steps_agree_across_kernels():
    """Three unrolled TTT steps of a tiny drafter: same g and parameter gradients per kernel."""
    cfg = Eagle3Config(hidden_size=32, target_hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                       intermediate_size=64, vocab_size=50, draft_vocab_size=20)
    torch.manual_seed(0)
    model = Eagle3Drafter(cfg).double()
    ids = torch.randint(0, 50, (2, 19))
    aux = torch.randn(2, 19, 96, dtype=torch.float64)
    pos = torch.arange(19)[None].expand(2, 19)

    def run(impl):
        model.zero_grad()
        h, cache, outs = model.project(aux), [], []
        for i in range(3):
            h = model.ttt_step(ids, h, pos + i, cache, impl)
            outs.append(h)
        torch.stack(outs).pow(2).mean().backward()
        return torch.stack(outs).detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ref_o, ref_g = run("reference")
    o, g = run("chunked")
    torch.testing.assert_close(o, ref_o, rtol=1e-10, atol=1e-12)
    assert set(g) == set(ref_g)
    for n in g:
        torch.testing.assert_close(g[n], ref_g[n], rtol=1e-9, atol=1e-12)


@pytest.mark.gpu
def test_compiled_flex_on_cuda_matches_reference():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    q, ks, vs = inputs(B=2, nh=8, nkv=2, L=300, hd=64, steps=4)
    q, ks, vs = (q.cuda().bfloat16().detach().requires_grad_(), [k.cuda().bfloat16().detach().requires_grad_() for k in ks],
                 [v.cuda().bfloat16().detach().requires_grad_() for v in vs])
    scale = 64 ** -0.5
    ref_o, ref_g = value_and_grads(lambda *a: ta.ttt_attention_reference(*a, scale), q, ks, vs)
    o, g = value_and_grads(lambda *a: ta.ttt_attention(*a, scale, "auto"), q, ks, vs)
    torch.testing.assert_close(o.float(), ref_o.float(), rtol=2e-2, atol=2e-2)
    for a, b in zip(g, ref_g):
        torch.testing.assert_close(a.float(), b.float(), rtol=5e-2, atol=5e-2)
