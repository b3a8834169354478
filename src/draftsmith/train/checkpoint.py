"""Training checkpoints that describe themselves and resume exactly.

    train/step-NNNNNN/model.safetensors   trainable drafter parameters (float32), by name
    train/step-NNNNNN/optim.safetensors   AdamW state flattened: `<param>.exp_avg`, `<param>.exp_avg_sq`, `<param>.step`
    train/step-NNNNNN/meta.json           step, data cursor (epoch, position in that epoch's plan),
                                          RNG states, counters, fingerprint, drafter + recipe config
    train/latest                          the name of the newest complete step folder

A step folder is written under a temporary name and renamed into place, then `latest` is
replaced atomically; the last KEEP folders are kept. Only safetensors and JSON are read back.
"""
from __future__ import annotations

import base64
import os
import re
import shutil
from pathlib import Path
from typing import Any, Optional

import torch

from ..artifacts import DraftsmithError, _fsync_dir, atomic_save_safetensors, atomic_write_json, atomic_write_text, read_json

KEEP = 2
LATEST = "latest"
STEP_RE = re.compile(r"^step-(\d{6,})$")


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def rng_state() -> dict[str, Any]:
    state = {"torch_cpu": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    if torch.cuda.is_available():
        state["torch_cuda"] = [base64.b64encode(s.numpy().tobytes()).decode() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    def tensor(b64: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(b64)), dtype=torch.uint8)

    torch.set_rng_state(tensor(state["torch_cpu"]))
    if "torch_cuda" in state and torch.cuda.is_available() and len(state["torch_cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([tensor(s) for s in state["torch_cuda"]])


def optimizer_tensors(opt: torch.optim.Optimizer, names: list[str]) -> dict[str, torch.Tensor]:
    """AdamW state as flat named tensors. `names` lists the parameters in the optimizer's order."""
    sd = opt.state_dict()
    out = {}
    for idx, st in sd["state"].items():
        for k, v in st.items():
            out[f"{names[idx]}.{k}"] = (v if torch.is_tensor(v) else torch.tensor(v)).detach().cpu()
    return out


def load_optimizer_tensors(opt: torch.optim.Optimizer, names: list[str], tensors: dict[str, torch.Tensor], path: Path) -> None:
    sd = opt.state_dict()
    state: dict[int, dict[str, torch.Tensor]] = {}
    used = set()
    for idx, name in enumerate(names):
        st = {k[len(name) + 1:]: v for k, v in tensors.items() if k.startswith(name + ".") and k[len(name) + 1:] in ("exp_avg", "exp_avg_sq", "step")}
        if st and set(st) != {"exp_avg", "exp_avg_sq", "step"}:
            raise DraftsmithError(f"{path}: optimizer state of {name} is incomplete ({sorted(st)}); delete this step folder to resume from the previous one")
        if st:
            state[idx] = st
            used.update(f"{name}.{k}" for k in st)
    extra = sorted(set(tensors) - used)
    if extra:
        raise DraftsmithError(f"{path}: unexpected optimizer tensors {extra[:4]}; the drafter shape changed, delete the train folder to start over")
    opt.load_state_dict({"state": state, "param_groups": sd["param_groups"]})


def save_checkpoint(train_dir: Path, step: int, params: dict[str, torch.Tensor], opt: torch.optim.Optimizer,
                    opt_names: list[str], meta: dict[str, Any]) -> Path:
    """Write step-NNNNNN/ atomically, point `latest` at it, prune old ones. Returns the folder."""
    name = step_dir_name(step)
    final = train_dir / name
    tmp = train_dir / f".{name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    atomic_save_safetensors(tmp / "model.safetensors", {k: v.detach().float().cpu() for k, v in params.items()})
    atomic_save_safetensors(tmp / "optim.safetensors", optimizer_tensors(opt, opt_names))
    atomic_write_json(tmp / "meta.json", {**meta, "step": step, "rng": rng_state()})
    if final.exists():  # the same step saved again (a rerun of a finished run)
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(train_dir)
    atomic_write_text(train_dir / LATEST, name + "\n")
    steps = sorted((int(m.group(1)), p) for p in train_dir.iterdir() if (m := STEP_RE.match(p.name)) and p.is_dir())
    for _, p in steps[:-KEEP]:
        if p != final:
            shutil.rmtree(p, ignore_errors=True)
    return final


def find_latest(train_dir: Path) -> Optional[Path]:
    """The folder `latest` names; if it is gone, the newest complete step folder; else None."""
    pointer = train_dir / LATEST
    if pointer.exists():
        p = train_dir / pointer.read_text().strip()
        if STEP_RE.match(p.name) and (p / "meta.json").exists():
            return p
    steps = sorted((int(m.group(1)), p) for p in train_dir.glob("step-*") if (m := STEP_RE.match(p.name)) and (p / "meta.json").exists())
    return steps[-1][1] if steps else None


def load_checkpoint(folder: Path) -> tuple[dict, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(meta, model tensors, optimizer tensors) of a step folder."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    meta = read_json(folder / "meta.json")
    try:
        model = load_file(str(folder / "model.safetensors"))
        optim = load_file(str(folder / "optim.safetensors"))
    except (SafetensorError, OSError, ValueError) as e:
        raise DraftsmithError(f"{folder}: unreadable checkpoint ({e}); delete this folder to resume from the previous one") from None
    return meta, model, optim
