"""H200 benchmark of the speculative engine: tau, speedup / tau at batch 1, speedup at batch 4 and 16.

Takes a run directory whose train stage is complete (recipe.yaml + train/drafter) and measures,
in one process, plain decoding against EAGLE-3 chain, EAGLE-3 tree and n-gram (prompt lookup)
on MT-Bench first turns, greedy; every greedy output is checked against plain decoding.

    python benchmarks/bench_speculative.py --run_dir runs/h200-reference --out benchmarks/out/bench_speculative.json
    python benchmarks/bench_speculative.py --run_dir runs/quickstart --smoke     # CPU check, ~1 minute

Keys: tau_mtbench_chain, tau_mtbench_tree, speedup_bs1_chain, speedup_bs1_tree, speedup_over_tau_bs1
(tree: speedup / tau; the EAGLE-3 paper shows 0.72-0.84), speedup_bs4, speedup_bs16 (best EAGLE-3
method at that batch size, both listed under `batches`), ngram_speedup_bs1, step_costs.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from draftsmith.fileio import atomic_write_json# noqa: E402
from draftsmith.speculate.cache import CAPTURE_FALLBACKS  # noqa: E402
from draftsmith.config import EvaluateConfig, Recipe, TargetConfig  # noqa: E402
from draftsmith.data.readers import load_prompts  # noqa: E402
from draftsmith.evaluate.costs import decode_roofline, measure_step_costs  # noqa: E402
from draftsmith.evaluate.measure import evaluate_batch, evaluate_prompt  # noqa: E402
from draftsmith.evaluate.report import fmt, ratio, summarize  # noqa: E402
from draftsmith.evaluate.stage import render_prompt  # noqa: E402
from draftsmith.speculate.methods import DecodeRunners, load_models  # noqa: E402
from draftsmith.target.model import eos_token_ids  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run_dir", required=True)
    ap.add_argument("--out", default=None, help="JSON output (default RUN_DIR/bench_speculative.json)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--benchmark", default="mtbench")
    ap.add_argument("--num_prompts", type=int, default=80)
    ap.add_argument("--max_new_tokens", type=int, default=256)
    ap.add_argument("--draft_steps", type=int, default=6)
    ap.add_argument("--tree_depth", type=int, default=6)
    ap.add_argument("--tree_topk", type=int, default=8)
    ap.add_argument("--tree_budget", type=int, default=48)
    ap.add_argument("--batch_sizes", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--fast", default="auto", help="decoding path of plain and speculative alike: auto, off, static, graphs, compile")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, for a CPU check")
    a = ap.parse_args(argv)
    if a.smoke:
        a.num_prompts, a.max_new_tokens, a.batch_sizes = 4, 24, [2, 4]
        a.tree_topk, a.tree_budget = 4, 12

    run_dir = Path(a.run_dir)
    raw = yaml.safe_load((run_dir / "recipe.yaml").read_text())
    t = raw.get("target", {})
    recipe = Recipe(target=TargetConfig(path=t["path"], device=a.device, dtype=a.dtype,
                                        trust_remote_code=bool(t.get("trust_remote_code", False)),
                                        aux_layer_ids=t.get("aux_layer_ids")))
    cfg = EvaluateConfig(max_new_tokens=a.max_new_tokens, draft_steps=a.draft_steps, tree_depth=a.tree_depth,
                         tree_topk=a.tree_topk, tree_budget=a.tree_budget, methods=["eagle3_chain", "eagle3_tree", "ngram"])
    target, drafter = load_models(recipe, run_dir / "train" / "drafter")
    runners = DecodeRunners(target, drafter, a.fast)
    print(f"[bench] decoding path: {runners.mode}", flush=True)
    eos = eos_token_ids(target)
    prompts = [render_prompt(target.tokenizer, p.turns[0], f"{a.benchmark}: {p.id}")
               for p in load_prompts(a.benchmark, a.num_prompts)]
    methods = cfg.methods
    t0 = time.perf_counter()

    # warm-up (allocator, kernels, cuBLAS heuristics) on every method and batch shape
    warm = replace(cfg, max_new_tokens=16)
    evaluate_prompt(target, drafter, prompts[0], warm, methods, eos, 0, "warm-up", runners=runners)
    for B in a.batch_sizes:
        evaluate_batch(target, drafter, (prompts * B)[:B], [[]] * B, warm, methods, eos, 0, runners=runners)

    records = []
    for i, ids in enumerate(prompts):
        rec = evaluate_prompt(target, drafter, ids, cfg, methods, eos, i, f"{a.benchmark}: prompt {i}", runners=runners)
        records.append({"benchmark": a.benchmark, **rec})
        print(f"[bench] prompt {i + 1}/{len(prompts)}: " + ", ".join(
            f"{m} tau {fmt(r['emitted'] / max(r['rounds'], 1))} x{fmt(rec['plain_s'] / r['spec_s'])}"
            for m, r in rec["methods"].items()), flush=True)
    batch_records = []
    for B in a.batch_sizes:
        for j in range(0, len(prompts) - B + 1, B):
            batch_records.append(evaluate_batch(target, drafter, prompts[j:j + B],
                                                   [r["plain_tokens"] for r in records[j:j + B]], cfg, methods, eos, j,
                                                   runners=runners))
    summary = summarize(records, batch_records, cfg, methods)
    m = {k: s["overall"] for k, s in summary["methods"].items()}
    best = {B: max((row["methods"][x]["speedup"] or 0) for x in ("eagle3_chain", "eagle3_tree"))
            for B, row in summary["batches"].items()}
    out = {
        "tau_mtbench_chain": m["eagle3_chain"]["tau"], "tau_mtbench_tree": m["eagle3_tree"]["tau"],
        "speedup_bs1_chain": m["eagle3_chain"]["speedup"], "speedup_bs1_tree": m["eagle3_tree"]["speedup"],
        "speedup_over_tau_bs1": ratio(m["eagle3_tree"]["speedup"], m["eagle3_tree"]["tau"]),
        "speedup_over_tau_bs1_chain": ratio(m["eagle3_chain"]["speedup"], m["eagle3_chain"]["tau"]),
        "speedup_bs4": best.get("4"), "speedup_bs16": best.get("16"),
        "ngram_speedup_bs1": m["ngram"]["speedup"], "tau_ngram": m["ngram"]["tau"],
        "tokens_per_s_plain_bs1": summary["plain"]["tokens_per_s"],
        "batches": summary["batches"],
        "lossless": {k: s.get("lossless") for k, s in summary["methods"].items()},
        "path": runners.mode,
        "roofline_bs1": decode_roofline(target, summary["plain"]["tokens_per_s"]),
        "step_costs": measure_step_costs(target, drafter, prompts[0] + records[0]["plain_tokens"], runners=runners),
        "config": {**vars(a), "device_name": torch.cuda.get_device_name() if target.device.type == "cuda" else "cpu",
                   "dtype_resolved": str(target.dtype), "torch": torch.__version__},
        "wall_s": time.perf_counter() - t0,
        "capture_fallbacks": list(CAPTURE_FALLBACKS),  # captures that went eager: those calls' timings are eager
    }
    path = Path(a.out) if a.out else run_dir / "bench_speculative.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, out)
    print(json.dumps({k: v for k, v in out.items() if not isinstance(v, dict)}, indent=1))
    print(f"[bench] wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
