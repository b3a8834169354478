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
from draftsmith.fileio import sha256_file
from draftsmith.messages import DraftsmithError
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


FLAGS = ("norm_before_fc", "norm_before_residual", "norm_output")


def with_flags(drafter, folder, **flags):
    """The drafter rebuilt with architecture flags (draft.*) and its norms moved away from 1 (a
    norm applied in the wrong place then changes the logits), saved to `folder`."""
    from dataclasses import replace

    from draftsmith.draft.io import save_drafter
    from draftsmith.draft.model import Eagle3Drafter

    d = Eagle3Drafter(replace(drafter.cfg, **flags))
    d.load_state_dict(drafter.state_dict(), strict=False)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in d.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
    save_drafter(d.eval(), folder)
    return d.eval()


def random_inputs(drafter, T=9, offset=0):
    g = torch.Generator().manual_seed(0)
    aux = torch.randn(1, T, 3 * drafter.cfg.target_hidden_size, generator=g)
    ids = torch.randint(0, drafter.cfg.vocab_size, (1, T), generator=g)
    return aux, ids, torch.arange(T)[None] + offset


@pytest.mark.parametrize("rope,flags", [("default", {}), ("llama3", {}), ("default", {f: True for f in FLAGS}),
                                        ("default", {f: False for f in FLAGS})],
                         ids=["default", "llama3", "all_norms", "no_norms"])
def test_speculators_loads_our_export_and_matches_forward(tiny_drafter, tmp_path, rope, flags):
    """The default vLLM export (no with_embeddings given), loaded by speculators' own loader, gives
    our drafter's logits at every TTT step: the embedding travels in the folder (its loader
    would keep a random one), and the architecture flags mean the same on both sides."""
    root, model_dir, _, drafter = tiny_drafter
    if rope == "llama3":
        root, model_dir, _, drafter = make_tiny_drafter(tmp_path, rope_parameters=LLAMA3)
        assert drafter.cfg.rope_scaling["rope_type"] == "llama3"
    src = root / "drafter"
    if flags:
        src = tmp_path / "flagged"
        drafter = with_flags(drafter, src, **flags)
    export_vllm(src, model_dir, tmp_path / "vllm", dtype="float32")
    theirs = load_with_speculators(tmp_path / "vllm")
    assert type(theirs).__name__ == "Eagle3DraftModel"
    assert theirs.config.eagle_aux_hidden_state_layer_ids == [2, 4, 5]  # internal [1, 3, 4] + 1
    assert {f: getattr(theirs.config, f) for f in FLAGS} == {f: getattr(drafter.cfg, f) for f in FLAGS}
    assert all(getattr(drafter.cfg, f) == v for f, v in flags.items())
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


def test_import_speculators_default_drafter_matches_its_forward(tiny_drafter, tmp_path):
    """A drafter built by speculators' own training constructor with its default EAGLE-3 flags
    (norm_before_fc, norm_before_residual, norm_output on; its save_pretrained writer) imports
    with `draftsmith import-drafter`, and our forward gives its logits at every TTT step."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from bench_peer import PEER_DEFAULTS, peer_layer_config
    from speculators.models.eagle3 import Eagle3DraftModel

    from draftsmith.cli import main

    root, model_dir, _, drafter = tiny_drafter
    torch.manual_seed(0)
    theirs = Eagle3DraftModel.from_training_args(
        verifier_config=peer_layer_config(str(model_dir), PEER_DEFAULTS["sliding_window"]), t2d=drafter.t2d, d2t=drafter.d2t,
        draft_vocab_size=drafter.cfg.draft_vocab_size, ttt_steps=3, verifier_name_or_path=str(model_dir),
        target_layer_ids=[2, 4, 5], draft_attn_impl="eager", embed_requires_grad=False,
        **{f: PEER_DEFAULTS[f] for f in (*FLAGS, "fc_norm")})
    with torch.no_grad():  # a trained-looking drafter: its init leaves lm_head = the target's rows, norms = 1
        g = torch.Generator().manual_seed(1)
        for name, p in theirs.named_parameters():
            if not name.startswith(("embed_tokens", "verifier_", "lm_head")):
                p.copy_((1 if name.endswith("norm.weight") else 0) + 0.2 * torch.randn(p.shape, generator=g))
    theirs.eval().save_pretrained(str(tmp_path / "theirs"))
    assert main(["import-drafter", str(tmp_path / "theirs"), "--target", str(model_dir), "--out", str(tmp_path / "ours")]) == 0
    ours = load_drafter(tmp_path / "ours")
    assert (ours.cfg.norm_before_fc, ours.cfg.norm_before_residual, ours.cfg.norm_output) == (True, True, True)
    aux, ids, pos = random_inputs(ours)
    for a, b in zip(ttt_logits_speculators(theirs, aux, ids, pos, 3), ttt_logits_ours(ours, aux, ids, pos, 3), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-5)


def test_sglang_export_refuses_what_sglang_cannot_run(tiny_drafter, tmp_path):
    """SGLang's LlamaForCausalLMEagle3 has no norm before fc and no normed residual (and skips
    unknown weights silently): such a drafter is refused, nothing written; norm_output (EAGLE-3.1)
    goes into the config."""
    root, model_dir, _, drafter = tiny_drafter
    for flag in ("norm_before_fc", "norm_before_residual"):
        with_flags(drafter, tmp_path / flag, **{flag: True})
        with pytest.raises(DraftsmithError, match=f"{flag} true, which SGLang's LlamaForCausalLMEagle3 does not implement"):
            export_sglang(tmp_path / flag, model_dir, tmp_path / "out")
        assert not (tmp_path / "out").exists()
    with_flags(drafter, tmp_path / "no", norm_output=True)
    export_sglang(tmp_path / "no", model_dir, tmp_path / "out", dtype="float32")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["norm_output"] is True
    assert import_drafter(tmp_path / "out", model_dir, tmp_path / "back")["flags"]["norm_output"] is True


@pytest.mark.parametrize("fmt", ["sglang", "vllm"])
def test_roundtrip_is_bit_identical(tiny_drafter, tmp_path, fmt):
    """export -> import -> export gives the same files byte for byte (bf16, each format's default
    for the embedding: SGLang leaves it out, the vLLM format ships it)."""
    root, model_dir, _, drafter = tiny_drafter
    export = export_sglang if fmt == "sglang" else export_vllm
    first = export(root / "drafter", model_dir, tmp_path / "a", dtype="bfloat16")
    info = import_drafter(tmp_path / "a", model_dir, tmp_path / "imported")
    assert (info["format"], info["dtype"], info["with_embeddings"], info["aux_layer_ids"]) == (fmt, "bfloat16", fmt == "vllm", [1, 3, 4])
    back = load_drafter(tmp_path / "imported")
    # SGLang: taken from the target; vLLM format: the shipped table (bf16 here)
    want = drafter.embed_tokens.weight if fmt == "sglang" else drafter.embed_tokens.weight.bfloat16().float()
    assert torch.equal(back.embed_tokens.weight, want)
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
    for change, match in (({"fc_norm": True}, "fc_norm true"),
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
