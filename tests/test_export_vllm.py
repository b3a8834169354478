"""vLLM (speculators format) export: layer-id conventions, key set, config schema, refusals."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.messages import DraftsmithError
from draftsmith.config import DraftConfig
from draftsmith.draft.build import drafter_config, init_drafter
from draftsmith.draft.io import save_drafter
from draftsmith.export.conventions import from_sglang, from_vllm, to_sglang, to_vllm
from draftsmith.export.sglang import required_shapes
from draftsmith.export.vllm import export_vllm
from draftsmith.target.model import default_aux_layer_ids, load_target
from draftsmith.testing import make_model_dir

DOCS = Path(__file__).resolve().parents[1] / "docs" / "conventions.md"


def test_layer_id_conventions_kimi_k2():
    """Kimi-K2, 61 layers: internal [1, 29, 57] <-> vLLM [2, 30, 58] <-> SGLang [1, 29, 57]."""
    internal = default_aux_layer_ids(61)
    assert internal == [1, 29, 57]
    assert to_vllm(internal) == [2, 30, 58] and from_vllm([2, 30, 58]) == internal
    assert to_sglang(internal) == [1, 29, 57] and from_sglang([1, 29, 57], 61) == internal
    # Both runtimes' defaults without a list, [2, N//2, N-3] as layer inputs, are our default.
    assert from_vllm([2, 61 // 2, 61 - 3]) == from_sglang(None, 61) == internal
    with pytest.raises(DraftsmithError, match="do not start with layer 1"):
        to_sglang([2, 30, 58])
    with pytest.raises(DraftsmithError, match="layer 0"):
        from_vllm([0, 30, 58])
    # The table in docs/conventions.md says the same.
    row = next(line for line in DOCS.read_text().splitlines() if line.startswith("| Kimi-K2"))
    assert [re.sub(r"[`\s]", "", c) for c in row.strip("|").split("|")][1:4] == ["[1,29,57]", "[2,30,58]", "[1,29,57]"]


def test_keys_and_config(tiny_drafter, tmp_path):
    root, model_dir, _, drafter = tiny_drafter
    files = export_vllm(root / "drafter", model_dir, tmp_path / "vllm", verifier="org/tiny-llama", num_speculative_tokens=5)
    assert [f["file"] for f in files] == ["config.json", "model.safetensors"]
    state = load_file(str(tmp_path / "vllm" / "model.safetensors"))
    want = {k.replace("midlayer.", "layers.0."): s for k, s in required_shapes(drafter.cfg, with_embeddings=True).items()}
    assert {k: tuple(v.shape) for k, v in state.items()} == want
    assert not any(k.startswith("midlayer.") for k in state)
    # shipped by default: speculators' loader would not fill it from the verifier (test_interop)
    assert torch.equal(state["embed_tokens.weight"], drafter.embed_tokens.weight.bfloat16())
    assert state["fc.weight"].dtype == torch.bfloat16 and state["d2t"].dtype == torch.int64 and state["t2d"].dtype == torch.bool
    assert torch.equal(state["layers.0.self_attn.q_proj.weight"], drafter.midlayer.self_attn.q_proj.weight.bfloat16())

    c = json.loads((tmp_path / "vllm" / "config.json").read_text())
    t = json.loads((model_dir / "config.json").read_text())
    assert c["speculators_model_type"] == "eagle3" and c["architectures"] == ["Eagle3Speculator"]
    sc = c["speculators_config"]
    assert sc["algorithm"] == "eagle3" and sc["default_proposal_method"] == "greedy"
    assert sc["proposal_methods"] == [{"proposal_type": "greedy", "speculative_tokens": 5, "verifier_accept_k": 1,
                                       "accept_tolerance": 0.0}]
    assert sc["verifier"] == {"name_or_path": "org/tiny-llama", "architectures": ["LlamaForCausalLM"]}
    assert c["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # internal [1, 3, 4]: vLLM reads layer inputs
    assert c["norm_before_residual"] is False  # vLLM's adapter would default a missing key to true
    assert (c["norm_before_fc"], c["norm_output"], c["fc_norm"]) == (False, True, False)  # draft.* defaults
    assert (c["draft_vocab_size"], c["target_hidden_size"]) == (100, t["hidden_size"])
    layer = c["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1 and layer["vocab_size"] == t["vocab_size"]
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps"):
        assert layer[key] == t[key], key
    assert layer["rope_theta"] == t["rope_parameters"]["rope_theta"] and layer["rope_scaling"] is None


def test_refusals(tiny_drafter, tmp_path):
    root, model_dir, _, drafter = tiny_drafter
    other = make_model_dir(tmp_path / "other", num_layers=8, hidden_size=32)
    with pytest.raises(DraftsmithError, match="not trained for this target"):
        export_vllm(root / "drafter", other, tmp_path / "out")
    target_cfg = load_target(model_dir, device="cpu", dtype="float32").config
    d = init_drafter(drafter_config(target_cfg, DraftConfig(), 100, [1, 4]), drafter.embed_tokens.weight,
                     drafter.d2t, drafter.t2d, seed=0)
    save_drafter(d, tmp_path / "two")
    with pytest.raises(DraftsmithError, match="exactly 3"):
        export_vllm(tmp_path / "two", model_dir, tmp_path / "out")
    assert not (tmp_path / "out").exists()
