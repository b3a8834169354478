"""The train stage: an EAGLE-3 drafter trained with training-time test on captured states.

Reads capture/ (hidden-state shards; online mode: data/ token shards, sources.py), vocab/ (d2t, t2d) and, from the target, only its input
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

Where the hidden states come from is decided once (sources.py: capture/'s shards, or online,
train.online: true, the target's forward on prepare's token shards, nothing written for the
states; the manifest records `online`). The trained module, its optimizers and a resume come from
state.py; the figures logged beside the steps and the end of the run (the drafter, the manifest)
from finish.py. run() reads top-down: Trainer.from_recipe builds what is set up once (its methods
are a step's parts: train_step, heldout_checkpoint), the loop takes the steps, finish() writes
the drafter and the manifest.
"""
from __future__ import annotations

import math
import sys
import time
from collections import deque
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from ..fileio import append_jsonl, atomic_write_bytes, read_jsonl, remove_temp_files, to_jsonable
from ..manifests import load_manifest, new_manifest, require_complete, verify_shards, write_manifest
from ..messages import DraftsmithError, log
from ..rundir import RECIPE_FILE, rerun_command, stage_dir
from ..config import Recipe, check_recipe, heldout_sample_temperature
from ..distributed.group import DistInfo, all_reduce_sum, barrier, full_tensor, init_distributed, is_sharded
from ..draft.build import drafter_config, init_drafter
from ..draft.model import Eagle3Config
from ..figures.train import TrainFigures
from ..draft.vocab import VOCAB_FILE, draft_ids, load_vocab
from ..target.model import read_target_embeddings, resolve_dtype
from .checkpoint import find_latest, save_checkpoint
from .data import Loader, epoch_plan, micro_batching, total_steps_of
from .finish import finish, full_drafter, header, log_window, save_drafter_atomic, scalars, window_metrics
from .flops import peak_flops, train_flops_per_token
from ..data.conversations import conversation_keys
from .heldout import BEST_FIGURES, eval_interval, heldout_count, overfitting, plot_learning_curve, split_by_conversation
from .sources import CaptureSource, data_source
from .state import CURVE_FILE, EVAL_FILE, METRICS_FILE, Progress, Trainable, make_trainable, resume
from .ttt import position_weights, simulated_tau

MAX_NONFINITE_IN_A_ROW = 10
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
    figures = TrainFigures.from_manifest(manifest)
    spent = figures.budget.train_s
    if spent is None:  # no record of the time spent
        return "restart", f"train.max_minutes changed from {old_s / 60:g} to {new_s / 60:g}"
    spent_txt = f"{spent / 60:.2f} min spent"
    if figures.stopped == "budget":
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


TRAIN_NEEDS = ("train.ttt_steps", "train.batch_tokens", "train.max_length", "train.max_tokens", "train.max_minutes")
"""What run() checks again (config.check_recipe's table) in a Recipe built in code; the rest (e.g. lr 0 in a
test) is refused at parse time only."""


# -- one training run: set up once (Trainer.from_recipe), then its steps (run), then the drafter (finish) --

@dataclass
class Trainer:
    """What a run sets up once: the samples and their split, the step plan, the trained module and
    its optimizers; built from the recipe by from_recipe, the rest derived from that here. Its
    methods are the parts of a step; where the run is comes from a Progress."""
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
    micro_tokens: int
    micro_per_step: int
    conversations: list
    train_ids: list[int]
    heldout_ids: list[int]
    overfit_named: bool = False  # the overfitting line is logged once, when first seen
    # derived in __post_init__
    compute_dtype: torch.dtype = field(init=False)
    autocast: object = field(init=False)
    train_lengths: list[int] = field(init=False)
    sample_weights: torch.Tensor = field(init=False)  # [N, k] float64: each sample's loss weight per TTT position
    flops_per_token: float = field(init=False)
    peak: float | None = field(init=False)
    total_steps: int = field(init=False)
    eval_every: int = field(init=False)

    def __post_init__(self):
        tc, device = self.tc, self.info.device
        self.compute_dtype = resolve_dtype(tc.dtype, device)
        self.autocast = torch.autocast(device.type, dtype=self.compute_dtype) if self.compute_dtype != torch.float32 else nullcontext()
        self.train_lengths = [self.index.lengths[j] for j in self.train_ids]
        self.sample_weights = torch.stack([position_weights(m, self.k) for m in self.index.loss_mask])
        mean_context = sum(n * (n + 1) / 2 for n in self.train_lengths) / max(1, sum(self.train_lengths))
        self.flops_per_token = train_flops_per_token(self.cfg, self.k, mean_context)
        self.peak = peak_flops(device, tc.peak_tflops)
        self.total_steps = total_steps_of(self.recipe, lambda e: len(self.plan_of(e)), self.micro_per_step)
        self.eval_every = eval_interval(tc.eval_every, self.total_steps)

    @classmethod
    def from_recipe(cls, recipe: Recipe, run_dir: Path, fp: str) -> Trainer:
        """Check the inputs, start (or take up) the manifest, open the data source, build the drafter
        from the target's embedding and head, split off the held-out conversations."""
        tc = recipe.train
        check_recipe(recipe, str(run_dir / RECIPE_FILE), only=TRAIN_NEEDS)
        info = init_distributed(tc.device)
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
        if info.is_main:
            out_dir.mkdir(parents=True, exist_ok=True)
            remove_temp_files(out_dir, recursive=True)  # half-written files of a killed run (rank 0 is the only writer)
            write_manifest(out_dir, manifest)
        # Every shard is hashed on rank 0, on a resume too: a byte flipped since the last run must not train.
        shard_paths = verify_shards(source.dir, source.manifest, check_hash=info.is_main)

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
        conversations = conversation_keys(index.source_id, index.sample_index)
        train_ids, heldout_ids = split_by_conversation(conversations, heldout_count(tc.heldout_samples, len(index)), recipe.seed)
        return cls(recipe=recipe, fp=fp, info=info, out_dir=out_dir, manifest=manifest, latest=latest, source=source, cfg=cfg,
                   tr=tr, head_weight=head_weight, micro_tokens=micro_tokens, micro_per_step=micro_per_step,
                   conversations=conversations, train_ids=train_ids, heldout_ids=heldout_ids)

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
        tw = window_metrics(window, self.k)
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
            save_drafter_atomic(best, out_dir / "best", {"step": step, "tau_simulated": ev["tau"], "loss": ev["loss"],
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


def run(recipe: Recipe, run_dir: Path, fp: str) -> dict:
    """The train stage (module docstring): set up, resume if a checkpoint is there, take the steps
    (evaluating on the held-out samples and saving checkpoints as they fall due), finish."""
    t = Trainer.from_recipe(recipe, Path(recipe.run_dir if run_dir is None else run_dir), fp)
    tc, info, main, out_dir, device = t.tc, t.info, t.main, t.out_dir, t.info.device
    if t.latest is None:  # a fresh start: torch's RNG from the seed (a resume restores the checkpoint's), so the
        torch.manual_seed(recipe.seed * 1_000_003 + info.rank)  # state each checkpoint records is the same in every run
    prog, window_recs = resume(t.latest, t.tr, fp, out_dir, info, t.best_figure[1])
    metrics_path = out_dir / METRICS_FILE
    window: deque = deque(window_recs, maxlen=max(1, tc.log_every))
    evals = [r for r in read_jsonl(out_dir / EVAL_FILE)] if t.heldout_ids else []
    barrier(info)
    writer = bar = None
    if main:
        log(header(t, prog.epoch))
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
                    scalars(writer, rec)

            if main and (step % max(1, tc.log_every) == 0 or last):
                now = time.time()
                tokens_per_s = tokens_window / max(now - t_window, 1e-9)
                eta = (now - t_start) / (step - start_step) * (t.total_steps - step)
                log_window(writer, window, t, prog, tokens_per_s, eta)
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
