"""The target's transformers model as the fast path runs it: fewer kernels a step, the same outputs.

    graph_safe_experts      MoE experts on a kernel without host syncs (CUDA graphs need one)
    fuse_rms_norms          every standard RMSNorm module on torch's rms_norm (one kernel on CUDA)
    join_rotaries           the modeling file's rotary function rotating q and k as one tensor (same bits)
    compile_regions         torch.compile of the pure regions (evaluate.fast: compile)
    hf_decode_attention     draft.attention.decode_attention behind transformers' AttentionInterface,
                            switched on per forward (decode_attention_configs; FastTarget._forward)

Each changes the model (or its modeling file) in place, for every later forward in this process; each is
checked first where it could change an output (a norm against its own forward, a rotary bit for bit).
"""
from __future__ import annotations

import functools
from typing import Callable, Optional

import torch

from ..messages import log
from ..draft.attention import decode_attention


def graph_safe_experts(model: torch.nn.Module) -> bool:
    """MoE targets: CUDA graphs need an expert kernel without host syncs. transformers' eager
    experts loop over the experts that got tokens, and grouped_mm outside bf16 takes a fallback,
    both syncing the host; such a target is switched to grouped_mm (bf16) or batched_mm. False
    (and a log line) when none can be set: the run uses static caches without graphs."""
    impl = getattr(model.config, "_experts_implementation", None)
    can_set = getattr(model, "_can_set_experts_implementation", lambda: False)
    if impl not in ("eager", "grouped_mm") or not can_set():
        return True
    # torch's grouped_mm kernel is bf16; other dtypes take a fallback that syncs the host
    bf16 = next(model.parameters()).dtype == torch.bfloat16
    if impl == "grouped_mm" and bf16:
        return True
    for cand in (("grouped_mm", "batched_mm") if bf16 else ("batched_mm",)):
        try:
            model.set_experts_implementation(cand)
            log(f"[fast] MoE experts: {impl} -> {cand} (CUDA graphs need an expert kernel without host syncs)")
            return True
        except (ValueError, ImportError, RuntimeError):
            continue
    log("[fast] MoE experts: no graph-safe expert kernel in this transformers; static caches without CUDA graphs")
    return False


def fuse_rms_norms(model: torch.nn.Module) -> int:
    """Every RMSNorm module of the model whose forward is the standard one (transformers' LlamaRMSNorm
    and its copies: weight * normalized(x in float32) back in x's dtype) runs torch's rms_norm instead
    when input and weight share a dtype: one fused kernel on CUDA instead of eight (casts, power, mean,
    eps, rsqrt, two products), each a node of a decode step's CUDA graph; the same float32 math (bf16:
    rounded once instead of twice). Each module is checked on a random input against its own forward
    first; a variant (Gemma's 1 + weight, no weight, another eps name) or a module whose forward is
    already wrapped (accelerate's hooks) keeps its own. Plain decoding and
    every method run the same modules. Affects every later forward of this model in this process.
    Returns the number of modules switched (0 the second time)."""
    import torch.nn.functional as F

    if getattr(model, "_draftsmith_rms_norms", False):
        return 0
    n = 0
    gen = torch.Generator().manual_seed(0)
    for m in model.modules():
        w = getattr(m, "weight", None)
        eps = getattr(m, "variance_epsilon", getattr(m, "eps", None))
        if (not type(m).__name__.endswith("RMSNorm") or not isinstance(w, torch.nn.Parameter) or w.dim() != 1
                or not isinstance(eps, float) or w.device.type == "meta" or "forward" in vars(m)):
            continue  # (a forward set on the instance: someone's wrapper, e.g. accelerate's device hooks)
        own = m.forward
        x = torch.randn(3, w.shape[0], generator=gen).to(device=w.device, dtype=w.dtype)
        with torch.no_grad():
            want, got = own(x), F.rms_norm(x, (w.shape[0],), w, eps)
        tol = 1e-5 if w.dtype == torch.float32 else 2e-2
        if want.dtype != got.dtype or not torch.allclose(want.float(), got.float(), rtol=tol, atol=tol):
            continue

        def forward(x, own=own, w=w, eps=eps):
            return F.rms_norm(x, (x.shape[-1],), w, eps) if x.dtype == w.dtype else own(x)
        m.forward = forward
        n += 1
    model._draftsmith_rms_norms = True
    return n


def _standard_rotation(mod) -> Optional[Callable]:
    """transformers' apply_rotary_pos_emb on one tensor (its own rotate_half), cos/sin unsqueezed."""
    rotate_half = getattr(mod, "rotate_half", None)
    return None if rotate_half is None else (lambda x, cos, sin: (x * cos) + (rotate_half(x) * sin))


def _interleaved_rotation(mod) -> Callable:
    """transformers' apply_rotary_pos_emb_interleave (DeepSeek's pairs) on one tensor, cos/sin unsqueezed."""
    def rotate(x, cos, sin):
        cos, sin = cos[..., :cos.shape[-1] // 2], sin[..., :sin.shape[-1] // 2]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return rotate


ROTATIONS = {"apply_rotary_pos_emb": _standard_rotation, "apply_rotary_pos_emb_interleave": _interleaved_rotation}
"""The rotary functions of transformers' modeling files, and what each does to one tensor."""


def joint_rotary(orig: Callable, rotate: Callable) -> Callable:
    """A rotary function (q, k, cos, sin) that rotates q and k together: one rotation of cat(q, k) along
    the heads, then split. The same elementwise ops on the same values, so the same bits, in about half
    the kernels (a cat and one rotation, not two rotations of five or seven kernels each). Other call
    forms (another unsqueeze_dim, position_ids, unlike shapes) take orig."""
    @functools.wraps(orig)
    def rotary(q, k, cos, sin, *args, **kwargs):
        if (args or kwargs not in ({}, {"unsqueeze_dim": 1}) or q.dim() != 4 or k.dim() != 4 or q.dtype != k.dtype
                or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]):
            return orig(q, k, cos, sin, *args, **kwargs)
        x = rotate(torch.cat([q, k], 1), cos.unsqueeze(1), sin.unsqueeze(1))
        return x[:, :q.shape[1]], x[:, q.shape[1]:]
    rotary.draftsmith_joint = True
    return rotary


def join_rotaries(model: torch.nn.Module) -> int:
    """Replace, in the modeling file of each attention module of the model, the rotary functions
    (ROTATIONS) by joint_rotary's, after checking on random inputs (the model's dtype and device,
    grouped KV heads) that they give the same bits; a function that does not (another version's
    code, another rotation) keeps its own.
    Process-wide, like compile_regions' patch of the same functions: every model of that file gains,
    none changes. Returns the number of functions replaced."""
    import sys

    p = next(model.parameters(), None)
    if p is None or p.device.type == "meta":
        return 0
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, h, 3, 16, generator=gen).to(device=p.device, dtype=p.dtype) for h in (4, 2))
    cos, sin = (torch.randn(2, 3, 16, generator=gen).to(device=p.device, dtype=p.dtype) for _ in range(2))
    n, seen = 0, set()
    for m in model.modules():
        mod = sys.modules.get(type(m).__module__)
        if "Attention" not in type(m).__name__ or mod is None or mod in seen:
            continue
        seen.add(mod)
        for name, rotation in ROTATIONS.items():
            orig, rotate = getattr(mod, name, None), rotation(mod)
            if not callable(orig) or rotate is None or getattr(orig, "draftsmith_joint", False):
                continue
            joint = joint_rotary(orig, rotate)
            try:
                with torch.no_grad():
                    same = all(torch.equal(a, b) for a, b in zip(orig(q, k, cos, sin), joint(q, k, cos, sin)))
            except Exception:  # another signature: left as it is
                same = False
            if same:
                setattr(mod, name, joint)
                n += 1
    return n


def compile_regions(model: torch.nn.Module) -> int:
    """torch.compile the model's pure regions in place: every *RMSNorm and dense *MLP module and
    the attention's rotary function (the many small kernels of a decode step; fused, they leave the
    weight-reading matmuls). The KV-cache writes, the MoE routing and the hooks stay eager, so
    nothing that mutates state is traced. Affects every later forward of this model in this
    process. Returns the number of compiled modules (0 the second time)."""
    import sys

    if getattr(model, "_draftsmith_compiled", False):
        return 0
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    n, patched = 0, set()
    for m in model.modules():
        cls = type(m).__name__
        if cls.endswith(("RMSNorm", "MLP")):
            m.forward = torch.compile(m.forward)
            n += 1
        mod = sys.modules.get(type(m).__module__)
        if "Attention" in cls and mod is not None and hasattr(mod, "apply_rotary_pos_emb") and mod not in patched:
            mod.apply_rotary_pos_emb = torch.compile(mod.apply_rotary_pos_emb)
            patched.add(mod)
    model._draftsmith_compiled = True
    return n


# ----------------------------------------------------------------------------- the target's attention


DECODE_ATTENTION = "draftsmith_decode"
"""The name of hf_decode_attention in transformers' AttentionInterface."""
DECODE_ATTENTION_CALLS = [0]
"""How many eager calls of hf_decode_attention ran decode_attention (FastTarget.prefill checks that its
forward did: a model whose attention ignores AttentionInterface would read the boolean mask as numbers)."""
UNHANDLED = ("position_bias", "s_aux", "sinks", "softcap")
"""Attention-function arguments that change the math: with any of them set, transformers' sdpa runs."""


def hf_decode_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' attention-function contract (integrations/sdpa_attention.py): q [B, H, N, D],
    k/v [B, KVH, S, D(v)] and a 4D mask in, ([B, N, H, Dv], None) out, over decode_attention. What it
    does not handle goes to transformers' own sdpa function unchanged: no or a non-4D mask (is_causal
    decides there), dropout, attention weights asked for, position biases, sinks, softcapping. A mask
    narrower than the cache (W columns) attends over the cache's first W columns only."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if (attention_mask is None or attention_mask.dim() != 4 or dropout or kwargs.get("output_attentions")
            or any(kwargs.get(k) is not None for k in UNHANDLED) or query.shape[1] % key.shape[1]
            or attention_mask.shape[-1] > key.shape[-2] or query.shape[-1] != key.shape[-1]):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    DECODE_ATTENTION_CALLS[0] += 1
    W = attention_mask.shape[-1]  # FastTarget's attention width: the cache's first W columns (views, no copy)
    return decode_attention(query, key[:, :, :W], value[:, :, :W], attention_mask, scaling).transpose(1, 2).contiguous(), None


def decode_attention_configs(model: torch.nn.Module) -> list:
    """The configs (the model's and its sub-models') that FastTarget's forwards switch from `sdpa` to
    DECODE_ATTENTION (registered here), or [] (nothing switched, the additive mask as before). Which
    ones transformers itself decides: model.set_attn_implementation, undone at once, leaves a model whose
    attention does not go through AttentionInterface as it is (its source check; remote code may not);
    configs not on sdpa (eager, flash attention) stay as loaded."""
    from transformers import AttentionInterface

    AttentionInterface.register(DECODE_ATTENTION, hf_decode_attention)
    loaded = {id(m.config): (m.config, m.config._attn_implementation_internal) for m in model.modules()
              if hasattr(getattr(m, "config", None), "_attn_implementation_internal")}
    setter = getattr(model, "set_attn_implementation", None)
    if setter is None:
        return []
    try:
        setter(DECODE_ATTENTION)
        return [c for c, impl in loaded.values() if impl == "sdpa" and c._attn_implementation_internal == DECODE_ATTENTION]
    except (ValueError, KeyError, ImportError) as e:
        log(f"[fast] {type(model).__name__}: attention stays transformers' ({type(e).__name__}: {str(e)[:120]})")
        return []
    finally:
        for c, impl in loaded.values():
            c._attn_implementation_internal = impl
