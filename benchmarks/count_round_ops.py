"""Ops per resident round, by phase (CPU proxy for the kernels of the round's CUDA graph).

Runs greedy EAGLE-3 resident rounds (speculate/resident.py) on the static path on a CPU with a tiny
target shaped like the reference one (DeepSeek-V3 architecture, 12 layers by default; its MoE
experts on `batched_mm`, the kernel the graphed path switches a float32 MoE to) and a random
drafter, under torch.profiler, and counts per round and per phase (resident.py's `phase` labels):

    ops      top-level ops the round's Python issues in that phase (a compiled part: one)
    kernels  leaf aten ops, views, allocations and no-op casts left out, and inductor's fused
             kernels: on a GPU each is about one kernel, one node of the round's CUDA graph, a few
             microseconds even inside the graph (torch's rms_norm counts as one: CUDA runs it as one
             fused kernel, a CPU as several ops)

The round's own logic is everything except `verify` (the target's forward with its mask), `expand`
(the drafter steps) and `feed_forward` (the drafter's forward over the committed rows).

    python benchmarks/count_round_ops.py                          # chain k=5 and tree 4/16 depth 5, batch 1
    python benchmarks/count_round_ops.py --batch 4 --arch llama
    python benchmarks/count_round_ops.py --compile_round on       # the round's pure parts compiled (inductor)
    python benchmarks/count_round_ops.py --out counts.json

It also counts one plain decoding step and one drafter step (one row per sequence) on the same path.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))

from draftsmith.fileio import atomic_write_json# noqa: E402
from draftsmith.speculate.eagle3 import Eagle3Proposer, FastDraft  # noqa: E402
from draftsmith.speculate.engine import generate, plain_generate_batch  # noqa: E402
from draftsmith.speculate.fast import FastTarget  # noqa: E402
from draftsmith.target.model import load_target  # noqa: E402
from draftsmith.testing import make_model_dir  # noqa: E402
from test_engine import make_drafter  # noqa: E402

SHAPES = {"chain": (1, 5, 5), "tree": (4, 16, 5)}
"""(topk, budget, depth): the chain k=5 and the tree (top-k 4, 16 nodes, depth 5) the H200 recipe evaluates."""
PHASES = ("select", "masks", "verify", "accept", "commit", "cache_moves", "drafter_feed", "feed_forward", "expand")
OWN = ("select", "masks", "accept", "commit", "cache_moves", "drafter_feed")
"""The round's own logic: every phase but the model forwards (expand's drafter steps, verify, feed_forward)."""
NOT_KERNELS = {"aten::select", "aten::unsqueeze", "aten::expand", "aten::transpose", "aten::slice", "aten::view",
               "aten::reshape", "aten::as_strided", "aten::alias", "aten::lift_fresh", "aten::detach", "aten::t",
               "aten::permute", "aten::squeeze", "aten::_unsafe_view", "aten::empty", "aten::empty_strided",
               "aten::empty_like", "aten::resolve_conj", "aten::resolve_neg", "aten::result_type", "aten::split",
               "aten::unbind", "aten::chunk", "aten::narrow", "aten::view_as", "aten::expand_as", "aten::unflatten",
               "aten::flatten", "aten::contiguous", "aten::_reshape_alias", "aten::set_", "aten::split_with_sizes",
               "aten::to", "aten::as_strided_", "aten::resize_", "aten::scalar_tensor", "aten::_local_scalar_dense",
               "aten::item", "aten::is_nonzero", "aten::new_empty", "aten::new_empty_strided", "aten::unsqueeze_",
               "aten::squeeze_", "aten::detach_", "aten::_has_compatible_shallow_copy_type", "aten::size",
               "aten::numpy_T"}
"""Views, allocations, no-op casts, wrapped Python scalars (no kernel on a GPU either), host reads."""
ONE_KERNEL_ON_GPU = {"aten::_fused_rms_norm"}
"""Ops a CPU runs as several leaf ops and CUDA as one fused kernel (torch's rms_norm, input and weight of
one dtype): counted as one kernel, their CPU leaves not at all."""


def phase_of(e) -> str:
    """The innermost phase label above event e ("other" outside every label)."""
    p = e
    while p is not None:
        if p.name in PHASES:
            return p.name
        p = p.cpu_parent
    return "other"


def is_fused(e) -> bool:
    """An inductor kernel: `graph_0_cpp_fused_...` on a CPU (with cpp.enable_kernel_profile), `triton_...` on a GPU."""
    return "cpp_fused" in e.name or e.name.startswith("triton_")


def is_op(e) -> bool:
    return e.name.startswith(("aten::", "Torch-Compiled", "## Call CompiledFxGraph")) or is_fused(e)


def count(events, rounds: int, top: int = 5) -> dict:
    """{phase: {"ops", "kernels" per round, "top": most frequent kernels}}."""
    ops, kernels = Counter(), {p: Counter() for p in PHASES + ("other",)}
    below: dict[int, bool] = {}

    def kernel_below(e) -> bool:  # a kernel among e's descendants
        if id(e) not in below:
            below[id(e)] = any((is_op(c) and c.name not in NOT_KERNELS) or kernel_below(c) for c in e.cpu_children)
        return below[id(e)]

    def inside_one_kernel(e) -> bool:
        p = e.cpu_parent
        while p is not None and p.name not in ONE_KERNEL_ON_GPU:
            p = p.cpu_parent
        return p is not None

    for e in events:
        if not is_op(e) or inside_one_kernel(e):
            continue
        ph = phase_of(e)
        parent = e.cpu_parent
        if parent is None or not is_op(parent):
            ops[ph] += 1
        if is_fused(e):
            kernels[ph]["inductor kernel"] += 1
        elif e.name in ONE_KERNEL_ON_GPU:
            kernels[ph][e.name] += 1
        elif e.name.startswith("aten::") and e.name not in NOT_KERNELS and not kernel_below(e):
            kernels[ph][e.name] += 1
    out = {}
    for ph in PHASES + ("other",):
        k = kernels[ph]
        out[ph] = {"ops": round(ops[ph] / rounds, 1), "kernels": round(sum(k.values()) / rounds, 1),
                   "top": [(n, round(c / rounds, 1)) for n, c in k.most_common(top)]}
    out["own"] = {"ops": round(sum(out[p]["ops"] for p in OWN), 1),
                  "kernels": round(sum(out[p]["kernels"] for p in OWN), 1)}
    out["round"] = {"ops": round(sum(out[p]["ops"] for p in PHASES), 1),
                    "kernels": round(sum(out[p]["kernels"] for p in PHASES), 1)}
    return out


def kernels_of(fn, top: int) -> tuple[float, list]:
    """(kernels, the most frequent) of one call of fn, profiled after a warm-up call."""
    fn()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    c = count(prof.events(), 1, top)["other"]
    return c["kernels"], c["top"]


@torch.inference_mode()
def step_counts(ft: FastTarget, fd: FastDraft, prompts: list[list[int]], top: int) -> dict:
    """Kernels of one plain decoding step (a generation of 33 new tokens less one of 1: no prefill) and
    of one drafter step over one row per sequence on its static cache (FastDraft.step)."""
    k33, top33 = kernels_of(lambda: plain_generate_batch(ft.target, prompts, 33, fast=ft), top)
    k1, _ = kernels_of(lambda: plain_generate_batch(ft.target, prompts, 1, fast=ft), top)
    d, B = fd.drafter, len(prompts)
    cache = fd.reset(B, 64)
    ids, pos = torch.zeros(B, 1, dtype=torch.long), torch.full((B, 1), 20)
    hidden, mask = torch.randn(B, 1, d.cfg.hidden_size), torch.ones(B, 1, cache.size, dtype=torch.bool)
    kd, topd = kernels_of(lambda: fd.step(ids, hidden, pos, mask, torch.tensor(20)), top)
    return {"plain_step": {"kernels": round((k33 - k1) / 32, 1), "top_33_tokens": top33},
            "draft_step": {"kernels": kd, "top": topd}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="deepseek_v3")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--max_new_tokens", type=int, default=48)
    ap.add_argument("--compile_round", default="off", choices=["off", "on"])
    ap.add_argument("--top", type=int, default=5, help="kernels listed per phase")
    ap.add_argument("--methods", nargs="*", default=["chain", "tree"])
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    if a.compile_round == "on":  # each inductor kernel as a profiler event (CPU: C++ kernels, none otherwise)
        torch._inductor.config.cpp.enable_kernel_profile = True
    target = load_target(make_model_dir(tempfile.mkdtemp(), arch=a.arch, num_layers=a.layers), device="cpu",
                         dtype="float32")
    if hasattr(target.model, "set_experts_implementation") and getattr(
            target.model.config, "_experts_implementation", None) == "eager":
        target.model.set_experts_implementation("batched_mm")  # as the graphed path does (fast.graph_safe_experts)
    drafter = make_drafter(target, draft_vocab=200, seed=3)
    ft, fd = FastTarget(target, "static"), FastDraft(drafter, graphs=False)
    prompts = [list(range(1, 40 + 7 * i)) for i in range(a.batch)]
    shapes = {m: SHAPES[m] for m in a.methods}
    result = {"arch": a.arch, "layers": a.layers, "batch": a.batch, "compile_round": a.compile_round,
              "torch": torch.__version__, "methods": {}}
    result.update(step_counts(ft, fd, prompts, a.top))
    print(f"plain step: {result['plain_step']['kernels']} kernels; drafter step (one row): "
          f"{result['draft_step']['kernels']} kernels {result['draft_step']['top']}", flush=True)
    for name, (topk, budget, depth) in shapes.items():
        def run(n):
            prop = Eagle3Proposer(drafter, topk=topk, budget=budget, fast=fd)
            kw = {"compile_round": True} if a.compile_round == "on" else {}
            return generate(target, prop, prompts, n, depth=depth, fast=ft, resident=True, **kw)
        run(a.max_new_tokens)  # warm-up (and compilation)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            run(a.max_new_tokens)
        events = prof.events()
        rounds = sum(e.name == "expand" for e in events)
        c = count(events, rounds, a.top)
        result["methods"][name] = {"rounds": rounds, "phases": c}
        print(f"{name}, batch {a.batch}, {a.arch} x{a.layers} layers, compile_round {a.compile_round}: "
              f"{rounds} rounds; per round: {c['round']['kernels']} kernels ({c['own']['kernels']} in the round's own "
              f"logic), {c['round']['ops']} top-level ops", flush=True)
        for ph in PHASES + ("other",):
            print(f"  {ph:13s} {c[ph]['kernels']:7.1f} kernels {c[ph]['ops']:7.1f} ops   {c[ph]['top']}")
    if a.out:
        atomic_write_json(a.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
