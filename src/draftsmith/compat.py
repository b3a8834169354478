"""Facts about a target and the software around it that decide what can run.

    TESTED                    the Python / torch / transformers versions draftsmith is tested with

    mtp_layers / mtp_report   does the target ship multi-token-prediction (MTP) layers, i.e. a
                              drafter for free (DeepSeek-V3: 1; Kimi-K2 keeps the key but sets 0)
    check_tokenizers          can a second model serve as an independent draft model? Only if
                              both tokenizers map the same strings to the same ids.
"""
from __future__ import annotations

import inspect
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from safetensors import safe_open

from .fileio import JSON_ERRORS, json_error
from .messages import DraftsmithError

TESTED = {"python": ("3.11", "3.12"), "torch": ("2.11", "2.13"), "transformers": ("5.17", "5.25")}
"""Versions draftsmith's tests ran with: (lowest, highest). CPU CI (.ci/run) runs the whole suite on
the pins of .ci/constraints.txt (torch 2.13, transformers 5.17), then the model-facing tests again on
the newest transformers < 6 with FutureWarnings as errors (5.25 when last run; tests/test_interop.py
left out, speculators pins transformers <= 5.19); the H200 machine runs torch 2.11. Raise a highest
version when .ci/run passes on a newer release."""

def cache_kwargs(model: Any, cache: Any) -> dict:
    """The keyword that hands a KV cache to `model.forward`: `cache` on transformers releases that
    renamed it (5.2x: `past_key_values` is deprecated there, removed in 5.40), else
    `past_key_values`. Looked up on the forward's signature, not the version number."""
    forward = getattr(model, "forward", model)
    fid = id(getattr(forward, "__func__", forward))  # a bound method's function: one lookup per class
    key = _CACHE_KEYS.get(fid)
    if key is None:
        try:
            params = inspect.signature(forward).parameters
        except (TypeError, ValueError):
            params = {}
        key = _CACHE_KEYS[fid] = "cache" if "cache" in params else "past_key_values"
    return {key: cache}


_CACHE_KEYS: dict[int, str] = {}


def output_cache(out: Any) -> Any:
    """The KV cache a transformers forward returned: `out.cache` on releases that renamed it (reading
    `past_key_values` there logs a deprecation), else `out.past_key_values`; None when there is none."""
    if isinstance(out, dict) and "cache" in out:  # ModelOutput is a dict of its set fields
        return out["cache"]
    if hasattr(type(out), "__dataclass_fields__") and "cache" in type(out).__dataclass_fields__:
        return getattr(out, "cache", None)
    return getattr(out, "past_key_values", None)


# Config keys under which architectures declare MTP layers: DeepSeek-V3/V4, GLM-4.5, MiMo,
# ERNIE 4.5, Nemotron-H (num_nextn_predict_layers), transformers' alias (num_mtp_layers),
# Qwen3-Next / Qwen3.5 (mtp_num_hidden_layers).
MTP_KEYS = ("num_nextn_predict_layers", "num_mtp_layers", "mtp_num_hidden_layers", "mtp_num_layers", "n_mtp_layers")


def _config_dicts(config: Any) -> list[dict]:
    """The config and its text config (multimodal wrappers), and a nested `mtp_config`, as dicts."""
    if isinstance(config, dict):
        cfgs = [config, config.get("text_config") or {}]
    else:
        get = getattr(config, "get_text_config", None)
        cfgs = [vars(c) for c in ([config, get()] if get is not None else [config])]
    return [d for c in cfgs for d in (c, c.get("mtp_config") or {}) if isinstance(d, dict)]


def _mtp_key(config: Any) -> tuple[int, Optional[str]]:
    seen = None
    for d in _config_dicts(config):
        for key in MTP_KEYS:
            if key in d and d[key] is not None:
                if int(d[key]):
                    return int(d[key]), key
                seen = seen or key
    return 0, seen


def mtp_layers(config: Any) -> int:
    """Number of MTP (next-n prediction) layers the target's config declares; 0 when none.

    `config` is a transformers config or the dict of a config.json. Note that transformers
    fills DeepseekV3Config/Glm4MoeConfig.num_mtp_layers with 1 when config.json lacks the key;
    read the raw config.json (mtp_report(path)) to see what the checkpoint itself declares."""
    return _mtp_key(config)[0]


def _checkpoint_keys(model_dir: Path) -> Optional[list[str]]:
    """Weight names of a local checkpoint from its index or safetensors headers (no tensors read)."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_bytes()).get("weight_map", {})
        except (*JSON_ERRORS, AttributeError) as e:
            why = json_error(e) if not isinstance(e, AttributeError) else "not a JSON object"
            raise DraftsmithError(f"{index}: not a safetensors index ({why}); re-download the model") from None
        return list(weight_map) if isinstance(weight_map, dict) else None
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        return None
    keys: list[str] = []
    for f in files:
        with safe_open(str(f), "pt") as h:
            keys += list(h.keys())
    return keys


def mtp_weight_names(keys: list[str], num_hidden_layers: int) -> list[str]:
    """Checkpoint keys that belong to MTP layers: `model.layers.{N}.*` past the decoder
    (DeepSeek-V3, GLM-4.5) or any `mtp` module (Qwen3-Next, MiMo, ERNIE)."""
    extra = re.compile(rf"(^|\.)layers\.{num_hidden_layers}\.")
    return [k for k in keys if extra.search(k) or re.search(r"(^|\.)mtp", k)]


@dataclass
class MtpReport:
    layers: int
    """MTP layers the config declares (0: none)."""
    key: Optional[str]
    """The config key that declared it (None: no MTP key at all)."""
    weights_present: Optional[bool] = None
    """Whether the checkpoint carries MTP weights (None: not checked / no local weights)."""

    def summary(self) -> str:
        if not self.layers:
            why = f"{self.key}=0" if self.key else "no MTP key in config.json"
            return f"no MTP layers ({why}): speculation needs a trained drafter (EAGLE-3) or n-gram"
        s = f"{self.layers} MTP layer(s) declared ({self.key})"
        if self.weights_present is False:
            return s + " but the checkpoint has no MTP weights (stripped re-upload?): train a drafter instead"
        return s + ": the server can speculate with them for free (vLLM/SGLang MTP), compare against a drafter"


def mtp_report(model: str | Path | dict | Any) -> MtpReport:
    """MTP layers of a local model folder (raw config.json + checkpoint keys), a config.json
    dict or a transformers config."""
    if isinstance(model, (str, Path)):
        path = Path(model)
        cfg_file = path / "config.json" if path.is_dir() else path
        try:
            raw = json.loads(cfg_file.read_bytes())
        except (OSError, *JSON_ERRORS) as e:
            why = (e.strerror or str(e)) if isinstance(e, OSError) else json_error(e)
            raise DraftsmithError(f"{cfg_file}: cannot read the model config ({why}); give a model folder with config.json") from None
        if not isinstance(raw, dict):
            raise DraftsmithError(f"{cfg_file}: not a model config (a JSON {type(raw).__name__}, not an object); "
                                  "give a model folder with config.json")
        n, key = _mtp_key(raw)
        rep = MtpReport(n, key)
        layers = (raw.get("text_config") or raw).get("num_hidden_layers")
        keys = _checkpoint_keys(cfg_file.parent) if n and layers is not None else None
        if keys is not None:
            rep.weights_present = bool(mtp_weight_names(keys, int(layers)))
        return rep
    n, key = _mtp_key(model)
    return MtpReport(n, key)


# ----------------------------------------------------------------------------- tokenizers


SPECIAL = ("bos_token", "eos_token", "pad_token", "unk_token")
PROBES = ["Hello, world!", "def f(x):\n    return x * 2\n", "The capital of France is Paris.",
          "1234567890", "  leading spaces and ünïcödé 中文"]


@dataclass
class TokenizerReport:
    target_size: int
    draft_size: int
    shared: int = 0
    """Token strings in both vocabularies."""
    id_mismatches: int = 0
    """Shared strings whose ids differ."""
    only_target: int = 0
    only_draft: int = 0
    examples: list[str] = field(default_factory=list)
    special: list[str] = field(default_factory=list)
    """Special tokens that differ, e.g. "eos '<|end|>'=2 vs '</s>'=1"."""
    probes_differ: int = 0
    """Probe strings that encode to different ids."""

    @property
    def compatible(self) -> bool:
        """Draft ids can be used as target ids as they are. A draft vocabulary that is a strict
        prefix of the target's (a smaller sibling with fewer added tokens) is accepted."""
        return (not self.id_mismatches and not self.only_draft and not self.special and not self.probes_differ)

    def summary(self) -> str:
        parts = [f"vocab {self.target_size:,} vs {self.draft_size:,}"]
        if self.id_mismatches:
            parts.append(f"{self.id_mismatches:,} of {self.shared:,} shared strings map to other ids "
                         f"(e.g. {', '.join(self.examples[:3])})")
        if self.only_draft:
            parts.append(f"{self.only_draft:,} draft tokens unknown to the target")
        if self.only_target:
            parts.append(f"{self.only_target:,} target tokens unknown to the draft")
        if self.special:
            parts.append("special tokens differ: " + ", ".join(self.special))
        if self.probes_differ:
            parts.append(f"{self.probes_differ}/{len(PROBES)} probe texts tokenize differently")
        return "; ".join(parts)

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["compatible"] = self.compatible
        return d


def check_tokenizers(target_tok: Any, draft_tok: Any) -> TokenizerReport:
    """Compare two Hugging Face tokenizers: vocabulary (string -> id), special tokens, and how
    a few probe texts tokenize. Pure: reads only the tokenizer objects."""
    tv, dv = target_tok.get_vocab(), draft_tok.get_vocab()
    rep = TokenizerReport(target_size=len(tv), draft_size=len(dv))
    shared = tv.keys() & dv.keys()
    rep.shared = len(shared)
    rep.only_target, rep.only_draft = len(tv) - len(shared), len(dv) - len(shared)
    mismatched = sorted((s for s in shared if tv[s] != dv[s]), key=lambda s: tv[s])
    rep.id_mismatches = len(mismatched)
    rep.examples = [f"{s!r}: {tv[s]} vs {dv[s]}" for s in mismatched[:5]]
    for name in SPECIAL:
        t, d = getattr(target_tok, name, None), getattr(draft_tok, name, None)
        t_id, d_id = getattr(target_tok, f"{name}_id", None), getattr(draft_tok, f"{name}_id", None)
        if t is not None and (t, t_id) != (d, d_id):  # the draft must stop where the target stops
            rep.special.append(f"{name.removesuffix('_token')} {t!r}={t_id} vs {d!r}={d_id}")
    for text in PROBES:
        if target_tok.encode(text, add_special_tokens=False) != draft_tok.encode(text, add_special_tokens=False):
            rep.probes_differ += 1
    return rep


def require_compatible_tokenizers(target_tok: Any, draft_tok: Any, target_name: str, draft_name: str) -> TokenizerReport:
    """check_tokenizers, raising a one-line DraftsmithError that explains a mismatch."""
    rep = check_tokenizers(target_tok, draft_tok)
    if not rep.compatible:
        raise DraftsmithError(f"{draft_name}: its tokenizer differs from the target's ({target_name}): {rep.summary()}; "
                              "an independent draft model must share the target's tokenizer (pick a smaller model "
                              "of the same family, or train an EAGLE-3 drafter instead)")
    return rep
