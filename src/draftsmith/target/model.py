"""Load a Hugging Face causal LM and read its aux hidden states.

One small interface for every target (DESIGN.md §5): `Target.forward` returns logits, the
aux hidden states (outputs of the decoder layers in `aux_layer_ids`, concatenated) and the
final hidden state, with the model's own KV cache. Decoder layers are found by structure,
so the same code serves Llama, Qwen, MoE models and decoders wrapped inside multimodal
models (`model.language_model.layers`).
"""
from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn as nn
from safetensors import SafetensorError, safe_open

from ..fileio import JSON_ERRORS, json_error
from ..messages import DraftsmithError
from ..rundir import relative_hint
from ..compat import cache_kwargs, output_cache
from ..distributed.group import resolve_device

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[dtype]


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """[1, N//2 - 1, N - 4] (outputs of those 0-indexed layers), clamped into range for tiny models."""
    return [min(max(i, 0), num_layers - 1) for i in (1, num_layers // 2 - 1, num_layers - 4)]


def load_tokenizer(path: str | Path, trust_remote_code: bool = False):
    from transformers import AutoTokenizer  # why here: transformers takes seconds to import; only loaders need it

    config = Path(path) / "config.json"
    if config.exists():  # a broken config.json breaks the tokenizer load too: name the real culprit
        try:
            if not isinstance(json.loads(config.read_bytes()), dict):
                raise ValueError("not a JSON object")
        except JSON_ERRORS as e:
            raise DraftsmithError(f"{config}: not a valid model config ({json_error(e)[:120]}); "
                                  "re-download the model or fix config.json") from None
    try:
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except Exception as e:
        raise DraftsmithError(f"{path}: cannot load a tokenizer ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                              "the folder needs tokenizer.json / tokenizer_config.json") from None


def eos_token_ids(target: "Target") -> list[int]:
    """Every id that ends the target's answer: the tokenizer's EOS and the generation config's."""
    ids = set()
    for v in (getattr(target.tokenizer, "eos_token_id", None),
              getattr(getattr(target.model, "generation_config", None), "eos_token_id", None)):
        ids.update(v if isinstance(v, (list, tuple)) else [] if v is None else [v])
    return sorted(int(i) for i in ids)


def text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    return get() if get is not None else config


def read_text_config(path: str | Path, trust_remote_code: bool = False,
                     fix: str = "set target.path to a local Hugging Face model folder") -> Any:
    """The text config of a local model folder's config.json (the decoder's, also under a
    multimodal wrapper), without loading weights; `fix` ends the error when it cannot be read."""
    from transformers import AutoConfig  # why here: transformers takes seconds to import; only loaders need it

    path = Path(path)
    try:
        return text_config(AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise DraftsmithError(f"{path / 'config.json'}: cannot read the target config ({str(e).splitlines()[0][:200]}); {fix}") from None


def find_decoder_layers(model: nn.Module, num_layers: int) -> tuple[str, nn.ModuleList]:
    """The ModuleList of the language decoder's layers, wherever it sits (also under a wrapper)."""
    found = []
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) == num_layers and name.rsplit(".", 1)[-1] in ("layers", "h", "blocks"):
            if any(part in name for part in ("vision", "visual", "audio", "mtp")):
                continue
            found.append(name)
    if not found:
        raise DraftsmithError(f"{type(model).__name__}: no decoder layer list of length {num_layers} found; "
                              "this architecture needs a line in draftsmith/target/model.py:find_decoder_layers")
    # Prefer the language model inside a wrapper, then the shortest path.
    found.sort(key=lambda n: (0 if ("language_model" in n or "text_model" in n) else 1, len(n)))
    return found[0], model.get_submodule(found[0])


@dataclass
class TargetOutput:
    logits: Optional[torch.Tensor]  # [B, T, V] or None
    aux_hidden: torch.Tensor  # [B, T, n_aux * H]
    final_hidden: torch.Tensor  # [B, T, H] after the final norm
    past_key_values: Any = None


class Target:
    """A loaded target model with hooks on its aux layers."""

    def __init__(self, model: nn.Module, tokenizer: Any, aux_layer_ids: Optional[list[int]] = None):
        self.model = model
        self.tokenizer = tokenizer
        self.config = text_config(model.config)
        self.num_layers = int(self.config.num_hidden_layers)
        self.hidden_size = int(self.config.hidden_size)
        self.vocab_size = int(self.config.vocab_size)
        layers_name, self.layers = find_decoder_layers(model, self.num_layers)
        self.decoder = model.get_submodule(layers_name.rsplit(".", 1)[0]) if "." in layers_name else model
        ids = list(aux_layer_ids) if aux_layer_ids else default_aux_layer_ids(self.num_layers)
        bad = [i for i in ids if not 0 <= i < self.num_layers]
        if bad:
            raise DraftsmithError(f"target.aux_layer_ids {ids}: {bad} outside 0..{self.num_layers - 1}; "
                                  "ids are 0-indexed decoder layers whose outputs are used")
        self.aux_layer_ids = ids
        self._captured: dict[int, torch.Tensor] = {}
        for i in sorted(set(ids)):
            self.layers[i].register_forward_hook(self._hook(i))

    def _hook(self, i: int):
        def hook(_module, _inputs, output):
            self._captured[i] = output[0] if isinstance(output, (tuple, list)) else output
        return hook

    @property
    def device(self) -> torch.device:
        """Where inputs go: the input embedding's device (the first GPU under a device_map)."""
        return self.model.get_input_embeddings().weight.device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                past_key_values: Any = None, position_ids: Optional[torch.Tensor] = None,
                use_cache: bool = False, with_logits: bool = True) -> TargetOutput:
        """Target forward. Without logits only the decoder runs (capture: no lm_head cost)."""
        self._captured.clear()
        kw = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=use_cache,
                  **cache_kwargs(self.model if with_logits else self.decoder, past_key_values))
        if with_logits:
            out = self.model(**kw, output_hidden_states=False, return_dict=True)
            logits = out.logits
            final = self._final_hidden
        else:
            out = self.decoder(**kw, return_dict=True)
            logits, final = None, out.last_hidden_state
        # Under a device_map the aux layers may sit on different GPUs.
        aux = torch.cat([self._captured[i].to(final.device) for i in self.aux_layer_ids], dim=-1)
        return TargetOutput(logits=logits, aux_hidden=aux, final_hidden=final,
                            past_key_values=output_cache(out))

    def _install_final_hook(self) -> None:
        def hook(_m, _i, output):
            self._final_hidden = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
        self.decoder.register_forward_hook(hook)

    def input_embeddings(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight

    def output_embeddings(self) -> torch.Tensor:
        head = self.model.get_output_embeddings()
        return head.weight if head is not None else self.input_embeddings()


def model_class(config: Any):
    """The Auto class that builds this config with an LM head: AutoModelForCausalLM, or for
    wrappers it does not map (Llava, Qwen2-VL, Mistral3: decoder under `language_model`)
    AutoModelForImageTextToText."""
    # why here: transformers takes seconds to import; only loaders need it
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or getattr(config, "auto_map", None):
        return AutoModelForCausalLM
    return AutoModelForImageTextToText


def load_target(path: str | Path, device: str = "auto", dtype: str = "auto", trust_remote_code: bool = False,
                aux_layer_ids: Optional[list[int]] = None, with_tokenizer: bool = True,
                device_map: Optional[str | dict] = None, experts_implementation: Optional[str] = None) -> Target:
    """Load a local Hugging Face causal LM as a Target (eval mode, no grad).

    device_map (e.g. "auto", "balanced", a {module: device} dict) spreads a large target over
    the visible GPUs through accelerate; inputs then go to the embedding's device."""
    from transformers import AutoConfig  # why here: transformers takes seconds to import; only loaders need it

    path = Path(path)
    if not (path / "config.json").exists():
        raise DraftsmithError(f"{path / 'config.json'}: not found{relative_hint(path)}; target.path must be a local Hugging Face "
                              "model folder")
    if not any(path.glob("*.safetensors")):
        raise DraftsmithError(f"{path}: no *.safetensors weights (pickled .bin checkpoints are never loaded); "
                              "convert the checkpoint to safetensors")
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    try:
        config = AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
        if device_map and importlib.util.find_spec("accelerate") is None:
            raise DraftsmithError(f"target.device_map {device_map!r}: needs the accelerate package; pip install accelerate "
                                  "(or unset target.device_map to load the target on one device)")
        extra = {"device_map": device_map} if device_map else {}
        if experts_implementation:
            extra["experts_implementation"] = experts_implementation
        model, loading = model_class(config).from_pretrained(str(path), config=config, dtype=dt, output_loading_info=True,
                                                             trust_remote_code=trust_remote_code, use_safetensors=True, **extra)
    except (OSError, SafetensorError, KeyError, TypeError, AttributeError) as e:
        # OSError (EnvironmentError): an unreadable config.json or weights; the others: a config.json that is not a
        # config (a list, a string where a number belongs) or weights that are not safetensors
        raise DraftsmithError(f"{path}: cannot read the model files ({' '.join(str(e).split())[:200]}); re-download the model "
                              "or fix config.json") from None
    except ValueError as e:
        hint = "set target.trust_remote_code: true if you trust this folder's code" if "trust_remote_code" in str(e) \
            else "check that the folder holds a causal LM that transformers supports"
        raise DraftsmithError(f"{path}: cannot load the model ({str(e).splitlines()[0][:200]}); {hint}") from None
    missing = sorted((loading or {}).get("missing_keys") or [])
    if missing:  # transformers would initialise them at random: a target that computes something else
        raise DraftsmithError(f"{path}: the weights lack {len(missing)} tensor(s) its config.json needs ({', '.join(missing[:3])}"
                              f"{', ...' if len(missing) > 3 else ''}); the checkpoint is incomplete or for another config, "
                              "re-download the model")
    if not device_map:
        model.to(dev)
    model.eval()
    model.requires_grad_(False)
    tok = load_tokenizer(path, trust_remote_code) if with_tokenizer else None
    t = Target(model, tok, aux_layer_ids)
    t._install_final_hook()
    return t


# ----------------------------------------------------------------------------- target tensors without loading the target


def _weight_files(path: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, from model.safetensors(.index.json)."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_bytes())["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise ValueError("weight_map is not a mapping of tensor names to file names")
        except (*JSON_ERRORS, KeyError, TypeError) as e:
            why = f"no {e}" if isinstance(e, KeyError) else json_error(e) if not isinstance(e, TypeError) else "not a JSON object"
            raise DraftsmithError(f"{index}: not a safetensors index ({why}); re-download the model") from None
        return {k: path / v for k, v in weight_map.items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise DraftsmithError(f"{path}: no *.safetensors weights (only safetensors are read); convert the checkpoint to safetensors")
    out = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            out.update({k: f for k in h.keys()})
    return out


def _find_key(param_name: str, shape: tuple[int, ...], keys: dict[str, Path], shapes) -> Optional[str]:
    """The checkpoint key of a model parameter: the exact name, else the unique key of the
    right shape sharing the longest dotted suffix (checkpoints of wrapper models often nest
    the language model under another prefix than the module tree)."""
    if param_name in keys:
        return param_name
    parts = param_name.split(".")
    for n in range(len(parts) - 1, 1, -1):
        suffix = "." + ".".join(parts[-n:])
        hits = [k for k in keys if (k.endswith(suffix) or k == suffix[1:]) and shapes(k) == shape]
        if len(hits) == 1:
            return hits[0]
    return None


def read_target_embeddings(path: str | Path, trust_remote_code: bool = False) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """(input embedding [V, H], lm_head weight [V, H], text config) of a local HF model,
    reading only those tensors. The model is built on the meta device to learn the two
    parameter names; tied (or absent) heads use the embedding."""
    from transformers import AutoConfig, AutoModelForCausalLM  # why here: seconds to import; only loaders need it

    path = Path(path)
    try:
        config = AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise DraftsmithError(f"{path}: cannot build the target from its config ({str(e).splitlines()[0][:200]}); "
                              "target.path must be a local Hugging Face causal LM (set target.trust_remote_code if it ships code)") from None
    emb_param = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    head_param = head.weight if head is not None else None
    names: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    tied = head_param is None or head_param is emb_param  # transformers ties them when the config says so
    declared_tied = bool(getattr(text_config(config), "tie_word_embeddings", False) or getattr(config, "tie_word_embeddings", False))
    files = _weight_files(path)
    handles: dict[Path, Any] = {}

    def handle(f: Path):
        if f not in handles:
            handles[f] = safe_open(str(f), framework="pt")
        return handles[f]

    def shape_of(key: str) -> tuple[int, ...]:
        return tuple(handle(files[key]).get_slice(key).get_shape())

    def read(param: torch.Tensor) -> Optional[torch.Tensor]:
        for name in names[id(param)]:  # a tied parameter has several names; the file holds one
            key = _find_key(name, tuple(param.shape), files, shape_of)
            if key is not None:
                return handle(files[key]).get_tensor(key)
        return None

    embed = read(emb_param)
    if embed is None:
        raise DraftsmithError(f"{path}: no tensor for the input embedding `{names[id(emb_param)][0]}` "
                              f"of shape {tuple(emb_param.shape)} in the safetensors files; the weights do not match config.json")
    lm_head = None if tied else read(head_param)
    if lm_head is None:
        if not (tied or declared_tied):
            raise DraftsmithError(f"{path}: no tensor for the output head `{names[id(head_param)][0]}` of shape "
                                  f"{tuple(head_param.shape)} and tie_word_embeddings is false; the weights do not match config.json")
        lm_head = embed
    return embed, lm_head, text_config(config)
