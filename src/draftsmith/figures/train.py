"""The train stage's figures (train/finish.py writes them; train/heldout.py builds the held-out
record): docs/CONTRACTS.md, train."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ..manifests import Figures, absent_when_none, section


@dataclass
class Overfitting(Figures):
    """metrics.heldout.overfitting: the held-out figure fell from its best while the training one rose."""
    from_step: Optional[int] = None
    to_step: Optional[int] = None
    heldout_from: Optional[float] = None
    heldout_to: Optional[float] = None
    train_from: Optional[float] = None
    train_to: Optional[float] = None


@dataclass
class Engine(Figures):
    """metrics.heldout.engine: the engine's greedy-chain tau on held-out prompts, or why it was skipped."""
    tau_chain: Optional[float] = absent_when_none()
    prompts: Optional[int] = absent_when_none()
    depth: Optional[int] = absent_when_none()
    max_new_tokens: Optional[int] = absent_when_none()
    emitted: Optional[int] = absent_when_none()
    rounds: Optional[int] = absent_when_none()
    conversations: Optional[list[Any]] = absent_when_none()
    """Each prompt's conversation key (data/conversations.py)."""
    skipped: Optional[str] = absent_when_none()


@dataclass
class Heldout(Figures):
    """metrics.heldout: the held-out evaluations' record; best_* are train/best's (by best_by, train.keep_best)."""
    samples: Optional[int] = None
    conversations: Optional[int] = None
    evaluations: Optional[int] = None
    best_by: Optional[str] = None
    """train.keep_best (greedy / sampled); absent in runs before it, which kept by greedy."""
    best_step: Optional[int] = None
    best_tau_simulated: Optional[float] = None
    best_acc_per_position: Optional[list[float]] = None
    best_tau_sampled: Optional[float] = None
    best_accept_sampled_per_position: Optional[list[float]] = None
    sample_temperature: Optional[float] = None
    last_step: Optional[int] = None
    last_tau_simulated: Optional[float] = None
    last_acc_per_position: Optional[list[float]] = None
    last_tau_sampled: Optional[float] = None
    sampled_best_step: Optional[int] = None
    """The evaluation keep_best sampled would keep."""
    sampled_best_tau: Optional[float] = None
    still_improving: Optional[bool] = None
    overfitting: Optional[Overfitting] = None
    engine: Optional[Engine] = absent_when_none()


@dataclass
class TrainMetrics(Figures):
    """metrics: the last log window's figures, throughput, memory; the held-out record when samples are held out."""
    loss: Optional[float] = None
    acc_per_position: Optional[list[float]] = None
    tau_simulated: Optional[float] = None
    tokens_per_s: Optional[float] = None
    steps: Optional[int] = None
    window_steps: Optional[int] = None
    mfu: Optional[float] = None
    peak_memory_gib: Optional[float] = None
    train_flops_per_token: Optional[float] = None
    heldout_tau_simulated_best: Optional[float] = absent_when_none()
    heldout: Optional[Heldout] = absent_when_none()


@dataclass
class TrainCounts(Figures):
    steps: Optional[int] = None
    skipped_nonfinite: Optional[int] = None
    samples: Optional[int] = None
    samples_heldout: Optional[int] = None
    samples_dropped: Optional[int] = None
    tokens_per_epoch: Optional[int] = None
    batches_per_epoch: Optional[int] = None
    micro_batches_per_step: Optional[int] = None
    epochs_started: Optional[int] = None
    batch_layout: Optional[str] = None
    micro_batch_tokens: Optional[int] = None


@dataclass
class Budget(Figures):
    """budget: what the run was allowed and what it spent (train_s: training seconds over every session)."""
    max_tokens: Optional[int] = None
    max_minutes: Optional[float] = None
    total_steps: Optional[int] = None
    train_s: Optional[float] = None


@dataclass
class TrainFigures(Figures):
    """What train/finish.py writes at the top of the manifest (beside the drafter's files and checksums)."""
    device: Optional[str] = None
    compute_dtype: Optional[str] = None
    world_size: Optional[int] = None
    stopped: Optional[str] = None
    """steps: the planned step count (max_steps / max_tokens / epochs); budget: train.max_minutes."""
    budget: Budget = section(Budget)
    counts: TrainCounts = section(TrainCounts)
    metrics: TrainMetrics = section(TrainMetrics)
