"""peer_tau_ratio's 95% interval over turns for this session's H200 runs (bench_peer.ratio_interval), from the
[evaluate] lines of their logs: these runs predate bench_peer's per-turn rows, and the logs print each turn's tau
to 2 decimals (rounds = tokens / tau), so the taus come out within 0.01 of the stored ones.
    python benchmarks/results/h200-2026-12-05-s12/turns_ci.py   (from the repository root, PYTHONPATH=src)"""
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_peer  # noqa: E402

D = str(Path(__file__).resolve().parent) + "/"
LINE = re.compile(r"prompt (\d+)( turn 2)?: (\d+) tokens, eagle3_chain tau ([\d.]+) .*eagle3_tree tau ([\d.]+)")

def runs(log):
    rows = [LINE.search(l).groups() for l in open(D + log) if "eagle3_tree tau" in l]
    return [rows[i:i + 32] for i in range(0, len(rows), 32)]

def row(turns):
    return {m: [[f"{q}{t or ''}", int(n), int(n) / float(tau)] for q, t, n, c, tr in turns for tau in [c if m == "eagle3_chain" else tr]]
            for m in ("eagle3_chain", "eagle3_tree")}

ours = [runs("D-peer_muon3.log")[0], runs("E-peer_muon3_s1.log")[0], runs("F-peer_muon3_s2.log")[0]]
theirs = [runs("C-peer.log")[0], runs("E-peer_muon3_s1.log")[1], runs("F-peer_muon3_s2.log")[1]]
res = {"ours": [{"per_turn": row(t)} for t in ours], "theirs": [{"per_turn": row(t)} for t in theirs]}
for key in ("tau_tree", "tau_chain"):
    m = {"tau_tree": "eagle3_tree", "tau_chain": "eagle3_chain"}[key]
    tau = lambda r: sum(x[1] for x in r["per_turn"][m]) / sum(x[2] for x in r["per_turn"][m])
    point = (sum(map(tau, res["ours"])) / 3) / (sum(map(tau, res["theirs"])) / 3)
    print(key, "ours", [round(tau(r), 3) for r in res["ours"]], "theirs", [round(tau(r), 3) for r in res["theirs"]],
          "ratio", round(point, 3), "95%", [round(x, 3) for x in bench_peer.ratio_interval(res, key)[0]])
