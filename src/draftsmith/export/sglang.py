"""Export a drafter as a SGLang-native EAGLE-3 folder (`LlamaForCausalLMEagle3`).

    SGLang --speculative-algorithm EAGLE3 --speculative-draft-model-path OUT_DIR

Weights keep our names (they are SGLang's): `midlayer.*`, `fc.weight`, `norm.weight`,
`lm_head.weight`, `d2t`, `t2d`; SGLang prefixes `model.` itself and fills `embed_tokens` from
the target when the folder has none. SGLang skips unknown keys without a word, so every key and
shape is checked here before anything is written.

Architecture flags (draft.*): `norm_output` is written as the config key SGLang's EAGLE-3.1
support reads (`norm_output: true`; SGLang releases before it ignore the key, so serve such a
drafter with a release that has EAGLE-3.1); `norm_before_fc` and `norm_before_residual` have no
counterpart in SGLang's LlamaForCausalLMEagle3 and are refused (check_sglang_flags).

Aux layer ids. SGLang reads `eagle_config.eagle_aux_hidden_state_layer_ids` and hands it to the
target's `set_eagle3_layers_to_capture`, which (llama.py, qwen2/3, deepseek_v2, ...) sets
`layers_to_capture = [val + 1 for val in layer_ids]`; the model's forward appends
`hidden_states + residual` *before* running layer i when i is in that list, i.e. the INPUT of
layer i+1 = the OUTPUT of layer i. So the list SGLang reads equals our internal ids (outputs of
0-indexed layer i). Its default with no list, [2, N//2, N-3], is in the input convention and
gets no +1. sgl-project/sglang PR #25454 (merged 2026-05) keeps the +1 only when the first id
is 1 and otherwise reads the list as layer inputs; a list whose first id is not 1 thus means
different layers to older and newer SGLang, and is refused (export/conventions.py).
export/importer.py reads such a folder back (`load_sglang`, `import_drafter`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from ..fileio import atomic_save_safetensors, atomic_write_json, replace_dir, sha256_file, temp_dir
from ..messages import DraftsmithError
from ..draft.io import load_drafter, state_dict_mismatch
from ..draft.model import Eagle3Config, Eagle3Drafter
from ..target.model import read_text_config
from .checks import check_target, check_vocab_map
from .conventions import to_sglang

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
MIDLAYER_NORMS = ("input_layernorm", "hidden_norm", "post_attention_layernorm")


def required_shapes(cfg: Eagle3Config, with_embeddings: bool = False) -> dict[str, tuple[int, ...]]:
    """Every tensor SGLang's LlamaForCausalLMEagle3 needs, with its shape."""
    H, I, nh, nkv, hd = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    shapes = {
        "midlayer.self_attn.q_proj.weight": (nh * hd, 2 * H),
        "midlayer.self_attn.k_proj.weight": (nkv * hd, 2 * H),
        "midlayer.self_attn.v_proj.weight": (nkv * hd, 2 * H),
        "midlayer.self_attn.o_proj.weight": (H, nh * hd),
        "midlayer.mlp.gate_proj.weight": (I, H),
        "midlayer.mlp.up_proj.weight": (I, H),
        "midlayer.mlp.down_proj.weight": (H, I),
        **{f"midlayer.{n}.weight": (H,) for n in MIDLAYER_NORMS},
        "fc.weight": (H, cfg.num_aux_layers * cfg.target_hidden_size),
        "norm.weight": (H,),
        "lm_head.weight": (cfg.draft_vocab_size, H),
        "d2t": (cfg.draft_vocab_size,),
        "t2d": (cfg.vocab_size,),
    }
    if cfg.norm_before_fc:  # speculators' / vLLM's name for it
        shapes["input_norm.weight"] = (cfg.num_aux_layers * cfg.target_hidden_size,)
    if with_embeddings:
        shapes["embed_tokens.weight"] = (cfg.vocab_size, H)
    return shapes


ARCH_FLAGS = ("norm_before_fc", "norm_before_residual", "norm_output")
SGLANG_REFUSED = ("norm_before_fc", "norm_before_residual")  # SGLang's LlamaForCausalLMEagle3 has neither


def check_sglang_flags(cfg: Eagle3Config, where: str) -> None:
    """SGLang's EAGLE-3 Llama computes residual = h and fc(cat(aux)) with no norm before it, and
    skips unknown weights without a word: a drafter trained otherwise would load and draft wrong."""
    on = [f for f in SGLANG_REFUSED if getattr(cfg, f)]
    if on:
        raise DraftsmithError(f"{where}: {' and '.join(on)} true, which SGLang's LlamaForCausalLMEagle3 does not implement "
                              "(it would load and draft wrong); export to vllm, or train with draft.{" + ",".join(on) + "}: false")


def target_text_config(target_path: str | Path, trust_remote_code: bool = False):
    """The text config of the target a drafter is exported for (both exporters check against it)."""
    return read_text_config(target_path, trust_remote_code, fix="set target.path to the model the drafter was trained for")


def llama_layer_config(cfg: Eagle3Config, theta: float, scaling: Optional[dict], max_pos: int, dtype: str) -> dict:
    """The Llama decoder-layer fields both runtimes read (rope in the legacy keys, which
    transformers 4 and 5 both accept)."""
    return {
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": theta,
        "rope_scaling": scaling,
        "max_position_embeddings": max_pos,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": dtype,
    }


def sglang_config(cfg: Eagle3Config, target_cfg, dtype: str, where: str) -> dict:
    """config.json for SGLang. Shapes are the drafter's; rope and max positions are the target's
    and must equal what the drafter was trained with."""
    theta, scaling, max_pos = check_target(cfg, target_cfg, where)
    check_sglang_flags(cfg, where)
    layer = llama_layer_config(cfg, theta, scaling, max_pos, dtype)
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        **layer,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        **({"norm_output": True} if cfg.norm_output else {}),  # EAGLE-3.1: the next step reads norm(g)
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": to_sglang(cfg.aux_layer_ids, where),
            "use_aux_hidden_state": True,
            "use_input_layernorm_in_first_layer": True,
            "use_last_layernorm": True,
            "use_mtp_layernorm": False,
        },
    }


def sglang_state(drafter: Eagle3Drafter, dtype: str, with_embeddings: bool, where: str) -> dict[str, torch.Tensor]:
    """The tensors to write, checked key by key and shape by shape against `required_shapes`."""
    state = {k: v.detach().cpu() for k, v in drafter.state_dict().items()}
    if not with_embeddings:
        state.pop("embed_tokens.weight", None)
    what = state_dict_mismatch(state, required_shapes(drafter.cfg, with_embeddings))
    if what:
        raise DraftsmithError(f"{where}: drafter does not map onto SGLang's LlamaForCausalLMEagle3 ({what}); "
                              "the export key map in draftsmith/export/sglang.py needs updating")
    check_vocab_map(state["d2t"], state["t2d"], where)
    cast = DTYPES[dtype]
    return {k: v.to(torch.int64) if k == "d2t" else v if k == "t2d" else v.to(cast) for k, v in state.items()}


def export_sglang(drafter_dir: str | Path, target_path: str | Path, out_dir: str | Path,
                  dtype: str = "bfloat16", with_embeddings: Optional[bool] = None, trust_remote_code: bool = False) -> list[dict]:
    """Write config.json + model.safetensors for SGLang into out_dir (replaced as a whole).
    `with_embeddings` None: no embedding (SGLang always takes the target's). Returns [{file, sha256, bytes}]."""
    with_embeddings = bool(with_embeddings)
    drafter_dir, out_dir = Path(drafter_dir), Path(out_dir)
    if dtype not in DTYPES:
        raise DraftsmithError(f"export.dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    where = str(drafter_dir / "config.json")
    drafter = load_drafter(drafter_dir)
    config = sglang_config(drafter.cfg, target_text_config(target_path, trust_remote_code), dtype, where)
    return write_folder(out_dir, sglang_state(drafter, dtype, with_embeddings, where), config)


def write_folder(out_dir: Path, state: dict[str, torch.Tensor], config: dict) -> list[dict]:
    """model.safetensors + config.json into out_dir, replaced as a whole: the folder is built
    beside its final place and swapped in, so a reader never sees half of it."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_dir(out_dir)
    tmp.mkdir(parents=True)
    atomic_save_safetensors(tmp / "model.safetensors", state, metadata={"format": "pt"})
    atomic_write_json(tmp / "config.json", config)
    replace_dir(tmp, out_dir)
    return [{"file": p.name, "sha256": sha256_file(p), "bytes": p.stat().st_size}
            for p in sorted(out_dir.iterdir()) if p.is_file()]
