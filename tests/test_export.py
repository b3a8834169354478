"""SGLang export: key set, shapes, config fields, layer-id convention, reload equality, refusals."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from draftsmith import pipeline
from draftsmith.manifests import finish_manifest, new_manifest
from draftsmith.messages import DraftsmithError
from draftsmith.config import DraftConfig, ExportConfig, Recipe, TargetConfig
from draftsmith.draft.build import drafter_config, init_drafter
from draftsmith.draft.io import save_drafter
from draftsmith.draft.model import DraftKVCache
from draftsmith.export.importer import load_sglang
from draftsmith.export.sglang import export_sglang, required_shapes
from draftsmith.testing import make_model_dir

EXPECTED_KEYS = {
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
    "midlayer.post_attention_layernorm.weight", "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"}


def test_keys_shapes_config(tiny_drafter, tmp_path):
    root, model_dir, target, drafter = tiny_drafter
    files = export_sglang(root / "drafter", model_dir, tmp_path / "sglang", dtype="bfloat16")
    assert sorted(f["file"] for f in files) == ["config.json", "model.safetensors"]
    state = load_file(str(tmp_path / "sglang" / "model.safetensors"))
    assert set(state) == EXPECTED_KEYS == set(required_shapes(drafter.cfg))
    for k, shape in required_shapes(drafter.cfg).items():
        assert tuple(state[k].shape) == shape, k
    assert state["fc.weight"].shape == (64, 3 * 64) and state["lm_head.weight"].shape == (100, 64)
    assert state["fc.weight"].dtype == torch.bfloat16 and state["d2t"].dtype == torch.int64 and state["t2d"].dtype == torch.bool
    assert torch.equal(state["d2t"], drafter.d2t) and torch.equal(state["t2d"], drafter.t2d)

    c = json.loads((tmp_path / "sglang" / "config.json").read_text())
    t = json.loads((model_dir / "config.json").read_text())
    assert c["architectures"] == ["LlamaForCausalLMEagle3"] and c["model_type"] == "llama"
    assert c["num_hidden_layers"] == 1 and c["tie_word_embeddings"] is False and c["torch_dtype"] == "bfloat16"
    assert (c["vocab_size"], c["draft_vocab_size"], c["target_hidden_size"]) == (t["vocab_size"], 100, t["hidden_size"])
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "rms_norm_eps", "max_position_embeddings"):
        assert c[key] == t[key], key
    assert c["rope_theta"] == t["rope_parameters"]["rope_theta"] and c["rope_scaling"] is None
    # Internal [1, N//2-1, N-4] = [1, 3, 4] for N=8; SGLang adds +1 and captures layer inputs,
    # so it reads our internal ids unchanged (vLLM would get [2, 4, 5]).
    assert target.aux_layer_ids == [1, 3, 4]
    assert c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert c["eagle_config"]["use_aux_hidden_state"] is True
    # transformers reads the legacy rope keys back.
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(str(tmp_path / "sglang"))
    assert hf.hidden_size == 64 and hf.rope_parameters["rope_theta"] == t["rope_parameters"]["rope_theta"]


@torch.inference_mode()
def test_reload_gives_identical_outputs(tiny_drafter, tmp_path):
    root, model_dir, target, drafter = tiny_drafter
    export_sglang(root / "drafter", model_dir, tmp_path / "sglang", dtype="float32")
    back = load_sglang(tmp_path / "sglang", embed_tokens=target.input_embeddings())
    ids = torch.tensor([[1, 7, 42, 99, 5, 3]])
    aux = torch.randn(1, 6, 3 * 64, generator=torch.Generator().manual_seed(0))
    pos = torch.arange(6)[None]
    outs = []
    for m in (drafter, back):
        g = m(ids, m.project(aux), pos, DraftKVCache())
        outs.append((g, m.logits(g), m.draft_to_target(m.logits(g).argmax(-1))))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_refusals_write_nothing(tiny_drafter, tmp_path):
    root, model_dir, target, drafter = tiny_drafter
    other = make_model_dir(tmp_path / "other", num_layers=8, hidden_size=32)
    with pytest.raises(DraftsmithError, match="not trained for this target"):
        export_sglang(root / "drafter", other, tmp_path / "out")
    broken = drafter.cfg
    broken_dir = tmp_path / "bad_ids"
    d = init_drafter(drafter_config(target.config, DraftConfig(), 100, [2, 3, 4]), target.input_embeddings(),
                     drafter.d2t, drafter.t2d, seed=0)
    save_drafter(d, broken_dir)
    with pytest.raises(DraftsmithError, match="do not start with layer 1"):
        export_sglang(broken_dir, model_dir, tmp_path / "out")
    d.t2d[0] = ~d.t2d[0]
    d.cfg.aux_layer_ids = list(broken.aux_layer_ids)
    save_drafter(d, broken_dir)
    with pytest.raises(DraftsmithError, match="t2d does not mark"):
        export_sglang(broken_dir, model_dir, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_export_stage(tiny_drafter, tmp_path):
    root, model_dir, target, drafter = tiny_drafter
    run_dir = tmp_path / "run"
    save_drafter(drafter, run_dir / "train" / "drafter")
    finish_manifest(run_dir / "train", new_manifest("train", "train-fp", {}, {}))
    recipe = Recipe(run_dir=str(run_dir), target=TargetConfig(path=str(model_dir)), export=ExportConfig(formats=["sglang"]))
    m = pipeline.run_stage("export", recipe)
    assert m["status"] == "complete"
    assert [f["file"] for f in m["formats"]["sglang"]["files"]] == ["config.json", "model.safetensors"]
    assert (run_dir / "export" / "sglang" / "model.safetensors").exists()
    recipe.export.formats = ["tensorrt"]
    with pytest.raises(DraftsmithError, match="export.formats 'tensorrt': not a format; choose from sglang, vllm"):
        pipeline.run_stage("export", recipe)
