"""Export a drafter in the speculators format (vllm-project/speculators), which vLLM loads natively:

    vllm serve OUT_DIR                                   # target = speculators_config.verifier
    vllm serve TARGET --speculative-config '{"method": "eagle3", "model": "OUT_DIR", ...}'

config.json (schema of speculators 0.9 `Eagle3SpeculatorConfig`, read by vLLM's
transformers_utils/configs/speculators): `speculators_model_type: "eagle3"`, `speculators_config`
(algorithm, greedy proposal with `speculative_tokens`, verifier name_or_path + architectures),
`transformer_layer_config` (a Llama config of the one decoder layer; `vocab_size` = the target's),
`draft_vocab_size`, `target_hidden_size`, `eagle_aux_hidden_state_layer_ids` in vLLM's
convention (internal + 1, export/conventions.py), and the architecture flags written out, each
as the drafter was trained (draft.*): `norm_before_residual` (vLLM's speculators adapter
defaults a missing key to TRUE, speculators to false), `norm_before_fc` (weight `input_norm`),
`norm_output`, and `fc_norm: false`. vLLM reads norm_before_residual since its first EAGLE-3
release, norm_before_fc since vllm-project/vllm#38111 (2026-03) and norm_output since #46488
(2026-06); an older vLLM ignores the last two, so serve a drafter with them on a recent one.
Weights: our names with `midlayer.` -> `layers.0.` (vLLM's Eagle3LlamaForCausalLM and
speculators' Eagle3DraftModel both use `layers.0.*`). `embed_tokens` is written by default:
speculators' own loader (Eagle3DraftModel.from_pretrained) does not fill a missing embedding
from the verifier (it keeps a random initialisation and drafts wrong without an error); vLLM
loads it or shares the target's, the same values. vLLM's Eagle3 Llama builds `fc` for exactly 3
aux layers, so other counts are refused.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from ..fileio import read_json
from ..messages import DraftsmithError
from ..draft.io import load_drafter
from ..draft.model import Eagle3Config, Eagle3Drafter
from .checks import check_target
from .conventions import to_vllm
from .sglang import DTYPES, llama_layer_config, sglang_state, target_text_config, write_folder

SPECULATORS_FORMAT = "0.9.0"  # the speculators release whose schema and loader the tests check
FLAG_FIELDS = ("norm_before_residual", "norm_before_fc", "norm_output")  # Eagle3Config fields of the same names


def to_vllm_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {("layers.0." + k[len("midlayer."):]) if k.startswith("midlayer.") else k: v for k, v in state.items()}


def vllm_config(cfg: Eagle3Config, target_cfg, dtype: str, verifier: str, verifier_architectures: list[str],
                num_speculative_tokens: int, where: str) -> dict:
    """config.json in the speculators format, checked against the target."""
    theta, scaling, max_pos = check_target(cfg, target_cfg, where)
    if cfg.num_aux_layers != 3 or len(cfg.aux_layer_ids) != 3:
        raise DraftsmithError(f"{where}: drafter has {cfg.num_aux_layers} aux layers {cfg.aux_layer_ids}; vLLM's Eagle3 "
                              "drafter takes exactly 3 (fc input = 3 x target_hidden_size); train with 3 target.aux_layer_ids")
    if num_speculative_tokens < 1:
        raise DraftsmithError(f"export.num_speculative_tokens {num_speculative_tokens}: must be at least 1")
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_FORMAT,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(num_speculative_tokens),
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": str(verifier), "architectures": list(verifier_architectures)},
        },
        "transformer_layer_config": llama_layer_config(cfg, theta, scaling, max_pos, dtype),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": to_vllm(cfg.aux_layer_ids),
        **{k: bool(getattr(cfg, k)) for k in FLAG_FIELDS},
        "fc_norm": False,  # per-aux norms before fc: a speculators variant draftsmith does not train
        "embed_requires_grad": False,
        "torch_dtype": dtype,
    }


def export_vllm(drafter_dir: str | Path, target_path: str | Path, out_dir: str | Path, dtype: str = "bfloat16",
                verifier: Optional[str] = None, num_speculative_tokens: int = 3, with_embeddings: Optional[bool] = None,
                trust_remote_code: bool = False) -> list[dict]:
    """Write config.json + model.safetensors in the speculators format into out_dir (replaced
    as a whole). `verifier` is the target as vLLM should load it (a hub id or a path on the
    serving machine); default: target_path. `with_embeddings` None: written (module docstring).
    Returns [{file, sha256, bytes}]."""
    with_embeddings = True if with_embeddings is None else bool(with_embeddings)
    drafter_dir, target_path = Path(drafter_dir), Path(target_path)
    if dtype not in DTYPES:
        raise DraftsmithError(f"export.dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    where = str(drafter_dir / "config.json")
    drafter = load_drafter(drafter_dir)
    archs = read_json(target_path / "config.json").get("architectures") or []
    config = vllm_config(drafter.cfg, target_text_config(target_path, trust_remote_code), dtype,
                         verifier or str(target_path), archs, num_speculative_tokens, where)
    return write_folder(Path(out_dir), vllm_state(drafter, dtype, with_embeddings, where), config)


def vllm_state(drafter: Eagle3Drafter, dtype: str, with_embeddings: bool, where: str) -> dict[str, torch.Tensor]:
    """The tensors to write: SGLang's checked key set (export/sglang.py), renamed."""
    return to_vllm_names(sglang_state(drafter, dtype, with_embeddings, where))
