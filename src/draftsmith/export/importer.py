"""Import an existing EAGLE-3 checkpoint (SGLang-native or speculators/vLLM format) as an
Eagle3Drafter, to evaluate it, fine-tune it or re-export it.

    draftsmith import-drafter SRC_DIR --target TARGET --run-dir runs/NAME   # then evaluate / export
    draftsmith import-drafter SRC_DIR --target TARGET --out DIR              # a drafter folder only

The format is read from config.json: `speculators_model_type` -> speculators, architectures
`LlamaForCausalLMEagle3` -> SGLang. Aux-layer ids are converted to the internal convention
(export/conventions.py); a checkpoint without ids gets its runtime's default for the target's
layer count. Only the architecture our drafter has is accepted (one Llama decoder layer, no
biases; the architecture flags norm_before_fc, norm_before_residual and norm_output, which
speculators turns on by default, are carried into Eagle3Config); anything else (fc_norm, biases,
more layers) is refused by name, never dropped. A sliding attention window (speculators' default
draft layer has one of 2,048 tokens) is recorded: draftsmith's drafter attends the whole
context, the same up to the window's length. Weights are read from safetensors only. Re-exporting an import with the source's dtype
(and embeddings, if it had them) gives the same tensors bit for bit (tests/test_interop.py).
"""
from __future__ import annotations

import argparse
import hashlib
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from ..fileio import read_json, sha256_file
from ..manifests import finish_manifest, new_manifest
from ..messages import DraftsmithError, log
from ..draft.build import rope_settings
from ..draft.io import drafter_shapes, save_drafter, state_dict_mismatch
from ..draft.model import Eagle3Config, Eagle3Drafter
from ..target.model import read_target_embeddings
from .checks import check_target, check_vocab_map
from .conventions import from_sglang, from_vllm

SGLANG_ARCHS = ("LlamaForCausalLMEagle3",)


def detect_format(config: dict, where: str) -> str:
    if "speculators_model_type" in config:
        if config["speculators_model_type"] != "eagle3":
            raise DraftsmithError(f"{where}: speculators_model_type {config['speculators_model_type']!r} is not an EAGLE-3 "
                                  "drafter; only eagle3 checkpoints can be imported")
        return "vllm"
    if any(a in SGLANG_ARCHS for a in config.get("architectures") or []):
        return "sglang"
    raise DraftsmithError(f"{where}: neither a speculators config (speculators_model_type) nor a SGLang EAGLE-3 config "
                          f"(architectures {list(SGLANG_ARCHS)}); give the folder of an EAGLE-3 drafter")


def _flags(c: dict, where: str, allowed=("norm_before_fc", "norm_before_residual", "norm_output")) -> dict:
    """The architecture flags of a config: the ones Eagle3Config has, each a bool; any other
    flag that is on (fc_norm: per-aux norms before fc) is refused."""
    unsupported = [k for k in ("norm_before_fc", "norm_before_residual", "norm_output", "fc_norm") if c.get(k) and k not in allowed]
    if unsupported:
        raise DraftsmithError(f"{where}: {', '.join(unsupported)} true is a drafter variant draftsmith does not implement; "
                              "this checkpoint cannot be imported")
    return {k: bool(c.get(k, False)) for k in allowed}


def _drafter_config(layer: dict, draft_vocab_size: Optional[int], target_hidden_size: Optional[int],
                    aux_ids: list[int], num_layers: Optional[int], where: str, flags: dict) -> Eagle3Config:
    bad = [k for k in ("attention_bias", "mlp_bias") if layer.get(k)]
    if int(layer.get("num_hidden_layers", 1)) != 1:
        bad.append(f"num_hidden_layers {layer['num_hidden_layers']}")
    if layer.get("hidden_act", "silu") != "silu":
        bad.append(f"hidden_act {layer['hidden_act']}")
    if bad:
        raise DraftsmithError(f"{where}: {', '.join(bad)} not supported (draftsmith's drafter is one Llama layer without "
                              "biases, SiLU MLP); this checkpoint cannot be imported")
    theta, scaling = rope_settings(SimpleNamespace(rope_theta=layer.get("rope_theta"), rope_scaling=layer.get("rope_scaling"),
                                                   rope_parameters=layer.get("rope_parameters")))
    H, nh = int(layer["hidden_size"]), int(layer["num_attention_heads"])
    return Eagle3Config(
        hidden_size=H, target_hidden_size=int(target_hidden_size or H), num_attention_heads=nh,
        num_key_value_heads=int(layer.get("num_key_value_heads") or nh), head_dim=int(layer.get("head_dim") or H // nh),
        intermediate_size=int(layer["intermediate_size"]), vocab_size=int(layer["vocab_size"]),
        draft_vocab_size=int(draft_vocab_size or layer["vocab_size"]), num_aux_layers=len(aux_ids),
        rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
        max_position_embeddings=int(layer.get("max_position_embeddings") or 4096), aux_layer_ids=list(aux_ids),
        target_num_layers=int(num_layers or 0), **flags)


def read_checkpoint(folder: str | Path, num_layers: Optional[int], aux_layer_ids: Optional[list[int]] = None
                    ) -> tuple[str, Eagle3Config, dict[str, torch.Tensor]]:
    """(format, drafter config, tensors under our names) of an EAGLE-3 folder. `num_layers`:
    the target's decoder-layer count; `aux_layer_ids` (internal) overrides the file's ids."""
    folder = Path(folder)
    where = str(folder / "config.json")
    if not folder.is_dir():
        raise DraftsmithError(f"{folder}: no such folder; give the folder of an EAGLE-3 drafter (config.json + *.safetensors)")
    c = read_json(folder / "config.json")
    if not isinstance(c, dict):
        raise DraftsmithError(f"{where}: a JSON {type(c).__name__}, not an object; give the config.json of an EAGLE-3 drafter")
    try:
        return _read_checkpoint(folder, c, where, num_layers, aux_layer_ids)
    except (KeyError, TypeError, ValueError, AttributeError) as e:  # a config key missing or of the wrong type
        what = f"key {e}" if isinstance(e, KeyError) else " ".join(str(e).split())[:160]
        raise DraftsmithError(f"{where}: a missing or malformed value ({what}); fix config.json (numbers for sizes, "
                              "an object for transformer_layer_config)") from None


def _read_checkpoint(folder: Path, c: dict, where: str, num_layers: Optional[int], aux_layer_ids: Optional[list[int]]
                     ) -> tuple[str, Eagle3Config, dict[str, torch.Tensor]]:
    fmt = detect_format(c, where)
    if fmt == "vllm":
        missing = [k for k in ("transformer_layer_config", "draft_vocab_size") if k not in c]
        if missing:
            raise DraftsmithError(f"{where}: speculators config lacks {', '.join(missing)}; not a complete eagle3 checkpoint")
        if "norm_before_residual" not in c:
            raise DraftsmithError(f"{where}: norm_before_residual is missing (vLLM reads that as true, speculators as false); "
                                  "add it to config.json with the value the drafter was trained with")
        ids = c.get("eagle_aux_hidden_state_layer_ids")
        # No list: vLLM's default [2, N//2, N-3] (layer inputs) = SGLang's default, same conversion.
        internal = from_vllm(ids, where) if ids else from_sglang(None, num_layers, where)
        cfg = _drafter_config(c["transformer_layer_config"], c["draft_vocab_size"], c.get("target_hidden_size"),
                              aux_layer_ids or internal, num_layers, where, _flags(c, where))
    else:
        ids = (c.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        internal = aux_layer_ids or from_sglang(ids, num_layers, where)
        # SGLang's LlamaForCausalLMEagle3 knows norm_output (EAGLE-3.1) only
        cfg = _drafter_config(c, c.get("draft_vocab_size"), c.get("target_hidden_size"), internal, num_layers, where,
                              _flags(c, where, allowed=("norm_output",)))
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise DraftsmithError(f"{folder}: no *.safetensors weights (pickled .bin files are never loaded); "
                              "convert the checkpoint to safetensors first")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except (SafetensorError, OSError) as e:
            raise DraftsmithError(f"{f}: unreadable safetensors ({' '.join(str(e).split())[:160]}); re-download the drafter") from None
    state = {("midlayer." + k[len("layers.0."):]) if k.startswith("layers.0.") else k: v for k, v in state.items()}
    return fmt, cfg, state


def build_drafter(cfg: Eagle3Config, state: dict[str, torch.Tensor], embed_tokens: Optional[torch.Tensor],
                  where: str) -> Eagle3Drafter:
    """A float32 drafter holding exactly these tensors (the embedding from the target when absent)."""
    state = dict(state)
    if "embed_tokens.weight" not in state:
        if embed_tokens is None:
            raise DraftsmithError(f"{where}: has no embed_tokens.weight; give the target (its input embedding is used)")
        state["embed_tokens.weight"] = embed_tokens
    if cfg.draft_vocab_size == cfg.vocab_size and "d2t" not in state:  # full vocab: the identity map
        state["d2t"] = torch.zeros(cfg.vocab_size, dtype=torch.int64)
        state["t2d"] = torch.ones(cfg.vocab_size, dtype=torch.bool)
    model = Eagle3Drafter(cfg)
    want = model.state_dict()
    what = state_dict_mismatch(state, drafter_shapes(model))
    if what:
        raise DraftsmithError(f"{where}: weights do not fit draftsmith's EAGLE-3 drafter ({what}); "
                              "only Llama-style EAGLE-3 drafters without biases can be imported")
    check_vocab_map(state["d2t"], state["t2d"], where,
                    fix="the checkpoint's vocab map is broken; export it again from the run that trained it")
    model.load_state_dict({k: v.to(want[k].dtype) for k, v in state.items()}, strict=True)
    model.embed_tokens.weight.requires_grad_(False)
    return model.eval()


def load_sglang(folder: str | Path, embed_tokens: Optional[torch.Tensor] = None,
                num_layers: Optional[int] = None) -> Eagle3Drafter:
    """Read a SGLang EAGLE-3 folder back into an Eagle3Drafter (float32, CPU). `embed_tokens`
    (the target's input embedding) is needed when the folder has none, `num_layers` (the
    target's) when its config lists no aux layers."""
    fmt, cfg, state = read_checkpoint(folder, num_layers)
    if fmt != "sglang":
        raise DraftsmithError(f"{Path(folder) / 'config.json'}: a {fmt} checkpoint, not SGLang's; use export.importer.import_drafter")
    return build_drafter(cfg, state, embed_tokens, str(Path(folder) / "model.safetensors"))


def import_drafter(src: str | Path, target_path: str | Path, out_dir: str | Path,
                   aux_layer_ids: Optional[list[int]] = None, trust_remote_code: bool = False) -> dict:
    """Read an EAGLE-3 checkpoint for `target_path`, check it against the target, and save it as
    a draftsmith drafter folder (config.json + model.safetensors). Returns what was found:
    format, dtype, with_embeddings, aux ids (internal), sha256 of the source weights."""
    src = Path(src)
    where = str(src / "config.json")
    embed, _, tcfg = read_target_embeddings(target_path, trust_remote_code)
    fmt, cfg, state = read_checkpoint(src, int(tcfg.num_hidden_layers), aux_layer_ids)
    check_target(cfg, tcfg, where)
    window = sliding_window_of(read_json(src / "config.json"))
    bad = [i for i in cfg.aux_layer_ids if not 0 <= i < int(tcfg.num_hidden_layers)]
    if bad:
        raise DraftsmithError(f"{where}: aux layers {cfg.aux_layer_ids} (internal ids) include {bad}, outside the target's "
                              f"0..{int(tcfg.num_hidden_layers) - 1}; give --aux-layer-ids")
    float_dtypes = sorted({str(v.dtype).replace("torch.", "") for v in state.values() if v.is_floating_point()})
    drafter = build_drafter(cfg, state, embed, where)
    save_drafter(drafter, out_dir)
    digest = hashlib.sha256("".join(sha256_file(f) for f in sorted(src.glob("*.safetensors"))).encode()).hexdigest()
    return {"source": str(src), "format": fmt, "dtype": float_dtypes[0] if len(float_dtypes) == 1 else "float32",
            "with_embeddings": "embed_tokens.weight" in state, "aux_layer_ids": cfg.aux_layer_ids,
            "flags": {k: getattr(cfg, k) for k in ("norm_before_fc", "norm_before_residual", "norm_output")},
            "sliding_window": window, "source_sha256": digest}


def sliding_window_of(config: dict) -> Optional[int]:
    """The drafter layer's attention window when its config has one (speculators' default draft
    layer: `layer_types: [sliding_attention]`, `sliding_window: 2048`), else None."""
    layer = config.get("transformer_layer_config") or config
    if "sliding_attention" in (layer.get("layer_types") or []) or layer.get("use_sliding_window"):
        return int(layer["sliding_window"]) if layer.get("sliding_window") else None
    return None


def import_into_run(src: str | Path, target_path: str | Path, run_dir: str | Path,
                    aux_layer_ids: Optional[list[int]] = None, trust_remote_code: bool = False) -> dict:
    """Import into RUN_DIR/train/drafter with a complete train manifest, so `draftsmith evaluate`
    and `draftsmith export` (not `run`, which would retrain) work on it."""
    train_dir = Path(run_dir) / "train"
    info = import_drafter(src, target_path, train_dir / "drafter", aux_layer_ids, trust_remote_code)
    manifest = new_manifest("train", f"imported-{info['source_sha256'][:16]}", {"imported": info},
                            {"source_sha256": info["source_sha256"]})
    manifest["imported"] = info
    return finish_manifest(train_dir, manifest)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="draftsmith import-drafter",
                                description="Import an EAGLE-3 checkpoint (SGLang or speculators format) as a draftsmith drafter.")
    p.add_argument("src", help="folder with config.json + *.safetensors")
    p.add_argument("--target", required=True, help="local folder of the target model the drafter was trained for")
    out = p.add_mutually_exclusive_group(required=True)
    out.add_argument("--run-dir", help="write RUN_DIR/train/drafter + a complete train manifest (then evaluate / export)")
    out.add_argument("--out", help="write a drafter folder here")
    p.add_argument("--aux-layer-ids", help="internal ids (outputs of 0-indexed layers), e.g. 1,29,57; default: from the file")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="run code shipped with the target folder (off: only trust a folder you know)")
    args = p.parse_args(argv)
    try:
        ids = [int(x) for x in args.aux_layer_ids.split(",")] if args.aux_layer_ids else None
    except ValueError:
        raise DraftsmithError(f"--aux-layer-ids {args.aux_layer_ids!r}: not a comma-separated list of layer numbers; "
                              "give e.g. 1,29,57") from None
    if args.run_dir:
        info = import_into_run(args.src, args.target, args.run_dir, ids, args.trust_remote_code)["imported"]
        dest = Path(args.run_dir) / "train" / "drafter"
    else:
        info = import_drafter(args.src, args.target, args.out, ids, args.trust_remote_code)
        dest = Path(args.out)
    flags = [k for k, v in info["flags"].items() if v]
    log(f"[import] {info['format']} checkpoint {args.src} -> {dest} (aux layers {info['aux_layer_ids']} internal, "
        f"{info['dtype']}{', with embeddings' if info['with_embeddings'] else ''}{', ' + ', '.join(flags) if flags else ''})")
    if info["sliding_window"]:
        log(f"[import] its attention window of {info['sliding_window']} tokens is not kept: draftsmith's drafter attends "
            f"the whole context (the same for contexts up to {info['sliding_window']} tokens)")
    if args.run_dir:
        log(f"[import] same tensors again: draftsmith export RECIPE --run_dir {args.run_dir} --target.path {args.target} "
            f"--export.formats '[{info['format']}]' --export.dtype {info['dtype']}"
            f" --export.with_embeddings {'true' if info['with_embeddings'] else 'false'}")
    return 0
