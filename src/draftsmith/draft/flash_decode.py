"""A fused decoding attention (Triton): N new query rows against S cache columns with grouped KV heads, a
boolean mask, one kernel that reads each KV head once for all its query heads and rows, and a
second that combines the column splits (flash-decoding).

Why: a verify forward's attention over 2..16 rows cost about four times one row's (SDPA's multi-row
kernels) or, folded into two batched matmuls and a float32 softmax (fold_mm), about 25 us a layer in
five kernels where the bytes read take under 2 us (issue 50). Here:

    grid (B * KVH, splits, row blocks)   each program: one KV head of one sequence, a contiguous range of
                                         columns, BLOCK_R = 16 folded rows (query head r // N of the
                                         group, query row r % N: the n_rep heads that share a KV head read
                                         it once); scores q k^T in float32, the mask, an online softmax,
                                         p v accumulated in float32
    one split                            the program normalises and writes the output itself
    several                              float32 partials (acc, max, sum) -> _combine_kernel, which adds
                                         the splits in a fixed order (no atomics)

The split count depends on B * KVH and S only (never on N), and each row's arithmetic is independent
of the other rows of its block: a row's output does not depend on how many rows came with it (as
speculate/skinny.py's GEMM). Hidden columns take -1e30, not -inf, so a row that sees no column averages
every column (as fold_mm) instead of giving NaN. The output is written as [B, N, H, Dv] memory and
returned as its [B, H, N, Dv] view: transformers' attention contract transposes it back for free.

    applies(q, k, v, mask)            whether flash_decode runs for these tensors
    flash_decode(q, k, v, mask, scale, split_blocks=None)

Under TRITON_INTERPRET=1 it also runs on a CPU, in float32 as well (the tests).
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from ..messages import log
from ..tritonlib import INTERPRET, tl, triton

BLOCK_R = 16
"""Folded rows per program: the tensor cores' smallest tile; more rows take more row blocks."""
MAX_HEAD_DIM = 256
MAX_SPLITS = 32
"""Column splits at most (the combine kernel holds every split's partial row at once)."""
ENABLED = os.environ.get("DRAFTSMITH_FLASH_DECODE", "1") != "0"
"""False (DRAFTSMITH_FLASH_DECODE=0 at start, or a failed build: disable): decode_attention never takes
flash_decode (benchmarks set it to time the kernels it replaced)."""
_DTYPES = (torch.bfloat16, torch.float16)
_SM_COUNT: dict = {}


if triton is not None:
    @triton.jit(do_not_specialize=["N", "S", "R", "sqb", "sqh", "sqn", "skb", "skh", "sks",
                                   "svb", "svh", "svs", "smb", "smn", "sob", "soh", "son"])
    def _decode_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, out_ptr, ws_ptr, wm_ptr, wl_ptr,
                       N, S, R, n_rep, KVH, split_len, scale,
                       sqb, sqh, sqn, skb, skh, sks, svb, svh, svs, smb, smn, sob, soh, son,
                       D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, HAS_MASK: tl.constexpr, SINGLE: tl.constexpr,
                       DOT_F32: tl.constexpr):
        """One (sequence, KV head), one column split, BLOCK_R folded rows. DOT_F32: the tiles cast to
        float32 before each dot (only under the interpreter, whose bf16 dot is wrong)."""
        pid_bh = tl.program_id(0)
        pid_s = tl.program_id(1)
        pid_r = tl.program_id(2)
        b = pid_bh // KVH
        kvh = pid_bh % KVH
        offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        r_ok = offs_r < R
        head = kvh * n_rep + offs_r // N
        n = offs_r % N
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        d_ok = offs_d < D
        dv_ok = offs_dv < DV
        q = tl.load(q_ptr + b * sqb + head[:, None] * sqh + n[:, None] * sqn + offs_d[None, :],
                    mask=r_ok[:, None] & d_ok[None, :], other=0.0)
        if DOT_F32:
            q = q.to(tl.float32)
        k_base = k_ptr + b * skb + kvh * skh
        v_base = v_ptr + b * svb + kvh * svh
        s_first = pid_s * split_len
        m_i = tl.full([BLOCK_R], -1e38, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
        acc = tl.zeros([BLOCK_R, BLOCK_DV], dtype=tl.float32)
        for i in range(0, split_len // BLOCK_S):  # the split's whole tiles (past the cache's end: loads masked)
            offs_s = s_first + i * BLOCK_S + tl.arange(0, BLOCK_S)
            s_ok = offs_s < S
            kt = tl.load(k_base + offs_s[None, :] * sks + offs_d[:, None], mask=d_ok[:, None] & s_ok[None, :], other=0.0)
            vt = tl.load(v_base + offs_s[:, None] * svs + offs_dv[None, :], mask=s_ok[:, None] & dv_ok[None, :], other=0.0)
            if DOT_F32:
                kt = kt.to(tl.float32)
                vt = vt.to(tl.float32)
            s = tl.dot(q, kt) * scale
            if HAS_MASK:
                seen = tl.load(mask_ptr + b * smb + n[:, None] * smn + offs_s[None, :],
                               mask=r_ok[:, None] & s_ok[None, :], other=0)
                s = tl.where(seen != 0, s, -1e30)
            s = tl.where(s_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
            m_i = m_new
        if SINGLE:
            o = acc / l_i[:, None]
            tl.store(out_ptr + b * sob + head[:, None] * soh + n[:, None] * son + offs_dv[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=r_ok[:, None] & dv_ok[None, :])
        else:
            row = (pid_bh * tl.num_programs(1) + pid_s) * (tl.num_programs(2) * BLOCK_R) + offs_r
            tl.store(ws_ptr + row[:, None] * BLOCK_DV + offs_dv[None, :], acc)
            tl.store(wm_ptr + row, m_i)
            tl.store(wl_ptr + row, l_i)

    @triton.jit(do_not_specialize=["N", "R", "R_pad", "n_splits", "sob", "soh", "son"])
    def _combine_kernel(ws_ptr, wm_ptr, wl_ptr, out_ptr, N, R, R_pad, n_rep, KVH, n_splits, sob, soh, son,
                        DV: tl.constexpr, BLOCK_DV: tl.constexpr, SPLITS: tl.constexpr):
        """One folded row of one (sequence, KV head): its splits' partials weighed by exp(max - overall max),
        summed in split order, divided by the weighed sums."""
        pid = tl.program_id(0)
        bh = pid // R
        r = pid % R
        offs_p = tl.arange(0, SPLITS)
        offs_dv = tl.arange(0, BLOCK_DV)
        p_ok = offs_p < n_splits
        row = (bh * n_splits + offs_p) * R_pad + r
        m = tl.load(wm_ptr + row, mask=p_ok, other=float("-inf"))
        l = tl.load(wl_ptr + row, mask=p_ok, other=0.0)
        w = tl.exp(m - tl.max(m, 0))
        acc = tl.load(ws_ptr + row[:, None] * BLOCK_DV + offs_dv[None, :], mask=p_ok[:, None], other=0.0)
        o = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
        b = bh // KVH
        head = (bh % KVH) * n_rep + r // N
        tl.store(out_ptr + b * sob + head * soh + (r % N) * son + offs_dv, o.to(out_ptr.dtype.element_ty),
                 mask=offs_dv < DV)


def disable(error: BaseException) -> None:
    """flash_decode off for this process after it failed (a Triton or GPU that cannot build it), said once."""
    global ENABLED
    ENABLED = False
    log(f"[flash_decode] the kernel failed ({type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}); "
        "decode_attention runs fold_mm and SDPA instead")


def _pow2(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few splits, so that the tests run the combine kernel
    if device not in _SM_COUNT:
        _SM_COUNT[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SM_COUNT[device]


def applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]) -> bool:
    """Whether flash_decode runs for these arguments: Triton, CUDA tensors in bf16/fp16 (or the interpreter,
    float32 too), head dims at most 256, no autograd, a boolean mask [B or 1, 1, N, S] or none."""
    if not ENABLED or triton is None or q.dim() != 4 or not (q.dtype == k.dtype == v.dtype):
        return False
    if INTERPRET:
        if q.dtype not in _DTYPES + (torch.float32,):
            return False
    elif not (q.is_cuda and q.dtype in _DTYPES):
        return False
    if q.shape[-1] > MAX_HEAD_DIM or v.shape[-1] > MAX_HEAD_DIM or q.shape[-1] < 1:
        return False
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return False
    B, _, N, _ = q.shape
    if mask is not None and (mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1
                             or mask.shape[0] not in (1, B) or tuple(mask.shape[2:]) != (N, k.shape[2])):
        return False
    return True


def splits_for(BKV: int, S: int, block_s: int, device: torch.device) -> tuple[int, int]:
    """(splits, columns per split) for BKV (sequence, KV head) pairs over S columns: enough programs for
    about two per SM, each split whole tiles; independent of the row count."""
    blocks = max(1, -(-S // block_s))
    want = min(blocks, MAX_SPLITS, max(1, -(-2 * _sm_count(device) // BKV)))
    split_len = -(-blocks // want) * block_s
    return -(-S // split_len) if S else 1, split_len


@torch.compiler.disable  # why: a compiled region calls it as it is (a graph break), as skinny_linear
def flash_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], scale: float,
                 split_blocks: Optional[int] = None) -> torch.Tensor:
    """softmax(q k^T * scale, hidden where mask is False) v: q [B, H, N, D], k [B, KVH, S, D],
    v [B, KVH, S, Dv], mask bool [B or 1, 1, N, S] or None. split_blocks: column tiles per split
    (default: splits_for's choice; benchmarks try others). Returns [B, H, N, Dv] (a view of
    [B, N, H, Dv] memory)."""
    B, H, N, D = q.shape
    KVH, S, DV = k.shape[1], k.shape[2], v.shape[-1]
    n_rep = H // KVH
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    R = n_rep * N
    BLOCK_D, BLOCK_DV = max(16, _pow2(D)), max(16, _pow2(DV))
    BLOCK_S = 64 if max(BLOCK_D, BLOCK_DV) <= 128 else 32
    if split_blocks is None:
        n_splits, split_len = splits_for(B * KVH, S, BLOCK_S, q.device)
    else:
        split_len = split_blocks * BLOCK_S
        n_splits = max(1, -(-S // split_len))
        if n_splits > MAX_SPLITS:
            raise ValueError(f"flash_decode: {n_splits} splits of {split_len} columns exceed {MAX_SPLITS}")
    out = torch.empty(B, N, H, DV, dtype=q.dtype, device=q.device).transpose(1, 2)
    if mask is not None:
        if mask.stride(-1) != 1:
            mask = mask.contiguous()
        m = mask.view(torch.uint8)
        smb, smn = (m.stride(0) if m.shape[0] > 1 else 0), m.stride(2)
    else:
        m, smb, smn = q, 0, 0  # a pointer the kernel never reads
    r_blocks = -(-R // BLOCK_R)
    single = n_splits == 1
    if single:
        ws = wm = wl = out
    else:
        ws = torch.empty(B * KVH * n_splits * r_blocks * BLOCK_R, BLOCK_DV, dtype=torch.float32, device=q.device)
        wml = torch.empty(2, ws.shape[0], dtype=torch.float32, device=q.device)
        wm, wl = wml[0], wml[1]
    _decode_kernel[(B * KVH, n_splits, r_blocks)](
        q, k, v, m, out, ws, wm, wl, N, S, R, n_rep, KVH, split_len, float(scale),
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), smb, smn, out.stride(0), out.stride(1), out.stride(2),
        D=D, DV=DV, BLOCK_D=BLOCK_D, BLOCK_DV=BLOCK_DV, BLOCK_R=BLOCK_R, BLOCK_S=BLOCK_S,
        HAS_MASK=mask is not None, SINGLE=single, DOT_F32=INTERPRET, num_warps=4, num_stages=2)
    if not single:
        _combine_kernel[(B * KVH * R,)](
            ws, wm, wl, out, N, R, r_blocks * BLOCK_R, n_rep, KVH, n_splits, out.stride(0), out.stride(1),
            out.stride(2), DV=DV, BLOCK_DV=BLOCK_DV, SPLITS=max(2, _pow2(n_splits)), num_warps=4)
    return out
