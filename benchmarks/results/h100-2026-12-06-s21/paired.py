"""The twenty-first session's H100 files: a T 1 drafter trained on answers the target regenerated greedily (g) or
sampled at temperature 1 (s), the engine at temperature 1, 0.7 and greedy. Each row's figures, then paired ratios of
tau over the same 160 turns (bootstrap over turns, 2,000 draws, ratio of sum emitted / sum rounds):
python benchmarks/results/h100-2026-12-06-s21/paired.py"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from paired_turns import paired  # noqa: E402

D = Path(__file__).parent
FILES = {("g", "1"): "C3-g-t1-at1.json", ("s", "1"): "C3-s-t1-at1.json", ("g", "0.7"): "C5-g-t1-at07.json",
         ("s", "0.7"): "C5-s-t1-at07.json", ("g", "0"): "C4-g-t1-at0.json", ("s", "0"): "C4-s-t1-at0.json"}


def row(data, t):
    return json.load(open(D / FILES[(data, t)]))["variants"]["t1"]["runs"][0]


def turns(data, t, m):  # [key, emitted, rounds] per turn
    return {k: (e, n) for k, e, n in row(data, t)["per_turn"][m]}



for t in ("1", "0.7", "0"):
    for data in ("g", "s"):
        r = row(data, t)
        ng = f", n-gram {r['ngram_tau']:.3f} / {r['ngram_speedup']:.2f}x" if "ngram_tau" in r else ""
        print(f"T {t:>3} answers {'greedy ' if data == 'g' else 'sampled'}: chain {r['tau_chain']:.3f} / "
              f"{r['speedup_chain']:.2f}x, tree {r['tau_tree']:.3f} / {r['speedup_tree']:.2f}x{ng}; held-out acc@0 "
              f"{r['heldout_acc'][0]:.3f}, tau_sim {r['tau_sim']:.3f}, tau_sim_sampled_t1 {r.get('tau_sim_sampled_t1', float('nan')):.3f}")
for t in ("1", "0.7", "0"):
    for m in ("eagle3_chain", "eagle3_tree"):
        paired(f"temperature {t}: {m[7:]}, sampled answers / greedy answers", turns("s", t, m), turns("g", t, m))
