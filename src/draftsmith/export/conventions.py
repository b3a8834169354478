"""Aux-layer ids in each runtime's convention (DESIGN.md §4, docs/conventions.md).

    internal  id i = the OUTPUT of 0-indexed decoder layer i   (what capture hooks)
    vLLM      id k = the INPUT of decoder layer k = output of k-1   -> internal + 1
    SGLang    explicit list: +1 then input of layer -> internal, unchanged (list must start at 1)
              no list: default [2, N//2, N-3] read as layer inputs   -> internal [1, N//2-1, N-4]

Kimi-K2 (61 layers): internal [1, 29, 57] = vLLM [2, 30, 58] = SGLang [1, 29, 57].

vLLM: its decoder loops append `hidden_states + residual` before running layer idx when idx is
in `aux_hidden_state_layers` (llama.py, qwen3, deepseek_v2, ...), and its own default is
[2, N//2, N-3]; speculators (0.9) uses the same numbers and accepts id N (the final hidden
state). SGLang: see export/sglang.py.
"""
from __future__ import annotations

from ..messages import DraftsmithError


def to_vllm(internal_ids: list[int]) -> list[int]:
    """Internal ids -> vLLM / speculators `eagle_aux_hidden_state_layer_ids`."""
    return [int(i) + 1 for i in internal_ids]


def from_vllm(vllm_ids: list[int], where: str = "config.json") -> list[int]:
    """vLLM / speculators ids -> internal ids. Id 0 (the embedding output) has no internal id."""
    ids = [int(i) - 1 for i in vllm_ids]
    if any(i < 0 for i in ids):
        raise DraftsmithError(f"{where}: eagle_aux_hidden_state_layer_ids {list(vllm_ids)} include layer 0 (the input "
                              "embeddings), which draftsmith cannot capture; import a drafter trained on decoder-layer outputs")
    return ids


def to_sglang(internal_ids: list[int], where: str = "config.json") -> list[int]:
    """Internal ids -> SGLang's explicit list: unchanged, and it must start at 1 (older SGLang
    adds +1 to any list, SGLang with PR #25454 only to a list whose first id is 1)."""
    ids = [int(i) for i in internal_ids]
    if not ids or ids[0] != 1:
        raise DraftsmithError(f"{where}: aux_layer_ids {ids} do not start with layer 1; SGLang reads such a list as "
                              "layer outputs before PR #25454 and as layer inputs after it, so the export would be wrong "
                              "on one of them; train with target.aux_layer_ids starting at 1 (the default)")
    return ids


def from_sglang(sglang_ids: list[int] | None, num_layers: int | None, where: str = "config.json") -> list[int]:
    """SGLang's `eagle_config.eagle_aux_hidden_state_layer_ids` (or None) -> internal ids.
    Without a list SGLang uses its default [2, N//2, N-3] as layer inputs; `num_layers` (the
    target's N) is then needed."""
    if not sglang_ids:
        if not num_layers:
            raise DraftsmithError(f"{where}: no eagle_aux_hidden_state_layer_ids and no target layer count; "
                                  "give the target model so SGLang's default layers can be resolved")
        return [1, num_layers // 2 - 1, num_layers - 4]
    ids = [int(i) for i in sglang_ids]
    if ids[0] != 1:
        raise DraftsmithError(f"{where}: eagle_aux_hidden_state_layer_ids {ids} do not start with 1, so older SGLang reads "
                              "them as layer outputs and newer SGLang (PR #25454) as layer inputs; give the internal ids "
                              "(outputs of 0-indexed decoder layers) with --aux-layer-ids")
    return ids  # an explicit list starting at 1 means the same layers as our internal ids

