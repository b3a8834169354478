"""Build a drafter for a target: its config from the target's config, and its init from the
target's input embedding (target/model.py's read_target_embeddings reads it without loading the
target).

Shapes come from the target's config.json (STYLE.md): hidden size = the target's; heads,
kv heads, head_dim and MLP width default to the target's unless DraftConfig sets them.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn as nn

from ..messages import DraftsmithError
from ..rundir import fix_command
from ..config import DraftConfig
from .model import Eagle3Config, Eagle3Drafter


def rope_settings(cfg: Any) -> tuple[float, Optional[dict]]:
    """(rope_theta, rope_scaling) of a transformers config, old (`rope_theta`/`rope_scaling`)
    or new (`rope_parameters`) style. Scaling is None for plain rotary embeddings."""
    params = getattr(cfg, "rope_parameters", None)
    if isinstance(params, dict) and "full_attention" in params and isinstance(params["full_attention"], dict):
        params = params["full_attention"]  # per-layer-type dicts (models with sliding layers)
    theta = getattr(cfg, "rope_theta", None)
    if theta is None and isinstance(params, dict):
        theta = params.get("rope_theta")
    scaling = getattr(cfg, "rope_scaling", None)
    if scaling is None and isinstance(params, dict) and params.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return float(theta if theta is not None else 10000.0), (dict(scaling) if scaling else None)


def default_intermediate_size(hidden_size: int) -> int:
    """A dense SwiGLU width for targets without a dense `intermediate_size` (pure MoE):
    8/3 * H rounded up to a multiple of min(256, H)."""
    multiple = min(256, hidden_size)
    return int(math.ceil(8 * hidden_size / 3 / multiple) * multiple)


def drafter_config(target_text_config: Any, draft_cfg: DraftConfig, draft_vocab_size: int,
                   aux_layer_ids: list[int]) -> Eagle3Config:
    """The drafter's Eagle3Config for a target text config (transformers PretrainedConfig)."""
    t = target_text_config
    H = int(t.hidden_size)
    heads = draft_cfg.num_attention_heads or int(t.num_attention_heads)
    kv_heads = draft_cfg.num_key_value_heads or int(getattr(t, "num_key_value_heads", None) or heads)
    if draft_cfg.num_attention_heads and not draft_cfg.num_key_value_heads and heads % kv_heads:
        kv_heads = heads
    head_dim = draft_cfg.head_dim
    if head_dim is None:
        if getattr(t, "kv_lora_rank", None):
            # MLA (DeepSeek-V3, Kimi-K2): the target's `head_dim` is the rope part only; use
            # the value head width, the size of each head's attention output.
            head_dim = int(getattr(t, "v_head_dim", None) or H // heads)
        else:
            head_dim = int(getattr(t, "head_dim", None) or H // heads)
    intermediate = draft_cfg.intermediate_size or getattr(t, "intermediate_size", None) or default_intermediate_size(H)
    if heads % kv_heads:
        raise DraftsmithError(f"draft.num_attention_heads {heads} is not a multiple of draft.num_key_value_heads {kv_heads}; "
                              "set both in the recipe's draft section")
    if head_dim % 2:
        raise DraftsmithError(f"draft.head_dim {head_dim}: rotary embeddings need an even head_dim; set draft.head_dim")
    theta, scaling = rope_settings(t)
    return Eagle3Config(
        hidden_size=H, target_hidden_size=H, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, intermediate_size=int(intermediate), vocab_size=int(t.vocab_size),
        draft_vocab_size=int(draft_vocab_size), num_aux_layers=len(aux_layer_ids),
        rms_norm_eps=float(getattr(t, "rms_norm_eps", None) or 1e-6), rope_theta=theta, rope_scaling=scaling,
        max_position_embeddings=int(getattr(t, "max_position_embeddings", None) or 4096),
        aux_layer_ids=list(aux_layer_ids), target_num_layers=int(t.num_hidden_layers),
        norm_before_fc=bool(draft_cfg.norm_before_fc), norm_before_residual=bool(draft_cfg.norm_before_residual),
        norm_output=bool(draft_cfg.norm_output))


def init_drafter(cfg: Eagle3Config, embed_weight: torch.Tensor, d2t: torch.Tensor, t2d: torch.Tensor,
                 seed: int, std: float = 0.02, vocab_path: Optional[str | Path] = None) -> Eagle3Drafter:
    """A float32 drafter on CPU: linears ~ N(0, std) from `seed`, norms 1, the embedding copied
    from the target (frozen), d2t/t2d set. `vocab_path`: the file d2t/t2d were read from (named
    by the error when they do not fit, with the commands that rebuild it)."""
    if tuple(embed_weight.shape) != (cfg.vocab_size, cfg.hidden_size):
        raise DraftsmithError(f"target embedding has shape {tuple(embed_weight.shape)}, the drafter needs "
                              f"({cfg.vocab_size}, {cfg.hidden_size}); the target config and weights disagree")
    if d2t.numel() != cfg.draft_vocab_size or t2d.numel() != cfg.vocab_size:
        fix = (f"rerun {fix_command('vocab', vocab_path, then=('train',))}" if vocab_path is not None
               else "build d2t/t2d for this drafter config")
        raise DraftsmithError(f"{vocab_path or 'd2t/t2d'}: d2t has {d2t.numel()} entries and t2d {t2d.numel()}, the drafter "
                              f"needs {cfg.draft_vocab_size} and {cfg.vocab_size}; {fix}")
    model = Eagle3Drafter(cfg)
    gen = torch.Generator().manual_seed(int(seed))
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear):
                module.weight.copy_(torch.randn(module.weight.shape, generator=gen) * std)
        model.embed_tokens.weight.copy_(embed_weight.to(torch.float32))
        model.d2t.copy_(d2t.to(torch.int64))
        model.t2d.copy_(t2d.to(torch.bool))
    model.embed_tokens.weight.requires_grad_(False)
    return model
