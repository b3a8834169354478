"""`draftsmith probe-layers RECIPE`: choose the drafter's aux layers by measurement.

The default triple [1, N//2-1, N-4] was tuned on Llama; nothing says it suits another target.
This command runs the target once over a few prepared samples with every candidate layer hooked,
then trains one cheap probe per candidate triple (all in parallel, independent parameters):

    logits = U (sum_l A_l rms(h_l[t]) + B e[x_{t+1}]) + c       rank-r linear map, top-F tokens

from the triple's outputs at position t and the embedding of the next token (what the drafter
sees) to the target's distribution at t+1 restricted to the F most frequent tokens (soft
cross-entropy). Triples are ranked by held-out accuracy against the target's greedy token.
Writes RUN_DIR/probe/results.json and report.md and a `probe_layers` ledger event.
"""
from __future__ import annotations

import argparse
import itertools
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file

from .fileio import atomic_write_json, atomic_write_text
from .manifests import require_complete, verify_shards
from .messages import DraftsmithError, log
from .rundir import Ledger, stage_dir
from .config import field_docs, parse_recipe
from .data.conversations import conversation_keys
from .data.shards import iter_samples
from .target.model import default_aux_layer_ids, load_target, read_text_config


@dataclass
class ProbeConfig:
    max_tokens: int = 8192
    """Positions to probe on (taken from the first prepared samples)."""
    layers: Optional[list[int]] = None
    """Candidate layers; default: num_candidate_layers evenly spaced plus the default triple."""
    num_candidate_layers: int = 8
    """Evenly spaced candidate layers when --layers is not given."""
    top_tokens: int = 512
    """Output classes: the most frequent tokens under the loss mask."""
    rank: int = 64
    """Rank r of each probe's linear map."""
    steps: int = 300
    """Adam steps of every probe."""
    batch: int = 512
    """Positions per probe training step."""
    lr: float = 3e-3
    """Adam learning rate of the probes."""
    val_fraction: float = 0.2
    """Share of the samples held out to score the probes."""
    seed: int = 0
    """Seed of the probes' initial weights, batches and held-out split."""


def candidate_layers(num_layers: int, count: int, default: list[int]) -> list[int]:
    spaced = {round(i * (num_layers - 1) / max(count - 1, 1)) for i in range(count)}
    return sorted(spaced | set(default))


def candidate_triples(layers: list[int], default: list[int]) -> list[tuple[int, ...]]:
    triples = list(itertools.combinations(sorted(set(layers)), 3))
    return ([tuple(default)] if tuple(default) not in triples else []) + triples


def _top_tokens(run_dir: Path, labels: torch.Tensor, vocab: int, k: int) -> torch.Tensor:
    """The k most frequent tokens under the loss mask (prepare's counts; else the labels' own)."""
    path = stage_dir(run_dir, "prepare") / "token_counts.safetensors"
    if path.exists():
        counts = load_file(str(path))["counts"][:vocab].to(torch.float64)
    else:
        counts = torch.bincount(labels, minlength=vocab).to(torch.float64)
    counts = torch.nn.functional.pad(counts, (0, vocab - counts.numel()))
    return torch.argsort(-counts, stable=True)[:min(k, vocab)]


@torch.no_grad()
def gather(target, samples, max_tokens: int) -> dict:
    """Per position t (assistant tokens, loss_mask[t+2]): rms-normalised outputs of every hooked
    layer at t [M, nL, H], the embedding of x[t+1] [M, H], the target's logits at t+1 [M, V],
    and which conversation the position came from (`owner`: ShareGPT parts `abc_0`, `abc_1` are one, so the
    held-out split of train_probes never puts part of a conversation on both sides)."""
    H, emb = target.hidden_size, target.input_embeddings()
    feats, embs, logits, owner, n = [], [], [], [], 0
    ids_of, index_of = [], []
    for s in samples:
        ids = s.input_ids[None].to(target.device)
        out = target.forward(ids, with_logits=True)
        T = ids.shape[1]
        keep = torch.nonzero(s.loss_mask[2:T].bool()).flatten()  # t with a target at t+2
        if keep.numel() == 0:
            continue
        h = out.aux_hidden[0].float().view(T, -1, H)[keep]
        feats.append((h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).cpu())
        embs.append(emb[ids[0, keep + 1]].float().cpu())
        logits.append(out.logits[0, keep + 1].float().cpu())
        owner.append(torch.full((keep.numel(),), len(ids_of)))
        ids_of.append(s.source_id)
        index_of.append(s.sample_index)
        n += keep.numel()
        if n >= max_tokens:
            break
    if not feats:
        raise DraftsmithError("data/manifest.json: no assistant tokens to probe; check prepare's loss masks")
    cat = lambda xs: torch.cat(xs)[:max_tokens]  # noqa: E731
    keys = conversation_keys(ids_of, index_of)
    number = {k: i for i, k in enumerate(dict.fromkeys(keys))}
    conversation = torch.tensor([number[k] for k in keys])
    return {"h": cat(feats), "e": cat(embs), "logits": cat(logits), "owner": conversation[cat(owner)]}


def train_probes(data: dict, triples: list[tuple[int, ...]], layer_index: dict[int, int], top: torch.Tensor,
                 cfg: ProbeConfig) -> list[dict]:
    """Train one rank-r probe per triple (batched, independent parameters: Adam is per-parameter)
    and score each on the held-out samples."""
    g = torch.Generator().manual_seed(cfg.seed)
    owners = data["owner"].unique()
    val_owners = owners[torch.randperm(owners.numel(), generator=g)[:max(1, int(owners.numel() * cfg.val_fraction))]]
    is_val = torch.isin(data["owner"], val_owners)
    if is_val.all():
        is_val = torch.arange(is_val.numel()) >= int(is_val.numel() * (1 - cfg.val_fraction))
    teacher = torch.log_softmax(data["logits"][:, top], -1)
    label = teacher.argmax(-1)
    in_top = torch.isin(data["logits"].argmax(-1), top)  # positions whose greedy token is a probe class
    idx = torch.tensor([[layer_index[l] for l in t] for t in triples])  # [C, 3]
    C, H, F, r = len(triples), data["h"].shape[-1], top.numel(), cfg.rank
    torch.manual_seed(cfg.seed)
    A = torch.nn.Parameter(torch.randn(C, 3, H, r) / (3 * H) ** 0.5)
    B = torch.nn.Parameter(torch.randn(C, H, r) / H ** 0.5)
    U = torch.nn.Parameter(torch.randn(C, r, F) / r ** 0.5)
    c = torch.nn.Parameter(torch.zeros(C, F))
    opt = torch.optim.Adam([A, B, U, c], lr=cfg.lr)

    def forward(rows: torch.Tensor) -> torch.Tensor:  # -> [B, C, F]
        x = data["h"][rows][:, idx]  # [B, C, 3, H]
        z = torch.einsum("bcih,cihr->bcr", x, A) + torch.einsum("bh,chr->bcr", data["e"][rows], B)
        return torch.einsum("bcr,crf->bcf", z, U) + c

    train_rows = torch.nonzero(~is_val).flatten()
    for step in range(cfg.steps):
        rows = train_rows[torch.randint(train_rows.numel(), (min(cfg.batch, train_rows.numel()),), generator=g)]
        logp = torch.log_softmax(forward(rows), -1)
        loss = -(teacher[rows].exp()[:, None] * logp).sum(-1).mean(0).sum()  # sum over probes: independent
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    val_rows = torch.nonzero(is_val).flatten()
    with torch.no_grad():
        correct, losses = torch.zeros(C), torch.zeros(C)
        for chunk in val_rows.split(cfg.batch):
            logp = torch.log_softmax(forward(chunk), -1)
            hit = (logp.argmax(-1) == label[chunk, None]) & in_top[chunk, None]
            correct += hit.float().sum(0)
            losses += -(teacher[chunk].exp()[:, None] * logp).sum(-1).sum(0)
    n = max(val_rows.numel(), 1)
    # accuracy over all held-out positions: a greedy token outside the top-F counts as a miss
    return [{"layers": list(t), "accuracy": float(correct[i] / n), "loss": float(losses[i] / n), "val_positions": n}
            for i, t in enumerate(triples)]


def probe_layers(recipe, cfg: ProbeConfig) -> dict:
    run_dir = Path(recipe.run_dir)
    data_m = require_complete(stage_dir(run_dir, "prepare"), "prepare")
    shards = verify_shards(stage_dir(run_dir, "prepare"), data_m)
    t0 = time.time()
    tcfg = read_text_config(recipe.target.path, recipe.target.trust_remote_code)
    N = int(tcfg.num_hidden_layers)
    default = list(recipe.target.aux_layer_ids or default_aux_layer_ids(N))
    layers = sorted(set(cfg.layers)) if cfg.layers else candidate_layers(N, cfg.num_candidate_layers, default)
    bad = [i for i in layers + default if not 0 <= i < N]
    if bad:
        raise DraftsmithError(f"--layers {layers}: {bad} outside 0..{N - 1}; layer ids are 0-indexed decoder layers")
    hooked = sorted(set(layers) | set(default))
    if len(set(layers)) < 3:
        raise DraftsmithError(f"--layers {layers}: need at least 3 distinct candidate layers")
    t = recipe.target
    target = load_target(t.path, device=t.device, dtype=t.dtype, trust_remote_code=t.trust_remote_code, aux_layer_ids=hooked,
                         device_map=t.device_map)
    log(f"[probe] capturing layers {hooked} on up to {cfg.max_tokens} positions")
    data = gather(target, iter_samples(shards, with_hidden=False), cfg.max_tokens)
    top = _top_tokens(run_dir, data["logits"].argmax(-1), target.vocab_size, cfg.top_tokens)
    triples = candidate_triples(layers, default)
    log(f"[probe] training {len(triples)} probes x {cfg.steps} steps on {data['h'].shape[0]} positions")
    results = train_probes(data, triples, {l: i for i, l in enumerate(hooked)}, top, cfg)
    ranked = sorted(results, key=lambda r: (-r["accuracy"], r["loss"]))
    for i, r in enumerate(ranked, 1):
        r["rank"] = i
    default_r = next(r for r in results if r["layers"] == default)
    best = ranked[0]
    coverage = float(torch.isin(data["logits"].argmax(-1), top).float().mean())
    # Held-out accuracy is a proportion over n positions: differences within ~2 standard errors are noise.
    n_val = results[0]["val_positions"]
    se = (max(default_r["accuracy"] * (1 - default_r["accuracy"]), 1e-12) / max(n_val, 1)) ** 0.5
    better = best["layers"] != default and best["accuracy"] - default_r["accuracy"] > 2 * se
    return {"target": t.path, "num_layers": N, "default": default_r, "best": best, "candidates": ranked,
            "candidate_layers": layers, "positions": int(data["h"].shape[0]), "top_tokens_coverage": coverage,
            "config": asdict(cfg), "seconds": round(time.time() - t0, 1),
            "accuracy_standard_error": se, "significant": better,
            "recommendation": f"target.aux_layer_ids: {best['layers']}" if better else
            f"keep the default {default} (" + ("it ranks first" if best["layers"] == default else
                                               f"the best, {best['layers']}, is within 2 standard errors") + ")"}


def to_markdown(res: dict, limit: int = 15) -> str:
    d = res["default"]
    rows = ["| rank | layers | accuracy | vs default | loss |", "|---|---|---|---|---|"]
    shown = res["candidates"][:limit] + ([d] if d["rank"] > limit else [])
    for r in shown:
        mark = " (default)" if r["layers"] == d["layers"] else ""
        rows.append(f"| {r['rank']} | {r['layers']}{mark} | {r['accuracy']:.3f} | {r['accuracy'] - d['accuracy']:+.3f} | "
                    f"{r['loss']:.3f} |")
    return "\n\n".join([
        f"# Aux-layer probe: {res['target']} ({res['num_layers']} layers)",
        f"{len(res['candidates'])} candidate triples from layers {res['candidate_layers']}; {res['positions']} positions; "
        f"probe classes cover {res['top_tokens_coverage']:.1%} of the target's greedy tokens. Accuracy: held-out "
        "agreement with the target's greedy next-next token (a rank-"
        f"{res['config']['rank']} linear probe, {res['config']['steps']} steps).",
        "\n".join(rows),
        f"Standard error of an accuracy here: {res['accuracy_standard_error']:.3f}; a lead under 2 standard errors is noise.",
        f"Recommendation: {res['recommendation']}. A probe is a proxy: confirm with a short `draftsmith train` + "
        "`evaluate` on both triples before a long run.",
    ]) + "\n"


def main(argv: list[str]) -> int:
    """`draftsmith probe-layers RECIPE.yaml [--steps N] [--layers 1 5 9 ...] [--json] [--section.key value ...]`."""
    p = argparse.ArgumentParser(prog="draftsmith probe-layers", description=__doc__.split("\n")[0],
                                usage="%(prog)s RECIPE.yaml [--steps N] [--layers L [L ...]] [--json] [--section.key value ...]",
                                epilog="RECIPE.yaml (first) is the run's recipe: the probe reads its prepared data/ and its target; "
                                       "any recipe key may follow as --section.key value (see `draftsmith run --help`).")
    docs = field_docs(ProbeConfig)
    for name, f in ProbeConfig.__dataclass_fields__.items():
        if name == "layers":
            p.add_argument("--layers", type=int, nargs="+", help=docs[name] + " (0-indexed decoder layers whose outputs are used)")
        else:
            p.add_argument(f"--{name.replace('_', '-')}", dest=name, type=type(f.default), default=f.default,
                           help=f"{docs[name]} (default: {f.default})")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    a, rest = p.parse_known_args(argv)
    recipe, _ = parse_recipe(rest, prog="draftsmith probe-layers")
    cfg = ProbeConfig(**{k: getattr(a, k) for k in ProbeConfig.__dataclass_fields__})
    res = probe_layers(recipe, cfg)
    out = Path(recipe.run_dir) / "probe"
    atomic_write_json(out / "results.json", res)
    md = to_markdown(res)
    atomic_write_text(out / "report.md", md)
    Ledger(recipe.run_dir).append("probe_layers", best=res["best"]["layers"], best_accuracy=res["best"]["accuracy"],
                                  default=res["default"]["layers"], default_accuracy=res["default"]["accuracy"])
    print(json.dumps(res, indent=2) if a.json else md)
    return 0
