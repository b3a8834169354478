"""The speculative methods by name (config.SPEC_METHODS), on top of the decode loop: the one entry
point the evaluate stage and train's held-out check both decode through.

    load_models(recipe, drafter_dir)     the target (the drafter's aux layers hooked) and the drafter
    DecodeRunners(target, drafter, mode) the fast path's runners (evaluate.fast), per batch size, or eager
    make_proposer(method, ...)           one method's proposer, one branch per method
    method_depth(cfg, method)            how deep a method drafts (its verify rows past the context)
    prompt_budget(target, cfg, methods)  the longest prompt the target's positions leave room for
    decode(target, drafter, method, prompts, cfg, eos_ids, ...)   (new tokens, SpecStats) per prompt
    decode_plain(target, prompts, cfg, eos_ids, ...)              plain decoding's new tokens per prompt

Nothing here times anything: evaluate/measure.py times these calls.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from ..messages import DraftsmithError
from ..config import Recipe
from ..draft.io import load_drafter, read_drafter_config
from ..target.model import load_target
from .eagle3 import Eagle3Proposer, FastDraft
from .engine import generate, plain_generate_batch
from .fast import FastTarget, choose_mode, fast_target_or_none
from .hybrid import HybridProposer
from .ngram import NgramProposer
from .proposer import PerSequence
from .skinny import resolve_verify_gemm


def load_models(recipe: Recipe, drafter_dir: Path):
    """The target (with the drafter's aux layers hooked) and the drafter, on one device and dtype."""
    cfg_path = drafter_dir / "config.json"
    dcfg = read_drafter_config(cfg_path)
    t = recipe.target
    aux = dcfg.aux_layer_ids or t.aux_layer_ids
    if t.aux_layer_ids and dcfg.aux_layer_ids and list(t.aux_layer_ids) != list(dcfg.aux_layer_ids):
        raise DraftsmithError(f"{cfg_path}: drafter was trained on aux layers {dcfg.aux_layer_ids} but "
                              f"target.aux_layer_ids is {t.aux_layer_ids}; use the drafter's ids or retrain")
    target = load_target(t.path, device=t.device, dtype=t.dtype, trust_remote_code=t.trust_remote_code,
                         aux_layer_ids=aux,
                         experts_implementation=t.experts_implementation)
    want = {"vocab_size": target.vocab_size, "target_hidden_size": target.hidden_size,
            "num_aux_layers": len(target.aux_layer_ids)}
    bad = {k: (getattr(dcfg, k), v) for k, v in want.items() if getattr(dcfg, k) != v}
    if bad:
        what = ", ".join(f"{k} {a} != target's {b}" for k, (a, b) in bad.items())
        raise DraftsmithError(f"{cfg_path}: drafter does not fit target {t.path} ({what}); retrain it for this target")
    drafter = load_drafter(drafter_dir, device=target.device, dtype=target.dtype)
    return target, drafter


def ngram_depth(cfg) -> int:
    return cfg.ngram_steps or cfg.draft_steps


def method_depth(cfg, method: str) -> int:
    if method == "ngram":
        return ngram_depth(cfg)
    if method == "hybrid":  # the drafter's tree and the n-gram chain beside it, each to its own depth
        return max(cfg.tree_depth, ngram_depth(cfg))
    return cfg.tree_depth if method == "eagle3_tree" else cfg.draft_steps


def max_positions(target) -> Optional[int]:
    """The target's max_position_embeddings (its text config's), or None when it declares none."""
    cfg = target.model.config
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    n = getattr(cfg, "max_position_embeddings", None)
    return int(n) if isinstance(n, int) and n > 0 else None


def prompt_budget(target, cfg, methods: list[str]) -> Optional[int]:
    """Longest prompt (tokens) that leaves room in the target's positions for max_new_tokens and the
    deepest draft a method verifies past them; None when the target declares no limit."""
    n = max_positions(target)
    if n is None:
        return None
    depth = max([method_depth(cfg, m) for m in methods], default=0)
    budget = n - cfg.max_new_tokens - depth - 1
    if budget < 1:
        raise DraftsmithError(f"evaluate.max_new_tokens {cfg.max_new_tokens}: with draft depth {depth} it leaves no room for a "
                              f"prompt in the target's {n} positions (max_position_embeddings); lower evaluate.max_new_tokens")
    return budget


class DecodeRunners:
    """The decode runners every measurement of one evaluate run shares (evaluate.fast), cached per
    batch size: a FastTarget and a FastDraft (static caches, graphs captured once and reused), or
    neither (eager). With `auto`, a target the fast path cannot run (sliding-window layers, a
    target spread over several GPUs) falls back to eager with a log line; an explicit mode errs.
    `verify_gemm` (evaluate.verify_gemm): the FastTargets' matmuls of up to 16 rows, plain and verify alike."""

    def __init__(self, target=None, drafter=None, mode: str = "off", verify_gemm: str = "cublas"):
        self.target_model, self.drafter, self.requested, self.verify_gemm = target, drafter, mode, verify_gemm
        self.mode = choose_mode(mode, target) if target is not None else "off"
        if self.mode != "off":  # an explicit skinny that cannot run errs here, not as a fast path unavailable
            self.verify_gemm = resolve_verify_gemm(verify_gemm, target.model)
        self._by_batch: dict[int, tuple] = {}

    def get(self, batch: int) -> tuple[Optional[FastTarget], Optional[FastDraft]]:
        if self.mode == "off":
            return None, None
        if batch not in self._by_batch:
            ft = fast_target_or_none(self.target_model, self.mode, self.requested, "evaluate.fast",
                                     "eager decoding for plain and every method", batch_size=batch,
                                     verify_gemm=self.verify_gemm)
            if ft is None:
                self.mode = "off"
                return None, None
            self._by_batch[batch] = (ft, FastDraft(self.drafter, graphs=ft.graphs, compile=ft.mode == "compile"))
        return self._by_batch[batch]


EAGER_RUNNERS = DecodeRunners()
"""No fast path: plain and speculative decoding on the eager target."""


def make_proposer(method: str, drafter, cfg, batch: int, generator=None, runners: DecodeRunners = EAGER_RUNNERS):
    fast = runners.get(batch)[1]
    if method == "eagle3_chain":
        return Eagle3Proposer(drafter, topk=1, budget=cfg.draft_steps, temperature=cfg.temperature, generator=generator,
                              fast=fast)
    if method == "eagle3_tree":
        return Eagle3Proposer(drafter, topk=cfg.tree_topk, budget=cfg.tree_budget, temperature=cfg.temperature,
                              generator=generator, fast=fast)
    if method == "ngram":
        return PerSequence([NgramProposer(cfg.ngram_max) for _ in range(batch)])
    if method == "hybrid":
        return HybridProposer(make_proposer("eagle3_tree", drafter, cfg, batch, generator, runners),
                              make_proposer("ngram", drafter, cfg, batch), cfg.tree_depth, ngram_depth(cfg),
                              cfg.hybrid_trust_ngram)
    raise ValueError(method)


def decode_plain(target, prompts: list[list[int]], cfg, eos_ids, generator=None, runners: DecodeRunners = EAGER_RUNNERS,
                 max_new_tokens=None) -> list[list[int]]:
    """Plain decoding, the baseline: the decode loop with no proposer, over the runners' cache: on the fast
    path the resident loop's steps (the token fed back on the GPU, one graph per step), else one eager
    forward per token on the host."""
    return plain_generate_batch(target, prompts, max_new_tokens or cfg.max_new_tokens, eos_ids, cfg.temperature, generator,
                                fast=runners.get(len(prompts))[0])


def decode(target, drafter, method: str, prompts: list[list[int]], cfg, eos_ids, generator=None, max_new_tokens=None,
           runners: DecodeRunners = EAGER_RUNNERS):
    """(new tokens per prompt, SpecStats per prompt) of one speculative method (cfg: an EvaluateConfig)."""
    return generate(target, make_proposer(method, drafter, cfg, len(prompts), generator, runners), prompts,
                    max_new_tokens or cfg.max_new_tokens, method_depth(cfg, method), eos_ids, cfg.temperature, generator,
                    fast=runners.get(len(prompts))[0], resident=cfg.resident, compile_round=cfg.compile_round == "on")
