"""The headline figures of one H200 driver run, from the files its steps leave behind.

    python benchmarks/collect_h200.py benchmarks/results/h200-2026-12-03-driver            # print
    python benchmarks/collect_h200.py benchmarks/results/h200-2026-12-03-driver3 --out benchmarks/results/h200.json
    python benchmarks/collect_h200.py RUN_A RUN_B --out ...   # several runs: a file in a later one replaces the earlier's


Reads the files benchmarks/h200.sh leaves in $OUT, each under its own name or with a call's
prefix (`B-fp8_eval_results.json`; see BENCHMARKS.md for the calls): eval_results.json (the
pipeline's evaluate: MT-Bench, batch 1/4/16), fp8_eval_results.json (where present: the same
pipeline on fp8 captures), k3/k7_eval_results.json (chain k sweeps), humaneval_eval_results.json,
reference_training.json, train_metrics.jsonl, and where present train_manifest.json (the
pipeline's training MFU), bench_capture.json, bench_train.json, bench_train_kimi.json (its Kimi probe replaces
bench_train.json's), bench_train_real_h512/2048/4096.json (training on real captures), regen_manifest.json,
profile_rounds.json, bench_engine.json (engine efficiency at fixed τ on the 8B-shaped pair, and its fraction of
the weight-bandwidth ceiling), verify_rows.json (bench_verify_rows.py: a 16-row verify forward against one row) and
bench_peer.json (the peer at equal data: peer_tau_ratio) and peer_temperatures.json (bench_peer.py --by-temperature:
peer_tau_ratio_T<T>, each temperature against our recipe for it). Every figure is computed here from those files; nothing is typed in."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from draftsmith.fileio import atomic_write_text


def overall(results: dict, method: str) -> dict:
    return results["summary"]["methods"][method]["overall"]


def r3(x: float) -> float:
    return round(float(x), 3)


def find(dirs: list[Path], name: str) -> Path | None:
    """`name`, or the one file named PREFIX-name (a call's copy), in the last of `dirs` that holds one."""
    for d in reversed(dirs):
        hits = [p for p in sorted(d.iterdir()) if p.name == name or p.name.endswith("-" + name)]
        if len(hits) > 1:
            sys.exit(f"{d}: several files named {name}: {', '.join(p.name for p in hits)}; keep one")
        if hits:
            return hits[0]
    return None


def collect(dirs: list[Path], used: dict | None = None) -> dict:
    """The figures from the files of one run, or of several (a file in a later run replaces the
    earlier's); `used` gets each file read by name."""
    used = {} if used is None else used

    def path(name: str, required: bool = True) -> Path | None:
        p = find(dirs, name)
        if p is None and required:
            sys.exit(f"{' '.join(map(str, dirs))}: no {name} (nor PREFIX-{name}); run the driver step that writes it "
                     "(benchmarks/h200.sh)")
        if p is not None:
            used[name] = p.as_posix()
        return p

    def load(name: str, required: bool = True):
        p = path(name, required)
        return None if p is None else json.loads(p.read_text())

    main, fp8 = load("eval_results.json"), load("fp8_eval_results.json", required=False)
    chain, tree, ngram = (overall(main, m) for m in ("eagle3_chain", "eagle3_tree", "ngram"))
    batches = main["summary"]["batches"]
    roof = main["summary"]["roofline"]
    out = {
        "tau_mtbench_chain": r3(chain["tau"]), "tau_mtbench_tree": r3(tree["tau"]),
        "speedup_bs1_chain": r3(chain["speedup"]), "speedup_bs1_tree": r3(tree["speedup"]),
        "speedup_over_tau_bs1": r3(tree["speedup"] / tree["tau"]),
        "speedup_over_tau_bs1_chain": r3(chain["speedup"] / chain["tau"]),
        "ngram_speedup_bs1": r3(ngram["speedup"]), "tau_mtbench_ngram": r3(ngram["tau"]),
        "tau_tree_over_ngram": r3(tree["tau"] / ngram["tau"]),
        "plain_tokens_per_s_bs1": round(main["summary"]["plain"]["tokens_per_s"], 1),
        "plain_decode_bw_fraction_reference": round(roof["fraction_of_measured_bw"], 4),
        "ms_per_round": {m: round(1000 * overall(main, m)["spec_s"] / overall(main, m)["rounds"], 2)
                         for m in ("eagle3_chain", "eagle3_tree", "ngram")},
        "step_costs": {k: main["step_costs"][k] for k in ("target_forward_ms", "draft_step_ms", "round_overhead_ms",
                                                          "plain_overhead_ms")},
        "lossless_bs1": {m: main["summary"]["methods"][m]["lossless"] for m in ("eagle3_chain", "eagle3_tree", "ngram")},
    }
    for b in ("4", "16"):  # batch sizes the pipeline's evaluate ran beside 1
        if b in batches:
            out[f"speedup_bs{b}"] = r3(batches[b]["methods"]["eagle3_tree"]["speedup"])
    if batches:
        out["speedup_by_batch"] = {b: {m: r3(v["speedup"]) for m, v in row["methods"].items()} for b, row in batches.items()}
    big = load("bigtree_eval_results.json", required=False)  # a wider tree (driver step `bigtree`)
    if big:
        o, cfg = overall(big, "eagle3_tree"), big["config"]
        out["bigtree_bs1"] = {"depth": cfg["tree_depth"], "topk": cfg["tree_topk"], "budget": cfg["tree_budget"],
                              "tau": r3(o["tau"]), "speedup": r3(o["speedup"])}
    if fp8:  # the same pipeline and seed on fp8 captures
        loss = {m: r3(100 * (overall(main, m)["tau"] - overall(fp8, m)["tau"]) / overall(main, m)["tau"])
                for m in ("eagle3_chain", "eagle3_tree")}
        out["fp8_tau_loss_pct"] = max(loss.values())
        out["fp8_tau_loss_pct_by_method"] = loss
        out["tau_fp8_captures"] = {m: r3(overall(fp8, m)["tau"]) for m in ("eagle3_chain", "eagle3_tree")}
    ks = {k: load(f"k{k}_eval_results.json", required=False) for k in (3, 7)}  # driver step `ksweep`
    if all(ks.values()):
        sweep = {str(k): overall(ks[k], "eagle3_chain") if k in ks else chain for k in (3, 5, 7)}
        out["chain_k_sweep_mtbench_bs1"] = {k: {"tau": r3(o["tau"]), "speedup": r3(o["speedup"])} for k, o in sweep.items()}
    he = load("humaneval_eval_results.json", required=False)
    if he:
        out["humaneval_bs1"] = {m: {"tau": r3(overall(he, m)["tau"]), "speedup": r3(overall(he, m)["speedup"])}
                                for m in ("eagle3_chain", "eagle3_tree", "ngram")}
    cap = load("bench_capture.json", required=False)  # capture throughput (bench_capture.py)
    if cap:
        out.update({k: cap[k] for k in ("capture_over_forward", "capture_over_forward_fp8", "bytes_per_token_bf16",
                                        "bytes_per_token_fp8", "forward_tokens_per_s", "capture_tokens_per_s_bf16",
                                        "capture_tokens_per_s_fp8")})
        out.update({k: cap[k] for k in ("capture_over_forward_range", "capture_over_forward_fp8_range") if k in cap})
    ref = load("reference_training.json")
    out["reference_target"] = {k: ref[k] for k in ("params", "steps", "train_tokens_seen", "train_seconds", "val_loss", "val_ppl")}
    rows = [json.loads(line) for line in path("train_metrics.jsonl").read_text().splitlines() if line.strip()]
    last = [r for r in rows if "step" in r][-1]
    out["train_steps"], out["train_acc_per_position"] = last["step"], [round(a, 3) for a in last["acc"]]
    tm = load("train_manifest.json", required=False)  # the pipeline's own training run
    if tm:
        m = tm["metrics"]
        out["pipeline_train"] = {"tokens_per_s": round(m["tokens_per_s"], 1), "mfu": round(m["mfu"], 4),
                                 "peak_memory_gib": m["peak_memory_gib"], "steps": m["steps"]}
        engine = (m.get("heldout") or {}).get("engine") or {}
        if engine.get("tau_chain") is not None:  # train's end: the kept drafter on held-out first turns, by the engine
            out["heldout_tau_engine_chain"] = {"tau": r3(engine["tau_chain"]), "prompts": engine["prompts"], "depth": engine["depth"],
                                               "simulated": r3(m["heldout"]["best_tau_simulated"])}
    bt = load("bench_train.json", required=False)  # drafter training throughput at fixed shapes
    if bt:
        out.update({k: bt[k] for k in ("train_mfu_h2048", "train_tokens_per_s_h2048", "train_h2048_seq",
                                       "kimi_max_seq_len", "kimi_stopped")})
        out["train_runs"] = bt["runs"]
        out["kimi_runs"] = bt["kimi_runs"]
    bk = load("bench_train_kimi.json", required=False)  # the Kimi-shaped probe on its own (driver step `kimi`)
    if bk:
        out.update({k: bk[k] for k in ("kimi_max_seq_len", "kimi_stopped", "kimi_runs")})
    for width in (512, 2048, 4096):  # drafter training on real captures (driver step `trainreal`, bench_train.py --capture)
        br = load(f"bench_train_real_h{width}.json", required=False)
        if br:
            out[f"train_mfu_real_h{width}"] = br["mfu"]
            out[f"train_tokens_per_s_real_h{width}"] = br["tokens_per_s"]
            out[f"train_real_h{width}"] = {k: br[k] for k in ("tokens_per_s_min", "tokens_per_s_max", "step_s_median",
                                                                "step_s_spread", "real_token_fraction", "compiled", "recompiles",
                                                                "micro_batch_tokens", "micro_batches_per_step", "ttt_steps",
                                                                "peak_memory_gib", "drafter")}
    rg = load("regen_manifest.json", required=False)  # the target rewrites a subset's answers
    if rg:
        out["regenerate"] = {**rg["counts"], "seconds": rg["timings"]["regenerate_s"],
                             "loss_tokens_per_s": rg["metrics"].get("loss_tokens_per_s"),
                             "max_new_tokens": rg["config"]["max_new_tokens"], "batch_size": rg["config"]["batch_size"]}
    be = load("bench_engine.json", required=False)  # engine efficiency at fixed τ, 8B-shaped pair (driver step `engine`)
    if be and not any("chain" in row["methods"] for row in be["runs"].values()):
        # the planner is calibrated on the chain's rounds: a run without one (e.g. the tree alone) has no planner figures
        be = {k: v for k, v in be.items() if not k.startswith("planner")}
    if be:
        keys = [k for k in be if k.startswith(("engine_eff_8b_", "plain_bw_fraction_8b_", "engine_ceiling_fraction_"))]
        out.update({k: be[k] for k in keys + ["drafter_step_over_target_8b"] if k in be})
        if "planner_max_abs_err_pct" in be:  # chain calibrated per batch size; the tree is the test
            out["planner_max_abs_err_pct"] = be["planner_max_abs_err_pct"]
            out["planner_errors_pct_8b"] = be["planner_errors_pct"]
            out.update({k: be[k] for k in ("planner_tree_max_abs_err_pct", "planner_bs1_max_abs_err_pct") if k in be})
        out["engine_8b_tau_measured"] = {f"bs{b}_{m}_{loop}": r["tau"] for b, row in be["runs"].items()
                                         for m, by in row["methods"].items() for loop, r in by.items()}
        if be.get("skipped"):
            out["engine_8b_skipped"] = be["skipped"]
        if be.get("capture_fallbacks"):  # graphs that failed to capture: those calls were timed eagerly
            out["engine_8b_capture_fallbacks"] = be["capture_fallbacks"]
    vr = load("verify_rows.json", required=False)  # bench_verify_rows.py: a k-row verify forward against one row
    if vr and "verify_rows16_cost_ratio" in vr:
        out["verify_rows16_cost_ratio"] = vr["verify_rows16_cost_ratio"]
        out["verify_rows_cost_ratio"] = vr["verify_rows_cost_ratio"]
        out["verify_rows16_cost_ratio_by_setting"] = vr["rows16_cost_ratio_by_setting"]
        out["verify_rows_plain_ms_per_step"] = vr["plain_ms_per_step"]
    bp = load("bench_peer.json", required=False)  # the peer at equal data (driver step `peer`, bench_peer.py)
    if bp and "partial" in bp:
        sys.exit(f"{used['bench_peer.json']}: a partial bench_peer result ({bp['partial']}: its call was cut); "
                 "run that seed again to its end, or leave the file out")
    if bp:
        out["peer_tau_ratio"] = r3(bp["peer_tau_ratio"])
        out["peer"] = {"ratio_of": bp["peer_tau_ratio_of"], "eval_prompts": bp["eval_prompts"],
                       **({"ratio_ci95": [r3(x) for x in bp["peer_tau_ratio_ci95"]]} if "peer_tau_ratio_ci95" in bp else {}),
                       **{side: {k: (r3(v) if isinstance(v, float) else [r3(a) for a in v])
                                 for k, v in bp[f"{side}_mean"].items()} for side in ("ours", "theirs")},
                       "theirs_steps": [r["steps"] for r in bp["theirs"]], "ours_steps": [r["steps"] for r in bp["ours"]]}
    bt = load("peer_temperatures.json", required=False)  # bench_peer.py --by-temperature: each temperature's recipe
    if bt:
        for T, v in bt["by_temperature"].items():
            out[f"peer_tau_ratio_T{T}"] = r3(v["ratio"])
        out["peer_by_temperature"] = {T: {k: (r3(x) if isinstance(x, float) else x) for k, x in v.items() if k != "ci95"}
                                      | ({"ci95": [r3(x) for x in v["ci95"]]} if "ci95" in v else {})
                                      for T, v in bt["by_temperature"].items()}
    pr = load("profile_rounds.json", required=False)  # where a round's time goes
    if pr:
        out["round_profile"] = {m: {k: v[k] for k in ("rounds", "ms_per_round_profiled", "gpu_busy_ms_per_round")}
                                for m, v in pr["methods"].items()}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dirs", type=Path, nargs="+", help="one run's folder, or several (later ones' files win)")
    ap.add_argument("--out", type=Path, help="write the figures to this JSON file (replaced whole: every key in it comes "
                                            "from this script over one run's files, with the run in `_source`)")
    a = ap.parse_args()
    for d in a.run_dirs:
        if not d.is_dir():
            sys.exit(f"{d}: no such directory; give the folder holding a driver run's files")
    used: dict = {}
    got = collect(a.run_dirs, used)
    dirs = " ".join(d.as_posix() for d in a.run_dirs)
    figures = {"_source": {"run_dirs": [d.as_posix() for d in a.run_dirs], "files": used,
                           "command": f"python benchmarks/collect_h200.py {dirs} --out {a.out.as_posix()}" if a.out else None},
               **got}
    if a.out:
        atomic_write_text(a.out, json.dumps(figures, indent=1) + "\n")  # a kill leaves the old file or the new one
    print(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
