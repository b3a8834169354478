"""Engine efficiency at realistic costs: speedup ÷ τ of speculative rounds with τ fixed by an oracle,
on an 8B-shaped target and an 8B-class EAGLE-3 drafter (issue 20 item 1).

    python benchmarks/bench_engine.py --out bench_engine.json                 # H200, bf16, graphs: --budget_s 170 of
                                                                              # measuring, ~200 s with the build
    python benchmarks/bench_engine.py --small --out /tmp/e.json               # CPU smoke: tiny dims, static caches
    python benchmarks/bench_engine.py --bound_only [--draft_steps 3]          # the ceiling below, anywhere (meta device)
    python benchmarks/bench_engine.py --project benchmarks/results/h200-2026-12-05-s7/C-bench_engine.json
                                       # the planner's chain speedup / tau by draft steps from that run's costs

What is real and what is not
    target   a Llama-3-8B-shaped model (H 4096, 32 layers, 32 heads / 8 KV heads, MLP 14336, vocab 128256),
             random weights built directly on the GPU in bf16 (16 GB, seconds; nothing is read from disk),
             made decisive (`decisive`: greedy decoding follows a fixed token permutation by a wide margin)
    drafter  an EAGLE-3 drafter for it (one layer at H 4096, draft vocab 32000), random weights
    drafts   the drafter really runs: every round the proposer calls Eagle3Proposer.expand, i.e.
             the drafter's steps, its top-k and the frontier choice, inside the same graph as always
             (the host loop's graphed expansion, the resident round's graph). Only then are its
             outputs (tokens, scores, parents) replaced by an oracle's, in tensor ops on the device:
             a tree (chain: K = 1) whose first-child path carries the target's true next tokens
             down to depth τ - 1 and a wrong token at depth τ; every sibling is wrong. So each
             round accepts exactly τ - 1 drafts and emits τ tokens while paying the full drafting
             cost; tree selection, verification, acceptance and the cache moves are the engine's own.
    truth    the oracle's "true next tokens" are the plain decoding's output on the same fast path,
             then refined once to the speculative run's own output (in bf16 a verify forward over
             many rows may round a near-tie differently from a one-row step; the second pass then
             proposes what the verify rows really produce). τ is MEASURED from the round
             statistics, and efficiency divides by the measured τ, not the set one.

Per batch size (1, 4, 16), method (chain k = --draft_steps; tree --tree_topk/--tree_budget/--draft_steps)
and loop (host = engine.generate's host loop; resident = every round on the device, one graph):

    speedup      plain_s / spec_s: plain decoding on the same FastTarget (its graphed loop, same KV
                 cache, same process) against speculative decoding of the same prompts and token count
    engine_eff   speedup / measured τ
    plain_bw     the plain baseline's fraction of the memory-bandwidth limit (evaluate/costs.decode_roofline:
                 weight bytes per step × steps/s over a measured device copy bandwidth)
    planner      plan.predict's speedup from this process's measured step costs (evaluate/costs.
                 measure_step_costs: target forward and drafter step at every batch size) and the
                 round/plain overheads measured as evaluate does at each batch size (from that loop's
                 chain: the calibration point, error ~0 by construction; the tree is the test), with
                 the measured acceptance per position (tree: per depth); error % = 100 (predicted -
                 measured) / measured. Also planner_bs1 (batch-1 costs scaled: the old planner) and
                 planner_no_overhead (forwards and drafter steps alone).

Headline keys (the resident loop, the device path; `_host` keys beside them for the host loop):
engine_eff_8b_bs{1,4,16}_{chain,tree}, plain_bw_fraction_8b_bs{1,4,16}, drafter_step_over_target_8b,
planner_max_abs_err_pct (over both methods and every batch size measured, resident loop; the tree's
alone: planner_tree_max_abs_err_pct; the old batch-1 planner's: planner_bs1_max_abs_err_pct), plus raw
timings under "runs". engine_eff_bound_8b: the ceiling of speedup / τ when every step is weight-bandwidth
bound (weight_bound: bytes of a plain step over bytes of a round; "by_draft_steps" 1..--draft_steps) -- at the
default 5 draft steps no engine reaches 0.81 with this pair, at 3 steps 0.87. With --profile, step_profiles: the
kernels of a target forward over 1 and draft_steps + 1 tokens and of a drafter step over 1 and --tree_topk rows
(batch 1), beside the plain step's and the rounds'. With --small the `8b` in every key is `small`. --budget_s stops starting new
configurations once spent (what ran is written; the rest is listed in "skipped"). capture_fallbacks: every
CUDA-graph capture of this run that failed, so that call ran eagerly (speculate.cache.CAPTURE_FALLBACKS;
empty when every graph was captured; a non-empty list means those figures are not the graphed path's).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from draftsmith.draft import flash_decode as flash  # noqa: E402
from draftsmith.fileio import atomic_write_json  # noqa: E402
from draftsmith.config import DraftConfig  # noqa: E402
from draftsmith.draft.build import drafter_config  # noqa: E402
from draftsmith.draft.model import Eagle3Drafter  # noqa: E402
from draftsmith.evaluate.costs import decode_roofline, measure_step_costs  # noqa: E402
from draftsmith.evaluate.measure import timed  # noqa: E402
from draftsmith.speculate.methods import DecodeRunners  # noqa: E402
from draftsmith.plan import predict  # noqa: E402
from draftsmith.speculate.cache import CAPTURE_FALLBACKS  # noqa: E402
from draftsmith.speculate.eagle3 import Eagle3Proposer  # noqa: E402
from draftsmith.speculate.engine import generate, plain_generate_batch  # noqa: E402
from draftsmith.target.model import Target  # noqa: E402

CONFIGS = {
    # Llama-3-8B: the shapes that set the cost of a forward
    "8b": dict(hidden_size=4096, num_layers=32, heads=32, kv_heads=8, intermediate=14336, vocab=128256,
               draft_vocab=32000, init_std=None),
    # CPU smoke: tiny dims
    "small": dict(hidden_size=64, num_layers=4, heads=4, kv_heads=2, intermediate=128, vocab=512,
                  draft_vocab=200, init_std=0.2),
}


# ----------------------------------------------------------------------------- models


def build_target(dims: dict, device: torch.device, dtype: torch.dtype, seed: int, random: bool = True) -> Target:
    """A random-weight Llama of `dims`, built on `device` directly (no CPU copy, no disk); random=False
    leaves the weights as built (decisive skipped: the meta device's, for --bound_only)."""
    from transformers import LlamaConfig, LlamaForCausalLM  # why here: seconds to import

    cfg = LlamaConfig(vocab_size=dims["vocab"], hidden_size=dims["hidden_size"], intermediate_size=dims["intermediate"],
                      num_hidden_layers=dims["num_layers"], num_attention_heads=dims["heads"],
                      num_key_value_heads=dims["kv_heads"], max_position_embeddings=8192, rope_theta=500000.0,
                      rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(cfg, dtype=dtype)
    if random:
        decisive(model, dims["init_std"] or 0.02, seed)
    model.eval().requires_grad_(False)
    t = Target(model, None)
    t._install_final_hook()
    return t


@torch.no_grad()
def decisive(model, std: float, seed: int) -> None:
    """Random weights whose greedy next token is a fixed permutation of the current one, by a wide
    margin: embeddings N(0, 1), lm_head rows the embeddings permuted, each layer's output projections
    (o_proj, down_proj) 64x smaller than its others, so the residual stream stays the current token's
    embedding. Same shapes and kernels as any random Llama (the cost is what is measured), but the
    next token no longer hangs on bf16 near-ties. With plain N(0, 0.02) weights the tree and batch-4
    runs measured tau 1.2-1.4 instead of the set 3 (H200, 2026-12-04); the likely cause: a batched
    verify and a one-token step round a near-tie differently, and after one flip the run never meets
    the oracle's truth again (not yet re-measured with this target)."""
    for name, p in model.named_parameters():
        if p.dim() == 2:
            p.normal_(0, std / 64 if name.endswith(("o_proj.weight", "down_proj.weight")) else std)
    emb = model.get_input_embeddings().weight
    emb.normal_(0, 1)
    perm = torch.randperm(emb.shape[0], generator=torch.Generator().manual_seed(seed)).to(emb.device)
    model.lm_head.weight[perm] = emb  # greedy: token t -> perm[t]


def build_drafter(target: Target, dims: dict, seed: int) -> Eagle3Drafter:
    """An EAGLE-3 drafter shaped for `target` (draft.build.drafter_config), random weights made on
    the target's device in its dtype, the embedding shared with the target, a random draft vocab."""
    dev, V, Vd = target.device, target.vocab_size, dims["draft_vocab"]
    cfg = drafter_config(target.config, DraftConfig(), Vd, target.aux_layer_ids)
    gen = torch.Generator(device=dev).manual_seed(seed)
    with torch.device(dev):
        d = Eagle3Drafter(cfg).to(target.dtype)
    std = dims["init_std"] or 0.02
    with torch.no_grad():
        for name, p in d.named_parameters():
            if p.dim() == 2 and not name.startswith("embed_tokens"):
                p.copy_(torch.randn(p.shape, generator=gen, device=dev, dtype=torch.float32).to(p.dtype) * std)
        d.embed_tokens.weight.copy_(target.input_embeddings())
        chosen = torch.sort(torch.randperm(V, generator=gen, device=dev)[:Vd]).values
        d.d2t.copy_(chosen - torch.arange(Vd, device=dev))
        d.t2d.zero_()
        d.t2d[chosen] = True
    return d.eval().requires_grad_(False)


# ----------------------------------------------------------------------------- the oracle


def oracle_tree(table: torch.Tensor, rows: torch.Tensor, K: int, D: int, tau: int, vocab: int):
    """(toks, scores, parents) [B, K + (D-1)K²] in Eagle3Proposer.expand's layout (depth 1: K
    candidates; each further depth: K blocks of K children of the frontier), tensor ops only.
    The frontier at every depth is the first block's children; the first child of the first block
    carries table[b, rows_b + depth] (the true next token) for depth < tau and a wrong token from
    depth tau on; every other candidate is wrong (true + a distinct offset, mod vocab). Scores fall
    by 0.1 per depth along the first-child path and by 0.5 per sibling rank, so a budget of >= D
    nodes holds the whole path and the set is closed under ancestors."""
    B, dev = rows.shape[0], rows.device
    W = table.shape[1]
    ks = torch.arange(K, device=dev)
    toks, scores, parents = [], [], []
    front = front_score = None
    n_prev = 0
    for depth in range(1, D + 1):
        true = table.gather(1, (rows + depth).clamp(max=W - 1)[:, None])[:, 0]           # [B]
        width = 1 if depth == 1 else K
        off = 1 + torch.arange(width, device=dev)[:, None] * K + ks[None]               # [width, K], 1..width*K
        kid = (true[:, None, None] + off[None]) % vocab                                  # all wrong
        if depth < tau:  # (no `first[0, 0] = True`: a CPU-to-GPU copy, which a CUDA graph cannot capture)
            first = (torch.arange(width * K, device=dev) == 0).view(width, K)
            kid = torch.where(first[None], true[:, None, None], kid)
        if depth == 1:
            s = (-0.1 - 0.5 * ks.float())[None, None].expand(B, 1, K)
            par = torch.full((B, 1, K), -1, dtype=torch.long, device=dev)
        else:
            s = front_score[:, :, None] - 0.1 - 0.5 * ks.float()[None, None]
            par = front[:, :, None].expand(B, K, K)
        toks.append(kid.reshape(B, -1))
        scores.append(s.reshape(B, -1))
        parents.append(par.reshape(B, -1))
        front = (n_prev + ks)[None].expand(B, K)                                          # the first block
        front_score = s[:, 0]
        n_prev += width * K
    return torch.cat(toks, 1), torch.cat(scores, 1), torch.cat(parents, 1)


class OracleEagle(Eagle3Proposer):
    """Eagle3Proposer whose expansion runs for real (its cost is paid, in the same graph as always)
    and whose outputs are then replaced by `oracle_tree`'s. `table` [B, W] holds prompt +
    continuation per sequence; it must stay the same tensor for a FastDraft (graphs read it in
    place), refilled between generations."""

    def __init__(self, drafter, table: torch.Tensor, tau: int, vocab: int, **kw):
        super().__init__(drafter, **kw)
        self.table, self.tau, self.vocab = table, tau, vocab

    def expand(self, K, D, sampled, step, g_last, rows):
        super().expand(K, D, sampled, step, g_last, rows)  # the drafter's steps, top-k, frontier: the real cost
        toks, scores, parents = oracle_tree(self.table, rows, K, D, self.tau, self.vocab)
        return toks, scores, parents, None


def fill(table: torch.Tensor, seqs: list[list[int]]) -> None:
    table.zero_()
    for b, s in enumerate(seqs):
        table[b, :len(s)] = torch.tensor(s[:table.shape[1]], device=table.device)


# ----------------------------------------------------------------------------- measurement


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


def accept_profile(stats, depth: int) -> list[float]:
    """Per-position acceptance over every sequence: accepted[j] / reached[j] (evaluate's definition)."""
    out = []
    for j in range(depth):
        reached = sum(s.reached[j] for s in stats)
        out.append(sum(s.accepted[j] for s in stats) / reached if reached else 0.0)
    return out


def weight_bound(target: Target, drafter: Eagle3Drafter, steps: int, rows: int) -> dict:
    """The most speedup / τ any engine can reach at these shapes when every step is weight-bandwidth
    bound, as bytes: a plain step reads the target's weights once; a round reads them once for
    `rows` verify rows per sequence (costmodel.target_spec: dense weights, the lm_head, the experts
    those rows touch), the drafter's layer and head once per draft step (a round runs `steps` of them:
    its expansion's steps and the feed of the accepted rows) and its fc once. KV-cache and activation
    bytes are left out (a few per cent at these contexts), so the figure is a ceiling, not a model.
    Per draft step count 1..steps, batch 1."""
    from draftsmith.costmodel import target_spec
    from draftsmith.evaluate.costs import replace_bytes

    spec = replace_bytes(target_spec(target.model.config.to_dict()), target.dtype)
    per_step = sum(p.numel() * p.element_size() for n, p in drafter.named_parameters()
                   if n.split(".")[0] in ("midlayer", "norm", "lm_head"))
    fc = drafter.fc.weight.numel() * drafter.fc.weight.element_size()
    plain, verify = spec.bytes_read(1), spec.bytes_read(rows)
    return {"target_gb_per_step": round(plain / 1e9, 3), "drafter_gb_per_step": round(per_step / 1e9, 4),
            "drafter_step_over_target_bytes": round(per_step / plain, 4),
            "by_draft_steps": {str(k): round(plain / (verify + k * per_step + fc), 4) for k in range(1, steps + 1)}}


def kernel_profile(fn, per: int, top: int = 15) -> dict:
    """Where one step's GPU time goes: torch.profiler over fn() (already warmed up), the CUDA kernels
    grouped by name, divided by `per` (the steps or rounds fn runs): per-step milliseconds, launches per
    step, and the share of the kernels' total; the top `top` by time, and the sums."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        if us > 0:
            rows.append((e.key, us / 1000 / per, e.count / per))
    total = sum(ms for _, ms, _ in rows) or 1.0
    rows.sort(key=lambda r: -r[1])
    return {"kernel_ms_per_step": round(total, 4), "launches_per_step": round(sum(n for _, _, n in rows), 1),
            "top": [{"kernel": k[:120], "ms": round(ms, 4), "launches": round(n, 2), "share": round(ms / total, 4)}
                    for k, ms, n in rows[:top]]}


def project(run: dict) -> dict:
    """The planner's chain speedup ÷ τ at τ = the run's tau_set for every draft-step count that can
    commit it (τ - 1 .. the run's draft_steps), per batch size the run measured, from the run's own
    measured costs (its planner_inputs: step costs per batch size and the round overhead measured on
    its chain at its draft_steps, held fixed here -- the expansion's own logic per extra step is in
    the drafter step's cost). A projection from measurements, not a measurement."""
    tau, D = int(run["tau_set"]), int(run["draft_steps"])
    costs = run["planner_inputs"][run["planner_loop"]]["planner"]
    out = {}
    for B in sorted(int(b) for b in run["runs"]):
        row = {}
        for k in range(max(tau - 1, 1), D + 1):
            pred = predict([1.0] * (tau - 1) + [0.0] * (k - tau + 1), costs, [B], ks=[k], tree_budgets=[])["rows"][0]
            row[str(k)] = round(pred["speedup"] / pred["tokens_per_step"], 4)
        out[f"bs{B}"] = row
    return {"tau_set": tau, "loop": run["planner_loop"], "speedup_over_tau_by_draft_steps": out}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="tiny dims on the CPU (float32, static caches): a smoke run")
    ap.add_argument("--out", default=None)
    ap.add_argument("--tau", type=int, default=3, help="tokens per round the oracle makes happen (accepted drafts + 1)")
    ap.add_argument("--batch_sizes", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--methods", nargs="+", default=["chain", "tree"], choices=["chain", "tree"])
    ap.add_argument("--loops", nargs="+", default=["resident", "host"], choices=["resident", "host", "compiled"],
                    help="compiled: resident rounds with evaluate.compile_round on (the round's pure parts by inductor)")
    ap.add_argument("--profile", action="store_true",
                    help="after the batch-1 runs: the top CUDA kernels of one plain step and one round per method and loop")
    ap.add_argument("--draft_steps", type=int, default=5, help="chain k and tree depth (evaluate's defaults)")
    ap.add_argument("--tree_topk", type=int, default=4)
    ap.add_argument("--tree_budget", type=int, default=16)
    ap.add_argument("--prompt_len", type=int, default=None, help="default 128 (8b), 12 (small)")
    ap.add_argument("--max_new_tokens", type=int, default=None, help="default 128 (8b), 20 (small)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per configuration (median)")
    ap.add_argument("--fast", default=None, help="decoding path: graphs (GPU default) or static (CPU default)")
    ap.add_argument("--budget_s", type=float, default=170.0, help="start no new configuration after this many seconds")
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float32"], help="default bfloat16 (GPU), float32 (CPU)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--verify_gemm", default="auto", choices=["auto", "cublas", "skinny"],
                    help="evaluate.verify_gemm for plain and speculative forwards alike (auto: skinny where it runs)")
    ap.add_argument("--bound_only", action="store_true",
                    help="print the weight-bandwidth ceiling of speedup / tau (weight_bound) and stop: the models on "
                         "the meta device, no GPU, nothing timed")
    ap.add_argument("--project", metavar="RUN_JSON", default=None,
                    help="print the planner's chain speedup / tau by draft steps from that bench_engine run's measured "
                         "costs (project) and stop: nothing timed")
    ap.add_argument("--no_cudnn_sdpa", action="store_true",
                    help="torch's cuDNN attention backend off (SDPA picks flash / memory-efficient / math instead)")
    a = ap.parse_args(argv)
    t_start = time.perf_counter()
    n_fallbacks = len(CAPTURE_FALLBACKS)  # this run's captures that fell back to eager: CAPTURE_FALLBACKS[n_fallbacks:]
    name = "small" if a.small else "8b"
    dims = CONFIGS[name]
    if a.tau < 1 or a.tau > a.draft_steps + 1:
        print(f"--tau {a.tau}: needs 1 <= tau <= draft_steps + 1 ({a.draft_steps + 1})", file=sys.stderr)
        return 2
    if a.project:
        print(json.dumps(project(json.loads(Path(a.project).read_text())), indent=1))
        return 0
    if a.bound_only:
        dtype = getattr(torch, a.dtype or "bfloat16")
        with torch.device("meta"):
            target = build_target(dims, torch.device("meta"), dtype, a.seed, random=False)
            drafter = Eagle3Drafter(drafter_config(target.config, DraftConfig(), dims["draft_vocab"],
                                                   target.aux_layer_ids)).to(dtype)
        bound = weight_bound(target, drafter, a.draft_steps, a.draft_steps + 1)
        print(json.dumps({"config": name, "dims": dims, "dtype": str(dtype).replace("torch.", ""),
                          "draft_steps": a.draft_steps, f"engine_eff_bound_{name}": bound["by_draft_steps"][str(a.draft_steps)],
                          "weight_bound": bound}, indent=1))
        return 0
    cuda = torch.cuda.is_available() and not a.small
    if not a.small and not cuda:
        print("bench_engine: the 8B-shaped pair needs a CUDA GPU; run with --small for the CPU smoke", file=sys.stderr)
        return 2
    dev = torch.device("cuda" if cuda else "cpu")
    if a.no_cudnn_sdpa:
        torch.backends.cuda.enable_cudnn_sdp(False)
    dtype = getattr(torch, a.dtype) if a.dtype else (torch.bfloat16 if cuda else torch.float32)
    mode = a.fast or ("graphs" if cuda else "static")
    P = a.prompt_len or (128 if not a.small else 12)
    max_new = a.max_new_tokens or (128 if not a.small else 20)
    D = a.draft_steps
    shapes = {"chain": (1, D), "tree": (a.tree_topk, a.tree_budget)}

    target = build_target(dims, dev, dtype, a.seed)
    drafter = build_drafter(target, dims, a.seed + 1)
    V = target.vocab_size
    runners = DecodeRunners(target, drafter, mode, verify_gemm=a.verify_gemm)
    t_built = time.perf_counter() - t_start
    print(f"[bench_engine] {name}: target {sum(p.numel() for p in target.model.parameters()) / 1e9:.2f}B params, "
          f"drafter {sum(p.numel() for p in drafter.parameters() if p is not drafter.embed_tokens.weight) / 1e6:.0f}M "
          f"(+ shared embedding), {dtype}, path {runners.mode}, built in {t_built:.1f} s", flush=True)

    gen = torch.Generator().manual_seed(a.seed)
    all_prompts = torch.randint(3, V, (max(a.batch_sizes), P), generator=gen).tolist()

    # step costs on this path (what `plan` predicts from), at batch 1 and at every batch size measured
    profiles: dict[str, dict] = {}

    def probe(kind: str, batch: int, n: int, step) -> None:  # --profile: a target forward and a drafter step
        if batch == 1 and (kind, n) in (("target", 1), ("target", D + 1), ("draft", 1), ("draft", a.tree_topk)):
            profiles[f"{kind}_{n}"] = kernel_profile(step, 1)

    costs = measure_step_costs(target, drafter, all_prompts[0], repeats=5, runners=runners,
                               batch_sizes=a.batch_sizes, tree_topk=a.tree_topk,
                               probe=probe if a.profile and cuda else None)
    fwd1 = costs["target_forward_ms"]["1"]
    result = {"config": name, "dims": dims, "device": torch.cuda.get_device_name() if cuda else "cpu",
              "dtype": str(dtype).replace("torch.", ""), "path": runners.mode, "torch": torch.__version__,
              "verify_gemm": runners.verify_gemm, "flash_decode": flash.ENABLED and flash.triton is not None and cuda,
              "cudnn_sdpa": torch.backends.cuda.cudnn_sdp_enabled(), "tau_set": a.tau, "prompt_len": P, "max_new_tokens": max_new, "draft_steps": D,
              "tree": {"topk": a.tree_topk, "budget": a.tree_budget, "depth": D},
              "tau_expected": round((max_new - 1) / math.ceil((max_new - 1) / a.tau), 4),
              "step_costs": costs, "build_s": round(t_built, 1), "runs": {}, "skipped": [],
              "capture_fallbacks": CAPTURE_FALLBACKS[n_fallbacks:]}
    result[f"drafter_step_over_target_{name}"] = round(costs["draft_step_ms"] / fwd1, 4)
    if profiles:
        result["step_profiles"] = profiles
    bound = result["weight_bound"] = weight_bound(target, drafter, D, D + 1)
    result[f"engine_eff_bound_{name}"] = bound["by_draft_steps"][str(D)]
    print(f"[bench_engine] weight-bandwidth ceiling of speedup / tau at {D} draft steps: "
          f"{result[f'engine_eff_bound_{name}']:.3f} (by draft steps: {bound['by_draft_steps']})", flush=True)
    print(f"[bench_engine] target forward {fwd1:.3f} ms (1 token), drafter step {costs['draft_step_ms']:.3f} ms "
          f"({result[f'drafter_step_over_target_{name}']:.3f} of it)", flush=True)

    tables: dict[int, torch.Tensor] = {}
    for B in a.batch_sizes:
        prompts = all_prompts[:B]
        ft, fd = runners.get(B)
        if ft is None:
            print("bench_engine: no fast path for this target", file=sys.stderr)
            return 2
        # which attention the target's forwards ran: draft.attention.decode_attention, or the model's own (runs before 2026-12-04 s4)
        result.setdefault("target_attention", "decode_attention" if ft.attn_configs else "model's own")
        result.setdefault("cache_columns", {})[str(B)] = ft.S  # allocated; before 2026-12-05 attention read all of them, masked
        table = tables.setdefault(B, torch.zeros(B, P + max_new + D + 2, dtype=torch.long, device=dev))
        ref = plain_generate_batch(target, prompts, max_new, fast=ft)  # warm-up: captures the plain graph; the oracle's first truth
        result.setdefault("attention_columns", {})[str(B)] = ft.W  # what the forwards read (FastTarget.attend)
        plain_ts = [timed(target, lambda: plain_generate_batch(target, prompts, max_new, fast=ft))[1] for _ in range(a.repeats)]
        plain_s = median(plain_ts)
        tok_s = B * max_new / plain_s
        roof = decode_roofline(target, tok_s, batch=B)
        row = {"plain_s": round(plain_s, 5), "plain_s_all": [round(x, 5) for x in plain_ts],
               "plain_tokens_per_s": round(tok_s, 1), "plain_ms_per_step": round(1000 * plain_s / max_new, 4),
               "roofline": roof, "methods": {}}
        result[f"plain_bw_fraction_{name}_bs{B}"] = round(roof["fraction_of_measured_bw"], 4)
        if a.profile and cuda and B == 1:
            row["profile"] = kernel_profile(lambda: plain_generate_batch(target, prompts, max_new, fast=ft), max_new - 1)
        print(f"[bench_engine] batch {B}: plain {tok_s:.1f} tok/s ({row['plain_ms_per_step']:.3f} ms/step, "
              f"{roof['fraction_of_measured_bw']:.2f} of the measured bandwidth limit)", flush=True)
        for method in a.methods:
            K, budget = shapes[method]
            for loop in a.loops:
                if time.perf_counter() - t_start > a.budget_s:
                    result["skipped"].append(f"bs{B}_{method}_{loop}")
                    continue

                def run():
                    prop = OracleEagle(drafter, table, a.tau, V, topk=K, budget=budget, fast=fd)
                    return generate(target, prop, prompts, max_new, depth=D, fast=ft, resident=loop != "host",
                                    compile_round=loop == "compiled")

                fill(table, [p + r for p, r in zip(prompts, ref)])
                first, _ = run()                                  # warm-up: graphs captured
                fill(table, [p + r for p, r in zip(prompts, first)])  # the truth as the verify rows produce it
                times, outs = [], None
                for _ in range(a.repeats):
                    outs, s = timed(target, run)
                    times.append(s)
                new, stats = outs
                spec_s = median(times)
                rounds = max(st.rounds for st in stats)
                tau = sum(sum(st.emitted_per_round) for st in stats) / sum(st.rounds for st in stats)
                speedup = plain_s / spec_s
                row["methods"].setdefault(method, {})[loop] = r = {
                    "spec_s": round(spec_s, 5), "spec_s_all": [round(x, 5) for x in times], "rounds": rounds,
                    "ms_per_round": round(1000 * spec_s / rounds, 4), "tau": round(tau, 4),
                    "accept_per_position": [round(x, 4) for x in accept_profile(stats, D)],
                    "speedup": round(speedup, 4), "engine_eff": round(speedup / tau, 4),
                    "speedup_over_tau_set": round(speedup / a.tau, 4),
                    "equal_to_plain": f"{sum(x == y for x, y in zip(new, ref))}/{B}"}
                result[f"engine_eff_{name}_bs{B}_{method}{'' if loop == 'resident' else '_' + loop}"] = r["engine_eff"]
                r["ceiling_fraction"] = round(r["engine_eff"] / result[f"engine_eff_bound_{name}"], 4)
                if loop == "resident":  # issue 50: speedup / tau against the weight-bandwidth ceiling of it
                    result[f"engine_ceiling_fraction_bs{B}_{method}"] = r["ceiling_fraction"]
                if a.profile and cuda and B == 1:
                    r["profile"] = kernel_profile(lambda: run(), rounds)
                print(f"[bench_engine] batch {B} {method} {loop}: tau {tau:.3f}, x{speedup:.3f}, "
                      f"eff {r['engine_eff']:.3f}, {r['ms_per_round']:.3f} ms/round", flush=True)
        result["runs"][str(B)] = row
        result["capture_fallbacks"] = CAPTURE_FALLBACKS[n_fallbacks:]
        if a.out:  # what ran so far survives a kill past the step's time limit (the planner comes at the end)
            atomic_write_json(a.out, result)

    # headline keys and the planner. Three cost inputs, each with the measured acceptance per position
    # (chain: its profile; tree: the tree's per-depth profile, plan.predict's engine_trees rows):
    #   planner             what `draftsmith plan --run_dir` predicts after evaluate at these batch sizes: the
    #                       step costs measured at each batch size, and the round/plain overheads measured
    #                       there from this loop's chain (so the chain is the calibration point: its error is
    #                       ~0 by construction at every batch size; the tree's error is the test)
    #   planner_bs1         the batch-1 costs and overheads only, scaled to other batch sizes (the old planner)
    #   planner_no_overhead the measured forwards and drafter steps alone (no engine time)
    from draftsmith.costmodel import MeasuredCost

    errs, tree_errs, bs1_errs, inputs = {}, {}, {}, {}
    base = {"target_forward_ms": costs["target_forward_ms"], "draft_step_ms": costs["draft_step_ms"],
            "draft_step_ms_rows": costs.get("draft_step_ms_rows", {})}
    for loop in a.loops:
        mc = MeasuredCost.from_json({**base, "by_batch": costs.get("by_batch", {})})
        full = {**base, "by_batch": {b: dict(c) for b, c in costs.get("by_batch", {}).items()}}
        for B_str, row in result["runs"].items():
            B = int(B_str)
            chain = row["methods"].get("chain", {}).get(loop)
            if chain is None:
                continue
            over = round(chain["ms_per_round"] - (D * mc.draft_ms(B) + mc.verify_ms(B * (D + 1), B)), 4)
            plain_over = round(row["plain_ms_per_step"] - mc.verify_ms(B, B), 4)
            if B == 1:
                full.update(round_overhead_ms=over, plain_overhead_ms=plain_over)
            else:
                full["by_batch"][B_str].update(round_overhead_ms=over, plain_overhead_ms=plain_over)
        bs1 = {**base, **{k: full[k] for k in ("round_overhead_ms", "plain_overhead_ms") if k in full}}
        inputs[loop] = {"planner": full, "planner_bs1": bs1}
        for B_str, row in result["runs"].items():
            B = int(B_str)
            if row["methods"].get("chain", {}).get(loop) is None:
                result.setdefault("planner_uncalibrated", []).append(f"bs{B}_{loop}")  # no chain: no overheads
                continue
            for method, by_loop in row["methods"].items():
                r = by_loop.get(loop)
                if r is None:
                    continue
                K, budget = shapes[method]
                prof = r["accept_per_position"]
                kw = dict(ks=[D], tree_budgets=[]) if method == "chain" else \
                    dict(ks=[], tree_budgets=[], engine_trees=[(K, D, budget)], tree_accept=prof)
                for tag, c in (("planner", full), ("planner_bs1", bs1), ("planner_no_overhead", base)):
                    pred = predict(prof, c, [B], **kw)["rows"][0]
                    r[tag] = {"speedup": pred["speedup"], "tokens_per_step": pred["tokens_per_step"],
                              "step_ms": pred["step_ms"],
                              "err_pct": round(100 * (pred["speedup"] - r["speedup"]) / r["speedup"], 2)}
                if loop == a.loops[0]:
                    errs[f"bs{B}_{method}"] = r["planner"]["err_pct"]
                    bs1_errs[f"bs{B}_{method}"] = r["planner_bs1"]["err_pct"]
                    if method == "tree":
                        tree_errs[f"bs{B}"] = r["planner"]["err_pct"]
    result["planner_inputs"] = inputs
    result["planner_errors_pct"] = errs
    result["planner_bs1_errors_pct"] = bs1_errs
    result["planner_loop"] = a.loops[0]
    if errs:
        result["planner_max_abs_err_pct"] = round(max(abs(e) for e in errs.values()), 2)
        result["planner_bs1_max_abs_err_pct"] = round(max(abs(e) for e in bs1_errs.values()), 2)
    if tree_errs:
        result["planner_tree_max_abs_err_pct"] = round(max(abs(e) for e in tree_errs.values()), 2)
    result["wall_s"] = round(time.perf_counter() - t_start, 1)
    result["capture_fallbacks"] = CAPTURE_FALLBACKS[n_fallbacks:]
    if result["capture_fallbacks"]:
        print(f"[bench_engine] WARNING: {len(result['capture_fallbacks'])} CUDA-graph capture(s) fell back to eager; "
              "those calls' timings are eager ones (capture_fallbacks in the JSON)", flush=True)
    if a.out:
        atomic_write_json(a.out, result)
    print(json.dumps({k: v for k, v in result.items() if k not in ("runs", "step_costs", "dims")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
