"""Where a speculative round's time goes: torch.profiler over a few rounds of evaluate's own path.

Takes a run directory whose train stage is complete, decodes one prompt per method with the
recipe's evaluate settings (same FastTarget / FastDraft path as `draftsmith evaluate`), once to
warm up and once under the profiler, and writes per method: milliseconds per round, the GPU's
busy time per round (the union of kernel intervals, graph replays included), and the top host
ops by self CPU time. The gap between the two is the host work the GPU waits for.

    python benchmarks/profile_rounds.py RECIPE.yaml --out profile.json     # the GPU figures
    python benchmarks/profile_rounds.py recipes/quickstart.yaml --max_new_tokens 24   # CPU check
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from draftsmith.config import parse_recipe  # noqa: E402
from draftsmith.data.readers import load_prompts  # noqa: E402
from draftsmith.evaluate.measure import run_method  # noqa: E402
from draftsmith.evaluate.stage import render_prompt  # noqa: E402
from draftsmith.speculate.methods import DecodeRunners, load_models  # noqa: E402
from draftsmith.target.model import eos_token_ids  # noqa: E402


def busy_ms(events) -> float:
    """Union of the device kernels' [start, end) intervals, in ms (overlaps counted once)."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    total, cur_s, cur_e = 0.0, None, None
    for s, e in spans:
        if cur_e is None or s > cur_e:
            total += 0 if cur_e is None else cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    total += 0 if cur_e is None else cur_e - cur_s
    return total / 1000.0  # profiler times are in us


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipe")
    ap.add_argument("--out", default=None)
    ap.add_argument("--max_new_tokens", type=int, default=128)
    ap.add_argument("--methods", nargs="+", default=["eagle3_chain", "eagle3_tree", "ngram"])
    ap.add_argument("--top", type=int, default=15)
    a = ap.parse_args(argv)
    recipe, _ = parse_recipe([a.recipe])
    cfg = recipe.evaluate
    target, drafter = load_models(recipe, Path(recipe.run_dir) / "train" / "drafter")
    runners = DecodeRunners(target, drafter, cfg.fast)
    eos = eos_token_ids(target)
    p = load_prompts(cfg.benchmarks[0], 1)[0]
    prompt = render_prompt(target.tokenizer, p.turns[0], f"{cfg.benchmarks[0]}: {p.id}")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if target.device.type == "cuda" else [])
    result = {"recipe": a.recipe, "decoding_path": runners.mode, "max_new_tokens": a.max_new_tokens, "methods": {}}
    for method in a.methods:
        run_method(target, drafter, method, [prompt], cfg, eos, max_new_tokens=a.max_new_tokens, runners=runners)
        t0 = time.perf_counter()
        with profile(activities=acts) as prof:
            _, stats, _ = run_method(target, drafter, method, [prompt], cfg, eos, max_new_tokens=a.max_new_tokens,
                                        runners=runners)
        wall = 1000 * (time.perf_counter() - t0)
        rounds = stats[0].rounds
        table = sorted(prof.key_averages(), key=lambda k: k.self_cpu_time_total, reverse=True)[:a.top]
        r = {"rounds": rounds, "tau": round(stats[0].tau or 0, 3), "ms_per_round_profiled": round(wall / rounds, 3),
             "gpu_busy_ms_per_round": round(busy_ms(prof.events()) / rounds, 3) if len(acts) > 1 else None,
             "top_self_cpu": [{"op": k.key, "calls_per_round": round(k.count / rounds, 2),
                               "self_cpu_ms_per_round": round(k.self_cpu_time_total / 1000 / rounds, 4)} for k in table]}
        result["methods"][method] = r
        print(f"[profile] {method}: {rounds} rounds, {r['ms_per_round_profiled']} ms/round under the profiler, "
              f"GPU busy {r['gpu_busy_ms_per_round']} ms/round", flush=True)
        for row in r["top_self_cpu"][:8]:
            print(f"    {row['self_cpu_ms_per_round']:8.4f} ms  {row['calls_per_round']:7.2f}x  {row['op']}", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
