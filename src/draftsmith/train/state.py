"""The trained module, its optimizers, and resume (train/loop.py's Trainer holds what they build):

    make_trainable(drafter, train_cfg, info, compute_dtype) -> Trainable (TTTLoss, FSDP2 from outside, optimizers)
    resume(latest, trainable, fp, out_dir, info, best_key) -> (Progress, the metrics records kept)

A Progress is the run's position, saved in every checkpoint's meta.json beside the weights
(checkpoint.py); train/metrics.jsonl and train/eval.jsonl are cut back to it on a resume.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from ..fileio import atomic_write_text, read_json, read_jsonl
from ..messages import DraftsmithError, log
from ..distributed.group import DistInfo, parallelize
from ..draft.model import Eagle3Drafter
from ..draft.ttt_attention import resolve_impl
from .checkpoint import load_checkpoint, set_rng_state
from .ttt import TTTLoss

ADAM_BETAS = (0.9, 0.95)
METRICS_FILE = "metrics.jsonl"
EVAL_FILE = "eval.jsonl"
CURVE_FILE = "learning_curve.png"


def compile_loss(setting: str, device: torch.device, layout: str, attention: str) -> bool:
    """train.compile: on, off, or auto = on with CUDA, packed (fixed-shape) batches and flex attention."""
    if setting != "auto":
        return setting == "on"
    return device.type == "cuda" and layout == "packed" and resolve_impl(attention, device) == "flex"


def build_optimizers(named: list[tuple[str, torch.nn.Parameter]], tc) -> list[torch.optim.Optimizer]:
    """The optimizers of the trained tensors (train.optimizer). adamw: one AdamW, weight decay on
    the 2-D weights only. muon: torch.optim.Muon on the 2-D matrices of fc, attention and MLP
    (its orthogonalised update suits square-ish matrices; the lm_head is a vocabulary read-out
    and stays with AdamW, as in speculators), AdamW on the rest. Each group keeps its base lr in
    `base_lr`; the schedule scales it every step."""
    def adamw(params, decay):
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": decay, "base_lr": tc.lr},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0, "base_lr": tc.lr}]
        return torch.optim.AdamW([g for g in groups if g["params"]], lr=tc.lr, betas=ADAM_BETAS, eps=1e-8)

    if tc.optimizer == "adamw":
        return [adamw([p for _, p in named], tc.weight_decay)]
    if tc.optimizer != "muon":
        raise DraftsmithError(f"train.optimizer {tc.optimizer!r}: choose adamw or muon")
    is_matrix = [p.dim() == 2 and min(p.shape) > 1 and not n.endswith("lm_head.weight") for n, p in named]
    matrices = [p for (_, p), m in zip(named, is_matrix) if m]
    rest = [p for (_, p), m in zip(named, is_matrix) if not m]
    muon_lr = tc.muon_lr if tc.muon_lr is not None else tc.lr
    opts = [torch.optim.Muon([{"params": matrices, "base_lr": muon_lr}], lr=muon_lr, weight_decay=tc.muon_weight_decay,
                             adjust_lr_fn="match_rms_adamw")]
    if rest:
        opts.append(adamw(rest, tc.weight_decay))
    return opts


@dataclass
class Trainable:
    model: torch.nn.Module  # TTTLoss around the drafter, parallelized (FSDP2 under torchrun)
    params: list  # the trained tensors
    names: dict  # module FQN -> checkpoint name
    opts: list  # build_optimizers
    compiled: bool


def make_trainable(drafter: Eagle3Drafter, tc, info: DistInfo, compute_dtype: torch.dtype) -> Trainable:
    """FSDP2 from outside: the loss module's forward is one all-gather / reduce-scatter unit;
    then the optimizers of what requires grad (a frozen head does not)."""
    if not tc.train_head:
        drafter.lm_head.weight.requires_grad_(False)
    compiled = compile_loss(tc.compile, info.device, tc.batch_layout, tc.attention)
    model = parallelize(TTTLoss(drafter, int(tc.ttt_steps), tc.ttt_decay, tc.attention, "inductor" if compiled else None,
                                 int(tc.ttt_align_topk), float(tc.ttt_target_temperature)),
                        info, compute_dtype)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return Trainable(model, [p for _, p in named], {n: n.removeprefix("drafter.") for n, _ in named},
                     build_optimizers(named, tc), compiled)


@dataclass
class Progress:
    """The run's position, saved in every checkpoint's meta.json besides the weights."""
    step: int = 0
    epoch: int = 0
    position: int = 0  # micro-batches of the epoch's plan already taken
    skipped: int = 0  # non-finite steps so far
    in_a_row: int = 0
    best_tau: float | None = None  # best held-out figure so far (train.keep_best's)
    tokens_seen: int = 0  # training tokens of the steps so far (real tokens, no padding)
    train_s: float = 0.0  # seconds in the training loop, over all sessions (train.max_minutes)


def resume(latest: Path | None, tr: Trainable, fp: str, out_dir: Path, info: DistInfo,
           best_key: str = "tau_simulated") -> tuple[Progress, list[dict]]:
    """Fill the model and optimizers from checkpoint `latest` and cut metrics.jsonl / eval.jsonl
    back to its step (a crash may have torn a last line, or logged steps past it); returns the
    progress and the metrics records kept. Without a checkpoint: a fresh start, both files removed."""
    metrics_path, eval_path = out_dir / METRICS_FILE, out_dir / EVAL_FILE
    if latest is None:
        if info.is_main:
            for path in (metrics_path, eval_path, out_dir / CURVE_FILE):
                path.unlink(missing_ok=True)
            for folder in ("best", "last"):  # a best drafter of an earlier run must not become this run's
                shutil.rmtree(out_dir / folder, ignore_errors=True)
        return Progress(), []
    meta = load_checkpoint(latest, tr.model, tr.opts, tr.names)
    if meta.get("fingerprint") != fp:
        raise DraftsmithError(f"{latest / 'meta.json'}: checkpoint of other inputs or config (fingerprint {meta.get('fingerprint')}, "
                              f"now {fp}); delete {out_dir} to start over")
    set_rng_state(meta["rng"])
    prog = Progress(int(meta["step"]), int(meta["epoch"]), int(meta["position"]), int(meta.get("skipped_nonfinite", 0)),
                    int(meta.get("nonfinite_in_a_row", 0)), meta.get("best_tau"), 0, float(meta.get("train_s", 0.0)))
    kept = {}
    for path in (metrics_path, eval_path):
        kept[path] = [r for r in read_jsonl(path) if r["step"] <= prog.step]
        if info.is_main:
            atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in kept[path]))
    prog.tokens_seen = sum(r["tokens"] for r in kept[metrics_path])
    # best/ holds a drafter really measured at its recorded figure (possibly at a step past the
    # checkpoint, saved before the crash): its record is the best to beat.
    best = read_json_safe(out_dir / "best" / "best.json")
    if best_key in best:
        prog.best_tau = best[best_key]
    if info.is_main:
        log(f"[train] resuming from {latest.name} (saved at world size {meta.get('world_size', 1)}): "
            f"step {prog.step}/{meta.get('total_steps')}, epoch {prog.epoch}, batch {prog.position}")
    return prog, kept[metrics_path]


def read_json_safe(path: Path) -> dict:
    """The JSON file at `path`, {} when there is none (best/best.json before a first best)."""
    return read_json(path) if path.exists() else {}
