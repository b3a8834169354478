"""The train stage: an EAGLE-3 drafter trained with training-time test on captured states.

Reads capture/ (hidden-state shards; online mode: data/ token shards, see below), vocab/ (d2t, t2d) and, from the target, only its input
embedding and lm_head (read_target_embeddings: no full model load). Writes
    train/step-NNNNNN/{state/*.safetensors,meta.json}, train/latest   (checkpoint.py, DCP)
    train/metrics.jsonl     one record per optimizer step (loss, CE/acc per TTT position, lr, grad norm)
    train/eval.jsonl        held-out evaluations (heldout.py: accuracy per position, simulated tau, train figures)
    train/learning_curve.png  held-out and train simulated tau against tokens seen (rewritten at every eval)
    train/tensorboard/      the same as TensorBoard scalars, plus tokens/s, MFU, peak memory
    train/best/             the drafter with the best held-out figure so far (train.keep_best: simulated tau of
                            greedy decoding, or of speculative sampling), best.json its record
    train/drafter/          THE drafter, what evaluate and export read (config.json + model.safetensors,
                            draft/io.py's save_drafter): with held-out samples, a copy of best/ at the
                            end; without, the last step's
    train/last/             the last step's drafter (with held-out samples only)
Held-out samples (train.heldout_samples, default auto) are whole conversations (heldout.py:
ShareGPT's parts of one conversation together); the manifest's metrics.heldout record (best and
last held-out figures, still_improving, overfitting, and `engine`: the final drafter's tau measured
by evaluate's decoding on train.heldout_engine_prompts held-out first turns) is what `status`
shows and reasons from.
The same code runs under `python` (one process) and `torchrun` (FSDP2, docs/distributed.md).
A micro-batch is packed by default (train.batch_layout; train/data.py): whole samples end to
end in one fixed [1, micro_batch_tokens] row, so every forward has the same shape. A step takes
batch_tokens // micro_batch_tokens consecutive micro-batches of one epoch's plan (the last step
of an epoch takes what is left: `epochs: N` is N whole passes), dealt round-robin to the ranks
and read ahead on a background thread (data.Loader); each micro-batch's loss is a fraction of
the global batch's loss (ttt.ttt_loss weight_total), so 1 and N ranks take the same optimizer
steps. A step reads its figures from the device once.
A rerun after a crash continues from `latest` and reproduces the uninterrupted run's losses
at any world size: the batch plan is a function of (seed, epoch), the cursor and the AdamW
state are checkpointed, and the learning rate is a function of the step.

Where the hidden states come from is decided once (data_source): CaptureSource (capture/'s
shards) or OnlineSource (the target's forward); both give the same sample index and a `load`.
The optimizers and the module they train come from make_trainable, a resume from resume().
run() reads top-down: setup() builds a Trainer (what is set up once; its methods are a step's
parts: train_step, heldout_checkpoint), the loop takes the steps, finish() writes the drafter and
the manifest.

Online mode (train.online: true) reads the token shards of prepare (data/, or regen/ when
regenerate is on) instead of capture/, loads the whole target once next to the drafter
(recipe.target: path, device, dtype, aux_layer_ids, device_map, ...), and gets each
micro-batch's hidden states from its forward (target/online.py: capture's forward batching by
capture.batch_tokens, rounded to capture.storage_dtype as a capture shard would hold them).
The sample index, cuts, batch plan, cursor and checkpoints are those of the offline path, so
for the same token shards and seed it trains the same drafter (bit-identical when the forward
batches are the same, e.g. capture.batch_tokens 1) and resumes the same way. Under torchrun
each rank runs its own target copy on its own micro-batches. Nothing is written for the
hidden states; the manifest records `online: true`. A sample whose states hold NaN/inf is left
out of its micro-batch (capture would not have stored it).
"""
from __future__ import annotations

import json
import math
import shutil
import sys
import time
from collections import deque
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from ..artifacts import (RECIPE_FILE, DraftsmithError, append_jsonl, atomic_write_bytes, atomic_write_json,
                         atomic_write_text, finish_manifest, fingerprint, load_manifest, log, new_manifest, read_json,
                         read_jsonl, remove_temp_files, replace_dir, require_complete, rerun_command, sha256_file,
                         stage_dir, temp_dir, to_jsonable, token_stage, verify_shards, write_manifest)
from ..config import Recipe, check_recipe, heldout_sample_temperature
from ..distributed import (DistInfo, all_reduce_sum, barrier, full_tensor, init_distributed, is_sharded, parallelize,
                           rank_device)
from ..draft.build import drafter_config, init_drafter
from ..draft.io import save_drafter
from ..draft.model import Eagle3Config, Eagle3Drafter
from ..draft.ttt_attention import resolve_impl
from ..target.model import Target, load_target, read_target_embeddings, resolve_dtype
from ..target.online import online_batch
from ..vocab import VOCAB_FILE, draft_ids, load_vocab
from .checkpoint import find_latest, load_checkpoint, save_checkpoint, set_rng_state
from .data import CaptureIndex, Loader, TokenIndex, epoch_plan, steps_of_plan
from .flops import peak_flops, train_flops_per_token
from ..data.conversations import conversation_keys
from .heldout import (BEST_FIGURES, engine_prompts, engine_record, eval_interval, heldout_count, heldout_record,
                      overfitting, plot_learning_curve, split_by_conversation)
from .ttt import TTTLoss, position_weights, simulated_tau

MAX_NONFINITE_IN_A_ROW = 10
ADAM_BETAS = (0.9, 0.95)
METRICS_FILE = "metrics.jsonl"
EVAL_FILE = "eval.jsonl"
CURVE_FILE = "learning_curve.png"
UNFINGERPRINTED = ("train.log_every", "train.save_every", "train.heldout_engine_prompts", "train.peak_tflops", "train.max_minutes")
"""train.* keys that never change the trained drafter, left out of the stage's fingerprint
(stages.Stage.unfingerprinted): changing one leaves a complete train stage complete. They set what
is logged (log_every, also the window of the logged figures), how often a checkpoint is saved
(a resume reproduces the same steps from any of them), a measurement beside the drafter
(heldout_engine_prompts: to measure it on a complete stage, rerun with --force) and the peak
the MFU figure divides by. max_minutes is a wall-clock budget: whether another one changes the
drafter depends on where the complete run stopped, which budget_verdict decides. eval_every stays
in: train/drafter is the best drafter by held-out tau among the steps evaluated, so another
cadence can pick another drafter."""


def budget_verdict(manifest: dict, recipe: Recipe) -> tuple[str, str]:
    """(verdict, why) for a complete train output whose fingerprint matches `recipe` (which leaves
    train.max_minutes out), under the recipe's max_minutes: "done" when a run under it would stop
    at the same step (a run that finished its steps within it; a budget stop that it would also
    make), "continue" when a budget stopped the run and the new one is larger than the time spent
    (the stage resumes from its last checkpoint), "restart" when it would stop sooner."""
    new_s = 60.0 * float(recipe.train.max_minutes)
    old_s = 60.0 * float(((manifest.get("config") or {}).get("train") or {}).get("max_minutes", 0.0))
    if new_s == old_s:
        return "done", ""
    spent = (manifest.get("budget") or {}).get("train_s")
    if spent is None:  # no record of the time spent
        return "restart", f"train.max_minutes changed from {old_s / 60:g} to {new_s / 60:g}"
    spent_txt = f"{spent / 60:.2f} min spent"
    if manifest.get("stopped") == "budget":
        if not new_s or new_s > spent:
            return "continue", (f"train.max_minutes {new_s / 60:g} is past the {old_s / 60:g} min budget that stopped it "
                                f"({spent_txt}): continuing from its last checkpoint")
        if new_s > old_s:
            return "done", ""
        return "restart", f"train.max_minutes {new_s / 60:g} < the {old_s / 60:g} min budget it stopped at: it would stop sooner"
    if not new_s or new_s >= spent:
        return "done", ""
    return "restart", f"train.max_minutes {new_s / 60:g} is less than the {spent_txt} it took: it would stop sooner"


def lr_at(step: int, total_steps: int, lr: float, warmup_steps: int, min_lr_ratio: float, schedule: str = "cosine") -> float:
    """Learning rate of optimizer step `step` (1-based): linear warmup, then cosine or linear
    decay to lr*min_lr_ratio at the last step."""
    if warmup_steps > 0 and step <= warmup_steps:
        return lr * step / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    shape = 1 - progress if schedule == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * shape)


def total_steps_of(recipe: Recipe, plan_len, micro_per_step: int) -> int:
    """max_steps and/or the steps of max_tokens (ceil(max_tokens / batch_tokens)), the smaller;
    else the steps of `epochs` whole passes: each epoch's steps counted from its own plan
    (plan_len(e): micro-batches of epoch e), a fraction of the last one rounded up."""
    tc = recipe.train
    caps = ([int(tc.max_steps)] if tc.max_steps is not None else []) + ([-(-int(tc.max_tokens) // tc.batch_tokens)] if tc.max_tokens else [])
    if caps:
        return max(1, min(caps))
    whole = int(tc.epochs)
    steps = sum(steps_of_plan(plan_len(e), micro_per_step) for e in range(whole))
    if tc.epochs > whole:
        steps += math.ceil((tc.epochs - whole) * steps_of_plan(plan_len(whole), micro_per_step))
    return max(1, steps)


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


def micro_batching(batch_tokens: int, micro_batch_tokens: int | None, world_size: int) -> tuple[int, int]:
    """(micro-batch token budget, micro-batches per optimizer step)."""
    micro = int(micro_batch_tokens or max(1, batch_tokens // world_size))
    per_step = max(1, batch_tokens // micro)
    if per_step % world_size:
        raise DraftsmithError(f"train: batch_tokens {batch_tokens} / micro_batch_tokens {micro} = {per_step} micro-batches per step, "
                              f"not a multiple of the world size {world_size}; set batch_tokens to a multiple of "
                              f"micro_batch_tokens * {world_size}")
    return micro, per_step


def _fmt_s(s: float) -> str:
    s = int(max(0, s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _window_metrics(window: deque, k: int) -> dict:
    """Means over the recent non-skipped steps: loss, acc per position (row-weighted), tau."""
    recs = [r for r in window if not r["skipped"]]
    if not recs:
        return {"loss": float("nan"), "acc": [0.0] * k, "tau": 1.0, "grad_norm": float("nan")}
    correct = [sum(r["correct"][i] for r in recs) for i in range(k)]
    weight = [sum(r["weight"][i] for r in recs) for i in range(k)]
    acc = [c / w if w else 0.0 for c, w in zip(correct, weight)]
    return {"loss": sum(r["loss"] for r in recs) / len(recs), "acc": acc, "tau": simulated_tau(acc),
            "grad_norm": sum(r["grad_norm"] for r in recs) / len(recs)}


def _peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource  # why here: a Unix-only module, needed only off CUDA

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux: the process's peak RSS


def full_drafter(model: TTTLoss, cfg, info: DistInfo):
    """The whole drafter (float32, CPU) on rank 0, None elsewhere; a collective when sharded."""
    if not is_sharded(model):
        return model.drafter
    # why here: torch.distributed.checkpoint takes ~1.5 s to import; one rank never needs it
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not info.is_main:
        return None
    d = Eagle3Drafter(cfg)
    d.load_state_dict({n.removeprefix("drafter."): t for n, t in sd.items()})
    return d


def _save_drafter_atomic(drafter: Eagle3Drafter, folder: Path, extra: dict | None = None) -> str:
    """Save a drafter folder into place atomically; returns its model.safetensors' sha256."""
    tmp = temp_dir(folder)
    sha = save_drafter(drafter, tmp)
    if extra:
        atomic_write_json(tmp / "best.json", extra)
    replace_dir(tmp, folder)
    return sha


def _copy_drafter_atomic(src: Path, folder: Path) -> str:
    """Copy a drafter folder into place atomically; returns its model.safetensors' sha256."""
    tmp = temp_dir(folder)
    shutil.copytree(src, tmp)
    replace_dir(tmp, folder)
    return sha256_file(folder / "model.safetensors")


def _load_online_target(recipe: Recipe, info: DistInfo) -> tuple[Target, float]:
    """The target for online training (recipe.target), on this rank's GPU under torchrun as in
    capture; (target, load seconds). No tokenizer: the token shards are already tokenized."""
    t = recipe.target
    device_map = getattr(t, "device_map", None)
    if device_map and info.world_size > 1:
        raise DraftsmithError(f"target.device_map {device_map!r} with train.online under torchrun ({info.world_size} ranks): every rank "
                              "would spread its own copy of the target over all GPUs; unset target.device_map (one target per rank) "
                              "or capture offline (train.online: false)")
    t0 = time.time()
    target = load_target(t.path, rank_device(t.device, info), t.dtype, t.trust_remote_code, t.aux_layer_ids, with_tokenizer=False,
                         device_map=device_map, experts_implementation=t.experts_implementation)
    return target, round(time.time() - t0, 3)


# -- data sources: where a micro-batch's hidden states come from --------------------------------
# Both give the same sample index (lengths, cuts, order) for the same token shards, so the batch
# plans, cursor and checkpoints are shared; `load(sample_ids)` runs on the loader's thread.

class CaptureSource:
    """Offline: capture/'s shards hold the hidden states (CaptureIndex.batch reads them)."""

    online = False
    def __init__(self, recipe: Recipe, run_dir: Path):
        self.recipe, self.run_dir = recipe, run_dir
        self.nonfinite_fix = f"check capture/ for NaN/inf hidden states (rerun {rerun_command('capture', run_dir)})"
        self.dir, self.stage = stage_dir(run_dir, "capture"), "capture"
        self.manifest = require_complete(self.dir, self.stage)
        self.index: CaptureIndex | None = None
        self.packed_tokens, self.pin = None, False

    def fingerprinted_config(self) -> dict:
        return {}

    def open(self, shard_paths: list[Path], hidden: int, max_length: int, packed_tokens: int | None, pin: bool,
             info: DistInfo, manifest: dict) -> list[int]:
        """Index the samples; returns the aux layer ids whose states the source holds."""
        m = self.manifest
        if int(m.get("hidden_size", hidden)) != hidden:
            raise DraftsmithError(f"{self.dir / 'manifest.json'}: hidden_size {m['hidden_size']} differs from the target's {hidden}; "
                                  f"the capture is from another model, rerun {rerun_command('capture', self.run_dir)}")
        aux_layer_ids = list(m.get("aux_layer_ids") or [])
        if not aux_layer_ids:
            raise DraftsmithError(f"{self.dir / 'manifest.json'}: no aux_layer_ids recorded; rerun {rerun_command('capture', self.run_dir)}")
        self.index = CaptureIndex(shard_paths, max_length, hidden, len(aux_layer_ids))
        self.packed_tokens, self.pin = packed_tokens, pin
        return aux_layer_ids

    def load(self, sample_ids):
        return self.index.batch(sample_ids, self.packed_tokens, self.pin)

    def describe(self) -> str:
        return ""


class OnlineSource(CaptureSource):
    """Online (train.online): prepare's (or regenerate's) token shards, and the hidden states of
    the target's forward per micro-batch (target/online.py), batched by capture.batch_tokens and
    rounded to capture.storage_dtype as a capture shard would hold them."""

    online = True
    nonfinite_fix = "check target.dtype (float16 overflows: use bfloat16 or float32)"

    def __init__(self, recipe: Recipe, run_dir: Path):
        self.recipe, self.run_dir = recipe, run_dir
        self.dir, self.stage = token_stage(recipe, run_dir)
        self.manifest = require_complete(self.dir, self.stage)
        self.index: TokenIndex | None = None
        self.target: Target | None = None
        self.packed_tokens, self.pin = None, False

    def fingerprinted_config(self) -> dict:
        return {"capture": self.recipe.capture}  # the storage rounding and forward batching of the states

    def open(self, shard_paths, hidden, max_length, packed_tokens, pin, info, manifest):
        target, load_s = _load_online_target(self.recipe, info)
        manifest["timings"]["load_target_s"] = load_s
        if target.hidden_size != hidden:
            raise DraftsmithError(f"{self.recipe.target.path}: the loaded target's hidden size {target.hidden_size} differs from its "
                                  f"config's {hidden}; check target.path")
        aux_layer_ids = list(target.aux_layer_ids)
        manifest.update(aux_layer_ids=aux_layer_ids, hidden_size=hidden, storage_dtype=self.recipe.capture.storage_dtype,
                        source=self.stage)
        index = TokenIndex(shard_paths, max_length)
        top, where = index.max_token_id()
        if top >= target.vocab_size:
            si, j, _ = index.entries[where]
            raise DraftsmithError(f"{index.paths[si]}: sample {j}: token id {top} >= the target's vocab_size {target.vocab_size}; the "
                                  f"tokenizer in {self.recipe.target.path} does not belong to its model, fix the folder and rerun "
                                  f"{rerun_command(self.stage, self.run_dir)}")
        self.target, self.index, self.packed_tokens, self.pin = target, index, packed_tokens, pin
        return aux_layer_ids

    def load(self, sample_ids):
        c = self.recipe.capture
        b = online_batch(self.target, self.index.samples(sample_ids), c.storage_dtype, c.batch_tokens, self.packed_tokens)
        return b.pin_memory() if self.pin and b.input_ids.device.type == "cpu" else b

    def describe(self) -> str:
        return (f"; online: target forward on {self.target.device} ({str(self.target.dtype).replace('torch.', '')}), states rounded "
                f"to {self.recipe.capture.storage_dtype}, read from {self.dir}")


def data_source(recipe: Recipe, run_dir: Path) -> CaptureSource:
    """The one place that decides between offline captures and the online target forward."""
    return OnlineSource(recipe, run_dir) if recipe.train.online else CaptureSource(recipe, run_dir)


# -- the trained module, its optimizers, and resume ------------------------------------------------

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


TRAIN_NEEDS = ("train.ttt_steps", "train.batch_tokens", "train.max_length", "train.max_tokens", "train.max_minutes")
"""What run() checks again (config.check_recipe's table) in a Recipe built in code; the rest (e.g. lr 0 in a
test) is refused at parse time only."""


# -- one training run: set up once (setup), then its steps (run), then the drafter (finish) ---------

@dataclass
class Trainer:
    """What a run sets up once: the samples and their split, the step plan, the trained module and
    its optimizers. Its methods are the parts of a step; where the run is comes from a Progress."""
    recipe: Recipe
    fp: str
    info: DistInfo
    out_dir: Path
    manifest: dict
    latest: Path | None  # the checkpoint to resume from
    source: CaptureSource
    cfg: Eagle3Config
    tr: Trainable
    head_weight: torch.Tensor  # the target's lm_head rows of the draft vocab: the TTT targets' logits
    compute_dtype: torch.dtype
    autocast: object
    micro_tokens: int
    micro_per_step: int
    conversations: list
    train_ids: list[int]
    heldout_ids: list[int]
    train_lengths: list[int]
    sample_weights: torch.Tensor  # [N, k] float64: each sample's loss weight per TTT position
    total_steps: int
    eval_every: int
    flops_per_token: float
    peak: float | None
    overfit_named: bool = False  # the overfitting line is logged once, when first seen

    @property
    def tc(self):
        return self.recipe.train

    @property
    def k(self) -> int:
        return int(self.recipe.train.ttt_steps)

    @property
    def index(self):
        return self.source.index

    @property
    def main(self) -> bool:
        return self.info.is_main

    @property
    def sample_temperature(self) -> float:
        """The temperature of the held-out sampled acceptance: evaluate's when it samples, else 1."""
        return heldout_sample_temperature(self.recipe)

    @property
    def best_figure(self) -> tuple[str, str, str]:
        """train.keep_best's figure: (eval record key, best.json key, name), heldout.BEST_FIGURES."""
        return BEST_FIGURES[self.tc.keep_best]

    def plan_of(self, epoch: int) -> list[list[int]]:
        """Epoch `epoch`'s micro-batches (sample ids), a function of (seed, epoch) alone."""
        return [[self.train_ids[j] for j in b]
                for b in epoch_plan(self.train_lengths, self.micro_tokens, self.recipe.seed, epoch, self.tc.batch_layout)]

    def schedule(self, epoch: int, position: int):
        """(epoch, position after the step, the step's micro-batches) of each step from the cursor
        on; a step takes micro_per_step micro-batches of one epoch's plan (fewer at its end)."""
        plan = self.plan_of(epoch)
        while True:
            if position >= len(plan):
                epoch, position = epoch + 1, 0
                plan = self.plan_of(epoch)
            micro_ids = plan[position:position + self.micro_per_step]
            position += len(micro_ids)
            yield epoch, position, micro_ids

    def my_slots(self, micro_ids: list[list[int]]) -> list[list[int] | None]:
        """This rank's micro-batches of a step (round-robin); a rank left short at an epoch's end
        pads with None (a forward and backward at weight 0: FSDP needs every rank's collectives)."""
        world = self.info.world_size
        mine = micro_ids[self.info.rank::world]
        return mine + [None] * (-(-len(micro_ids) // world) - len(mine))

    def train_step(self, loader: Loader, micro_ids: list[list[int]], prog: Progress) -> dict:
        """One optimizer step over the step's micro-batches (this rank's slots, read by `loader`):
        advances `prog` (step, tokens seen, non-finite counts) and returns the step's metrics record.
        A non-finite loss or gradient skips the update (too many in a row stop the run)."""
        tc, k, info, device, model = self.tc, self.k, self.info, self.info.device, self.tr.model
        weight_total = self.sample_weights[[j for b in micro_ids for j in b]].sum(0)
        weight_total = (weight_total.pin_memory() if device.type == "cuda" else weight_total).to(device, non_blocking=True)
        step_tokens = sum(self.index.lengths[j] for b in micro_ids for j in b)
        prog.step += 1
        step = prog.step
        factor = lr_at(step, self.total_steps, 1.0, tc.warmup_steps, tc.min_lr_ratio, tc.lr_schedule)
        for opt in self.tr.opts:
            for group in opt.param_groups:
                group["lr"] = group["base_lr"] * factor

        slots = self.my_slots(micro_ids)
        sums = torch.zeros(1 + 3 * k, dtype=torch.float64, device=device)
        for mi, ids in enumerate(slots):
            ids_t, mask_t, aux_t, fin_t, pos_t, docs_t = loader.next().tensors()
            if is_sharded(model):  # reduce-scatter gradients once, after the last micro-batch
                model.set_requires_gradient_sync(mi == len(slots) - 1)
            with self.autocast:
                out = model(ids_t, mask_t, aux_t, fin_t, self.head_weight, weight_total, pos_t, docs_t)
            if ids is None:  # a rank's padding slot at an epoch's end: weight 0
                out = tuple(t * 0 for t in out)
            loss, ce, correct, weight = out
            # FSDP averages gradients over ranks; the micro losses are already fractions of the global one.
            (loss * info.world_size).backward()
            sums += torch.cat([loss.detach().reshape(1), ce, correct, weight]).double()
        all_reduce_sum(sums, info)
        grad_norm = full_tensor(torch.nn.utils.clip_grad_norm_(self.tr.params, tc.grad_clip if tc.grad_clip > 0 else float("inf")))
        stats = torch.cat([sums, grad_norm.detach().reshape(1).to(sums)]).tolist()  # the step's one read from the device
        loss, grad_norm = stats[0], stats[-1]
        ok = math.isfinite(loss) and math.isfinite(grad_norm)
        for opt in self.tr.opts:
            if ok:
                opt.step()
            opt.zero_grad(set_to_none=True)
        if ok:
            prog.in_a_row = 0
        else:
            prog.skipped, prog.in_a_row = prog.skipped + 1, prog.in_a_row + 1
            si, _, _ = self.index.entries[micro_ids[0][0]]
            if self.main:
                log(f"[train] step {step}: non-finite loss/grad ({loss}, {grad_norm}); skipped ({prog.in_a_row} in a row)")
            if prog.in_a_row >= MAX_NONFINITE_IN_A_ROW:
                raise DraftsmithError(f"{self.index.paths[si]}: {prog.in_a_row} training steps in a row had a non-finite loss or gradient "
                                      f"(last at step {step}); {self.source.nonfinite_fix} or lower train.lr")
        ce, correct, weight = stats[1:1 + k], stats[1 + k:1 + 2 * k], stats[1 + 2 * k:1 + 3 * k]
        prog.tokens_seen += step_tokens
        return {"step": step, "loss": loss, "ce": ce, "correct": correct, "weight": weight,
                "acc": [c / w if w else 0.0 for c, w in zip(correct, weight)], "lr": tc.lr * factor, "grad_norm": grad_norm,
                "tokens": step_tokens, "epoch": prog.epoch, "skipped": not ok}

    def evaluate_heldout(self, loader: Loader, step: int) -> dict:
        """Loss, acc per position and simulated tau on the held-out samples, over all ranks, and the
        sampled acceptance per position at sample_temperature with its simulated tau (ttt.py).
        Every rank runs the same number of forwards (FSDP collectives); spare ones count 0."""
        k, info, model, device = self.k, self.info, self.tr.model, self.info.device
        batches = [[self.heldout_ids[j] for j in b]
                   for b in epoch_plan([self.index.lengths[j] for j in self.heldout_ids], self.micro_tokens, self.recipe.seed, 0,
                                       self.tc.batch_layout)]
        wt = self.sample_weights[self.heldout_ids].sum(0).to(device)
        sums = torch.zeros(1 + 4 * k, dtype=torch.float64, device=device)
        with torch.no_grad():
            for r in range(math.ceil(len(batches) / info.world_size)):
                j = r * info.world_size + info.rank
                ids, mask, aux, fin, pos, docs = loader.now(batches[j if j < len(batches) else 0]).tensors()
                with self.autocast:
                    out = model(ids, mask, aux, fin, self.head_weight, wt, pos, docs, sample_temperature=self.sample_temperature)
                if j < len(batches):
                    sums += torch.cat([out[0].detach().reshape(1), *out[1:]]).double()
        if is_sharded(model):  # FSDP keeps the root's parameters gathered after a forward with no backward;
            model.reshard()    # the optimizer (and a checkpoint's state dict) holds the sharded ones
        all_reduce_sum(sums, info)
        correct, weight, accept = sums[1 + k:1 + 2 * k].tolist(), sums[1 + 2 * k:1 + 3 * k].tolist(), sums[1 + 3 * k:].tolist()
        acc = [c / w if w else 0.0 for c, w in zip(correct, weight)]
        sampled = [a / w if w else 0.0 for a, w in zip(accept, weight)]
        return {"step": step, "loss": float(sums[0]), "acc": acc, "tau": simulated_tau(acc), "weight": weight,
                "accept": sampled, "tau_sampled": simulated_tau(sampled), "sample_temperature": self.sample_temperature}

    def heldout_checkpoint(self, loader: Loader, prog: Progress, window: deque, evals: list[dict], writer) -> None:
        """Evaluate on the held-out samples, record it (eval.jsonl, TensorBoard, the learning
        curve), keep the drafter in best/ when it beats the best so far, and name overfitting."""
        tw = _window_metrics(window, self.k)
        ev = {**self.evaluate_heldout(loader, prog.step), "tokens_seen": prog.tokens_seen, "train_acc": tw["acc"],
              "train_tau": tw["tau"]}
        evals.append(ev)
        key, _, name = self.best_figure
        better = prog.best_tau is None or ev[key] > prog.best_tau
        if better:
            prog.best_tau = ev[key]
        best = full_drafter(self.tr.model, self.cfg, self.info) if better else None  # a collective: every rank
        if not self.main:
            return
        step, out_dir = prog.step, self.out_dir
        append_jsonl(out_dir / EVAL_FILE, ev)
        writer.add_scalar("eval/loss", ev["loss"], step)
        writer.add_scalar("eval/tau_simulated", ev["tau"], step)
        writer.add_scalar("eval/tau_sampled", ev["tau_sampled"], step)
        for i, a in enumerate(ev["acc"]):
            writer.add_scalar(f"eval/acc_{i}", a, step)
        mark = {key: " (best)" if better else f" (best {prog.best_tau:.2f})"}
        log(f"[train] eval step {step}: held-out loss {ev['loss']:.4f} | acc {' '.join(f'{a:.2f}' for a in ev['acc'])} | "
            f"simulated tau {ev['tau']:.2f}{mark.get('tau', '')} | sampled at T {ev['sample_temperature']:g}: accept "
            f"{' '.join(f'{a:.2f}' for a in ev['accept'])}, tau {ev['tau_sampled']:.2f}{mark.get('tau_sampled', '')} | "
            f"train tau {ev['train_tau']:.2f}")
        if better:
            _save_drafter_atomic(best, out_dir / "best", {"step": step, "tau_simulated": ev["tau"], "loss": ev["loss"],
                                                          "acc": ev["acc"], "tokens_seen": ev["tokens_seen"],
                                                          "accept_sampled": ev["accept"], "tau_sampled": ev["tau_sampled"],
                                                          "sample_temperature": ev["sample_temperature"],
                                                          "best_by": self.tc.keep_best})
        over = overfitting(evals, key)
        if over and not self.overfit_named:
            self.overfit_named = True
            log(f"[train] OVERFITTING: held-out {name} fell from {over['heldout_from']:.3f} (step {over['from_step']}) "
                f"to {over['heldout_to']:.3f} (step {over['to_step']}) while train simulated tau rose from "
                f"{over['train_from']:.3f} to {over['train_to']:.3f}; train/best keeps step {over['from_step']}'s drafter "
                "(more conversations or fewer epochs would help)")
        atomic_write_bytes(out_dir / CURVE_FILE, plot_learning_curve(evals, read_jsonl(out_dir / METRICS_FILE), key))

    def checkpoint_meta(self, prog: Progress) -> dict:
        return {"fingerprint": self.fp, "epoch": prog.epoch, "position": prog.position, "total_steps": self.total_steps,
                "skipped_nonfinite": prog.skipped, "nonfinite_in_a_row": prog.in_a_row, "best_tau": prog.best_tau,
                "tokens_seen": prog.tokens_seen, "train_s": prog.train_s,
                "drafter": asdict(self.cfg), "recipe": to_jsonable(self.recipe)}

    def header(self, epoch: int) -> str:
        """The run's first log line: what trains on what, in which steps, on what."""
        tc, index, plan = self.tc, self.index, self.plan_of(epoch)
        fill = sum(self.train_lengths) / max(1, len(plan) * self.micro_tokens)
        held = self.heldout_ids
        return (f"[train] drafter {sum(p.numel() for p in self.tr.params) / 1e6:.1f}M trainable params, draft vocab "
                f"{self.cfg.draft_vocab_size}, {len(self.train_ids)} samples ({index.dropped} dropped, {len(held)} held out"
                + (f" in {len({self.conversations[j] for j in held})} conversations, evaluated every {self.eval_every} steps" if held else "")
                + f"), {sum(self.train_lengths)} tokens/epoch, "
                f"{len(plan)} micro-batches/epoch x {self.micro_per_step} per step over {self.info.world_size} rank(s), "
                f"{self.total_steps} steps, "
                + (f"packed [1, {self.micro_tokens}] ({100 * fill:.1f}% real tokens), " if tc.batch_layout == "packed" else "padded, ")
                + f"{self.info.device} {str(self.compute_dtype).replace('torch.', '')}, attention {tc.attention}"
                + (", compiled loss" if self.tr.compiled else "") + self.source.describe())


def setup(recipe: Recipe, run_dir: Path, fp: str) -> Trainer:
    """Check the inputs, start (or take up) the manifest, open the data source, build the drafter
    from the target's embedding and head, split off the held-out conversations, plan the steps."""
    tc = recipe.train
    check_recipe(recipe, str(run_dir / RECIPE_FILE), only=TRAIN_NEEDS)
    k = int(tc.ttt_steps)
    info = init_distributed(tc.device)
    main = info.is_main
    micro_tokens, micro_per_step = micro_batching(tc.batch_tokens, tc.micro_batch_tokens, info.world_size)
    vocab_dir, out_dir = stage_dir(run_dir, "vocab"), stage_dir(run_dir, "train")
    source = data_source(recipe, run_dir)
    vocab_m = require_complete(vocab_dir, "vocab")
    latest = find_latest(out_dir) if out_dir.exists() else None
    prev = load_manifest(out_dir)
    if prev is not None and prev.get("status") == "running" and prev["fingerprint"] == fp:
        manifest = prev
    else:
        config = {"draft": recipe.draft, "train": tc, "seed": recipe.seed, **source.fingerprinted_config()}
        manifest = new_manifest("train", fp, config, {source.stage: source.manifest["fingerprint"], "vocab": vocab_m["fingerprint"]})
    manifest["online"] = source.online
    if main:
        out_dir.mkdir(parents=True, exist_ok=True)
        remove_temp_files(out_dir, recursive=True)  # half-written files of a killed run (rank 0 is the only writer)
        write_manifest(out_dir, manifest)
    # Every shard is hashed on rank 0, on a resume too: a byte flipped since the last run must not train.
    shard_paths = verify_shards(source.dir, source.manifest, check_hash=main)

    device = info.device
    compute_dtype = resolve_dtype(tc.dtype, device)
    embed, lm_head, tcfg = read_target_embeddings(recipe.target.path, recipe.target.trust_remote_code)
    d2t, t2d = load_vocab(vocab_dir / VOCAB_FILE)
    if t2d.numel() != int(tcfg.vocab_size):
        raise DraftsmithError(f"{vocab_dir / VOCAB_FILE}: t2d covers {t2d.numel()} tokens, the target has {tcfg.vocab_size}; "
                              f"rerun {rerun_command('vocab', run_dir)}")
    hidden = int(tcfg.hidden_size)
    # Packed micro-batches are one fixed row of micro_tokens: longer samples are cut to it.
    packed_tokens = micro_tokens if tc.batch_layout == "packed" else None
    max_length = min(tc.max_length, micro_tokens) if packed_tokens else tc.max_length
    aux_layer_ids = source.open(shard_paths, hidden, max_length, packed_tokens, device.type == "cuda", info, manifest)
    index = source.index
    if len(index) == 0:
        raise DraftsmithError(f"{source.dir / 'manifest.json'}: no sample has 3+ tokens and a loss token at position >= 2 "
                              f"({index.dropped} dropped); check prepare's loss masks and max_length")
    cfg = drafter_config(tcfg, recipe.draft, d2t.numel(), aux_layer_ids)
    drafter = init_drafter(cfg, embed, d2t, t2d, recipe.seed, vocab_path=vocab_dir / VOCAB_FILE).to(device)
    head_weight = lm_head[draft_ids(d2t)].to(device=device, dtype=compute_dtype)
    if tc.head_init == "target":  # a resumed run overwrites it with its checkpoint
        with torch.no_grad():
            drafter.lm_head.weight.copy_(lm_head[draft_ids(d2t)].to(drafter.lm_head.weight))
    del embed, lm_head
    tr = make_trainable(drafter, tc, info, compute_dtype)
    autocast = torch.autocast(device.type, dtype=compute_dtype) if compute_dtype != torch.float32 else nullcontext()

    conversations = conversation_keys(index.source_id, index.sample_index)
    train_ids, heldout_ids = split_by_conversation(conversations, heldout_count(tc.heldout_samples, len(index)), recipe.seed)
    train_lengths = [index.lengths[j] for j in train_ids]
    mean_context = sum(n * (n + 1) / 2 for n in train_lengths) / max(1, sum(train_lengths))
    t = Trainer(recipe, fp, info, out_dir, manifest, latest, source, cfg, tr,
                head_weight, compute_dtype, autocast, micro_tokens, micro_per_step, conversations, train_ids, heldout_ids,
                train_lengths, torch.stack([position_weights(m, k) for m in index.loss_mask]), total_steps=0, eval_every=0,
                flops_per_token=train_flops_per_token(cfg, k, mean_context), peak=peak_flops(device, tc.peak_tflops))
    t.total_steps = total_steps_of(recipe, lambda e: len(t.plan_of(e)), micro_per_step)
    t.eval_every = eval_interval(tc.eval_every, t.total_steps)
    return t


def run(recipe: Recipe, run_dir: Path, fp: str) -> dict:
    """The train stage (module docstring): set up, resume if a checkpoint is there, take the steps
    (evaluating on the held-out samples and saving checkpoints as they fall due), finish."""
    t = setup(recipe, Path(recipe.run_dir if run_dir is None else run_dir), fp)
    tc, info, main, out_dir, device = t.tc, t.info, t.main, t.out_dir, t.info.device
    prog, window_recs = resume(t.latest, t.tr, fp, out_dir, info, t.best_figure[1])
    metrics_path = out_dir / METRICS_FILE
    window: deque = deque(window_recs, maxlen=max(1, tc.log_every))
    evals = [r for r in read_jsonl(out_dir / EVAL_FILE)] if t.heldout_ids else []
    barrier(info)
    writer = bar = None
    if main:
        log(t.header(prog.epoch))
        from torch.utils.tensorboard import SummaryWriter  # why here: tensorboard is heavy, and only rank 0 writes

        writer = SummaryWriter(str(out_dir / "tensorboard"), purge_step=prog.step + 1 if prog.step else None)
        bar = tqdm(total=t.total_steps, initial=prog.step, desc="train", unit="step", file=sys.stderr, mininterval=2.0,
                   disable=not sys.stderr.isatty())
    start_step, start_tokens, t_start = prog.step, prog.tokens_seen, time.time()
    train_s_before, budget_s = prog.train_s, 60.0 * tc.max_minutes

    def out_of_time() -> bool:
        """The minutes budget is spent (rank 0's clock decides for every rank)."""
        prog.train_s = train_s_before + time.time() - t_start
        if not budget_s:
            return False
        flag = torch.tensor([float(prog.train_s >= budget_s)], dtype=torch.float64, device=device)
        all_reduce_sum(flag if main else flag.zero_(), info)
        return bool(flag.item())
    t_window, tokens_window = t_start, 0

    # The loader reads (or, online, computes) the micro-batches of the next step on a background
    # thread while this one trains: `queued` holds the steps whose batches it has been given.
    loader = Loader(t.source.load, device)
    steps_ahead = t.schedule(prog.epoch, prog.position)
    queued: deque = deque()
    stopped = "budget" if budget_s and train_s_before >= budget_s else None  # a resumed run whose budget was spent
    try:
        while prog.step < t.total_steps and stopped is None:
            while len(queued) < 2 and prog.step + len(queued) < t.total_steps:
                queued.append(next(steps_ahead))
                for ids in t.my_slots(queued[-1][2]):
                    loader.ahead(queued[-1][2][0] if ids is None else ids)
            prog.epoch, prog.position, micro_ids = queued.popleft()
            rec = t.train_step(loader, micro_ids, prog)
            step = prog.step
            window.append(rec)
            tokens_window += rec["tokens"]
            if out_of_time():
                stopped = "budget"
            last = step == t.total_steps or stopped is not None  # evaluate and save at the last step
            if main:
                append_jsonl(metrics_path, rec)
                bar.update(1)
                if not rec["skipped"]:
                    _scalars(writer, rec)

            if main and (step % max(1, tc.log_every) == 0 or last):
                now = time.time()
                tokens_per_s = tokens_window / max(now - t_window, 1e-9)
                eta = (now - t_start) / (step - start_step) * (t.total_steps - step)
                _log_window(writer, window, t, prog, tokens_per_s, eta)
                t_window, tokens_window = now, 0

            if t.heldout_ids and ((t.eval_every > 0 and step % t.eval_every == 0) or last):
                t.heldout_checkpoint(loader, prog, window, evals, writer)

            if step % max(1, tc.save_every) == 0 or last:
                folder = save_checkpoint(out_dir, step, t.tr.model, t.tr.opts, t.tr.names, t.checkpoint_meta(prog), info)
                t.manifest["checkpoint"] = folder.name
                if main:
                    write_manifest(out_dir, t.manifest)
    finally:
        loader.close()
        if main:
            writer.close()
            bar.close()
    wall = time.time() - t_start
    tokens_per_s = (prog.tokens_seen - start_tokens) / wall if wall > 0 and prog.step > start_step else None
    return finish(t, prog, stopped or "steps", window, evals, wall, round(train_s_before + wall, 3), tokens_per_s)


def _scalars(writer, rec: dict) -> None:
    """A step's figures in TensorBoard."""
    step = rec["step"]
    writer.add_scalar("train/loss", rec["loss"], step)
    writer.add_scalar("train/lr", rec["lr"], step)
    writer.add_scalar("train/grad_norm", rec["grad_norm"], step)
    for i, (a, c) in enumerate(zip(rec["acc"], rec["ce"])):
        writer.add_scalar(f"train/acc_{i}", a, step)
        writer.add_scalar(f"train/ce_{i}", c, step)
    writer.add_scalar("train/tau_simulated", simulated_tau(rec["acc"]), step)


def _log_window(writer, window: deque, t: Trainer, prog: Progress, tokens_per_s: float, eta: float) -> None:
    """The log line every log_every steps: the window's figures, throughput, MFU, memory."""
    w, step = _window_metrics(window, t.k), prog.step
    mfu = tokens_per_s * t.flops_per_token / (t.peak * t.info.world_size) if t.peak else None
    mem = _peak_memory_gib(t.info.device)
    log(f"[train] step {step}/{t.total_steps} | loss {w['loss']:.4f} | acc {' '.join(f'{a:.2f}' for a in w['acc'])} | "
        f"tau {w['tau']:.2f} | lr {window[-1]['lr']:.2e} | gnorm {w['grad_norm']:.2f} | {tokens_per_s:,.0f} tok/s"
        + (f" | mfu {100 * mfu:.1f}%" if mfu is not None else "") + f" | mem {mem:.1f} GiB | eta {_fmt_s(eta)}"
        + (f" | skipped {prog.skipped}" if prog.skipped else ""))
    writer.add_scalar("train/tokens_per_s", tokens_per_s, step)
    writer.add_scalar("train/peak_memory_gib", mem, step)
    if mfu is not None:
        writer.add_scalar("train/mfu", mfu, step)
    writer.flush()


def finish(t: Trainer, prog: Progress, stopped: str, window: deque, evals: list[dict], wall: float, train_s: float,
           tokens_per_s: float | None) -> dict:
    """The run's drafter (the best by held-out figure when there are held-out samples, else the
    last) in train/drafter, the held-out engine tau beside it, and the complete manifest."""
    tc, info, out_dir, manifest, step = t.tc, t.info, t.out_dir, t.manifest, prog.step
    device = info.device
    if stopped == "budget" and info.is_main:
        log(f"[train] budget of {tc.max_minutes:g} min spent after {prog.train_s / 60:.1f} min: stopped at step {step} of "
            f"{t.total_steps}, checkpoint saved")
    final = full_drafter(t.tr.model, t.cfg, info)
    barrier(info)
    if not info.is_main:
        return manifest
    final.eval()
    best_rec = read_json_safe(out_dir / "best" / "best.json") if t.heldout_ids else {}
    if best_rec:  # the drafter downstream stages use is the best by held-out figure; the last one stays beside it
        last_sha = _save_drafter_atomic(final, out_dir / "last")
        sha = _copy_drafter_atomic(out_dir / "best", out_dir / "drafter")
        manifest["last"] = {"dir": "last", "sha256": last_sha, "step": step}
    else:
        sha = _save_drafter_atomic(final, out_dir / "drafter")
        manifest.pop("last", None)
        shutil.rmtree(out_dir / "last", ignore_errors=True)
    w = _window_metrics(window, t.k)
    manifest["output_fingerprint"] = fingerprint(t.fp, sha)  # downstream reruns when a continued run changed the drafter
    manifest["drafter"] = {"dir": "drafter", "sha256": sha, "config": asdict(t.cfg),
                           "from": f"best held-out {t.best_figure[2]} (step {best_rec['step']})" if best_rec else f"last step ({step})"}
    manifest["device"], manifest["compute_dtype"] = device.type, str(t.compute_dtype).replace("torch.", "")
    manifest["world_size"] = info.world_size
    manifest["stopped"] = stopped  # steps: the planned step count (max_steps / max_tokens / epochs); budget: max_minutes
    manifest["budget"] = {"max_tokens": tc.max_tokens, "max_minutes": tc.max_minutes, "total_steps": t.total_steps,
                          "train_s": train_s}
    manifest["counts"] = {"steps": step, "skipped_nonfinite": prog.skipped, "samples": len(t.train_ids),
                          "samples_heldout": len(t.heldout_ids), "samples_dropped": t.index.dropped,
                          "tokens_per_epoch": sum(t.train_lengths), "batches_per_epoch": len(t.plan_of(prog.epoch)),
                          "micro_batches_per_step": t.micro_per_step, "epochs_started": prog.epoch + 1,
                          "batch_layout": tc.batch_layout, "micro_batch_tokens": t.micro_tokens}
    manifest["metrics"] = {"loss": w["loss"], "acc_per_position": w["acc"], "tau_simulated": w["tau"],
                           "tokens_per_s": tokens_per_s, "steps": step, "window_steps": len(window),
                           "mfu": tokens_per_s * t.flops_per_token / (t.peak * info.world_size) if t.peak and tokens_per_s else None,
                           "peak_memory_gib": round(_peak_memory_gib(device), 3), "train_flops_per_token": t.flops_per_token}
    if best_rec:
        held = t.heldout_ids
        manifest["metrics"]["heldout_tau_simulated_best"] = best_rec["tau_simulated"]
        manifest["metrics"]["heldout"] = heldout_record(evals, best_rec, len(held), len({t.conversations[j] for j in held}),
                                                       t.tc.keep_best)
        manifest["best"] = {"dir": "best", **best_rec}
        if tc.heldout_engine_prompts > 0:
            t0 = time.time()
            prompts = engine_prompts(t.conversations, t.index.input_ids, t.index.loss_mask, held)
            eng = engine_record(t.recipe, out_dir / "drafter", prompts, t.source.target if t.source.online else None)
            manifest["metrics"]["heldout"]["engine"] = eng
            manifest["timings"]["heldout_engine_s"] = round(time.time() - t0, 3)
            log(f"[train] held-out tau measured by the engine {eng['tau_chain']:.3f} on {eng['prompts']} held-out prompts "
                f"(greedy chain, depth {eng['depth']}, {eng['max_new_tokens']} new tokens, {time.time() - t0:.1f} s); "
                f"held-out simulated tau of this drafter {best_rec['tau_simulated']:.3f}" if "skipped" not in eng
                else f"[train] held-out tau by the engine skipped: {eng['skipped']}")
    manifest["timings"]["train_s_this_session"] = round(wall, 3)
    log(f"[train] done: {step} steps, loss {w['loss']:.4f}, acc {' '.join(f'{a:.2f}' for a in w['acc'])}, "
        f"simulated tau {w['tau']:.2f}; drafter in {out_dir / 'drafter'} ({manifest['drafter']['from']})"
        + (f"; held-out simulated tau best {best_rec['tau_simulated']:.3f}, last {evals[-1]['tau']:.3f}" if best_rec and evals else ""))
    return finish_manifest(out_dir, manifest)


def read_json_safe(path: Path) -> dict:
    return read_json(path) if path.exists() else {}
