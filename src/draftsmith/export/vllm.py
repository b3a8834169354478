"""Export a drafter in the speculators format (vllm-project/speculators), which vLLM loads natively:

    vllm serve OUT_DIR                                   # target = speculators_config.verifier
    vllm serve TARGET --speculative-config '{"method": "eagle3", "model": "OUT_DIR", ...}'

config.json (schema of speculators 0.9 `Eagle3SpeculatorConfig`, read by vLLM's
transformers_utils/configs/speculators): `speculators_model_type: "eagle3"`, `speculators_config`
(algorithm, greedy proposal with `speculative_tokens`, verifier name_or_path + architectures),
`transformer_layer_config` (a Llama config of the one decoder layer; `vocab_size` = the target's),
`draft_vocab_size`, `target_hidden_size`, `eagle_aux_hidden_state_layer_ids` in vLLM's
convention (internal + 1, export/conventions.py), and `norm_before_residual: false` written
out: vLLM's speculators adapter defaults a missing key to TRUE, speculators to false; our
residual is the un-normalised hidden state. Weights: our names with `midlayer.` -> `layers.0.`
(vLLM's Eagle3LlamaForCausalLM and speculators' Eagle3DraftModel both use `layers.0.*`);
`embed_tokens` is left out unless asked for: both loaders take it from the verifier then.
vLLM's Eagle3 Llama builds `fc` for exactly 3 aux layers, so other counts are refused.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from ..artifacts import DraftsmithError, read_json
from ..draft.io import load_drafter
from ..draft.model import Eagle3Config, Eagle3Drafter
from .checks import check_target
from .conventions import to_vllm
from .sglang import DTYPES, llama_layer_config, sglang_state, target_text_config, write_folder

SPECULATORS_FORMAT = "0.9.0"  # the speculators release whose schema and loader the tests check
FLAG_FIELDS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")  # all false for our drafter


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
        **{k: False for k in FLAG_FIELDS},
        "embed_requires_grad": False,
        "torch_dtype": dtype,
    }


def export_vllm(drafter_dir: str | Path, target_path: str | Path, out_dir: str | Path, dtype: str = "bfloat16",
                verifier: Optional[str] = None, num_speculative_tokens: int = 3, with_embeddings: bool = False,
                trust_remote_code: bool = False) -> list[dict]:
    """Write config.json + model.safetensors in the speculators format into out_dir (replaced
    as a whole). `verifier` is the target as vLLM should load it (a hub id or a path on the
    serving machine); default: target_path. Returns [{file, sha256, bytes}]."""
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
