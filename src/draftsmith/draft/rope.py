"""Rotary embeddings of the drafter, with the target's scaling (Llama-3.1 "llama3", YaRN, linear).

The drafter copies the target's rope settings (draft/build.py) and the exports write them for
the serving engine, so the drafter must compute the same rotation the engine will: inv_freq
and the attention scaling come from transformers' own rope init functions
(transformers.modeling_rope_utils), fed a Llama config built from the drafter's fields.
Rope types whose frequencies change with the sequence length at run time (dynamic NTK,
longrope) are refused rather than approximated.
"""
from __future__ import annotations

import functools
import json
from typing import Optional

import torch

from ..messages import DraftsmithError

STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional")


def rope_type(scaling: Optional[dict]) -> str:
    if not scaling:
        return "default"
    return str(scaling.get("rope_type", scaling.get("type", "default")))


# The tables are cached for the process: made under torch.inference_mode (an engine's first forward)
# they would be inference tensors, which a later training step may not save for backward.
@functools.lru_cache(maxsize=16)
@torch.inference_mode(False)
def _inv_freq(head_dim: int, theta: float, scaling_json: str, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    # why here: transformers takes seconds to import; only a scaled rope needs its init functions
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = json.loads(scaling_json)
    kind = rope_type(scaling)
    if kind not in STATIC_ROPE_TYPES:
        raise DraftsmithError(f"drafter config: rope_scaling type {kind!r} changes with the sequence length at run time and "
                              f"is not supported; supported: {', '.join(STATIC_ROPE_TYPES)}")
    if kind == "default":
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        return inv_freq, 1.0
    params = {k: v for k, v in scaling.items() if k != "type"}
    params.update(rope_type=kind, rope_theta=theta)
    # num_attention_heads * head_dim = hidden_size keeps any head_dim derivation consistent.
    cfg = LlamaConfig(hidden_size=head_dim, num_attention_heads=1, num_key_value_heads=1, head_dim=head_dim,
                      max_position_embeddings=max_position_embeddings, rope_parameters=params)
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[kind](cfg, None)
    return inv_freq.float(), float(attention_scaling)


def rope_inv_freq(head_dim: int, theta: float, scaling: Optional[dict],
                  max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim/2] float32 on CPU, attention scaling) for these rope settings."""
    return _inv_freq(int(head_dim), float(theta), json.dumps(scaling or None, sort_keys=True), int(max_position_embeddings))


@functools.lru_cache(maxsize=16)
@torch.inference_mode(False)
def _inv_freq_on(head_dim: int, theta: float, scaling_json: str, max_position_embeddings: int,
                 device: str) -> tuple[torch.Tensor, float]:
    """_inv_freq, already on `device` (no host-to-device copy per call: CUDA graphs capture the
    drafter's steps, and a capture may not copy from pageable host memory)."""
    inv_freq, scale = _inv_freq(head_dim, theta, scaling_json, max_position_embeddings)
    return inv_freq.to(device), scale


_TABLES: dict[tuple, tuple[torch.Tensor, float]] = {}


def rope_cos_sin(position_ids: torch.Tensor, cfg, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [B, T, head_dim] (HF 'rotate_half' layout) for integer positions [B, T] and an
    Eagle3Config (head_dim, rope_theta, rope_scaling, max_position_embeddings).

    The (inv_freq, scale) of a config and device are looked up in a dict by a key torch.compile
    can trace (a compiled TTT loss then reads them as constants); the first lookup fills it from
    transformers' rope init (which does not trace: call once eagerly before compiling)."""
    scaling = cfg.rope_scaling
    key = (int(cfg.head_dim), float(cfg.rope_theta), tuple(sorted((k, str(v)) for k, v in scaling.items())) if scaling else None,
           int(cfg.max_position_embeddings), str(position_ids.device))
    if key not in _TABLES:
        _TABLES[key] = _inv_freq_on(int(cfg.head_dim), float(cfg.rope_theta), json.dumps(scaling or None, sort_keys=True),
                                    int(cfg.max_position_embeddings), str(position_ids.device))
    inv_freq, scale = _TABLES[key]
    freqs = position_ids.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    if scale == 1.0:  # every type but YaRN: two kernels fewer
        return emb.cos().to(dtype), emb.sin().to(dtype)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def rope_table(cfg, n: int, dtype: torch.dtype, device) -> torch.Tensor:
    """rope_cos_sin of the positions 0..n-1, stacked [2, n, head_dim] in dtype: a decoding step looks its
    rows up (`table[:, position_ids]`, one gather) instead of computing them (about eight kernels, each a
    node of a CUDA graph)."""
    return torch.stack(rope_cos_sin(torch.arange(n, device=device)[None], cfg, dtype))[:, 0]
