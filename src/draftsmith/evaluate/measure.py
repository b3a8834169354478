"""The measurement runs of the evaluate stage: plain decoding and each speculative method on one
prompt or one batch (speculate/methods.py decodes them, on the run's decode runners: the fast
path's or eager), timed with the device synchronised; and the lossless check, which tells a
rounding tie from a bug by one independent forward.
"""
from __future__ import annotations

import time
from typing import Optional

import torch

from ..messages import DraftsmithError
from ..config import SPEC_METHODS, check_methods as check_method_names
from ..speculate.cache import CAPTURES, seeded_generator
from ..speculate.methods import EAGER_RUNNERS, DecodeRunners, decode, decode_plain

# A divergence is a rounding tie when the speculative token sits below the top logit of an independent
# forward by no more than the target's own rounding there: a verify forward over k+1 rows rounds
# differently from single-row forwards, and in 16-bit dtypes (MoE routing above all: a bf16 MoE target
# showed gaps of 0.127 where a fixed 0.1 called them bugs) the difference grows through the layers. So
# the tolerance is measured at the divergence point: TIE_SPREAD_FACTOR x the largest relative change of
# that row's logits when the same prefix is forwarded with SPREAD_ROWS more rows (tie_tolerance), never
# below the dtype's floor (float32: 1e-5; else its machine epsilon). Exactness is tested in float32.
TIE_SPREAD_FACTOR = 4
SPREAD_ROWS = (1, 8)
TIE_FLOOR = {torch.float32: 1e-5}


# ----------------------------------------------------------------------------- methods


def check_methods(cfg, where: str) -> list[str]:
    """Methods in a fixed order; plain is the reference and always runs. The names are checked at
    parse time too (config.check_recipe); again here for a Recipe built in code."""
    check_method_names(cfg.methods, where)
    return [m for m in SPEC_METHODS if m in cfg.methods]


def timed(where, fn):
    """(fn(), seconds), the device synchronised before and after; `where` is a device or has one."""
    device = getattr(where, "device", where)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    r = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return r, time.perf_counter() - t0


def timed_uncaptured(where, fn):
    """timed(where, fn), run again when that call captured a CUDA graph (speculate.cache.CAPTURES moved:
    a shape or an attention width the run's warm-up had not met, e.g. a longer prompt), so that no
    figure holds a capture's cost. The second call's result and seconds are returned."""
    n = CAPTURES[0]
    r = timed(where, fn)
    return timed(where, fn) if CAPTURES[0] != n else r


def run_plain(target, prompts: list[list[int]], cfg, eos_ids, generator=None, runners: DecodeRunners = EAGER_RUNNERS,
              max_new_tokens=None) -> tuple[list[list[int]], float]:
    """(new tokens per prompt, wall seconds) of plain decoding, the baseline (speculate.methods.decode_plain)."""
    runners.get(len(prompts))  # a batch size's fast runners are built before the clock starts
    return timed_uncaptured(target, lambda: decode_plain(target, prompts, cfg, eos_ids, generator, runners, max_new_tokens))


def run_method(target, drafter, method: str, prompts: list[list[int]], cfg, eos_ids, generator=None, max_new_tokens=None,
               runners: DecodeRunners = EAGER_RUNNERS):
    """(new tokens per prompt, SpecStats per prompt, wall seconds) of one speculative method (speculate.methods.decode)."""
    (new, stats), s = timed_uncaptured(target, lambda: decode(target, drafter, method, prompts, cfg, eos_ids, generator,
                                                              max_new_tokens, runners))
    return new, stats, s


# ----------------------------------------------------------------------------- one prompt


def _first_difference(a: list[int], b: list[int]) -> Optional[int]:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def tie_floor(dtype: torch.dtype) -> float:
    """The smallest tie tolerance: float32's 1e-5, else the dtype's machine epsilon (bf16 0.0078)."""
    return TIE_FLOOR.get(dtype, float(torch.finfo(dtype).eps) if dtype.is_floating_point else 1e-5)


def divergence_gaps(target, prompt_ids: list[int], plain: list[int], spec: list[int], pos: int):
    """(gap of plain's token, gap of spec's token, tie tolerance): the gaps below the top logit of ONE
    independent, uncached forward of the common prefix, relative to |top|, and the tolerance measured
    on the same row (see TIE_SPREAD_FACTOR); None when one side ended at `pos`."""
    if pos >= min(len(plain), len(spec)):
        return None
    prefix = prompt_ids + plain[:pos]

    def row_logits(extra: list[int]) -> torch.Tensor:
        ids = torch.tensor([prefix + extra], device=target.device)
        return target.forward(ids).logits[0, len(prefix) - 1].float()

    logits = row_logits([])
    top = logits.max()
    scale = top.abs().clamp(min=1.0)
    spread = max(float((row_logits(plain[pos:pos + r]) - logits).abs().max() / scale) for r in SPREAD_ROWS)
    tol = max(tie_floor(target.dtype), TIE_SPREAD_FACTOR * spread)
    return float((top - logits[plain[pos]]) / scale), float((top - logits[spec[pos]]) / scale), tol


def classify_divergence(gaps, dtype: torch.dtype) -> str:
    """tie:      the speculative token is (within the target's measured rounding) the top of the independent
                 forward too: two near-equal logits, rounded differently by differently shaped forwards;
    numeric:  the independent forward sides with neither decoder: rounding alone moves the top by
                 more than the tolerance here (bf16 MoE targets, whose routing can flip);
    bug:      the independent forward agrees with plain decoding and not with the speculative one.
    `gaps` is divergence_gaps' (plain, spec, tolerance); without a tolerance, the dtype's floor."""
    if gaps is None:
        return "bug"
    tol = gaps[2] if len(gaps) > 2 else tie_floor(dtype)
    gap_plain, gap_spec = gaps[0], gaps[1]
    if gap_spec <= tol:
        return "tie"
    return "numeric" if gap_plain > tol else "bug"


def _gap(gaps, i: int) -> str:
    return "n/a" if gaps is None else f"{gaps[i]:.4g}"


def _tolerance(gaps, dtype) -> str:
    return f"{gaps[2]:.4g}" if gaps is not None and len(gaps) > 2 and gaps[2] is not None else f"{tie_floor(dtype):g}"


def lossless_check(target, prompt_ids, plain, spec, check: bool, where: str, method: str) -> dict:
    """{lossless, first_difference, divergence, gap_plain, gap_spec, near_tie_gap}; raises on a
    divergence classified `bug` (see classify_divergence) when `check`."""
    rec = {"lossless": spec == plain, "first_difference": None, "divergence": None, "gap_plain": None,
           "gap_spec": None, "near_tie_gap": None, "tie_tolerance": None}
    if spec != plain:
        pos = _first_difference(plain, spec)
        gaps = divergence_gaps(target, prompt_ids, plain, spec, pos)
        kind = classify_divergence(gaps, target.dtype)
        rec.update(first_difference=pos, divergence=kind, gap_plain=gaps and gaps[0], gap_spec=gaps and gaps[1],
                   near_tie_gap=gaps[1] if kind == "tie" else None, tie_tolerance=gaps and gaps[2])
        if check and kind == "bug":
            got = spec[pos] if pos < len(spec) else "end"
            want = plain[pos] if pos < len(plain) else "end"
            raise divergence_error(where, method, f"{pos} (plain {want}, speculative {got})", gaps, target.dtype)
    return rec


def divergence_error(where: str, method: str, at: str, gaps, dtype) -> DraftsmithError:
    """The lossless check's stop on a divergence classified `bug`; its fix (the check off) resumes the
    evaluation: the turns measured so far are kept (evaluate.check_lossless is hashed at one value, pipeline.HASHED_AT)."""
    return DraftsmithError(f"{where}: {method}: speculative output differs from plain greedy decoding at new token "
                           f"{at}, and an independent forward agrees with plain decoding: no rounding tie (logit gaps to "
                           f"its top: plain {_gap(gaps, 0)}, speculative {_gap(gaps, 1)}, tie tolerance "
                           f"{_tolerance(gaps, dtype)}, measured from this target's own rounding there). This is a draftsmith bug unless the target's routing or kernels "
                           "differ by row count in this dtype; please report it (set evaluate.check_lossless false to measure "
                           "anyway: the turns measured so far are kept)")


def check_recorded(rec: dict, where: str, dtype) -> None:
    """The lossless check on a turn measured earlier with it off (a resumed evaluation): raises on a
    divergence recorded as `bug`, as lossless_check would have while measuring."""
    for method, r in rec.get("methods", {}).items():
        if r.get("divergence") == "bug":
            gaps = None if r.get("gap_spec") is None else (r["gap_plain"], r["gap_spec"], r.get("tie_tolerance"))
            raise divergence_error(f"{where} (measured with evaluate.check_lossless off)", method,
                                   str(r["first_difference"]), gaps, dtype)


def evaluate_prompt(target, drafter, prompt_ids: list[int], cfg, methods: list[str], eos_ids: list[int],
                    salt: int, where: str, runners: DecodeRunners = EAGER_RUNNERS) -> dict:
    """Plain and every method on one prompt, batch 1."""
    gen = lambda: seeded_generator(target.device, cfg.temperature, cfg.seed, salt)  # noqa: E731 (each run: the same draws)
    [plain], plain_s = run_plain(target, [prompt_ids], cfg, eos_ids, gen(), runners)
    rec = {"prompt_tokens": len(prompt_ids), "prompt_ids": prompt_ids, "plain_new_tokens": len(plain), "plain_s": plain_s,
           "plain_tokens": plain, "methods": {}}
    for m in methods:
        [spec], [st], spec_s = run_method(target, drafter, m, [prompt_ids], cfg, eos_ids, gen(), runners=runners)
        r = {"new_tokens": len(spec), "spec_s": spec_s, "target_s": st.target_s, "draft_s": st.draft_s,
             "rounds": st.rounds, "emitted": sum(st.emitted_per_round),
             "drafted_per_round": st.drafted_per_round, "accepted_per_round": st.accepted_per_round,
             "drafted": st.drafted, "reached": st.reached, "accepted": st.accepted}
        if cfg.temperature <= 0:
            r.update(lossless_check(target, prompt_ids, plain, spec, cfg.check_lossless, where, m))
        rec["methods"][m] = r
    return rec


def evaluate_batch(target, drafter, prompts: list[list[int]], references: list[list[int]], cfg, methods, eos_ids,
                   salt: int, runners: DecodeRunners = EAGER_RUNNERS) -> dict:
    """Plain and every method on one batch of prompts; outputs compared with the batch-1 plain ones."""
    gen = lambda: seeded_generator(target.device, cfg.temperature, cfg.seed, salt)  # noqa: E731 (each run: the same draws)
    plain, plain_s = run_plain(target, prompts, cfg, eos_ids, gen(), runners)
    rec = {"batch_size": len(prompts), "plain_s": plain_s, "plain_new_tokens": sum(map(len, plain)),
           "plain_steps": max(map(len, plain)), "methods": {}}  # steps of the batch: its longest sequence's
    for m in methods:
        new, stats, s = run_method(target, drafter, m, prompts, cfg, eos_ids, gen(), runners=runners)
        rec["methods"][m] = {"spec_s": s, "new_tokens": sum(map(len, new)), "rounds": sum(st.rounds for st in stats),
                             "batch_rounds": max(st.rounds for st in stats),
                             "emitted": sum(sum(st.emitted_per_round) for st in stats),
                             "identical": sum(a == b for a, b in zip(new, references))}
    return rec
