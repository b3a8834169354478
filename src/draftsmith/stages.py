"""The stage table: each stage's name, the function that runs it, and what the pipeline needs to
know of it, each declared by the stage's own module: the config sections its fingerprint covers
and the stages whose output it reads (`inputs` where the recipe changes them), the keys left out,
when it is skipped, an extra fingerprint input, a partial output a rerun resumes. The pipeline
runs it in this order and names no stage itself; the CLI lists it. A stage takes its inputs from
the run directory (manifests.py, rundir.py), never from here.

    prepare ─▶ regenerate (optional) ─▶ capture ─┐
                                      └▶ vocab ───┴▶ train ─▶ evaluate
                                                         └──▶ export
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from . import export, vocab
from .config import STAGES, Recipe
from .data import prepare, regenerate
from .evaluate import stage as evaluate
from .target import capture
from .train import heldout, sources
from .train import loop as train


@dataclass(frozen=True)
class Stage:
    run: Callable[[Recipe, Path, str], dict]
    """`run(recipe, run_dir, fingerprint) -> manifest`: idempotent, resumes what it listed."""
    help: str
    sections: tuple[str, ...]
    """Recipe sections its fingerprint covers."""
    upstream: tuple[str, ...]
    """Stages whose output it reads (their fingerprints enter its own)."""
    unfingerprinted: tuple[str, ...] = ()
    """Keys of its sections ("train.log_every") left out of its fingerprint: they only change what
    it logs, saves on the way or measures beside its output, never the output itself, so changing
    one leaves a complete stage complete (and downstream stages with it)."""
    revisit: Optional[Callable[[dict, Recipe], tuple[str, str]]] = None
    """For a key left out that can still matter (train.max_minutes, regenerate.timeout_s): `revisit(manifest, recipe)` of a
    complete output with the same fingerprint -> (verdict, why): "done" (skip it), "continue" (run
    the stage on it: it resumes from what it saved) or "restart" (start over, as for other inputs)."""
    distributed: bool = False
    """Runs on every rank under torchrun (it sets up the process group: capture, train, online training).
    A stage that is not runs on rank 0 only; the other ranks wait until rank 0 has finished it (pipeline.wait_for_rank0)."""
    skipped: Optional[Callable[[Recipe], Optional[str]]] = None
    """`skipped(recipe)`: why the stage does not run in this recipe (None: it runs); a skipped stage is
    no other stage's upstream (regenerate off: capture and vocab read data/)."""
    inputs: Optional[Callable[[Recipe], Optional[tuple[tuple[str, ...], tuple[str, ...]]]]] = None
    """`inputs(recipe)`: (sections, upstream) in place of the two above where the recipe changes them
    (train.online: the token shards and capture's settings instead of capture's output), else None."""
    extra: Optional[Callable[[Recipe], Any]] = None
    """`extra(recipe)`: an input its fingerprint covers beside its sections and upstream outputs (None:
    none in this recipe); a (name, value) pair is shown by value when it changes, anything else by name."""
    extra_name: str = "extra"
    """How a rerun names a change of `extra` (pipeline.what_changed)."""
    partial: Optional[str] = None
    """A file in its output folder whose content a rerun resumes (evaluate's measured turns), beside the
    shards its manifest lists: a failed run that wrote some is kept, not replaced by the output set aside."""


_TABLE = (  # in the order of config.STAGES, the one list of stage names
    Stage(prepare.run, "conversations -> token shards with assistant-only loss masks", ("prepare",), (),
          extra=prepare.fingerprint_extra, extra_name=prepare.EXTRA_NAME),
    Stage(regenerate.run, "optional: the target rewrites the assistant turns (regenerate.enabled)",
          ("regenerate",), ("prepare",), regenerate.UNFINGERPRINTED, regenerate.retry_verdict,
          skipped=regenerate.skip_reason, extra=regenerate.fingerprint_extra, extra_name=regenerate.EXTRA_NAME),
    Stage(capture.run, "target forward -> aux hidden-state shards", ("capture",), ("prepare", "regenerate"),
          distributed=True, skipped=capture.skip_reason),
    Stage(vocab.run, "draft vocabulary (d2t / t2d) from token frequencies", ("vocab",), ("prepare", "regenerate")),
    Stage(train.run, "train the EAGLE-3 drafter with training-time test", ("draft", "train", "seed"),
          ("capture", "vocab"), train.UNFINGERPRINTED, train.budget_verdict, distributed=True,
          inputs=sources.stage_inputs, extra=heldout.fingerprint_extra, extra_name=heldout.EXTRA_NAME),
    Stage(evaluate.run, "speculative decoding: acceptance length and speedup vs plain decoding", ("evaluate",),
          ("train",), revisit=evaluate.check_verdict, partial=evaluate.PARTIAL),
    Stage(export.run, "write SGLang / vLLM drafter folders", ("export",), ("train",)),
)
assert len(_TABLE) == len(STAGES), "stages.py: one Stage per name of config.STAGES, in its order"
STAGE_TABLE: dict[str, Stage] = dict(zip(STAGES, _TABLE))
"""In run order; its names are config.STAGES, which status reads without importing the stages."""
