"""CPU lab (twenty-first session): the twentieth session's comparison at another training seed. Two drafters
(the same m3e4 flags, seed SEED), one on answers the tiny target regenerated greedily (runs/lab/regen-base), one
on answers it sampled at T 1 (runs/lab/regen-base-t1); held-out figures on both held-out captures; our engine at
each temperature given (20 MT-Bench questions x 2 turns, chain and tree, evaluate.seed 0) with the per-turn
counts for a paired ratio. Run from a checkout's root:
    OMP_NUM_THREADS=2 PYTHONPATH=src:benchmarks python benchmarks/results/peer-cpu-regen/s21_seed.py OUT.json SEED 1.0 0.0
A rerun continues: every part already in OUT.json is kept (pipeline fingerprints keep the trained drafters)."""
import json
import sys
import time
from pathlib import Path

import bench_ablation as ab
from draftsmith import pipeline
from draftsmith.fileio import read_json
from draftsmith.rundir import stage_dir
from draftsmith.draft.io import load_drafter

R, LAB = "benchmarks/recipes/lab_regen.yaml", Path("runs/lab")
FLAGS = "--train.batch_tokens 1024 --train.optimizer muon --train.lr 0.003 --train.epochs 4".split()
ARGS = type("A", (), dict(eval_prompts=20, max_new_tokens=96, draft_steps=5, benchmark="mtbench"))()
DATA = {"greedy_regen": LAB / "regen-base", "sampled_regen": LAB / "regen-base-t1"}
HELDOUT = {"greedy": LAB / "regen-heldout", "sampled_t1": LAB / "regen-heldout-t1"}

out_path, seed, temps = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:] or ["1.0", "0.0"]
out = read_json(out_path) if out_path.exists() else {"seed": seed, "flags": FLAGS, "commands": [" ".join(sys.argv)]}
save = lambda: out_path.write_text(json.dumps(out, indent=1))  # noqa: E731
for name, base in DATA.items():
    run_dir = LAB / f"s21/{name}-m3e4-s{seed}"
    ab.link_stages(base, run_dir)
    recipe = ab.recipe_for(R, run_dir, seed, FLAGS)
    t = time.time()
    m = pipeline.run_stage("train", recipe)
    out.setdefault("train", {}).setdefault(name, {"steps": m["counts"]["steps"], "loss": m["metrics"]["loss"],
                                                   "wall_s": round(time.time() - t, 1)})
    for h, hd in HELDOUT.items():
        key = f"{name}|{h}"
        if key not in out.setdefault("heldout", {}):
            ho = ab.heldout_acceptance(load_drafter(run_dir / "train/drafter"), stage_dir(hd, "capture"), recipe.target.path, 6,
                                       recipe.train.max_length)
            out["heldout"][key] = ab.heldout_row(ho, 5)
    save()
    for T in temps:
        key = f"{name}|T{T}"
        if key not in out.setdefault("engine", {}):
            t = time.time()
            out["engine"][key] = {**ab.engine_taus(ARGS, R, run_dir, seed, FLAGS + ["--evaluate.temperature", T]),
                                  "wall_s": round(time.time() - t, 1)}
            e = out["engine"][key]
            print(f"{key}: chain {e['tau_chain']:.3f} tree {e['tau_tree']:.3f}", flush=True)
            save()
