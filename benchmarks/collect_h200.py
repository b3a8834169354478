"""The headline figures of one H200 driver run, from the files its steps leave behind.

    python benchmarks/collect_h200.py benchmarks/results/h200-2026-12-03-driver            # print
    python benchmarks/collect_h200.py benchmarks/results/h200-2026-12-03-driver --update benchmarks/results/h200.json

Reads (prefixes are the GPU calls of the run, see BENCHMARKS.md): C-eval_results.json (the
pipeline's evaluate: MT-Bench, batch 1/4/16), B-fp8_eval_results.json (the same pipeline on fp8
captures), B-k3/B-k7_eval_results.json (chain k sweeps), C-humaneval_eval_results.json,
A-reference_training.json, A-train_metrics.jsonl and E-bench_capture.json. Every figure is computed here from those
files; nothing is typed in."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def overall(results: dict, method: str) -> dict:
    return results["summary"]["methods"][method]["overall"]


def r3(x: float) -> float:
    return round(float(x), 3)


def collect(d: Path) -> dict:
    load = lambda name: json.loads((d / name).read_text())  # noqa: E731
    main, fp8 = load("C-eval_results.json"), load("B-fp8_eval_results.json")
    chain, tree, ngram = (overall(main, m) for m in ("eagle3_chain", "eagle3_tree", "ngram"))
    batches = main["summary"]["batches"]
    roof = main["summary"]["roofline"]
    out = {
        "tau_mtbench_chain": r3(chain["tau"]), "tau_mtbench_tree": r3(tree["tau"]),
        "speedup_bs1_chain": r3(chain["speedup"]), "speedup_bs1_tree": r3(tree["speedup"]),
        "speedup_over_tau_bs1": r3(tree["speedup"] / tree["tau"]),
        "speedup_over_tau_bs1_chain": r3(chain["speedup"] / chain["tau"]),
        "ngram_speedup_bs1": r3(ngram["speedup"]), "tau_mtbench_ngram": r3(ngram["tau"]),
        "speedup_bs4": r3(batches["4"]["methods"]["eagle3_tree"]["speedup"]),
        "speedup_bs16": r3(batches["16"]["methods"]["eagle3_tree"]["speedup"]),
        "speedup_by_batch": {b: {m: r3(v["speedup"]) for m, v in row["methods"].items()} for b, row in batches.items()},
        "plain_tokens_per_s_bs1": round(main["summary"]["plain"]["tokens_per_s"], 1),
        "plain_decode_bw_fraction_reference": round(roof["fraction_of_measured_bw"], 4),
        "ms_per_round": {m: round(1000 * overall(main, m)["spec_s"] / overall(main, m)["rounds"], 2)
                         for m in ("eagle3_chain", "eagle3_tree", "ngram")},
        "step_costs": {k: main["step_costs"][k] for k in ("target_forward_ms", "draft_step_ms", "round_overhead_ms",
                                                          "plain_overhead_ms")},
        "lossless_bs1": {m: main["summary"]["methods"][m]["lossless"] for m in ("eagle3_chain", "eagle3_tree", "ngram")},
    }
    loss = {m: r3(100 * (overall(main, m)["tau"] - overall(fp8, m)["tau"]) / overall(main, m)["tau"])
            for m in ("eagle3_chain", "eagle3_tree")}
    out["fp8_tau_loss_pct"] = max(loss.values())
    out["fp8_tau_loss_pct_by_method"] = loss
    out["tau_fp8_captures"] = {m: r3(overall(fp8, m)["tau"]) for m in ("eagle3_chain", "eagle3_tree")}
    sweep = {}
    for k, name in ((3, "B-k3_eval_results.json"), (5, None), (7, "B-k7_eval_results.json")):
        o = chain if name is None else overall(load(name), "eagle3_chain")
        sweep[str(k)] = {"tau": r3(o["tau"]), "speedup": r3(o["speedup"])}
    out["chain_k_sweep_mtbench_bs1"] = sweep
    he = load("C-humaneval_eval_results.json")
    out["humaneval_bs1"] = {m: {"tau": r3(overall(he, m)["tau"]), "speedup": r3(overall(he, m)["speedup"])}
                            for m in ("eagle3_chain", "eagle3_tree", "ngram")}
    if (d / "E-bench_capture.json").exists():  # capture throughput (random-weight target, bench_capture.py)
        cap = load("E-bench_capture.json")
        out.update({k: cap[k] for k in ("capture_over_forward", "capture_over_forward_fp8", "bytes_per_token_bf16",
                                        "bytes_per_token_fp8", "forward_tokens_per_s", "capture_tokens_per_s_bf16",
                                        "capture_tokens_per_s_fp8")})
    ref = load("A-reference_training.json")
    out["reference_target"] = {k: ref[k] for k in ("params", "steps", "train_tokens_seen", "train_seconds", "val_loss", "val_ppl")}
    rows = [json.loads(line) for line in (d / "A-train_metrics.jsonl").read_text().splitlines() if line.strip()]
    last = [r for r in rows if "step" in r][-1]
    out["train_steps"], out["train_acc_per_position"] = last["step"], [round(a, 3) for a in last["acc"]]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--update", type=Path, help="merge the figures into this JSON file")
    a = ap.parse_args()
    figures = collect(a.run_dir)
    if a.update:
        data = json.loads(a.update.read_text()) if a.update.exists() else {}
        data.update(figures)
        a.update.write_text(json.dumps(data, indent=1) + "\n")
    print(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
