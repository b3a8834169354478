"""`draftsmith plan`: is speculative decoding worth it for this target, on this hardware, at these
batch sizes? A prediction before training, from the target's config.json alone (docs/planner.md).

    tokens per step   E = 1 + sum_i prod_{j<=i} a_j          (Leviathan et al., per-position a_j)
    step time         k * t_draft(b) + t_verify(b * (k + 1))  (chain of k drafts, batch b)
    speedup           E * t_verify(b) / step time             (plain decoding emits 1 token per t_verify(b))

t_verify(T) is the target's forward over T tokens. Either measured (`step_costs`, the shape the
evaluate stage writes: {"target_forward_ms": {"1": ms, ...}, "draft_step_ms": ms}) or a roofline:
weight bytes read (MoE: n * (1 - (1 - t/n)^T) distinct experts per layer for T tokens), KV-cache
bytes, FLOPs, and a tensor-parallel AllReduce term (latency + bytes over the interconnect),
optionally calibrated to a measured single-stream decode time and communication share: the cost
model of costmodel.py.

    predict(accept, cost, batch_sizes)  -> {"rows": [...]}: E, step ms, tokens/s, speedup per method
    plan(PlanConfig)                    -> the same, with the cost and acceptance built from flags
"""
from __future__ import annotations

import heapq
import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Optional, Sequence, Union

import yaml

from .fileio import atomic_write_json, read_json
from .manifests import load_manifest
from .messages import DraftsmithError
from .rundir import RECIPE_FILE, stage_dir
from .config import cli_parser
from .figures.evaluate import EvaluateFigures
from .costmodel import HARDWARE, MeasuredCost, RooflineCost, StepCost, drafter_params, expected_tokens, target_spec

# ----------------------------------------------------------------------------- acceptance


def leviathan_tokens(alpha: float, k: int) -> float:
    """Leviathan et al. (2023), eq. 1: expected tokens per step for k drafts at acceptance alpha."""
    return k + 1.0 if alpha == 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def profile(accept: Union[float, Sequence[float]], k: int) -> list[float]:
    """Per-position acceptance for k positions: a constant alpha, or a measured list whose last
    value is repeated past its end (positions never measured are assumed no better)."""
    if isinstance(accept, (int, float)):
        return [float(accept)] * k
    acc = [float(a) for a in accept if a is not None]
    if not acc:
        raise DraftsmithError("acceptance profile: empty; give --alpha or an eval manifest with accept_rate_per_position")
    return (acc + [acc[-1]] * k)[:k]


SIBLING = 0.25
"""The sibling model's correlation factor s (below), measured: on the H200 (2026-12-04, the reference
target, regenerated data, MT-Bench at batch 1) the engine's trees of 16 tokens (depth 5, top-k 4) and
64 tokens (depth 6, top-k 8) reached tau 3.87 and 4.66; from the same run's chain acceptance the model
gives 4.98 and 6.48 at s = 1 (independent siblings), 4.07 and 4.56 at 0.2, 4.19 and 4.76 at 0.3."""


def tree_tokens(accept: Union[float, Sequence[float]], nodes: int, max_depth: int = 16,
                sibling: float = SIBLING) -> tuple[float, int, int]:
    """Expected tokens per verification of the best draft tree with `nodes` draft tokens.

    Model: at depth i the drafter's r-th ranked candidate is the target's token with probability
    a_i (s (1 - a_i))^(r-1) given its parent was: with s = 1 each extra sibling would catch a share
    a_i of what is left, independently of the first; real siblings are correlated (where the
    drafter's first guess is wrong its next ones are worse), and s = SIBLING is what the H200 trees
    measured. A node's value is the product along its path; expanding the best frontier node first
    (values never grow along a path or across siblings) gives the optimal tree for this model.
    Returns (E, depth, widest level)."""
    a = profile(accept, max_depth)
    frontier = [(-a[0], 0, 1, 1.0)]  # (-value, depth, sibling rank, parent's value): the root's first child
    e, depth_count = 1.0, [0] * max_depth
    for _ in range(nodes):
        if not frontier:
            break
        neg, d, r, parent = heapq.heappop(frontier)
        e += -neg
        depth_count[d] += 1
        if a[d] < 1:  # the next sibling
            heapq.heappush(frontier, (-parent * a[d] * (sibling * (1 - a[d])) ** r, d, r + 1, parent))
        if d + 1 < max_depth:  # the first child
            heapq.heappush(frontier, (neg * a[d + 1], d + 1, 1, -neg))
    depth = sum(1 for c in depth_count if c)
    return e, depth, max(depth_count)


def hybrid_tokens(tree_accept: Sequence[float], ngram_accept: Sequence[float]) -> float:
    """Expected tokens per verification of a tree and an n-gram chain in one tree, the two taken as
    independent: a round accepts the longer path, so P(>= j accepted) = 1 - (1 - T_j)(1 - N_j) with
    T_j, N_j the products of each one's per-depth acceptance up to j (0 past its depth)."""
    def reach(a: Sequence[float], j: int) -> float:
        return math.prod(a[:j]) if j <= len(a) else 0.0
    depth = max(len(tree_accept), len(ngram_accept))
    return 1.0 + sum(1 - (1 - reach(tree_accept, j)) * (1 - reach(ngram_accept, j)) for j in range(1, depth + 1))


# ----------------------------------------------------------------------------- prediction


KS = tuple(range(1, 9))
TREE_BUDGETS = (8, 16, 32, 64)


def _row(method: str, batch: int, e: float, step_ms: float, plain_ms: float, **extra) -> dict:
    return {"method": method, "batch": batch, "tokens_per_step": round(e, 4), "step_ms": round(step_ms, 4),
            "tokens_per_s": round(batch * e / step_ms * 1e3, 2), "plain_tokens_per_s": round(batch / plain_ms * 1e3, 2),
            "speedup": round(e * plain_ms / step_ms, 4), **extra}


def predict(accept: Union[float, Sequence[float]], cost: Union[StepCost, dict], batch_sizes: Sequence[int] = (1,),
            ks: Sequence[int] = KS, tree_budgets: Sequence[int] = TREE_BUDGETS,
            ngram_accept: Union[float, Sequence[float], None] = None, ngram_ms: float = 0.0,
            engine_trees: Sequence[tuple[int, int, int]] = (),
            tree_accept: Union[float, Sequence[float], None] = None,
            hybrid_accept: Union[float, Sequence[float], None] = None) -> dict:
    """Predicted tokens per step and speedup of EAGLE-3 chains (k in ks), trees (draft-token
    budgets) and n-gram lookup, per batch size. `cost` is a StepCost or measured step costs
    ({"target_forward_ms": {"1": ms, ...}, "draft_step_ms": ms, optional "by_batch": {b: ...}}).
    Every row is a sequence's view: tokens_per_step per sequence, step_ms for the whole batch.

    `engine_trees` adds rows for the trees the engine actually drafts, (topk, depth, budget) as in
    evaluate.tree_*: depth - 1 expansion steps of topk rows per sequence plus the committed-row feed,
    one verify over budget + 1 rows. Their tokens per step come from `tree_accept` when given (a
    tree's measured per-depth acceptance: E = 1 + sum_j prod_{i<=j} a_i, no model), else from the
    sibling model of tree_tokens.

    With n-gram acceptance and an engine tree, a `hybrid` row per tree: the tree with the best n-gram
    row's k-token chain grafted on, one verify over budget + k + 1 rows. Its tokens per step come from
    `hybrid_accept` (the hybrid's measured per-depth acceptance) when given, else from the tree and
    n-gram paths taken as independent (hybrid_tokens), which overstates it where both catch the
    same text (copies)."""
    if isinstance(cost, dict):
        cost = MeasuredCost.from_json(cost)
    rows = []
    for b in batch_sizes:
        overhead = cost.round_overhead(b) if hasattr(cost, "round_overhead") else 0.0  # measured (MeasuredCost)
        plain = cost.verify_ms(b, b) + (cost.plain_overhead(b) if hasattr(cost, "plain_overhead") else 0.0)
        draft = cost.draft_ms(b)
        for k in ks:
            e = expected_tokens(profile(accept, k))
            rows.append(_row("eagle3-chain", b, e, k * draft + cost.verify_ms(b * (k + 1), b) + overhead, plain, k=k,
                             verified_tokens=k + 1))
        for n in tree_budgets:  # no deeper than the longest chain row: past the measured positions all is extrapolated
            e, depth, width = tree_tokens(accept, n - 1, max_depth=max(ks, default=8))
            # one drafter step per level, each over the widest level's rows per sequence
            step = depth * cost.draft_ms(b, width) + cost.verify_ms(b * n, b) + overhead
            rows.append(_row("eagle3-tree", b, e, step, plain, budget=n, depth=depth, width=width, verified_tokens=n))
        for topk, depth, budget in engine_trees:
            if tree_accept is not None:
                e, source = expected_tokens(profile(tree_accept, depth)), "measured tree acceptance"
            else:
                e, source = tree_tokens(accept, budget, max_depth=depth)[0], f"sibling model (s = {SIBLING})"
            step = (depth - 1) * cost.draft_ms(b, topk) + draft + cost.verify_ms(b * (budget + 1), b) + overhead
            rows.append(_row("eagle3-tree-engine", b, e, step, plain, topk=topk, depth=depth, budget=budget,
                             verified_tokens=budget + 1, tokens_source=source))
        if ngram_accept is not None:
            # a measured profile only to the depth it was measured at: prompt lookup's acceptance past it is unknown
            ngram_ks = ks if isinstance(ngram_accept, (int, float)) else [k for k in ks if k <= len(ngram_accept)] or ks[:1]
            best = max((_row("ngram", b, expected_tokens(profile(ngram_accept, k)),
                             k * ngram_ms + cost.verify_ms(b * (k + 1), b) + overhead, plain, k=k, verified_tokens=k + 1)
                        for k in ngram_ks), key=lambda r: r["speedup"])
            rows.append(best)
            for topk, depth, budget in engine_trees:
                k = best["k"]
                if hybrid_accept is not None:
                    e, source = expected_tokens(profile(hybrid_accept, max(depth, k))), "measured hybrid acceptance"
                else:
                    tree_a = profile(tree_accept if tree_accept is not None else accept, depth)
                    e, source = hybrid_tokens(tree_a, profile(ngram_accept, k)), "tree and n-gram as independent"
                step = ((depth - 1) * cost.draft_ms(b, topk) + draft + k * ngram_ms
                        + cost.verify_ms(b * (budget + k + 1), b) + overhead)
                rows.append(_row("hybrid", b, e, step, plain, topk=topk, depth=depth, budget=budget, k=k,
                                 verified_tokens=budget + k + 1, tokens_source=source))
    best = {}
    for r in rows:
        if r["speedup"] > best.get(r["batch"], {"speedup": 0})["speedup"]:
            best[r["batch"]] = r
    return {"rows": rows, "best": {str(b): r for b, r in best.items()}}


# ----------------------------------------------------------------------------- CLI


@dataclass
class PlanConfig:
    """Predict what speculative decoding buys for a target on given hardware and batch sizes."""

    target: Optional[str] = None
    """Target config.json or model folder (default: the run's recipe target)."""
    run_dir: Optional[str] = None
    """A run directory: acceptance (and step_costs) from its eval manifest; writes RUN_DIR/plan.json."""
    hardware: str = "h200"
    """Hardware preset: h200, h100, a100-pcie, pcie-8x."""
    num_gpus: Optional[int] = None
    """GPUs the target is spread over (tensor parallel); unset: the preset's."""
    mem_bw_gbps: Optional[float] = None
    """Memory bandwidth per GPU, GB/s; unset: the preset's."""
    tflops: Optional[float] = None
    """Dense bf16 TFLOP/s per GPU; unset: the preset's."""
    interconnect_gbps: Optional[float] = None
    """AllReduce bus bandwidth per GPU, GB/s; unset: the preset's."""
    allreduce_latency_us: Optional[float] = None
    """Fixed cost of one small AllReduce, microseconds; unset: the preset's."""
    decode_ms_per_token: Optional[float] = None
    """Measured single-stream decode time per token; calibrates the roofline."""
    comm_share: Optional[float] = None
    """Measured share of a decode step spent in communication (AllReduce), 0..1."""
    step_costs: Optional[str] = None
    """JSON file (or an eval manifest) with measured step costs; replaces the roofline."""
    alpha: Optional[float] = None
    """Assumed acceptance rate per position (default: measured, else 0.7)."""
    accept: Optional[list[float]] = None
    """Per-position acceptance rates (overrides alpha and the eval manifest)."""
    ngram_alpha: float = 0.3
    """Assumed per-position acceptance of n-gram (prompt lookup) drafting, where the run's evaluation
    did not measure it."""
    batch_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])
    """Batch sizes (sequences decoded together) to predict for."""
    context: int = 2048
    """Tokens of KV cache per sequence."""
    draft_vocab_size: int = 32000
    """The drafter's output vocabulary (its lm_head rows), for its step cost."""
    weight_bits: Optional[float] = None
    """Override the bits per weight of every weight (default: from config.json)."""
    expert_weight_bits: Optional[float] = None
    """Override the bits per weight of routed experts."""
    json: bool = False
    """Print JSON instead of tables."""


def _eval_metrics(run_dir: Path) -> tuple[Optional[list[float]], Optional[dict], Optional[str], dict]:
    """(chain acceptance per position, step costs, the manifest's path, the tree: its measured
    acceptance per depth and shape (topk, depth, budget) where the run evaluated eagle3_tree, and the
    per-round acceptance of n-gram and the hybrid where it evaluated them: ngram_accept, hybrid_accept)."""
    m = load_manifest(stage_dir(run_dir, "evaluate"))
    if not m or m.get("status") != "complete":
        return None, None, None, {}
    src = str(stage_dir(run_dir, "evaluate") / "manifest.json")
    ev = EvaluateFigures.from_manifest(m)
    tree = {}
    rates = ev.metrics.accept_rate_per_position_by_method.get("eagle3_tree")
    c = m.get("config") if isinstance(m.get("config"), dict) else {}
    shape = [c.get(k) for k in ("tree_topk", "tree_depth", "tree_budget")]
    if rates and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in shape):
        tree = {"accept": rates, "shape": tuple(shape)}
    # over every round (evaluate's per_round_rates): prompt lookup's rounds without a match count; n-gram's
    # whether or not the run evaluated a tree
    per_round = ev.metrics.accept_rate_per_position_per_round_by_method
    tree.update({f"{k}_accept": per_round[k] for k in ("hybrid", "ngram") if per_round.get(k)})
    return ev.metrics.accept_rate_per_position or None, ev.step_costs or ev.metrics.step_costs, src, tree


def plan(cfg: PlanConfig) -> dict:
    """Build the acceptance profile and the cost model from cfg; predict; say where each input came from."""
    sources: dict[str, str] = {}
    accept, step_costs, tree = None, None, {}
    recipe = {}
    if cfg.run_dir:
        run = Path(cfg.run_dir)
        if (run / RECIPE_FILE).exists():
            recipe = yaml.safe_load((run / RECIPE_FILE).read_text()) or {}
        accept, step_costs, src, tree = _eval_metrics(run)
        if accept:
            sources["accept"] = f"{src}: metrics.accept_rate_per_position"
        if step_costs:
            sources["step_costs"] = f"{src}: step_costs"
        if "shape" in tree:
            sources["tree_accept"] = f"{src}: metrics.accept_rate_per_position_by_method.eagle3_tree"
        for k in ("hybrid", "ngram"):
            if tree.get(f"{k}_accept"):
                sources[f"{k}_accept"] = f"{src}: metrics.accept_rate_per_position_per_round_by_method.{k}"
    target = cfg.target or (recipe.get("target") or {}).get("path")
    if cfg.step_costs:
        d = read_json(cfg.step_costs)
        step_costs = d.get("step_costs") or d.get("metrics", {}).get("step_costs") or d
        sources["step_costs"] = cfg.step_costs
    if cfg.accept:
        accept, sources["accept"] = cfg.accept, "--accept"
    elif cfg.alpha is not None:
        accept, sources["accept"] = cfg.alpha, "--alpha"
    elif not accept:
        accept, sources["accept"] = 0.7, "assumed alpha 0.7 (no evaluation yet; pass --alpha or --run_dir)"
    if accept is None or (not isinstance(accept, float) and not [a for a in accept if a is not None]):
        raise DraftsmithError("acceptance profile is empty; pass --alpha")

    out: dict = {"accept": accept, "sources": sources}
    if step_costs:
        cost: StepCost = MeasuredCost.from_json(step_costs, sources["step_costs"])
        out["cost_model"] = "measured"
    else:
        if not target:
            raise DraftsmithError("no target: pass --target CONFIG.json (or --run_dir of a run whose recipe names it)")
        spec = target_spec(target, cfg.weight_bits, cfg.expert_weight_bits)
        if cfg.hardware not in HARDWARE:
            raise DraftsmithError(f"--hardware {cfg.hardware!r}: unknown; choose one of {', '.join(HARDWARE)}")
        hw = HARDWARE[cfg.hardware]
        over = {k: getattr(cfg, k) for k in ("num_gpus", "mem_bw_gbps", "tflops", "interconnect_gbps",
                                              "allreduce_latency_us") if getattr(cfg, k) is not None}
        hw = replace(hw, **over)
        cost = RooflineCost(spec, hw, cfg.context, drafter_params(spec, cfg.draft_vocab_size, _target_dict(target)))
        if cfg.decode_ms_per_token:
            cost = cost.calibrate(cfg.decode_ms_per_token, cfg.comm_share)
        sources["target"] = str(target)
        out.update(cost_model="roofline", target=asdict(spec), hardware=asdict(cost.hw),
                   drafter_params=cost.drafter_params, weight_gb=round(spec.weight_bytes() / 1e9, 2),
                   plain_decode_ms={str(b): round(cost.verify_ms(b, b), 4) for b in cfg.batch_sizes},
                   comm_share={str(b): round(cost.comm_ms(b, spec.num_layers) / cost.verify_ms(b, b), 4)
                               for b in cfg.batch_sizes})
    if "ngram_accept" not in sources:
        sources["ngram_accept"] = f"--ngram_alpha {cfg.ngram_alpha}"
    out.update(predict(accept, cost, cfg.batch_sizes, ngram_accept=tree.get("ngram_accept", cfg.ngram_alpha),
                       engine_trees=[tree["shape"]] if "shape" in tree else [], tree_accept=tree.get("accept"),
                       hybrid_accept=tree.get("hybrid_accept")))
    return out


def _target_dict(target: str) -> dict:
    p = Path(target)
    return read_json(p / "config.json" if p.is_dir() else p)


def to_table(result: dict) -> str:
    """One table per batch size: chains k=1..8, trees, n-gram."""
    lines = []
    for b in sorted({r["batch"] for r in result["rows"]}):
        lines.append(f"batch {b}" + (f" (plain decode {result['plain_decode_ms'][str(b)]:.2f} ms/step, "
                                       f"{result['comm_share'][str(b)]:.0%} communication)" if "plain_decode_ms" in result else ""))
        lines.append(f"  {'method':<14}{'verified':>9}{'tok/step':>10}{'step ms':>10}{'tok/s':>10}{'speedup':>9}")
        for r in (r for r in result["rows"] if r["batch"] == b):
            label = {"eagle3-chain": f"chain k={r.get('k')}", "eagle3-tree": f"tree {r.get('budget')}",
                     "eagle3-tree-engine": f"tree {r.get('topk')}x{r.get('depth')}/{r.get('budget')}",
                     "ngram": f"n-gram k={r.get('k')}",
                     "hybrid": f"hybrid {r.get('topk')}x{r.get('depth')}/{r.get('budget')}+{r.get('k')}"}[r["method"]]
            lines.append(f"  {label:<14}{r['verified_tokens']:>9}{r['tokens_per_step']:>10.2f}{r['step_ms']:>10.2f}"
                         f"{r['tokens_per_s']:>10.1f}{r['speedup']:>8.2f}x")
        best = result["best"][str(b)]
        lines.append(f"  best: {best['method']} {best.get('k') or best.get('budget')} -> {best['speedup']:.2f}x\n")
    lines.append("inputs: " + "; ".join(f"{k} from {v}" for k, v in result["sources"].items()))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """`draftsmith plan [--target CONFIG] [--run_dir RUN] [--hardware h200] ...`."""
    p = cli_parser("draftsmith plan", PlanConfig.__doc__)
    p.add_class_arguments(PlanConfig, None)
    cfg = PlanConfig(**{k: v for k, v in p.parse_args(argv).as_dict().items() if k in PlanConfig.__dataclass_fields__})
    result = plan(cfg)
    if cfg.run_dir:
        atomic_write_json(Path(cfg.run_dir) / "plan.json", {"config": asdict(cfg), **result})
    print(json.dumps(result, indent=2) if cfg.json else to_table(result))
    return 0


def speedup_at(result: dict, batch: int, k: int) -> Optional[float]:
    """The predicted chain speedup at (batch, k) from a plan result, or None."""
    return next((r["speedup"] for r in result["rows"] if r["method"] == "eagle3-chain" and r["batch"] == batch
                 and r.get("k") == k), None)


__all__ = ["expected_tokens", "leviathan_tokens", "tree_tokens", "hybrid_tokens", "predict", "plan", "PlanConfig", "speedup_at"]
