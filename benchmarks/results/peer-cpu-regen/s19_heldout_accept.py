"""CPU lab (nineteenth session), run from the repository root after the lab's base and held-out runs exist: held-out expected acceptance at T 1 (new) of the drafters the eighteenth session measured sampled."""
import json, sys, time
from pathlib import Path
sys.path.insert(0, "benchmarks")
import bench_ablation as ab
from draftsmith import pipeline
from draftsmith.draft.io import load_drafter
from draftsmith.rundir import stage_dir
O = "--train.batch_tokens 1024 --train.optimizer muon --train.lr 0.003 --train.epochs 4 --evaluate.temperature 1.0".split()
out = {}
for name, flags, old in (("m3e4", O, "m3_e4_samp1_s0.json"), ("m3e4t05", O + ["--train.ttt_target_temperature", "0.5"], "m3_e4_temp05_samp1_s0.json")):
    run = Path("runs/lab/rg4") / f"{name}-s0"
    ab.link_stages(Path("runs/lab/regen-base"), run)
    recipe = ab.recipe_for("benchmarks/recipes/lab_regen.yaml", run, 0, flags)
    t = time.time(); pipeline.run_stage("train", recipe); print(name, "trained", time.time() - t, flush=True)
    ho = ab.heldout_acceptance(load_drafter(run / "train" / "drafter"), stage_dir(Path("runs/lab/regen-heldout"), "capture"),
                               recipe.target.path, 6, recipe.train.max_length)
    row = ab.heldout_row(ho, 5)
    prev = json.load(open(f"benchmarks/results/peer-cpu-regen/{old}"))["ours"][0]
    row.update(old_heldout_acc=prev["heldout_acc"], engine_sampled_t1_chain=prev["tau_chain"], engine_sampled_t1_tree=prev["tau_tree"])
    out[name] = row
    print(name, json.dumps({k: row[k] for k in ("heldout_acc", "old_heldout_acc", "heldout_accept_t1", "tau_sim", "tau_sim_sampled_t1", "engine_sampled_t1_chain")}), flush=True)
json.dump(out, open("/tmp/labcheck.json", "w"), indent=1)
