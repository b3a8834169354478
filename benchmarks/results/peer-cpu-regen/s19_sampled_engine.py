"""Lab: our engine at temperature 1 on the retrained T 1 drafter, chain and tree, with this code (sampled trees)."""
import json, sys
from pathlib import Path
sys.path.insert(0, "benchmarks")
import bench_ablation as ab
O = "--train.batch_tokens 1024 --train.optimizer muon --train.lr 0.003 --train.epochs 4 --evaluate.temperature 1.0".split()
args = type("A", (), dict(eval_prompts=20, max_new_tokens=96, draft_steps=5, benchmark="mtbench"))()
name, flags = sys.argv[1], O + sys.argv[2:]
row = ab.engine_taus(args, "benchmarks/recipes/lab_regen.yaml", Path("runs/lab/rg4") / f"{name}-s0", 0, flags)
print(name, json.dumps({k: row[k] for k in ("tau_chain", "tau_tree", "speedup_chain", "speedup_tree")}), flush=True)
json.dump(row, open(f"/tmp/labeng-{name}.json", "w"))
