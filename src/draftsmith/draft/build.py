"""Build a drafter for a target: its config from the target's config, its init, and the two
target tensors it needs (input embedding, lm_head) read without loading the target.

Shapes come from the target's config.json (STYLE.md): hidden size = the target's; heads,
kv heads, head_dim and MLP width default to the target's unless DraftConfig sets them.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn as nn

from ..artifacts import DraftsmithError
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
                 seed: int, std: float = 0.02) -> Eagle3Drafter:
    """A float32 drafter on CPU: linears ~ N(0, std) from `seed`, norms 1, the embedding copied
    from the target (frozen), d2t/t2d set."""
    if tuple(embed_weight.shape) != (cfg.vocab_size, cfg.hidden_size):
        raise DraftsmithError(f"target embedding has shape {tuple(embed_weight.shape)}, the drafter needs "
                              f"({cfg.vocab_size}, {cfg.hidden_size}); the target config and weights disagree")
    if d2t.numel() != cfg.draft_vocab_size or t2d.numel() != cfg.vocab_size:
        raise DraftsmithError(f"vocab/vocab.safetensors: d2t has {d2t.numel()} entries and t2d {t2d.numel()}, the drafter needs "
                              f"{cfg.draft_vocab_size} and {cfg.vocab_size}; rerun `draftsmith vocab`")
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


# ----------------------------------------------------------------------------- target tensors


def _weight_files(path: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, from model.safetensors(.index.json)."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise DraftsmithError(f"{index}: not a safetensors index ({e}); re-download the model") from None
        return {k: path / v for k, v in weight_map.items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise DraftsmithError(f"{path}: no *.safetensors weights (only safetensors are read); convert the checkpoint to safetensors")
    out = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            out.update({k: f for k in h.keys()})
    return out


def _find_key(param_name: str, shape: tuple[int, ...], keys: dict[str, Path], shapes) -> Optional[str]:
    """The checkpoint key of a model parameter: the exact name, else the unique key of the
    right shape sharing the longest dotted suffix (checkpoints of wrapper models often nest
    the language model under another prefix than the module tree)."""
    if param_name in keys:
        return param_name
    parts = param_name.split(".")
    for n in range(len(parts) - 1, 1, -1):
        suffix = "." + ".".join(parts[-n:])
        hits = [k for k in keys if (k.endswith(suffix) or k == suffix[1:]) and shapes(k) == shape]
        if len(hits) == 1:
            return hits[0]
    return None


def read_target_embeddings(path: str | Path, trust_remote_code: bool = False) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """(input embedding [V, H], lm_head weight [V, H], text config) of a local HF model,
    reading only those tensors. The model is built on the meta device to learn the two
    parameter names; tied (or absent) heads use the embedding."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..target.model import text_config

    path = Path(path)
    try:
        config = AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise DraftsmithError(f"{path}: cannot build the target from its config ({str(e).splitlines()[0][:200]}); "
                              "target.path must be a local Hugging Face causal LM (set target.trust_remote_code if it ships code)") from None
    emb_param = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    head_param = head.weight if head is not None else None
    names: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    tied = head_param is None or head_param is emb_param  # transformers ties them when the config says so
    declared_tied = bool(getattr(text_config(config), "tie_word_embeddings", False) or getattr(config, "tie_word_embeddings", False))
    files = _weight_files(path)
    handles: dict[Path, Any] = {}

    def handle(f: Path):
        if f not in handles:
            handles[f] = safe_open(str(f), framework="pt")
        return handles[f]

    def shape_of(key: str) -> tuple[int, ...]:
        return tuple(handle(files[key]).get_slice(key).get_shape())

    def read(param: torch.Tensor) -> Optional[torch.Tensor]:
        for name in names[id(param)]:  # a tied parameter has several names; the file holds one
            key = _find_key(name, tuple(param.shape), files, shape_of)
            if key is not None:
                return handle(files[key]).get_tensor(key)
        return None

    embed = read(emb_param)
    if embed is None:
        raise DraftsmithError(f"{path}: no tensor for the input embedding `{names[id(emb_param)][0]}` "
                              f"of shape {tuple(emb_param.shape)} in the safetensors files; the weights do not match config.json")
    lm_head = None if tied else read(head_param)
    if lm_head is None:
        if not (tied or declared_tied):
            raise DraftsmithError(f"{path}: no tensor for the output head `{names[id(head_param)][0]}` of shape "
                                  f"{tuple(head_param.shape)} and tie_word_embeddings is false; the weights do not match config.json")
        lm_head = embed
    return embed, lm_head, text_config(config)
