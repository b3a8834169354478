"""Resident rounds against the host loop, in one process: the same target, drafter, prompts and
decoding path; per batch size and method, tau, speedup over plain decoding and ms per round of
both loops. Each batch of prompts runs plain, then every (method, loop) pair, so drift hits all
alike; outputs are compared with plain decoding (greedy). `capture_fallbacks` in the JSON lists every
CUDA-graph capture that failed and ran eagerly instead (empty when every graph was captured).

    python benchmarks/bench_resident.py RECIPE.yaml --out bench_resident.json       # the GPU figures
    python benchmarks/bench_resident.py recipes/quickstart.yaml --num_prompts 2 --max_new_tokens 24 \
        --batch_sizes 1 2 --fast static                                            # CPU check
    python benchmarks/bench_resident.py RECIPE.yaml --compile_round --out x.json     # + resident rounds with
                                                 # evaluate.compile_round: on (a third loop, same process)
    python benchmarks/bench_resident.py RECIPE.yaml --temperature 0.7 --out x.json   # sampled: both loops draw
                                                 # (outputs differ from plain's by design: `identical` is left out)
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from draftsmith.fileio import atomic_write_json# noqa: E402
from draftsmith.config import parse_recipe  # noqa: E402
from draftsmith.data.readers import load_prompts  # noqa: E402
from draftsmith.evaluate.costs import decode_roofline  # noqa: E402
from draftsmith.evaluate.measure import evaluate_batch, run_method, run_plain  # noqa: E402
from draftsmith.evaluate.stage import render_prompt  # noqa: E402
from draftsmith.speculate.methods import DecodeRunners, load_models  # noqa: E402
from draftsmith.speculate.cache import CAPTURE_FALLBACKS  # noqa: E402
from draftsmith.target.model import eos_token_ids  # noqa: E402

LOOPS = {"host": (False, "off"), "resident": (True, "off")}
"""name -> (evaluate.resident, evaluate.compile_round); --compile_round adds resident_compiled."""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipe")
    ap.add_argument("--out", default=None)
    ap.add_argument("--num_prompts", type=int, default=16)
    ap.add_argument("--max_new_tokens", type=int, default=128)
    ap.add_argument("--batch_sizes", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--methods", nargs="+", default=["eagle3_chain", "eagle3_tree"])
    ap.add_argument("--fast", default=None, help="override evaluate.fast")
    ap.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    ap.add_argument("--compile_round", action="store_true",
                    help="also resident rounds with evaluate.compile_round: on (the round's pure parts compiled), same process")
    a = ap.parse_args(argv)
    n_fallbacks = len(CAPTURE_FALLBACKS)  # this run's captures that fell back to eager: CAPTURE_FALLBACKS[n_fallbacks:]
    recipe, _ = parse_recipe([a.recipe])
    cfg = replace(recipe.evaluate, max_new_tokens=a.max_new_tokens, temperature=a.temperature)
    if a.fast:
        cfg = replace(cfg, fast=a.fast)
    target, drafter = load_models(recipe, Path(recipe.run_dir) / "train" / "drafter")
    runners = DecodeRunners(target, drafter, cfg.fast)
    eos = eos_token_ids(target)
    bench = cfg.benchmarks[0]
    prompts = [render_prompt(target.tokenizer, p.turns[0], f"{bench}: {p.id}") for p in load_prompts(bench, a.num_prompts)]
    print(f"[bench_resident] path {runners.mode}, {len(prompts)} prompts of {bench}, {a.max_new_tokens} new tokens", flush=True)
    t0 = time.perf_counter()
    loops = dict(LOOPS, **({"resident_compiled": (True, "on")} if a.compile_round else {}))
    cfgs = {name: replace(cfg, resident=flag, compile_round=cr) for name, (flag, cr) in loops.items()}
    for B in a.batch_sizes:  # warm-up at the measured length: graphs captured (and round parts compiled), every loop
        for c in cfgs.values():
            evaluate_batch(target, drafter, (prompts * B)[:B], [[]] * B, c, a.methods, eos, 0, runners=runners)
    result = {"recipe": a.recipe, "path": runners.mode, "max_new_tokens": a.max_new_tokens, "num_prompts": len(prompts),
              "temperature": a.temperature,
              "device": torch.cuda.get_device_name() if target.device.type == "cuda" else "cpu",
              "torch": torch.__version__, "batches": {}}
    for B in a.batch_sizes:
        acc = {"plain_s": 0.0, "plain_tokens": 0}
        per = {(m, n): {"spec_s": 0.0, "rounds": 0, "emitted": 0, "identical": 0, "sequences": 0}
               for m in a.methods for n in loops}
        for j in range(0, len(prompts) - B + 1, B):
            chunk = prompts[j:j + B]
            plain, plain_s = run_plain(target, chunk, cfg, eos, None, runners)
            acc["plain_s"] += plain_s
            acc["plain_tokens"] += sum(map(len, plain))
            for m in a.methods:
                for n, c in cfgs.items():
                    new, stats, s = run_method(target, drafter, m, chunk, c, eos, runners=runners)
                    r = per[(m, n)]
                    r["spec_s"] += s
                    r["rounds"] += max(st.rounds for st in stats)  # batch rounds: the longest sequence's
                    r["emitted"] += sum(sum(st.emitted_per_round) for st in stats)
                    r["identical"] += sum(x == y for x, y in zip(new, plain))
                    r["sequences"] += len(new)
        row = {"plain_tokens_per_s": round(acc["plain_tokens"] / acc["plain_s"], 1), "methods": {}}
        if B == 1:
            row["plain_roofline"] = decode_roofline(target, row["plain_tokens_per_s"])
        for (m, n), r in per.items():
            row["methods"].setdefault(m, {})[n] = {
                "tau": round(r["emitted"] / max(r["rounds"], 1), 3) if B == 1 else None,
                "speedup": round(acc["plain_s"] / r["spec_s"], 3),
                "ms_per_round": round(1000 * r["spec_s"] / max(r["rounds"], 1), 3),
                "identical": f"{r['identical']}/{r['sequences']}" if a.temperature <= 0 else None}
            if B == 1:
                x = row["methods"][m][n]
                x["speedup_over_tau"] = round(x["speedup"] / x["tau"], 3)
        result["batches"][str(B)] = row
        print(f"[bench_resident] batch {B}: plain {row['plain_tokens_per_s']} tok/s; " + "; ".join(
            f"{m} {n} x{v['speedup']} ({v['ms_per_round']} ms/round, {v['identical']} identical)"
            for m, d in row["methods"].items() for n, v in d.items()), flush=True)
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    result["capture_fallbacks"] = CAPTURE_FALLBACKS[n_fallbacks:]  # empty when every CUDA graph was captured
    if result["capture_fallbacks"]:
        print(f"[bench_resident] WARNING: {len(result['capture_fallbacks'])} CUDA-graph capture(s) fell back to eager; "
              "those calls' timings are eager ones (capture_fallbacks in the JSON)", flush=True)
    if a.out:
        atomic_write_json(a.out, result)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
