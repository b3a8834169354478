"""What a verify forward over k rows costs against one row, and which matmuls make the difference
(issue 50 item 1: k <= 16 rows at <= 1.03 of one row on the 8B-shaped target in bf16).

    PYTHONPATH=src python benchmarks/bench_verify_rows.py --out verify_rows.json    # CUDA: <= 4 min (--budget_s 200)
    PYTHONPATH=src python benchmarks/bench_verify_rows.py --small --out /tmp/v.json # CPU smoke: tiny dims

One process, four parts, the JSON rewritten after each (a kill keeps what ran):

  (d) correctness    per weight shape at 16 rows: skinny vs F.linear (max abs / relative diff), and whether
                     row r of an M-row call equals the 1-row call bit for bit (skinny: by construction;
                     cublas beside it for comparison): "correctness"
  (a) linears        every linear shape of the target (q, k, v, o, gate, up, down, lm_head, and the fused
                     qkv / gate_up a fused projection would run) at M = 1, 2, 4, 8, 16 rows, per candidate:
                     cublas (aten F.linear), cublaslt (torch.backends.cuda.preferred_blas_library), skinny
                     (speculate/skinny.py), compile (torch.compile max-autotune-no-cudagraphs of F.linear,
                     last, within the budget). Each time is one call's share of a CUDA-graph replay of calls
                     cycling through weight copies that together exceed the L2 cache (skinny.time_calls_ms,
                     median of --reps replays): ms, GB/s of weight read, ratio to the same candidate's M = 1
                     and to the best M = 1: "linears"; summed over one forward (32 layers' q..down + lm_head):
                     "linear_forward_ms", "linear_forward_ratio_to_best_1row"
  (b) forward        the whole target forward on the engine's fast path (FastTarget, CUDA graphs, batch 1,
                     --context cache columns filled) over 1, 2, 4, 8, 16 rows, per setting (SETTINGS:
                     evaluate.verify_gemm cublas or skinny, draft/flash_decode.py's attention off or on),
                     two interleaved passes (the lower median of each): "forward_ms",
                     "forward_ratio_to_own_1row", "forward_ratio_to_best_1row", plain decoding's ms a step
                     per setting ("plain_ms_per_step"), and whether a verify forward's row 0 equals the
                     one-row forward's logits ("row0_equal_1row"). Headline: verify_rows16_cost_ratio =
                     the best setting's 16-row forward / the best setting's 1-row forward (the honest one:
                     against the best plain step), verify_rows_cost_ratio {rows: same}, and per setting
                     "rows16_cost_ratio_by_setting"
  (c) profiles       torch.profiler's top kernels of a 1-row and a 16-row forward per setting: "profiles"

Every candidate and setting is guarded: its error string lands in the JSON, the others still run (a linear
whose CUDA-graph capture fails is timed from the host instead: its "host_launched" rows, "graph_errors").
"skipped" lists what the budget cut; "skinny_tuning" what the skinny kernel's tuner measured per shape.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_engine import CONFIGS, build_drafter, build_target, kernel_profile  # noqa: E402
from draftsmith.draft import flash_decode as flash  # noqa: E402
from draftsmith.fileio import atomic_write_json  # noqa: E402
from draftsmith.evaluate.costs import measure_step_costs  # noqa: E402
from draftsmith.speculate import skinny  # noqa: E402
from draftsmith.speculate.cache import CAPTURE_FALLBACKS  # noqa: E402
from draftsmith.speculate.engine import plain_generate  # noqa: E402
from draftsmith.speculate.methods import DecodeRunners  # noqa: E402

ROWS = (1, 2, 4, 8, 16)
PER_LAYER = ("q", "k", "v", "o", "gate", "up", "down")
CANDIDATES = ("cublas", "cublaslt", "skinny", "compile")
SETTINGS = {"cublas": ("cublas", False), "skinny": ("skinny", False), "cublas_flash": ("cublas", True),
            "skinny_flash": ("skinny", True)}
"""setting -> (evaluate.verify_gemm, whether decode_attention may take draft/flash_decode.py's kernel; without
it the multi-row attention is fold_mm and one row SDPA, as before the kernel)."""


@contextlib.contextmanager
def attention_setting(setting: str):
    """flash_decode on or off for one setting's graph captures and forwards."""
    saved, flash.ENABLED = flash.ENABLED, SETTINGS[setting][1]
    try:
        yield
    finally:
        flash.ENABLED = saved


def error(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:240]}"


def linear_shapes(dims: dict) -> dict[str, tuple[int, int]]:
    """name -> (N, K) of the target's linears (Llama: q, k, v, o, gate, up, down, lm_head) and of the
    fused projections (qkv, gate_up) a fused model would run instead."""
    H, I, V = dims["hidden_size"], dims["intermediate"], dims["vocab"]
    kv = dims["kv_heads"] * (H // dims["heads"])
    return {"q": (H, H), "k": (kv, H), "v": (kv, H), "o": (H, H), "gate": (I, H), "up": (I, H), "down": (H, I),
            "lm_head": (V, H), "qkv_fused": (H + 2 * kv, H), "gate_up_fused": (2 * I, H)}


def candidate_fn(name: str, dev: torch.device):
    """(fn(x, w) -> y, a context setup/teardown pair) for a candidate; raises where it cannot run."""
    if name == "cublas":
        return F.linear, None
    if name == "skinny":
        return skinny.skinny_linear, None
    if dev.type != "cuda":
        raise RuntimeError("needs CUDA")
    if name == "cublaslt":
        before = torch.backends.cuda.preferred_blas_library()
        return F.linear, (lambda: torch.backends.cuda.preferred_blas_library("cublaslt"),
                          lambda: torch.backends.cuda.preferred_blas_library(before))
    if name == "compile":
        from torch import _dynamo  # not `import torch._dynamo`: that binds `torch` locally for the whole function,
        # and the cublaslt branch above then raised UnboundLocalError (every cublaslt figure of the H100 run of 2026-12-07)
        for attr in ("cache_size_limit", "recompile_limit"):  # one compile per (M, N, K)
            if hasattr(_dynamo.config, attr):
                setattr(_dynamo.config, attr, 512)
        return torch.compile(lambda x, w: F.linear(x, w), mode="max-autotune-no-cudagraphs", dynamic=False), None
    raise ValueError(name)


def time_linear(fn, ctx, ws: list, M: int, reps: int, dev: torch.device, dtype: torch.dtype, graphs: bool = True) -> float:
    x = torch.randn(M, ws[0].shape[1], device=dev, dtype=dtype)
    if ctx:
        ctx[0]()
    try:
        return skinny.time_calls_ms(lambda i: fn(x, ws[i]), len(ws), dev, reps=reps, graphs=graphs)
    finally:
        if ctx:
            ctx[1]()


def finish_shape(row: dict) -> None:
    """Ratios of a shape's candidates: to its own M = 1 and to the best candidate's M = 1."""
    ones = [c["ms"]["1"] for c in row["candidates"].values() if "1" in c.get("ms", {})]
    best1 = min(ones) if ones else None
    for c in row["candidates"].values():
        ms = c.get("ms", {})
        c["gbps"] = {m: round(row["weight_bytes"] / (t * 1e-3) / 1e9, 1) for m, t in ms.items() if t > 0}
        if "1" in ms:
            c["ratio_to_own_1"] = {m: round(t / ms["1"], 4) for m, t in ms.items()}
        if best1:
            c["ratio_to_best_1"] = {m: round(t / best1, 4) for m, t in ms.items()}


def linears_part(result: dict, shapes: dict, cands, dev, dtype, reps: int, deadline: float, save) -> None:
    """(a): every shape x M x candidate in `cands` (a candidate already measured keeps its numbers)."""
    for name, (N, K) in shapes.items():
        row = result["linears"].setdefault(name, {"N": N, "K": K, "weight_bytes": N * K * dtype.itemsize,
                                                  "candidates": {}})
        ws = None
        for cand in cands:
            c = row["candidates"].setdefault(cand, {"ms": {}})
            if c.get("error") or all(str(M) in c["ms"] for M in ROWS):  # measured in an earlier call, or cannot run
                continue
            try:
                fn, ctx = candidate_fn(cand, dev)
            except Exception as e:  # noqa: BLE001 (the candidate cannot run here: its reason, the others go on)
                c["error"] = error(e)
                continue
            if cand == "skinny":
                c["kernel"] = skinny.applies(torch.empty(1, K, device=dev, dtype=dtype),
                                             torch.empty(N, K, device=dev, dtype=dtype), None)
                if c["kernel"]:
                    c["config"] = str(skinny.config_for(N, K, dtype, dev))  # tuned here, outside any capture
            order = (1, 16, 2, 4, 8) if cand == "compile" else ROWS  # compile: the ends first, the budget may cut
            for M in order:
                if str(M) in c["ms"]:
                    continue
                if time.perf_counter() > deadline:
                    result["skipped"].append(f"linears {name} {cand} M={M}")
                    continue
                ws = ws or skinny.weight_copies(N, K, dtype, dev)
                try:
                    c["ms"][str(M)] = round(time_linear(fn, ctx, ws, M, reps, dev, dtype), 5)
                except Exception as e:  # noqa: BLE001 (not capturable: timed from the host, and said so)
                    c.setdefault("graph_errors", {})[str(M)] = error(e)
                    try:
                        c["ms"][str(M)] = round(time_linear(fn, ctx, ws, M, reps, dev, dtype, graphs=False), 5)
                        c.setdefault("host_launched", []).append(M)
                    except Exception as e2:  # noqa: BLE001
                        c.setdefault("errors", {})[str(M)] = error(e2)
            c["ms"] = dict(sorted(c["ms"].items(), key=lambda kv: int(kv[0])))
        del ws
        finish_shape(row)
        save()
    # one forward's linears: 32 layers of q..down, the lm_head
    n_layers = result["dims"]["num_layers"]
    fwd = {}
    for cand in CANDIDATES:
        per = {}
        for M in map(str, ROWS):
            try:
                per[M] = round(n_layers * sum(result["linears"][s]["candidates"][cand]["ms"][M] for s in PER_LAYER)
                               + result["linears"]["lm_head"]["candidates"][cand]["ms"][M], 4)
            except KeyError:
                pass
        if per:
            fwd[cand] = per
    result["linear_forward_ms"] = fwd
    best1 = min((v["1"] for v in fwd.values() if "1" in v), default=None)
    if best1:
        result["linear_forward_ratio_to_best_1row"] = {c: {m: round(t / best1, 4) for m, t in v.items()}
                                                       for c, v in fwd.items()}


def correctness_part(result: dict, shapes: dict, dev, dtype) -> None:
    """(d): skinny against F.linear at 16 rows, and each candidate's row r of M rows against its 1-row call."""
    out = result["correctness"] = {}
    torch.manual_seed(0)
    for name, (N, K) in shapes.items():
        if f"{N}x{K}" in out:  # q and o, k and v, gate and up: one shape
            continue
        row = out[f"{N}x{K}"] = {"shapes": [s for s, nk in shapes.items() if nk == (N, K)]}
        try:
            w = torch.randn(N, K, device=dev, dtype=torch.float32).mul_(0.02).to(dtype)
            x = torch.randn(max(ROWS), K, device=dev, dtype=dtype)
            ref = F.linear(x.float(), w.float())
            for cand, fn in (("skinny", skinny.skinny_linear), ("cublas", F.linear)):
                full = fn(x, w)
                diff = (full.float() - ref).abs()
                row[cand] = {"max_abs_diff_vs_fp32": float(diff.max()),
                             "max_rel_diff_vs_fp32": float((diff / ref.abs().clamp_min(1e-3)).max()),
                             "rows_equal_1row": {str(M): all(torch.equal(fn(x[r:r + 1], w)[0], fn(x[:M], w)[r])
                                                             for r in range(M)) for M in ROWS}}
            row["skinny"]["kernel"] = skinny.applies(x, w, None)
            row["skinny_vs_cublas_max_abs_diff"] = float((skinny.skinny_linear(x, w).float() - F.linear(x, w).float()).abs().max())
            del w, x, ref
        except Exception as e:  # noqa: BLE001
            row["error"] = error(e)


@torch.inference_mode()
def row0_logits(ft, context: list[int], n: int) -> torch.Tensor:
    """Row 0's logits of an n-row verify forward after `context` (rows 1.. are copies of the last token)."""
    dev, C = ft.device, len(context)
    ft.prefill(torch.tensor([context], device=dev), torch.arange(C, device=dev)[None],
               torch.zeros(1, dtype=torch.long, device=dev), max_new_tokens=0, max_rows=max(ROWS) + 1)
    out = ft.verify(torch.tensor([context[-1:] * n]), torch.arange(C, C + n)[None], torch.zeros(1, dtype=torch.long),
                    torch.full((1,), C), torch.ones(n, n, dtype=torch.bool).tril()[None], n)
    return out.logits[0, 0].float().clone()


def forward_part(result: dict, target, drafter, mode: str, context: list[int], reps: int, passes: int,
                 profile: bool, deadline: float, save) -> None:
    """(b) and (c): the whole forward per verify_gemm setting, `passes` interleaved passes."""
    runners, meds, profiles = {}, {}, result["profiles"]
    for s, (gemm, _) in SETTINGS.items():
        try:
            runners[s] = DecodeRunners(target, drafter, mode, verify_gemm=gemm)
        except Exception as e:  # noqa: BLE001 (e.g. skinny without Triton)
            result["forward_errors"][s] = error(e)
    for p in range(passes):
        for s, r in runners.items():
            if time.perf_counter() > deadline:
                result["skipped"].append(f"forward {s} pass {p}")
                continue

            def probe(kind, batch, n, step, s=s):
                if p == 0 and profile and kind == "target" and n in (1, max(ROWS)):
                    try:
                        profiles.setdefault(s, {})[f"rows_{n}"] = kernel_profile(step, 1)
                    except Exception as e:  # noqa: BLE001
                        profiles.setdefault(s, {})[f"rows_{n}"] = {"error": error(e)}

            try:
                with attention_setting(s):
                    costs = measure_step_costs(target, drafter, context, repeats=reps, runners=r, probe=probe)
            except Exception as e:  # noqa: BLE001
                result["forward_errors"][s] = error(e)
                continue
            result["step_costs"].setdefault(s, []).append(costs)
            for n, ms in costs["target_forward_ms"].items():
                meds.setdefault(s, {}).setdefault(n, []).append(ms)
            save()
    fwd = {s: {n: round(min(v), 4) for n, v in by.items() if int(n) in ROWS} for s, by in meds.items()}
    result["forward_ms"] = fwd
    if not fwd:
        return
    best1 = min(v["1"] for v in fwd.values())
    result["forward_ratio_to_own_1row"] = {s: {n: round(t / v["1"], 4) for n, t in v.items()} for s, v in fwd.items()}
    result["forward_ratio_to_best_1row"] = {s: {n: round(t / best1, 4) for n, t in v.items()} for s, v in fwd.items()}
    result["verify_rows_cost_ratio"] = {n: round(min(v[n] for v in fwd.values()) / best1, 4) for n in map(str, ROWS)}
    result["verify_rows16_cost_ratio"] = result["verify_rows_cost_ratio"][str(max(ROWS))]
    result["rows16_cost_ratio_by_setting"] = {s: round(v[str(max(ROWS))] / v["1"], 4) for s, v in fwd.items()}
    result["best_setting_by_rows"] = {n: min(fwd, key=lambda s: fwd[s][n]) for n in map(str, ROWS)}
    for s, r in runners.items():  # plain decoding's step on each setting, and row 0 of 16 rows against 1 row
        if time.perf_counter() > deadline:
            result["skipped"].append(f"plain {s}")
            continue
        try:
            with attention_setting(s):
                plain_row0(result, s, r, target, context)
        except Exception as e:  # noqa: BLE001
            result["plain_ms_per_step"][s] = error(e)
        save()


def plain_row0(result: dict, s: str, r, target, context: list[int]) -> None:
    """Plain decoding's ms a step on setting s, and row 0 of a 16-row forward against the 1-row forward."""
    ft = r.get(1)[0]
    n_new = 32
    plain_generate(target, context, n_new, fast=ft)  # warm-up: the plain graph
    ts = []
    for _ in range(3):
        if target.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        plain_generate(target, context, n_new, fast=ft)
        ts.append(time.perf_counter() - t0)
    result["plain_ms_per_step"][s] = round(1000 * sorted(ts)[1] / n_new, 4)
    a, b = row0_logits(ft, context, 1), row0_logits(ft, context, max(ROWS))
    result["row0_equal_1row"][s] = {"equal": bool(torch.equal(a, b)), "max_abs_diff": float((a - b).abs().max()),
                                    "argmax_equal": bool(a.argmax() == b.argmax())}


def table(result: dict) -> str:
    lines = ["linears: ms at M=1 / M=16 (ratio to the best M=1)"]
    for name, row in result["linears"].items():
        cells = []
        for cand, c in row["candidates"].items():
            ms = c.get("ms", {})
            if "1" in ms and "16" in ms:
                cells.append(f"{cand} {ms['1']:.4f}/{ms['16']:.4f} ({c['ratio_to_best_1']['16']:.3f})")
            elif c.get("error"):
                cells.append(f"{cand} -")
        lines.append(f"  {name:14s} {row['N']}x{row['K']}: " + "; ".join(cells))
    for s, v in result.get("forward_ms", {}).items():
        lines.append(f"forward {s:7s} ms by rows: " + " ".join(f"{n}:{t:.3f}" for n, t in v.items())
                     + f"  (16/1: {result['rows16_cost_ratio_by_setting'][s]:.4f})")
    if "verify_rows16_cost_ratio" in result:
        lines.append(f"verify_rows16_cost_ratio {result['verify_rows16_cost_ratio']:.4f} "
                     f"(by rows: {result['verify_rows_cost_ratio']}); plain ms/step {result['plain_ms_per_step']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="tiny dims on the CPU (float32, static caches): a smoke run")
    ap.add_argument("--out", default=None)
    ap.add_argument("--budget_s", type=float, default=200.0,
                    help="start nothing new after this many seconds (a torch.compile started before may run ~30 s past it)")
    ap.add_argument("--context", type=int, default=None, help="cache columns filled before the forwards (512; small 24)")
    ap.add_argument("--reps", type=int, default=None, help="graph replays per linear timing (default 25; small 3)")
    ap.add_argument("--forward_reps", type=int, default=None, help="timed forwards per row count (default 30; small 2)")
    ap.add_argument("--passes", type=int, default=2, help="interleaved passes over the settings (forward part)")
    ap.add_argument("--no_compile", action="store_true", help="leave out the torch.compile candidate")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    t_start = time.perf_counter()
    deadline = t_start + a.budget_s
    n_fallbacks = len(CAPTURE_FALLBACKS)
    cuda = torch.cuda.is_available() and not a.small
    if not a.small and not cuda:
        print("bench_verify_rows: the 8B-shaped target needs a CUDA GPU; run with --small for the CPU smoke", file=sys.stderr)
        return 2
    name = "small" if a.small else "8b"
    dims = CONFIGS[name]
    dev = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    mode = "graphs" if cuda else "static"
    reps = a.reps or (25 if cuda else 3)
    C = a.context or (512 if cuda else 24)
    shapes = linear_shapes(dims)
    result = {"config": name, "dims": dims, "device": torch.cuda.get_device_name() if cuda else "cpu",
              "dtype": str(dtype).replace("torch.", ""), "path": mode, "torch": torch.__version__,
              "triton": getattr(skinny.triton, "__version__", None), "context": C, "rows": list(ROWS),
              "budget_s": a.budget_s, "correctness": {}, "linears": {}, "forward_errors": {}, "step_costs": {},
              "plain_ms_per_step": {}, "row0_equal_1row": {}, "profiles": {}, "skipped": []}

    def save():
        result["skinny_tuning"] = skinny.TUNE_LOG
        result["capture_fallbacks"] = CAPTURE_FALLBACKS[n_fallbacks:]
        result["wall_s"] = round(time.perf_counter() - t_start, 1)
        if a.out:
            atomic_write_json(a.out, result)

    target = build_target(dims, dev, dtype, a.seed)
    drafter = build_drafter(target, dims, a.seed + 1)
    result["build_s"] = round(time.perf_counter() - t_start, 1)
    print(f"[bench_verify_rows] {name}: built in {result['build_s']} s on {result['device']}, {result['dtype']}, "
          f"triton {result['triton']}", flush=True)
    correctness_part(result, shapes, dev, dtype)
    save()
    print(f"[bench_verify_rows] correctness done ({time.perf_counter() - t_start:.0f} s)", flush=True)
    fast_cands = [c for c in CANDIDATES if c != "compile"]
    linears_part(result, shapes, fast_cands, dev, dtype, reps, deadline, save)
    print(f"[bench_verify_rows] linears done ({time.perf_counter() - t_start:.0f} s)", flush=True)
    gen = torch.Generator().manual_seed(a.seed)
    context = torch.randint(3, dims["vocab"], (C,), generator=gen).tolist()
    forward_part(result, target, drafter, mode, context, a.forward_reps or (30 if cuda else 2), a.passes, cuda,
                 deadline, save)
    print(f"[bench_verify_rows] forwards done ({time.perf_counter() - t_start:.0f} s)", flush=True)
    if not a.no_compile:  # last: max-autotune compiles per (M, N, K) and may use what budget is left
        linears_part(result, shapes, CANDIDATES, dev, dtype, reps, deadline, save)
    save()
    print(table(result), flush=True)
    print(json.dumps({k: result.get(k) for k in ("verify_rows16_cost_ratio", "verify_rows_cost_ratio",
                                                 "rows16_cost_ratio_by_setting", "plain_ms_per_step",
                                                 "linear_forward_ratio_to_best_1row", "forward_errors", "skipped",
                                                 "capture_fallbacks", "wall_s")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
