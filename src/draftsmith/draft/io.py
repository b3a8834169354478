"""The drafter on disk: a folder of config.json (Eagle3Config) and model.safetensors, written
atomically by the train stage and read by evaluate, export and the importer. draft/model.py
stays a pure nn.Module; every file the drafter touches is read or written here.
"""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file

from ..fileio import atomic_save_safetensors, atomic_write_json, read_json
from ..messages import DraftsmithError
from .model import Eagle3Config, Eagle3Drafter


def read_drafter_config(path: str | Path) -> Eagle3Config:
    """An Eagle3Config from a drafter's config.json (keys it does not know are ignored)."""
    d = read_json(path)
    known = {k: v for k, v in d.items() if k in Eagle3Config.__dataclass_fields__}
    return Eagle3Config(**known)


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
    model = Eagle3Drafter(cfg)
    try:
        state = load_file(str(folder / "model.safetensors"))
    except Exception as e:  # SafetensorError (not safetensors), OSError (missing)
        raise DraftsmithError(f"{folder / 'model.safetensors'}: unreadable ({str(e).splitlines()[0][:200]}); retrain or re-export it") from None
    what = state_dict_mismatch(state, drafter_shapes(model), limit=4)
    if what:
        raise DraftsmithError(f"{folder / 'model.safetensors'}: not a drafter for {folder / 'config.json'} ({what}); retrain or re-export it")
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
