"""The verify forward's attention at N query rows against one row: which kernel, at what cost.

On the H200 (BENCHMARKS.md, 2026-12-04 third session) the 8B-shaped target's forward costs 1.18 of a
one-row step for the chain's 6 verify rows, most of it attention: for more than one query row cuDNN
takes a 64-row kernel (about 51 us a layer against 12.6 us for one row), and transformers' SDPA
path copies K and V to every query head (repeat_kv) over the whole static cache, on both paths.
This benchmark times one layer's attention at Llama-3.1-8B's shapes (32 query heads, 8 KV heads,
head dim 128, bf16) for N new rows over S cache columns, with the verify mask (committed columns
plus each row's ancestors among the new rows; a chain here), in these variants:

    hf          repeat_kv + SDPA with an additive mask, torch's choice of kernel (what runs today)
    gqa         SDPA with enable_gqa=True and a boolean mask (no K/V copies), torch's choice
    fold        the query heads that share a KV head folded into that head's rows (N rows become
                n_rep * N rows of 8 heads), SDPA with a boolean mask: no K/V copies, one KV read a head
    fold_mm     the same folding, two batched matmuls and a float32 softmax (no attention kernel)
    flash       draft/flash_decode.py's fused kernel (folded rows, one KV read a head, split columns and a
                combine kernel), its own split choice; flash_s<k>: k column tiles of 64 per split
    draftsmith  draft.attention.decode_attention with the boolean mask: what the drafter and the fast
                path's target run (flash where the kernel applies, else SDPA enable_gqa for one row and
                for many, fold_mm for a few; its kernel for each N is listed under "draftsmith_kernel")
    <v>_<kernel> hf, gqa or fold with one kernel forced: cudnn, efficient, math (where it runs)

Each is timed as CUDA-graph replays of 20 calls (the decode path replays graphs), and checked against
the math kernel's output. A variant a kernel refuses is reported as refused, not timed.

    python benchmarks/bench_verify_attention.py --out benchmarks/out/bench_verify_attention.json   # GPU
    python benchmarks/bench_verify_attention.py --smoke                                             # CPU check
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from draftsmith.draft import flash_decode as flash  # noqa: E402
from draftsmith.fileio import atomic_write_json  # noqa: E402
from draftsmith.speculate.cache import capture  # noqa: E402
from draftsmith.draft.attention import decode_attention, decode_kernel  # noqa: E402

SHAPE = dict(heads=32, kv_heads=8, head_dim=128)  # Llama-3.1-8B
SMOKE = dict(heads=4, kv_heads=2, head_dim=16)
KERNELS = ("cudnn", "efficient", "math")


def verify_mask(N: int, S: int, device) -> torch.Tensor:
    """bool [1, 1, N, S]: rows at columns [S - N, S) see every column before them (a chain)."""
    past = S - N
    cols = torch.arange(S, device=device)
    rows = past + torch.arange(N, device=device)
    return (cols[None, :] <= rows[:, None])[None, None]


def repeat_kv(x: torch.Tensor, n: int) -> torch.Tensor:
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, n, s, d).reshape(b, h * n, s, d)


def variants(q, k, v, mask):
    """name -> (kernel to force or None, zero-argument call)."""
    n_rep = q.shape[1] // k.shape[1]
    add = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
    out = {"hf": (None, lambda: F.scaled_dot_product_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), attn_mask=add)),
           "gqa": (None, lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True))}
    b, h, n, d = q.shape
    kvh = k.shape[1]
    fold_mask = mask.expand(b, 1, n, mask.shape[-1]).repeat(1, 1, n_rep, 1)  # rows (group member, query row)

    def fold(call):  # the query heads that share a KV head become rows of that head: no K/V copies
        return lambda: call(q.reshape(b, kvh, n_rep * n, d)).reshape(b, h, n, d)

    def mm(qf):  # two batched matmuls and a softmax in float32: the decode-kernel shape for few rows
        s = (qf @ k.transpose(-1, -2)).float() * d ** -0.5
        return (s.masked_fill(~fold_mask, float("-inf")).softmax(-1).to(v.dtype) @ v)

    out["fold"] = (None, fold(lambda qf: F.scaled_dot_product_attention(qf, k, v, attn_mask=fold_mask)))
    out["fold_mm"] = (None, fold(mm))
    if flash.applies(q, k, v, mask):
        out["flash"] = (None, lambda: flash.flash_decode(q, k, v, mask, d ** -0.5))
        for sb in (1, 2, 4, 8):
            if -(-k.shape[2] // (64 * sb)) <= flash.MAX_SPLITS:
                out[f"flash_s{sb}"] = (None, lambda sb=sb: flash.flash_decode(q, k, v, mask, d ** -0.5, split_blocks=sb))
    out["draftsmith"] = (None, lambda: decode_attention(q, k, v, mask, d ** -0.5))
    for kern in KERNELS:
        out[f"hf_{kern}"] = (kern, out["hf"][1])
        out[f"gqa_{kern}"] = (kern, out["gqa"][1])
        out[f"fold_{kern}"] = (kern, out["fold"][1])
    return out


def backend(kern):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    names = {"cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "math": "MATH"}
    return sdpa_kernel([getattr(SDPBackend, names[kern])])


def timed_us(fn, cuda: bool, calls: int = 20, repeats: int = 5) -> float:
    """Microseconds per call: the median of `repeats` replays of a CUDA graph of `calls` calls
    (on a CPU: wall time of `calls` calls)."""
    if not cuda:
        ts = []
        for _ in range(repeats):
            t = time.perf_counter()
            for _ in range(calls):
                fn()
            ts.append((time.perf_counter() - t) / calls * 1e6)
        return sorted(ts)[len(ts) // 2]
    g, _ = capture(lambda: [fn() for _ in range(calls)])  # the engine's own capture: a warm-up on a side stream, then the graph
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1000 / calls)
    return sorted(ts)[len(ts) // 2]


def measure(shape: dict, rows: list[int], cols: list[int], device, dtype, seed: int = 0) -> dict:
    cuda = device.type == "cuda"
    g = torch.Generator(device=device).manual_seed(seed)
    res: dict = {}
    for S in cols:
        for N in rows:
            q = torch.randn(1, shape["heads"], N, shape["head_dim"], device=device, dtype=dtype, generator=g)
            k = torch.randn(1, shape["kv_heads"], S, shape["head_dim"], device=device, dtype=dtype, generator=g)
            v = torch.randn(1, shape["kv_heads"], S, shape["head_dim"], device=device, dtype=dtype, generator=g)
            mask = verify_mask(N, S, device)
            vs = variants(q, k, v, mask)
            with backend("math"):
                ref = vs["hf"][1]().float()
            for name, (kern, fn) in vs.items():
                row = res.setdefault(name, {})
                key = f"N{N}_S{S}"
                try:
                    if kern is None:
                        out, us = fn(), timed_us(fn, cuda)
                    else:
                        with backend(kern):
                            out, us = fn(), timed_us(fn, cuda)
                except RuntimeError as e:  # this kernel does not take these inputs (or cannot be captured)
                    row[key] = {"refused": str(e).splitlines()[0][:160]}
                    continue
                err = (out.float() - ref).abs().max().item()
                row[key] = {"us": round(us, 2), "max_abs_err": err}
    for name, row in res.items():  # each N against one row at the same S
        for S in cols:
            base = row.get(f"N1_S{S}", {}).get("us")
            for N in rows:
                r = row.get(f"N{N}_S{S}", {})
                if base and "us" in r:
                    r["over_one_row"] = round(r["us"] / base, 3)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, float32: a correctness check")
    ap.add_argument("--rows", type=int, nargs="+", default=None, help="query rows N (default 1 2 6 17 65)")
    ap.add_argument("--cols", type=int, nargs="+", default=None, help="cache columns S (default 512 2048 8192)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not a.smoke
    if not cuda and not a.smoke:
        print("bench_verify_attention: needs a CUDA GPU; --smoke runs tiny shapes on the CPU", file=sys.stderr)
        return 2
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    rows = a.rows or ([1, 2, 6, 17, 65] if cuda else [1, 3])
    cols = a.cols or ([512, 2048, 8192] if cuda else [32])
    shape = SHAPE if cuda else SMOKE
    t = time.perf_counter()
    result = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
              "dtype": str(dtype).replace("torch.", ""), "shape": shape, "rows": rows, "cols": cols,
              "draftsmith_kernel": {f"N{N}": decode_kernel(N, shape["heads"] // shape["kv_heads"],
                                                           cuda and flash.triton is not None) for N in rows},
              "variants": measure(shape, rows, cols, device, dtype)}
    result["wall_s"] = round(time.perf_counter() - t, 1)
    if a.out:
        atomic_write_json(a.out, result)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
