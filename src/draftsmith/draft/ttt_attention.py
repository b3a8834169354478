"""Attention of a training-time-test (TTT) step, without the O(L^2 * k) score matrices.

At TTT step i a query at row t attends to the step-0 keys at rows <= t (causal) and to its
own row's keys from steps 1..i (the "diagonal" keys). Three implementations, same result:

    reference  scores [L, L + i] per step, softmax, in plain torch (kept for tests; small L)
    chunked    a flash-style autograd Function: query blocks, running log-sum-exp, scores
               recomputed in backward; memory O(block * L) per step, any device
    flex       torch.nn.attention.flex_attention over the concatenated keys of steps 0..i with
               a block mask (causal step-0 blocks + diagonal blocks); compiled on CUDA

Step 0 (plain causal attention) uses F.scaled_dot_product_attention in chunked/flex modes.
All take q [B, nh, L, hd] and the per-step keys/values ks, vs: lists of [B, nkv, L, hd]
(step 0 first) and return [B, nh, L, hd].
"""
from __future__ import annotations

import functools
from typing import Literal

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

AttentionImpl = Literal["auto", "reference", "chunked", "flex"]
CHUNK_SCORES = 1 << 22  # score elements per query block of the chunked kernel (16 MiB in fp32)
FLEX_BLOCK = 128


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, nkv, L, hd] -> [B, nkv * n_rep, L, hd]: each key/value head serves n_rep query heads (GQA)."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


def resolve_impl(impl: AttentionImpl, device: torch.device) -> str:
    """auto: flex (compiled) on CUDA, the chunked kernel elsewhere."""
    if impl != "auto":
        return impl
    return "flex" if device.type == "cuda" else "chunked"


def ttt_attention(q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor], scale: float,
                  impl: AttentionImpl = "auto") -> torch.Tensor:
    impl = resolve_impl(impl, q.device)
    n_rep = q.shape[1] // ks[0].shape[1]
    if impl == "reference":
        return ttt_attention_reference(q, ks, vs, scale)
    if len(ks) == 1:  # step 0: causal attention, a fused kernel on every device
        return F.scaled_dot_product_attention(q, repeat_kv(ks[0], n_rep), repeat_kv(vs[0], n_rep), is_causal=True, scale=scale)
    if impl == "flex":
        return ttt_attention_flex(q, ks, vs, scale)
    if impl == "chunked":
        kd = torch.stack([repeat_kv(k, n_rep) for k in ks[1:]], dim=3)  # [B, nh, L, i, hd]
        vd = torch.stack([repeat_kv(v, n_rep) for v in vs[1:]], dim=3)
        return _ChunkedTTTAttention.apply(q, repeat_kv(ks[0], n_rep), repeat_kv(vs[0], n_rep), kd, vd, scale)
    raise ValueError(f"unknown TTT attention implementation {impl!r} (auto, reference, chunked, flex)")


def ttt_attention_reference(q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor], scale: float) -> torch.Tensor:
    """The naive form: [L, L] step-0 scores plus i diagonal scores per row, one softmax."""
    n_rep = q.shape[1] // ks[0].shape[1]
    k0, v0 = repeat_kv(ks[0], n_rep), repeat_kv(vs[0], n_rep)
    L = q.shape[2]
    s0 = (q @ k0.transpose(-1, -2)) * scale  # [B, nh, L, L]
    causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
    s0 = s0.masked_fill(~causal, float("-inf"))
    diag = [(q * repeat_kv(kj, n_rep)).sum(-1, keepdim=True) * scale for kj in ks[1:]]
    s = torch.cat([s0, *diag], dim=-1).to(_acc(q)).softmax(-1).to(q.dtype)
    o = s[..., :L] @ v0
    for j, vj in enumerate(vs[1:]):
        o = o + s[..., L + j:L + j + 1] * repeat_kv(vj, n_rep)
    return o


def _acc(x: torch.Tensor) -> torch.dtype:
    """Softmax/accumulation dtype: float32, or float64 for float64 inputs (gradcheck)."""
    return torch.promote_types(x.dtype, torch.float32)


def _block_rows(B: int, H: int, L: int) -> int:
    return max(1, min(L, CHUNK_SCORES // max(1, B * H * L)))


class _ChunkedTTTAttention(torch.autograd.Function):
    """Exact TTT attention in query blocks with a saved log-sum-exp (flash-attention style):
    forward keeps only o and lse; backward recomputes each block's probabilities.
    q, k0, v0 [B, nh, L, hd]; kd, vd [B, nh, L, i, hd] (diagonal keys/values of steps 1..i)."""

    @staticmethod
    def forward(ctx, q, k0, v0, kd, vd, scale):
        B, H, L, _ = q.shape
        o = torch.empty_like(q)
        lse = torch.empty(B, H, L, dtype=_acc(q), device=q.device)
        C = _block_rows(B, H, L)
        for a in range(0, L, C):
            b = min(L, a + C)
            s, sd = _block_scores(q, k0, kd, a, b, scale)
            m = torch.maximum(s.amax(-1), sd.amax(-1))
            lse_b = m + torch.log(torch.exp(s - m[..., None]).sum(-1) + torch.exp(sd - m[..., None]).sum(-1))
            p, pd = torch.exp(s - lse_b[..., None]), torch.exp(sd - lse_b[..., None])
            o[:, :, a:b] = (p.to(q.dtype) @ v0[:, :, :b] + (pd.to(q.dtype)[..., None] * vd[:, :, a:b]).sum(-2))
            lse[:, :, a:b] = lse_b
        ctx.save_for_backward(q, k0, v0, kd, vd, o, lse)
        ctx.scale = scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k0, v0, kd, vd, o, lse = ctx.saved_tensors
        scale = ctx.scale
        B, H, L, _ = q.shape
        f32 = _acc(q)
        dq = torch.empty_like(q, dtype=f32)
        dk0, dv0 = torch.zeros_like(k0, dtype=f32), torch.zeros_like(v0, dtype=f32)
        dkd, dvd = torch.empty_like(kd, dtype=f32), torch.empty_like(vd, dtype=f32)
        delta = (do.to(f32) * o.to(f32)).sum(-1)  # [B, H, L]
        C = _block_rows(B, H, L)
        for a in range(0, L, C):
            b = min(L, a + C)
            s, sd = _block_scores(q, k0, kd, a, b, scale)
            p, pd = torch.exp(s - lse[:, :, a:b, None]), torch.exp(sd - lse[:, :, a:b, None])
            do_b, q_b = do[:, :, a:b].to(f32), q[:, :, a:b].to(f32)
            dv0[:, :, :b] += p.transpose(-1, -2) @ do_b
            dvd[:, :, a:b] = pd[..., None] * do_b[..., None, :]
            ds = p * (do_b @ v0[:, :, :b].to(f32).transpose(-1, -2) - delta[:, :, a:b, None])
            dsd = pd * ((do_b[..., None, :] * vd[:, :, a:b].to(f32)).sum(-1) - delta[:, :, a:b, None])
            dq[:, :, a:b] = (ds @ k0[:, :, :b].to(f32) + (dsd[..., None] * kd[:, :, a:b].to(f32)).sum(-2)) * scale
            dk0[:, :, :b] += (ds.transpose(-1, -2) @ q_b) * scale
            dkd[:, :, a:b] = dsd[..., None] * q_b[..., None, :] * scale
        return dq.to(q.dtype), dk0.to(k0.dtype), dv0.to(v0.dtype), dkd.to(kd.dtype), dvd.to(vd.dtype), None


def _block_scores(q, k0, kd, a: int, b: int, scale: float):
    """Scores (float32 or float64) of query rows a:b: step-0 [B, H, b-a, b] (causal, -inf above the diagonal)
    and diagonal [B, H, b-a, i]."""
    q_b = q[:, :, a:b]
    s = (q_b @ k0[:, :, :b].transpose(-1, -2)).to(_acc(q)) * scale
    rows = torch.arange(a, b, device=q.device)[:, None]
    s = s.masked_fill(torch.arange(b, device=q.device)[None] > rows, float("-inf"))
    sd = (q_b[..., None, :] * kd[:, :, a:b]).sum(-1).to(_acc(q)) * scale
    return s, sd


# -- flex attention ------------------------------------------------------------------------

@functools.lru_cache(maxsize=64)
def _ttt_block_mask(L: int, steps: int, device: str):
    def mask_mod(b, h, q_idx, kv_idx):
        step = kv_idx // L
        pos = kv_idx - step * L
        return (pos <= q_idx) & ((step == 0) | (pos == q_idx))

    return create_block_mask(mask_mod, None, None, L, steps * L, device=device, BLOCK_SIZE=FLEX_BLOCK)


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    import torch._dynamo  # why here: ~2.5 s to import; only the compiled (CUDA) path needs it

    # One compiled kernel per (padded L, step): a run sees up to max_length/128 * ttt_steps shapes;
    # past dynamo's default limit it would fall back to eager flex, which materialises the scores.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 512)
    return torch.compile(flex_attention, dynamic=False)


def ttt_attention_flex(q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor], scale: float,
                       compiled: bool | None = None) -> torch.Tensor:
    """flex_attention over cat(keys of steps 0..i) with the TTT block mask. L is padded to a
    multiple of the block size so that the compiled kernel sees few distinct shapes; padded
    keys sit after every real row's keys and are masked, padded query rows are dropped.
    Compiled on CUDA (eager flex materialises the scores: use it only to check the mask)."""
    L = q.shape[2]
    Lp = -(-L // FLEX_BLOCK) * FLEX_BLOCK
    pad = (0, 0, 0, Lp - L)
    k = torch.cat([F.pad(t, pad) for t in ks], dim=2)
    v = torch.cat([F.pad(t, pad) for t in vs], dim=2)
    mask = _ttt_block_mask(Lp, len(ks), str(q.device))
    fn = _compiled_flex() if (q.device.type == "cuda" if compiled is None else compiled) else flex_attention
    o = fn(F.pad(q, pad), k, v, block_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return o[:, :, :L]
