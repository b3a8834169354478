"""Skinny matmuls for the fast path's forwards: y = x @ W.T for x of M <= 16 rows (a decode step, a
verify forward), reading each weight element once (evaluate.verify_gemm: skinny).

Why: on an H100/H200 in bf16 a target forward over 2..16 rows costs 1.12-1.14 of a one-row forward
although it reads the same weight bytes (issue 50); cuBLAS runs a GEMV for one row and GEMM kernels
for a few rows, and those read the weight slower.

The kernel (Triton): each program owns BLOCK_N output columns for all rows (x padded to 16 rows, the
tensor cores' smallest tile, so one row costs the same weight read as 16) and loops over K; SPLIT_K > 1
writes float32 partial sums that a second kernel adds in a fixed order (no atomics). Its configuration
is tuned once per weight shape (N, K) and dtype at 16 rows and then used for every M <= 16, and M is
not a compile-time specialisation: every row count runs the same compiled kernel, and tensor-core rows
are independent, so row r of an M-row call equals the one-row call bit for bit (batch invariance: a
verify row rounds as the plain step does).

    skinny_linear(x, weight, bias)   the kernel where it applies, else F.linear (no Triton or CUDA, M > 16,
                                     another dtype, a misaligned or strided weight, autograd)
    linear_modules(model)            the nn.Linear modules it can take, their shapes tuned (tune)
    switched(modules)                a context: those modules' forward is skinny_linear inside it
    resolve_verify_gemm(...)         evaluate.verify_gemm auto|cublas|skinny -> cublas or skinny
    time_calls_ms(call, n)           ms of one call, from CUDA-graph replays of n calls (the tuner's and
                                     benchmarks/bench_verify_rows.py's clock)

Under TRITON_INTERPRET=1 the kernel also runs on a CPU (float32 as well; the tests), untuned.
"""
from __future__ import annotations

import contextlib
import math
import time
from typing import Callable, Iterator, Optional, Sequence

import torch
import torch.nn.functional as F

from ..messages import DraftsmithError, log
from ..tritonlib import INTERPRET, tl, triton

MAX_ROWS = 16
"""Rows the kernel takes (x padded to them); more rows go to F.linear (prefills, large batches)."""

CONFIGS: tuple[tuple[int, int, int, int, int], ...] = (
    # (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages): few output columns per program so that even
    # N = 1024 (k/v projections) fills the SMs; split-K where N alone cannot
    (16, 256, 1, 4, 4), (16, 512, 1, 4, 3), (32, 256, 1, 4, 4), (32, 512, 1, 4, 3),
    (64, 128, 1, 4, 4), (64, 256, 1, 4, 3), (128, 128, 1, 4, 3), (128, 128, 1, 8, 4),
    (32, 256, 2, 4, 4), (16, 256, 4, 4, 4), (64, 128, 4, 4, 4),
)
DEFAULT_CONFIG = (32, 256, 1, 4, 4)
"""Where no tuning runs: on a CPU (the interpreter), or a shape first met inside a graph capture."""

TUNED: dict[tuple, Optional[tuple]] = {}
"""(N, K, dtype, device) -> the config every call of that weight shape runs (None: F.linear, no config ran).
Fixed once chosen, for the process: changing it would change the rows' rounding."""
TUNE_LOG: dict[str, dict] = {}
"""What each tuning measured, "NxK dtype" -> {config: ms or error}: benchmarks write it out."""

_DTYPES = (torch.bfloat16, torch.float16)


if triton is not None:
    @triton.jit(do_not_specialize=["M", "stride_os"])
    def _skinny_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om, stride_os,
                       HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, DOT_F32: tl.constexpr):
        """out[pid_k, :M, n-block] = x[:M, k-range] @ w[n-block, k-range].T (+ bias when SPLIT_K == 1).
        DOT_F32: the tiles cast to float32 before the dot (only under the interpreter, whose bf16 dot is wrong)."""
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        k_steps = (K + SPLIT_K * BLOCK_K - 1) // (SPLIT_K * BLOCK_K)  # BLOCK_K steps per split (not tl.cdiv: the
        # interpreter, switched on after Triton's import as the tests do, cannot call Triton's own jit functions)
        k_first = pid_k * k_steps * BLOCK_K
        m_ok = offs_m[:, None] < M
        n_ok = offs_n[:, None] < N
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_first + offs_k)[None, :]
        w_ptrs = w_ptr + offs_n[:, None] * stride_wn + (k_first + offs_k)[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for i in range(0, k_steps):
            if EVEN_K:
                x = tl.load(x_ptrs, mask=m_ok, other=0.0)
                w = tl.load(w_ptrs, mask=n_ok, other=0.0)
            else:
                k_ok = (k_first + i * BLOCK_K + offs_k)[None, :] < K
                x = tl.load(x_ptrs, mask=m_ok & k_ok, other=0.0)
                w = tl.load(w_ptrs, mask=n_ok & k_ok, other=0.0)
            if DOT_F32:
                x = x.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(x, tl.trans(w), acc)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        out_ptrs = out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok & (offs_n[None, :] < N))

    @triton.jit(do_not_specialize=["MN"])
    def _split_sum_kernel(ws_ptr, b_ptr, out_ptr, MN, N, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
                          BLOCK: tl.constexpr):
        """out = ws[0] + ws[1] + ... (+ bias), in that order: a deterministic split-K reduction."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < MN
        acc = tl.load(ws_ptr + offs, mask=ok, other=0.0)
        for s in tl.static_range(1, SPLIT_K):
            acc += tl.load(ws_ptr + s * MN + offs, mask=ok, other=0.0)
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs % N, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def launch(x2: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], config: tuple) -> torch.Tensor:
    """The kernel over x2 [M <= 16, K] (contiguous) and weight [N, K] with one config; [M, N] out."""
    BN, BK, split, warps, stages = config
    M, K = x2.shape
    N = weight.shape[0]
    out = torch.empty(M, N, dtype=x2.dtype, device=x2.device)
    even_k = K % (BK * split) == 0
    meta = dict(BLOCK_M=MAX_ROWS, BLOCK_N=BN, BLOCK_K=BK, SPLIT_K=split, EVEN_K=even_k, DOT_F32=INTERPRET,
                num_warps=warps, num_stages=stages)
    grid = (triton.cdiv(N, BN), split)
    b = bias if bias is not None else weight  # a pointer the kernel never reads
    if split == 1:
        _skinny_kernel[grid](x2, weight, b, out, M, N, K, x2.stride(0), weight.stride(0), N, 0,
                             HAS_BIAS=bias is not None, **meta)
        return out
    ws = torch.empty(split, M, N, dtype=torch.float32, device=x2.device)
    _skinny_kernel[grid](x2, weight, b, ws, M, N, K, x2.stride(0), weight.stride(0), N, M * N, HAS_BIAS=False, **meta)
    _split_sum_kernel[(triton.cdiv(M * N, 1024),)](ws, b, out, M * N, N, HAS_BIAS=bias is not None, SPLIT_K=split,
                                                   BLOCK=1024, num_warps=4)
    return out


def unavailable(device: torch.device, dtype: torch.dtype) -> Optional[str]:
    """Why the kernel cannot run for weights of this device and dtype, or None."""
    if triton is None:
        return "Triton is not installed"
    if device.type != "cuda" and not INTERPRET:
        return f"the weights are on {device.type} (the kernel needs CUDA, or TRITON_INTERPRET=1)"
    if dtype not in _DTYPES and not (INTERPRET and dtype == torch.float32):
        return f"{str(dtype).replace('torch.', '')} weights (the kernel takes bfloat16 and float16)"
    return None


def applies(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> bool:
    """Whether skinny_linear runs the kernel for these arguments (else F.linear)."""
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1] or x.dtype != weight.dtype or x.device != weight.device:
        return False
    if unavailable(weight.device, weight.dtype) or not weight.is_contiguous() or weight.shape[1] % 8:
        return False
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)):
        return False
    if bias is not None and (bias.shape != weight.shape[:1] or bias.dtype != weight.dtype or not bias.is_contiguous()):
        return False
    return 0 < x.numel() // x.shape[-1] <= MAX_ROWS


@torch.compiler.disable  # why: a compiled region (evaluate.fast: compile) calls it as it is, a graph break
def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear(x, weight, bias), by the skinny kernel where it applies (see the module's docstring)."""
    if not applies(x, weight, bias):
        return F.linear(x, weight, bias)
    config = config_for(weight.shape[0], weight.shape[1], weight.dtype, weight.device)
    if config is None:
        return F.linear(x, weight, bias)
    x2 = x.reshape(-1, x.shape[-1])
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    return launch(x2, weight, bias, config).view(*x.shape[:-1], weight.shape[0])


# ----------------------------------------------------------------------------- tuning


def _median(xs: Sequence[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


def time_calls_ms(call: Callable[[int], object], n_calls: int, device: torch.device, reps: int = 20,
                  graphs: bool = True) -> float:
    """Milliseconds of one call: call(0) .. call(n_calls - 1) (e.g. over weight copies that together
    exceed the L2 cache) captured as one CUDA graph, replayed `reps` times after warm-ups, the median
    replay (CUDA events) over n_calls. graphs=False: the calls launched from the host (CUDA events
    still); on a CPU, wall time."""
    cuda = device.type == "cuda"

    def run():
        for i in range(n_calls):
            call(i)

    if not cuda:
        run()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            run()
            ts.append((time.perf_counter() - t0) * 1000 / n_calls)
        return _median(ts)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture: compilation, lazy allocations, kernel choice
        run()
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = None
    if graphs:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
    step = graph.replay if graph is not None else run
    step()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        step()
        t1.record()
        t1.synchronize()
        ts.append(t0.elapsed_time(t1) / n_calls)
    del graph
    return _median(ts)


def weight_copies(N: int, K: int, dtype: torch.dtype, device: torch.device, flush_bytes: int = 256 << 20) -> list:
    """Random [N, K] weights, as many as together exceed flush_bytes (several L2 caches; at most 32),
    so that a call cycling through them reads its weight from memory, as a forward does."""
    n = max(1, min(32, math.ceil(flush_bytes / (N * K * torch.empty((), dtype=dtype).element_size()))))
    return [torch.randn(N, K, device=device, dtype=torch.float32).mul_(0.02).to(dtype) for _ in range(n)]


def tune(N: int, K: int, dtype: torch.dtype, device: torch.device, reps: int = 10) -> Optional[tuple]:
    """The fastest of CONFIGS for a [N, K] weight at 16 rows (graph replays over weight copies beyond the
    L2 cache); None if none ran. Recorded in TUNE_LOG."""
    ws = weight_copies(N, K, dtype, device)
    x = torch.randn(MAX_ROWS, K, device=device, dtype=dtype)
    tried: dict[str, object] = {}
    best = None
    for config in CONFIGS:
        try:
            ms = time_calls_ms(lambda i, c=config: launch(x, ws[i], None, c), len(ws), device, reps=reps)
        except Exception as e:  # noqa: BLE001 (a config that does not compile or fit: the next one)
            tried[str(config)] = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
            continue
        tried[str(config)] = round(ms, 5)
        if best is None or ms < best[0]:
            best = (ms, config)
    TUNE_LOG[f"{N}x{K} {str(dtype).replace('torch.', '')}"] = {"chosen": str(best[1]) if best else None, "ms": tried}
    return best[1] if best else None


def config_for(N: int, K: int, dtype: torch.dtype, device: torch.device) -> Optional[tuple]:
    """The config every call with a [N, K] weight runs: tuned at its first call (on a CPU, or first met
    inside a CUDA graph capture, DEFAULT_CONFIG), then fixed."""
    key = (N, K, dtype, device)
    if key not in TUNED:
        if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
            TUNED[key] = DEFAULT_CONFIG
        else:
            TUNED[key] = tune(N, K, dtype, device)
            log(f"[skinny] {N}x{K} {str(dtype).replace('torch.', '')}: config {TUNED[key]} "
                "(BLOCK_N, BLOCK_K, SPLIT_K, warps, stages)")
    return TUNED[key]


# ----------------------------------------------------------------------------- a model's linears


def linear_modules(model: torch.nn.Module) -> list[torch.nn.Linear]:
    """Every plain nn.Linear of model (subclasses, e.g. quantized ones, keep their own) whose weight the
    kernel takes; each weight shape tuned now, before any graph capture."""
    mods = [m for m in model.modules() if type(m) is torch.nn.Linear and m.weight.dim() == 2
            and unavailable(m.weight.device, m.weight.dtype) is None and m.weight.is_contiguous()
            and m.weight.shape[1] % 8 == 0]
    for shape in sorted({(m.weight.shape[0], m.weight.shape[1], m.weight.dtype, m.weight.device) for m in mods}, key=str):
        config_for(*shape)
    return mods


def _skinny_forward(module: torch.nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
    """The module's skinny forward, made once and kept on it: the same object at every switch (a compiled
    region calling the module, evaluate.fast: compile, guards on it and would recompile for a new one)."""
    if "_skinny_forward" not in module.__dict__:
        module._skinny_forward = lambda x: skinny_linear(x, module.weight, module.bias)
    return module._skinny_forward


@contextlib.contextmanager
def switched(modules: Sequence[torch.nn.Linear]) -> Iterator[None]:
    """Inside: each module's forward is skinny_linear (an instance attribute over the class's);
    after, each has the forward it had (its own instance attribute, e.g. a hook's wrapper, or none)."""
    saved = [m.__dict__.get("forward") for m in modules]
    for m in modules:
        m.forward = _skinny_forward(m)
    try:
        yield
    finally:
        for m, f in zip(modules, saved):
            if f is None:
                del m.forward
            else:
                m.forward = f


VERIFY_GEMMS = ("auto", "cublas", "skinny")


def resolve_verify_gemm(requested: str, model: torch.nn.Module, key: str = "evaluate.verify_gemm") -> str:
    """auto|cublas|skinny -> cublas or skinny for `model` (its first matrix's device and dtype): skinny where
    the kernel cannot run is a config error naming why; auto takes skinny where it can, else cublas."""
    if requested not in VERIFY_GEMMS:
        raise DraftsmithError(f"{key} {requested!r}: unknown; use one of {', '.join(VERIFY_GEMMS)}")
    if requested == "cublas":
        return "cublas"
    weight = next(p for p in model.parameters() if p.dim() == 2)
    why = unavailable(weight.device, weight.dtype)
    if why is None:
        return "skinny"
    if requested == "skinny":
        raise DraftsmithError(f"{key} skinny: {why}; use {key}: cublas (or auto)")
    if weight.device.type == "cuda":
        log(f"[{key.split('.')[0]}] {key} auto: the skinny kernel cannot run ({why}); cuBLAS")
    return "cublas"
