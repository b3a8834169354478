"""compat: MTP detection (config keys, checkpoint weights) and the tokenizer compatibility check."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from packaging.version import Version
from safetensors.torch import save_file
from transformers import AutoTokenizer, DeepseekV3Config

from draftsmith.messages import DraftsmithError
from draftsmith.compat import TESTED, check_tokenizers, mtp_layers, mtp_report, require_compatible_tokenizers
from draftsmith.testing import _SENTENCES, train_tokenizer


def test_tested_versions_name_what_ci_runs():
    root = Path(__file__).resolve().parents[1]
    pins = dict(line.split("#")[0].strip().split("==") for line in (root / ".ci/constraints.txt").read_text().splitlines()
                if "==" in line.split("#")[0])
    for name in ("torch", "transformers"):  # the whole suite runs on the pins: each lies in its tested range
        pin = pins[name]
        lo, hi = (Version(v).release for v in TESTED[name])
        assert lo <= Version(pin).release[:2] <= hi, f"{name} {pin} (.ci/constraints.txt) outside TESTED {TESTED[name]}"
    assert TESTED["transformers"][0] == ".".join(pins["transformers"].split(".")[:2])  # the lowest is CI's pin
    # .ci/run also runs the model-facing tests on the newest transformers, so the range reaches past the pin
    assert '-U "transformers' in (root / ".ci/run").read_text()
    assert Version(TESTED["transformers"][1]) > Version(TESTED["transformers"][0])


def test_installed_transformers_is_tested():
    """The upper end of TESTED follows CI too: .ci/run runs this test again after it upgrades to the newest
    transformers < 6, so a newer release than TESTED names fails CI until TESTED is raised (after the
    model-facing tests passed on it); on the pins it checks the lower end."""
    from importlib.metadata import version

    root = Path(__file__).resolve().parents[1]
    newest_run = (root / ".ci/run").read_text().split('-U "transformers', 1)[1]
    assert "tests/test_compat.py::test_installed_transformers_is_tested" in newest_run
    lo, hi = TESTED["transformers"]
    v = Version(version("transformers")).release[:2]
    assert Version(lo).release <= v <= Version(hi).release, (
        f"transformers {version('transformers')} is outside compat.TESTED {lo}-{hi}: raise TESTED once .ci/run passes on it")


def tiny_deepseek(**kw) -> DeepseekV3Config:
    return DeepseekV3Config(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            num_hidden_layers=2, num_attention_heads=2, n_routed_experts=4, n_group=1, topk_group=1,
                            num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=8, q_lora_rank=None,
                            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, **kw)


def write_model_dir(path, config, weight_names):
    config.save_pretrained(str(path))
    save_file({n: torch.zeros(1) for n in weight_names}, str(path / "model.safetensors"))
    return path


@pytest.mark.parametrize("n", [0, 1])
def test_mtp_deepseek_config(tmp_path, n):
    cfg = tiny_deepseek(num_nextn_predict_layers=n)
    assert mtp_layers(cfg) == n
    layers = ["model.embed_tokens.weight", "model.layers.0.mlp.gate.weight", "model.layers.1.mlp.gate.weight"]
    rep = mtp_report(write_model_dir(tmp_path, cfg, layers + ["model.layers.2.eh_proj.weight"] * n))
    assert (rep.layers, rep.key) == (n, "num_nextn_predict_layers")
    assert rep.weights_present is (True if n else None)
    assert ("1 MTP layer(s) declared" in rep.summary()) == bool(n)
    assert ("no MTP layers (num_nextn_predict_layers=0)" in rep.summary()) == (not n)


def test_mtp_declared_but_weights_stripped(tmp_path):
    rep = mtp_report(write_model_dir(tmp_path, tiny_deepseek(num_nextn_predict_layers=1), ["model.layers.0.x.weight"]))
    assert rep.layers == 1 and rep.weights_present is False
    assert "no MTP weights" in rep.summary()


def test_mtp_other_keys_and_wrappers(tmp_path):
    assert mtp_layers({"model_type": "llama"}) == 0
    assert mtp_report({"model_type": "llama"}).key is None
    assert mtp_layers({"mtp_num_hidden_layers": 1}) == 1                       # Qwen3-Next
    assert mtp_layers({"text_config": {"num_nextn_predict_layers": 2}}) == 2   # multimodal wrapper
    assert mtp_layers({"mtp_config": {"num_nextn_predict_layers": 1}}) == 1
    # Kimi-K2 keeps the key at 0; a raw config.json (no transformers defaults) is what counts.
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "kimi_k2", "num_hidden_layers": 61,
                                                      "num_nextn_predict_layers": 0}))
    assert mtp_report(tmp_path).layers == 0
    # Qwen3-Next style `mtp.*` weights, sharded index
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 4, "mtp_num_hidden_layers": 1}))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"mtp.fc.weight": "a.safetensors"}}))
    assert mtp_report(tmp_path).weights_present is True
    with pytest.raises(DraftsmithError, match="config.json"):
        mtp_report(tmp_path / "missing")


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    out = {}
    for name, texts, vocab in [("a", _SENTENCES * 4, 512), ("a_small", _SENTENCES * 4, 300),
                               ("other", ["completely different corpus of words"] * 4 + _SENTENCES[::-1], 400)]:
        d = tmp_path_factory.mktemp(name)
        train_tokenizer(texts, vocab, d)
        out[name] = AutoTokenizer.from_pretrained(str(d))
    return out


def test_same_tokenizer_is_compatible(toks):
    rep = check_tokenizers(toks["a"], copy.deepcopy(toks["a"]))
    assert rep.compatible and rep.id_mismatches == rep.only_draft == rep.only_target == rep.probes_differ == 0
    assert require_compatible_tokenizers(toks["a"], toks["a"], "t", "d").shared == len(toks["a"])


def test_vocab_size_difference_is_explained(toks):
    rep = check_tokenizers(toks["a"], toks["a_small"])
    assert (rep.target_size, rep.draft_size) == (len(toks["a"]), 300) and not rep.compatible
    assert rep.only_target == len(toks["a"]) - 300 and rep.probes_differ > 0
    with pytest.raises(DraftsmithError) as e:
        require_compatible_tokenizers(toks["a"], toks["a_small"], "big-model", "small-model")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("small-model: ") and f"vocab {len(toks['a']):,} vs 300" in msg
    assert "same family" in msg


def test_differing_ids_for_same_strings(toks):
    rep = check_tokenizers(toks["a"], toks["other"])
    assert not rep.compatible and rep.id_mismatches > 0 and rep.examples
    assert "shared strings map to other ids" in rep.summary()


def test_special_tokens_differ(toks):
    draft = copy.deepcopy(toks["a"])
    draft.eos_token = "<|pad|>"
    rep = check_tokenizers(toks["a"], draft)
    assert not rep.compatible and rep.id_mismatches == 0
    assert rep.special == ["eos '<|end|>'=2 vs '<|pad|>'=0"]
