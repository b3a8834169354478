"""Paired ratios of tau over the same 160 turns (bootstrap over turns, 2,000 draws, ratio of sum emitted / sum rounds)
for the twentieth session's H100 files: python benchmarks/results/h100-2026-12-06-s20/paired.py"""
import json
import random
from pathlib import Path

D = Path(__file__).parent


def from_peer(f, side, m):  # a bench_peer file's per_turn rows: [key, emitted, rounds]
    return {k: (e, n) for k, e, n in json.load(open(D / f))[side][0]["per_turn"][m]}


def from_eval(f, m):  # an evaluate results.json
    return {p["key"]: (p["methods"][m]["emitted"], p["methods"][m]["rounds"]) for p in json.load(open(D / f))["prompts"]}


def paired(name, a, b):
    keys = sorted(a)
    assert set(keys) == set(b), name
    def ratio(ks):
        return (sum(a[k][0] for k in ks) / sum(a[k][1] for k in ks)) / (sum(b[k][0] for k in ks) / sum(b[k][1] for k in ks))
    rnd = random.Random(0)
    draws = sorted(ratio([rnd.choice(keys) for _ in keys]) for _ in range(2000))
    print(f"{name}: {ratio(keys):.3f} (95% {draws[50]:.3f}-{draws[1949]:.3f}, {len(keys)} turns)")


C, T1, T07 = "C-t1s-s0-bench_peer.json", "D-t1-ngram-results.json", "D-t07-results.json"
paired("temperature 1: tree / chain", from_peer(C, "ours", "eagle3_tree"), from_peer(C, "ours", "eagle3_chain"))
paired("temperature 1: tree / n-gram", from_peer(C, "ours", "eagle3_tree"), from_eval(T1, "ngram"))
paired("temperature 1: ours tree / peer tree", from_peer(C, "ours", "eagle3_tree"), from_peer(C, "theirs", "eagle3_tree"))
paired("temperature 0.7: tree / chain", from_eval(T07, "eagle3_tree"), from_eval(T07, "eagle3_chain"))
paired("temperature 0.7: tree / n-gram", from_eval(T07, "eagle3_tree"), from_eval(T07, "ngram"))
paired("greedy: ours tree / peer tree", from_peer("B-ours-s0-bench_peer.json", "ours", "eagle3_tree"),
       from_peer("B-ours-s0-bench_peer.json", "theirs", "eagle3_tree"))
