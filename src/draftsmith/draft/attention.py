"""Attention of a decoding step: N new query rows against a KV cache of S columns, the kernel picked by N.

Decoding asks attention for one row (plain decoding), a few (a chain's or a tree's verify rows, a
tree's drafter step) or many (a prefill). One layer at Llama-3.1-8B's shapes (32 query heads, 8 KV
heads, head dim 128, bf16, CUDA-graph replays, S = 2048; benchmarks/results/h200-2026-12-04-s4/
bench_verify_attention.json, microseconds at N = 1 / 2 / 6 / 17 / 65):

    repeat_kv copies + additive float mask, SDPA (transformers' sdpa path)   51.4 / 86.8 / 87.8 / 89.4 / 93.2
    SDPA, enable_gqa, boolean mask (no K/V copies)                           12.4 / 50.0 / 50.9 / 52.3 / 53.7
    query heads folded into their KV head's rows, two matmuls (fold_mm)      24.8 / 25.2 / 27.2 / 35.0 / 68.4

SDPA is fast for one row; from 2 rows to 65 its cost barely moves, at four times one row's, so a
few rows pay for many. Folding the n_rep query heads that share a KV head into that head's
rows makes few-row attention two batched matmuls that read each KV head once; their float32
scores grow with rows times columns, so past a few dozen folded rows SDPA wins again (at S = 512
and 8192 the order is the same). Hence:

    n_rep * N <= FLASH_ROWS, where flash_decode applies (Triton, CUDA, bf16/fp16, a boolean mask)
                                    flash_decode (draft/flash_decode.py): one fused kernel reading each KV
                                    head once, and a split combine
    otherwise: N == 1               SDPA with enable_gqa (a boolean mask stays boolean)
    2 <= N, n_rep * N <= FOLD_ROWS  fold_mm
    n_rep * N > FOLD_ROWS           SDPA with enable_gqa

N is a shape, so a captured CUDA graph holds one branch. On a CPU (no Triton kernel) every branch
but flash_decode runs, in float32 each equal to SDPA's math within float rounding; flash_decode runs
there under Triton's interpreter (tests/test_decode_attention.py).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from . import flash_decode as flash

FLASH_ROWS = 256
"""Most folded rows (query heads per KV head x query rows) that take flash_decode where it applies;
more (a prefill) take SDPA's own kernels."""
FOLD_ROWS = 68
"""Most folded rows (query heads per KV head x query rows) that take fold_mm. Measured: fold_mm beat
SDPA at 8, 24 and 68 folded rows (N 2, 6, 17 at 4 query heads per KV head) and lost at 260 (N 65),
at S = 512, 2048 and 8192 (bench_verify_attention.json above). Between 68 and 260 is not measured."""


_BMM_FLOAT32_OUT: list[Optional[bool]] = [None]
"""Whether this torch has bmm with out_dtype on CUDA (bf16/fp16 in, float32 out); found by the first call."""


def scores(qf: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """qf [B, KVH, R, D] @ k^T -> float32 scores [B, KVH, R, S]. On CUDA in bf16/fp16 the matmul writes
    float32 itself (bmm's out_dtype), as attention kernels keep their scores: rounding them to bf16
    first would move each softmax weight by up to ~1 % at typical score sizes. Elsewhere (a CPU in
    float32, the tests) the plain product, cast."""
    if qf.is_cuda and qf.dtype in (torch.bfloat16, torch.float16) and _BMM_FLOAT32_OUT[0] is not False:
        B, KVH, R, D = qf.shape
        try:
            out = torch.bmm(qf.reshape(B * KVH, R, D), k.transpose(-1, -2).reshape(B * KVH, D, k.shape[2]),
                            out_dtype=torch.float32)
            _BMM_FLOAT32_OUT[0] = True
            return out.view(B, KVH, R, k.shape[2])
        except (TypeError, RuntimeError):  # an older torch: no out_dtype (a real CUDA error recurs below)
            if _BMM_FLOAT32_OUT[0]:
                raise
            _BMM_FLOAT32_OUT[0] = False
    return (qf @ k.transpose(-1, -2)).float()


def decode_kernel(n_rows: int, n_rep: int, flash_applies: bool = False) -> str:
    """Which kernel `decode_attention` runs for n_rows query rows at n_rep query heads per KV head
    ("flash", "fold_mm" or "sdpa"); flash_applies: whether flash_decode can take the tensors."""
    if flash_applies and n_rep * n_rows <= FLASH_ROWS:
        return "flash"
    return "fold_mm" if n_rows > 1 and n_rep * n_rows <= FOLD_ROWS else "sdpa"


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor] = None,
                     scale: Optional[float] = None) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v with grouped KV heads, no K/V copies.

    q [B, H, N, D]; k [B, KVH, S, D]; v [B, KVH, S, Dv] (H a multiple of KVH; query head h reads KV
    head h // (H / KVH), as repeat_kv lays them out); mask [B or 1, 1, N, S]: bool (True = attend) or
    an additive float mask (HF's), or None (every column); a mask per head [.., H, N, S] takes SDPA.
    scale defaults to D ** -0.5. Every row should see at least one column: fold_mm and flash_decode
    fill hidden columns with a finite lowest value, not -inf, so a row that sees none averages every
    column instead of giving NaN. Returns [B, H, N, Dv] (flash_decode's: a view of [B, N, H, Dv] memory)."""
    B, H, N, D = q.shape
    KVH, S = k.shape[1], k.shape[2]
    if H % KVH:
        raise ValueError(f"decode_attention: {H} query heads are not a multiple of {KVH} key/value heads")
    n_rep = H // KVH
    if scale is None:
        scale = D ** -0.5
    kernel = decode_kernel(N, n_rep, flash.applies(q, k, v, mask))
    if kernel == "flash":
        try:
            return flash.flash_decode(q, k, v, mask, scale)
        except Exception as e:  # noqa: BLE001 (a Triton that cannot compile it here: the kernels below, said once)
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise
            flash.disable(e)
            kernel = decode_kernel(N, n_rep)
    if kernel == "sdpa" or (mask is not None and mask.shape[1] != 1):  # a per-head mask: SDPA
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=n_rep > 1)
    # fold_mm: the n_rep query heads of a KV head are rows (r, n) of that head: [B, KVH, n_rep * N, D]
    s = scores(q.reshape(B, KVH, n_rep * N, D), k) * scale
    if mask is not None:
        s = s.view(B, KVH, n_rep, N, S)
        m = mask[:, :, None]  # [B or 1, 1, 1, N, S]: the same mask for every head and group member
        if m.dtype == torch.bool:
            s = s.masked_fill(~m, torch.finfo(torch.float32).min)
        else:
            s = s + m.float()
        s = s.view(B, KVH, n_rep * N, S)
    o = s.softmax(-1).to(v.dtype) @ v
    return o.view(B, H, N, v.shape[-1])
