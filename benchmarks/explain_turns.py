"""Explain a finished evaluate stage turn by turn: each turn's EAGLE-3 engine tau beside the drafter's
teacher-forced chain tau on the same tokens (draftsmith.evaluate.explain), and every engine round
checked against the teacher-forced predictions.

    python benchmarks/explain_turns.py RUN_DIR [--dtype float32] [--worst 10] [--out explain.json]

The target and drafter load as evaluate loads them, in --dtype (default float32, TF32 off: the
predictions are then exact, whatever dtype evaluate decoded in; `recipe` keeps the recipe's). Read
the table so: `left at` is the new token where the method's answer left plain decoding's (a bf16
near-tie; `-`: never): its rounds from there are not checked, and its tau measures another answer
(such turns are listed last). Otherwise a turn whose engine chain tau is far below its teacher-forced
tau was lost by the decoding path (numerics, graphs, resident rounds); a turn where both are low is
the drafter's blind spot. With --dtype matching a float32 evaluate, every chain round must equal its
prediction and no tree round may fall below it (exit 1 otherwise).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

from draftsmith.fileio import atomic_write_json, read_json
from draftsmith.manifests import require_complete
from draftsmith.messages import DraftsmithError
from draftsmith.rundir import stage_dir
from draftsmith.config import parse_recipe
from draftsmith.evaluate.explain import explain_turn, predictions
from draftsmith.speculate.methods import load_models
from draftsmith.target.model import resolve_dtype


def explain_run(run_dir: Path, dtype: str = "float32", keys: list[str] | None = None) -> dict:
    recipe, _ = parse_recipe([str(run_dir / "recipe.yaml"), "--run_dir", str(run_dir)])
    eval_dir = stage_dir(run_dir, "evaluate")
    require_complete(eval_dir, "evaluate")
    results_path = eval_dir / "results.json"
    records = {r["key"]: r for r in read_json(results_path)["prompts"]}
    if any("prompt_ids" not in r for r in records.values()):
        raise DraftsmithError(f"{results_path}: written before evaluate kept each turn's prompt ids; rerun evaluate "
                              f"(draftsmith evaluate {run_dir / 'recipe.yaml'} --run_dir {run_dir} --force)")
    missing = [k for k in keys or [] if k not in records]
    if missing:
        raise DraftsmithError(f"{results_path}: no measured turn has the key(s) {', '.join(missing)}; give keys as "
                              f"results.json names them, e.g. {next(iter(records), '(none)')!r}")
    cfg, evaluated_in = recipe.evaluate, recipe.target.dtype
    if cfg.temperature > 0:
        raise DraftsmithError(f"{run_dir / 'recipe.yaml'}: evaluate sampled (evaluate.temperature {cfg.temperature}); teacher-forced "
                              "predictions explain greedy rounds only: evaluate with --evaluate.temperature 0")
    if dtype != "recipe":
        recipe = dataclasses.replace(recipe, target=dataclasses.replace(recipe.target, dtype=dtype))
        if dtype == "float32":
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    target, drafter = load_models(recipe, stage_dir(run_dir, "train") / "drafter")
    k = max(cfg.draft_steps, cfg.tree_depth)
    turns = []
    for rec in records.values():
        if not keys or rec["key"] in keys:
            x = rec["prompt_ids"] + rec["plain_tokens"]
            row = explain_turn(predictions(target, drafter, x, k), x, rec["prompt_tokens"], rec["methods"], cfg.draft_steps)
            turns.append({"key": rec["key"], "prompt_tokens": rec["prompt_tokens"], **row})
    total = {}
    for m in ("eagle3_chain", "eagle3_tree"):
        rows = [t for t in turns if m in t]
        if rows:
            r = [records[t["key"]]["methods"][m] for t in rows]
            total[m] = {"tau": sum(x["emitted"] for x in r) / max(1, sum(x["rounds"] for x in r)),
                        "rounds": sum(t[m]["rounds"] for t in rows),
                        "checked_rounds": sum(t[m]["checked_rounds"] for t in rows),
                        "diverged_turns": sum(t[m]["diverged_at"] is not None for t in rows),
                        "bad_rounds": sum(t[m]["bad_rounds"] for t in rows)}
    tf_rounds = sum(t["rounds_teacher_forced"] for t in turns)
    total["teacher_forced_chain_tau"] = sum(t["new_tokens"] - 1 for t in turns) / max(1, tf_rounds)
    return {"run_dir": str(run_dir), "dtype": dtype_name(target.dtype),
            "evaluate_dtype": dtype_name(resolve_dtype(evaluated_in, target.device)), "depth": cfg.draft_steps,
            "turns": turns, "total": total}


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def gap(t: dict) -> float:
    """The engine chain's tau less the teacher-forced one (most negative: the turn the engine lost most on);
    a chain that left plain decoding's answer decoded other tokens: last."""
    c = t.get("eagle3_chain", {})
    if c.get("tau") is None or c["diverged_at"] is not None:
        return float("inf")
    return c["tau"] - t["tau_teacher_forced"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--dtype", default="float32", help="float32 (default), bfloat16, float16, or recipe")
    ap.add_argument("--keys", nargs="*", help="only these turns (results.json keys, e.g. 'mtbench#56/turn2')")
    ap.add_argument("--worst", type=int, default=10, help="print this many turns, largest engine shortfall first")
    ap.add_argument("--out", help="write the whole result as JSON here")
    args = ap.parse_args(argv)
    try:
        res = explain_run(args.run_dir, args.dtype, args.keys)
    except DraftsmithError as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    print(f"{'turn':32} {'new':>4} {'tf chain':>8} {'chain':>6} {'left at':>7} {'unequal':>7} {'tree':>6} {'left at':>7} {'below':>5}")
    for t in sorted(res["turns"], key=gap)[:args.worst]:
        c, tr = t.get("eagle3_chain", {}), t.get("eagle3_tree", {})
        f = (lambda v: f"{v:.2f}" if isinstance(v, float) else "-")
        d = (lambda v: "-" if v is None else v)
        print(f"{t['key']:32} {t['new_tokens']:>4} {f(t['tau_teacher_forced']):>8} {f(c.get('tau')):>6} {d(c.get('diverged_at')):>7} "
              f"{c.get('bad_rounds', '-'):>7} {f(tr.get('tau')):>6} {d(tr.get('diverged_at')):>7} {tr.get('bad_rounds', '-'):>5}")
    print(json.dumps(res["total"]))
    if args.out:
        atomic_write_json(Path(args.out), res)
    exact = res["dtype"] == res["evaluate_dtype"] == "float32"
    return 1 if exact and any(v.get("bad_rounds") for v in res["total"].values() if isinstance(v, dict)) else 0


if __name__ == "__main__":
    sys.exit(main())
