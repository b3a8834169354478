"""Paired ratios of tau over the same 160 turns (bootstrap over turns, 2,000 draws, ratio of sum emitted / sum rounds)
for the twentieth session's H100 files: python benchmarks/results/h100-2026-12-06-s20/paired.py"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from paired_turns import paired  # noqa: E402

D = Path(__file__).parent


def from_peer(f, side, m):  # a bench_peer file's per_turn rows: [key, emitted, rounds]
    return {k: (e, n) for k, e, n in json.load(open(D / f))[side][0]["per_turn"][m]}


def from_eval(f, m):  # an evaluate results.json
    return {p["key"]: (p["methods"][m]["emitted"], p["methods"][m]["rounds"]) for p in json.load(open(D / f))["prompts"]}



C, T1, T07 = "C-t1s-s0-bench_peer.json", "D-t1-ngram-results.json", "D-t07-results.json"
paired("temperature 1: tree / chain", from_peer(C, "ours", "eagle3_tree"), from_peer(C, "ours", "eagle3_chain"))
paired("temperature 1: tree / n-gram", from_peer(C, "ours", "eagle3_tree"), from_eval(T1, "ngram"))
paired("temperature 1: ours tree / peer tree", from_peer(C, "ours", "eagle3_tree"), from_peer(C, "theirs", "eagle3_tree"))
paired("temperature 0.7: tree / chain", from_eval(T07, "eagle3_tree"), from_eval(T07, "eagle3_chain"))
paired("temperature 0.7: tree / n-gram", from_eval(T07, "eagle3_tree"), from_eval(T07, "ngram"))
paired("greedy: ours tree / peer tree", from_peer("B-ours-s0-bench_peer.json", "ours", "eagle3_tree"),
       from_peer("B-ours-s0-bench_peer.json", "theirs", "eagle3_tree"))
