"""Host-side torch ops per speculative round that CUDA graphs do not cover (CPU proxy).

Runs `generate` on the static path (the fast path without graphs, so it runs on a CPU) with a tiny
target and a random drafter, profiles it with torch.profiler, and counts the top-level ops outside
the calls that `Graphed` would replay as CUDA graphs, views left out. On a GPU each of these is a
kernel launch or a small copy issued by the host every round.

    python benchmarks/count_host_ops.py            # batch 1
    python benchmarks/count_host_ops.py --batch4   # a batch of 4 prompts
"""
from __future__ import annotations

import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))

from draftsmith.speculate import cache, fast  # noqa: E402
from draftsmith.speculate.eagle3 import Eagle3Proposer, FastDraft  # noqa: E402
from draftsmith.speculate.engine import generate  # noqa: E402
from draftsmith.speculate.proposer import PerSequence  # noqa: E402
from draftsmith.speculate.ngram import NgramProposer  # noqa: E402
from draftsmith.target.model import load_target  # noqa: E402
from draftsmith.testing import make_model_dir  # noqa: E402
from test_engine import make_drafter  # noqa: E402

VIEWS = {"aten::select", "aten::unsqueeze", "aten::expand", "aten::transpose", "aten::slice", "aten::view",
         "aten::reshape", "aten::as_strided", "aten::alias", "aten::lift_fresh", "aten::detach", "aten::t",
         "aten::permute", "aten::squeeze", "aten::_unsafe_view", "aten::empty", "aten::resolve_conj",
         "aten::resolve_neg", "aten::result_type"}


def main() -> int:
    torch.manual_seed(0)
    target = load_target(make_model_dir(tempfile.mkdtemp(), num_layers=2), device="cpu", dtype="float32")
    drafter = make_drafter(target, draft_vocab=200, seed=3)
    ft, fd = fast.FastTarget(target, "static"), FastDraft(drafter, graphs=False)
    call = cache.Graphed.__call__

    def marked(self, *xs):
        with torch.profiler.record_function("GRAPHED"):
            return call(self, *xs)
    cache.Graphed.__call__ = marked
    prompts = [list(range(1, 40))] if "--batch4" not in sys.argv else [list(range(1, 40 + 7 * i)) for i in range(4)]
    methods = {"chain k=5": lambda: Eagle3Proposer(drafter, topk=1, budget=5, fast=fd),
               "tree 16": lambda: Eagle3Proposer(drafter, topk=4, budget=16, fast=fd),
               "ngram": lambda: PerSequence([NgramProposer(3)])}
    for name, make in methods.items():
        make_b = (lambda: PerSequence([NgramProposer(3) for _ in prompts])) if name == "ngram" else make
        generate(target, make_b(), prompts, 8, depth=5, fast=ft)  # warm-up
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            _, stats = generate(target, make_b(), prompts, 64, depth=5, fast=ft)
        rounds = stats[0].rounds
        top = [e for e in prof.events() if e.cpu_parent is None]
        ops = [e for e in top if e.name != "GRAPHED" and e.name not in VIEWS]
        graphed = sum(e.name == "GRAPHED" for e in top)
        print(f"{name}, batch {len(prompts)}: {rounds} rounds, {graphed / rounds:.1f} graphed calls and "
              f"{len(ops) / rounds:.1f} other non-view ops per round; most: {Counter(e.name for e in ops).most_common(6)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
