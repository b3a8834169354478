"""What train's end-of-training engine measurement costs: on a finished run directory (offline,
with capture/), rebuild train's held-out prompts and time heldout.engine_record (target load
included) for several prompt counts; the same prompts, drafter and decoding as the train stage.

    python benchmarks/bench_heldout_engine.py /tmp/qs --prompts 16 8 4

Prints one line per count: seconds, tau, target verifications (rounds).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from draftsmith.fileio import read_json
from draftsmith.config import parse_recipe
from draftsmith.train.data import CaptureIndex
from draftsmith.data.conversations import conversation_keys
from draftsmith.train.heldout import engine_prompts, engine_record, heldout_count, split_by_conversation


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--prompts", type=int, nargs="+", default=[16, 8])
    args = ap.parse_args()
    recipe = parse_recipe([str(args.run_dir / "recipe.yaml")])[0]
    capture = read_json(args.run_dir / "capture" / "manifest.json")
    train = read_json(args.run_dir / "train" / "manifest.json")
    max_length = recipe.train.max_length  # train's cut: packed samples also to the micro-batch
    if recipe.train.batch_layout == "packed":
        max_length = min(max_length, train["counts"]["micro_batch_tokens"])
    index = CaptureIndex([args.run_dir / "capture" / s["file"] for s in capture["shards"]], max_length,
                         capture["hidden_size"], len(capture["aux_layer_ids"]))
    keys = conversation_keys(index.source_id, index.sample_index)
    _, held = split_by_conversation(keys, heldout_count(recipe.train.heldout_samples, len(index)), recipe.seed)
    prompts = engine_prompts(keys, index.input_ids, index.loss_mask, held)
    print(f"{len(index)} samples, {len(held)} held out in {len({keys[j] for j in held})} conversations, {len(prompts)} prompts")
    for n in args.prompts:
        recipe.train.heldout_engine_prompts = n
        t0 = time.time()
        rec = engine_record(recipe, args.run_dir / "train" / "drafter", prompts, None)
        print(f"prompts {n}: {time.time() - t0:.1f} s, tau {rec.get('tau_chain')}, rounds {rec.get('rounds')}"
              + (f", skipped: {rec['skipped']}" if "skipped" in rec else ""))


if __name__ == "__main__":
    main()
