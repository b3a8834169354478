"""Interop with a real third-party loader and round trips through both formats.

speculators (vllm-project/speculators, the format vLLM loads) reads our vLLM export with its own
Eagle3DraftModel; its forward over 3 TTT steps must match ours. Checkpoints in either format
(ours, or written by speculators itself) import into an Eagle3Drafter and re-export bit-identical.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from draftsmith import pipeline
from draftsmith.artifacts import DraftsmithError, sha256_file
from draftsmith.config import ExportConfig, Recipe, TargetConfig
from draftsmith.draft.io import load_drafter
from draftsmith.export.importer import import_drafter
from draftsmith.export.sglang import export_sglang
from draftsmith.export.vllm import export_vllm
from draftsmith.testing import make_tiny_drafter

LLAMA3 = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 256}


def load_with_speculators(folder):
    """speculators' own loader, as its docs use it (eager attention: flex needs a compiler)."""
    from speculators import SpeculatorModelConfig
    from speculators.models.eagle3 import Eagle3DraftModel

    config = SpeculatorModelConfig.from_pretrained(str(folder))
    config.transformer_layer_config._attn_implementation = "eager"
    return Eagle3DraftModel.from_pretrained(str(folder), config=config).eval()


@torch.no_grad()
def ttt_logits_ours(drafter, aux, ids, pos, steps):
    """Our training-time-test unroll with speculators' teacher forcing (step i reads ids shifted by i)."""
    out, hidden, cache = [], drafter.project(aux), []
    for i in range(steps):
        x = torch.cat([ids[:, i:], ids.new_zeros(1, i)], dim=-1)
        g = drafter.ttt_step(x, hidden, pos + i, cache)
        out.append(drafter.logits(g))
        hidden = g
    return out


@torch.no_grad()
def ttt_logits_speculators(model, aux, ids, pos, steps):
    logits = []
    hook = model.lm_head.register_forward_hook(lambda mod, args, out: logits.append(out.detach()))
    model(hidden_states=aux, input_ids=ids, document_ids=torch.zeros_like(ids), position_ids=pos.clone(), ttt_steps=steps)
    hook.remove()
    return logits


@pytest.mark.parametrize("rope", ["default", "llama3"])
def test_speculators_loads_our_export_and_matches_forward(tiny_drafter, tmp_path, rope):
    root, model_dir, _, drafter = tiny_drafter
    if rope == "llama3":
        root, model_dir, _, drafter = make_tiny_drafter(tmp_path, rope_parameters=LLAMA3)
        assert drafter.cfg.rope_scaling["rope_type"] == "llama3"
    export_vllm(root / "drafter", model_dir, tmp_path / "vllm", dtype="float32", with_embeddings=True)
    theirs = load_with_speculators(tmp_path / "vllm")
    assert type(theirs).__name__ == "Eagle3DraftModel"
    assert theirs.config.eagle_aux_hidden_state_layer_ids == [2, 4, 5]  # internal [1, 3, 4] + 1
    assert theirs.config.norm_before_residual is False
    ours = {k.replace("midlayer.", "layers.0."): v for k, v in drafter.state_dict().items()}
    sd = theirs.state_dict()
    for k, v in ours.items():
        assert torch.equal(sd[k], v), k
    T, steps = 9, 3
    g = torch.Generator().manual_seed(0)
    aux = torch.randn(1, T, 3 * 64, generator=g)
    ids = torch.randint(0, drafter.cfg.vocab_size, (1, T), generator=g)
    pos = torch.arange(T)[None] + (200 if rope == "llama3" else 0)  # past the llama3 original context
    for a, b in zip(ttt_logits_speculators(theirs, aux, ids, pos, steps), ttt_logits_ours(drafter, aux, ids, pos, steps),
                    strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("fmt", ["sglang", "vllm"])
def test_roundtrip_is_bit_identical(tiny_drafter, tmp_path, fmt):
    """export -> import -> export gives the same files byte for byte (bf16, no embeddings)."""
    root, model_dir, _, drafter = tiny_drafter
    export = export_sglang if fmt == "sglang" else export_vllm
    first = export(root / "drafter", model_dir, tmp_path / "a", dtype="bfloat16")
    info = import_drafter(tmp_path / "a", model_dir, tmp_path / "imported")
    assert (info["format"], info["dtype"], info["with_embeddings"], info["aux_layer_ids"]) == (fmt, "bfloat16", False, [1, 3, 4])
    back = load_drafter(tmp_path / "imported")
    assert torch.equal(back.embed_tokens.weight, drafter.embed_tokens.weight)  # taken from the target
    assert back.cfg.target_num_layers == 8
    second = export(tmp_path / "imported", model_dir, tmp_path / "b", dtype=info["dtype"])
    assert first == second  # names, sha256 and sizes of config.json and model.safetensors


def test_import_checkpoint_written_by_speculators(tiny_drafter, tmp_path):
    """A checkpoint saved by speculators itself (its config writer, its key names) imports, and
    re-exports to the same tensors."""
    root, model_dir, _, drafter = tiny_drafter
    export_vllm(root / "drafter", model_dir, tmp_path / "ours", dtype="float32", with_embeddings=True)
    load_with_speculators(tmp_path / "ours").save_pretrained(str(tmp_path / "theirs"))
    written = json.loads((tmp_path / "theirs" / "config.json").read_text())
    assert written["speculators_model_type"] == "eagle3" and "transformer_layer_config" in written
    info = import_drafter(tmp_path / "theirs", model_dir, tmp_path / "imported")
    assert (info["format"], info["with_embeddings"], info["aux_layer_ids"]) == ("vllm", True, [1, 3, 4])
    back = load_drafter(tmp_path / "imported")
    for k, v in drafter.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    export_vllm(tmp_path / "imported", model_dir, tmp_path / "again", dtype=info["dtype"], with_embeddings=True)
    src = {k: v for f in (tmp_path / "theirs").glob("*.safetensors") for k, v in load_file(str(f)).items()}
    out = load_file(str(tmp_path / "again" / "model.safetensors"))
    assert set(out) == set(src)
    for k in out:
        assert out[k].dtype == src[k].dtype and torch.equal(out[k], src[k]), k


def test_import_into_run_then_export_stage(tiny_drafter, tmp_path):
    """`import-drafter --run-dir`: the export stage (and evaluate) then run on the imported drafter."""
    from draftsmith.cli import main

    root, model_dir, _, drafter = tiny_drafter
    export_sglang(root / "drafter", model_dir, tmp_path / "src", dtype="float32")
    run_dir = tmp_path / "run"
    assert main(["import-drafter", str(tmp_path / "src"), "--target", str(model_dir), "--run-dir", str(run_dir)]) == 0
    recipe = Recipe(run_dir=str(run_dir), target=TargetConfig(path=str(model_dir)),
                    export=ExportConfig(formats=["sglang", "vllm"], dtype="float32"))
    m = pipeline.run_stage("export", recipe)
    assert sorted(m["formats"]) == ["sglang", "vllm"]
    assert sha256_file(run_dir / "export" / "sglang" / "model.safetensors") == sha256_file(tmp_path / "src" / "model.safetensors")


def test_import_refusals(tiny_drafter, tmp_path):
    root, model_dir, _, drafter = tiny_drafter
    export_vllm(root / "drafter", model_dir, tmp_path / "v", dtype="float32")
    cfg_path = tmp_path / "v" / "config.json"
    c = json.loads(cfg_path.read_text())
    for change, match in (({"norm_before_residual": True}, "norm_before_residual true"),
                          ({"norm_before_residual": None}, "norm_before_residual is missing"),
                          ({"eagle_aux_hidden_state_layer_ids": [0, 4, 5]}, "layer 0"),
                          ({"speculators_model_type": "mtp"}, "not an EAGLE-3")):
        bad = {**c, **change}
        if change.get("norm_before_residual", 0) is None:
            bad.pop("norm_before_residual")
        cfg_path.write_text(json.dumps(bad))
        with pytest.raises(DraftsmithError, match=match):
            import_drafter(tmp_path / "v", model_dir, tmp_path / "out")
    export_sglang(root / "drafter", model_dir, tmp_path / "s", dtype="float32")
    s = json.loads((tmp_path / "s" / "config.json").read_text())
    s["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 4, 5]
    (tmp_path / "s" / "config.json").write_text(json.dumps(s))
    with pytest.raises(DraftsmithError, match="do not start with 1"):
        import_drafter(tmp_path / "s", model_dir, tmp_path / "out")
    # No list at all: SGLang's default for 8 layers, [2, 4, 5] as inputs = internal [1, 3, 4].
    del s["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    (tmp_path / "s" / "config.json").write_text(json.dumps(s))
    assert import_drafter(tmp_path / "s", model_dir, tmp_path / "out")["aux_layer_ids"] == [1, 3, 4]
    (tmp_path / "s" / "model.safetensors").rename(tmp_path / "s" / "pytorch_model.bin")
    with pytest.raises(DraftsmithError, match="pickled"):
        import_drafter(tmp_path / "s", model_dir, tmp_path / "out2")
    assert not (tmp_path / "out2").exists()
