"""The drafter on disk: a folder of config.json (Eagle3Config) and model.safetensors, written
atomically by the train stage and read by evaluate, export and the importer. draft/model.py
stays a pure nn.Module; every file the drafter touches is read or written here.
"""
from __future__ import annotations

import json
import math
from dataclasses import MISSING, asdict
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file

from ..fileio import atomic_save_safetensors, atomic_write_json, read_json
from ..messages import DraftsmithError
from .model import Eagle3Config, Eagle3Drafter


MAX_SIZE = 1 << 24
"""Largest width, head count or vocabulary a drafter config may give (past it the file is not a drafter's)."""


def _config_problem(d: dict) -> Optional[str]:
    """What in a drafter config.json's keys Eagle3Config cannot take (None: nothing)."""
    fields = Eagle3Config.__dataclass_fields__
    missing = [k for k, f in fields.items() if f.default is MISSING and f.default_factory is MISSING and k not in d]
    if missing:
        return f"no {', '.join(missing)}"
    for k, f in fields.items():
        if k not in d:
            continue
        v, kind = d[k], f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        if kind == "int":
            ok = isinstance(v, int) and not isinstance(v, bool) and (0 if k == "target_num_layers" else 1) <= v <= MAX_SIZE
        elif kind == "float":
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
        elif kind == "bool":
            ok = isinstance(v, bool)
        elif k == "rope_scaling":
            ok = v is None or isinstance(v, dict)
        else:  # aux_layer_ids
            ok = isinstance(v, list) and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= MAX_SIZE for i in v)
        if not ok:
            return f"{k} {json.dumps(v, default=str)[:40]} is not {'a positive number' if kind in ('int', 'float') else kind}"
    return None


def read_drafter_config(path: str | Path) -> Eagle3Config:
    """An Eagle3Config from a drafter's config.json (keys it does not know are ignored); a file that is
    not a drafter config (not an object, a key missing or of the wrong kind) is a one-line error."""
    d = read_json(path)
    what = f"a JSON {type(d).__name__}, not an object" if not isinstance(d, dict) else _config_problem(d)
    if what:
        raise DraftsmithError(f"{path}: not a drafter config ({what}); retrain or re-export the drafter")
    return Eagle3Config(**{k: v for k, v in d.items() if k in Eagle3Config.__dataclass_fields__})


def state_dict_mismatch(state: dict[str, torch.Tensor], want: dict[str, tuple[int, ...]], limit: Optional[int] = None) -> Optional[str]:
    """How a state dict differs from the wanted keys and shapes, e.g. "missing: fc.weight;
    wrong shape: lm_head.weight (101, 64) (want (100, 64))"; None when it fits. `limit`: the
    names listed per kind before "..."."""
    missing, extra = sorted(set(want) - set(state)), sorted(set(state) - set(want))
    bad = sorted(f"{k} {tuple(state[k].shape)} (want {tuple(want[k])})" for k in set(want) & set(state)
                 if tuple(state[k].shape) != tuple(want[k]))
    if not (missing or extra or bad):
        return None
    cut = lambda v: ", ".join(v) if limit is None or len(v) <= limit else ", ".join(v[:limit]) + "..."  # noqa: E731
    return "; ".join(f"{n}: {cut(v)}" for n, v in (("missing", missing), ("unexpected", extra), ("wrong shape", bad)) if v)


def drafter_shapes(model: Eagle3Drafter) -> dict[str, tuple[int, ...]]:
    """The key -> shape of every tensor a drafter's state dict holds."""
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def load_drafter(folder: str | Path, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32) -> Eagle3Drafter:
    """Load a drafter saved by the train stage (config.json + model.safetensors)."""
    folder = Path(folder)
    cfg = read_drafter_config(folder / "config.json")
    try:
        state = load_file(str(folder / "model.safetensors"))
    except Exception as e:  # SafetensorError (not safetensors), OSError (missing)
        raise DraftsmithError(f"{folder / 'model.safetensors'}: unreadable ({str(e).splitlines()[0][:200]}); retrain or re-export it") from None
    with torch.device("meta"):  # the shapes the config gives, without allocating them (a config may be absurd)
        shapes = drafter_shapes(Eagle3Drafter(cfg))
    what = state_dict_mismatch(state, shapes, limit=4)
    if what:
        raise DraftsmithError(f"{folder / 'model.safetensors'}: not a drafter for {folder / 'config.json'} ({what}); retrain or re-export it")
    model = Eagle3Drafter(cfg)
    model.load_state_dict(state)
    return model.to(device=device, dtype=dtype).eval()


def save_drafter(model: Eagle3Drafter, folder: str | Path) -> str:
    """Write config.json + model.safetensors atomically; returns the weights' sha256."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    sha = atomic_save_safetensors(folder / "model.safetensors",
                                  {k: v.detach().cpu() for k, v in model.state_dict().items()})
    atomic_write_json(folder / "config.json", asdict(model.cfg))
    return sha
