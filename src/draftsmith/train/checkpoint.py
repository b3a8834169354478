"""Training checkpoints that describe themselves and resume exactly, at any world size.

    train/step-NNNNNN/state/*.safetensors  torch.distributed.checkpoint (DCP) in Hugging Face
                                           safetensors storage: every rank writes its own shards;
                                           keys `model.<param>` (float32 master weights) and
                                           `optim.<param>.{exp_avg,exp_avg_sq,step}`; each file's
                                           header records its shards' offsets (DCP_SHARDING_INFO)
    train/step-NNNNNN/meta.json            step, data cursor (epoch, position in that epoch's plan),
                                           RNG state, counters, world size at save, fingerprint,
                                           drafter + recipe config
    train/latest                           the name of the newest complete step folder

DCP's default FileSystemWriter keeps its metadata in a pickled `.metadata` file; the
HuggingFaceStorageWriter/Reader pair keeps it in the safetensors headers (JSON), so nothing
is ever unpickled. Loading reads any saved sharding into the current one (DCP resharding):
a run saved on 8 ranks resumes on 1 or 2.
A step folder is written under a temporary name and renamed into place by rank 0 after every
rank has finished, then `latest` is replaced atomically; the last KEEP folders are kept.
"""
from __future__ import annotations

import base64
import contextlib
import re
import shutil
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors import SafetensorError, safe_open

from ..fileio import atomic_write_json, atomic_write_text, canonicalize_safetensors, read_json, replace_dir, sha256_file, temp_dir
from ..messages import DraftsmithError
from ..distributed.group import DistInfo, barrier

KEEP = 2
LATEST = "latest"
STATE = "state"
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


@contextlib.contextmanager
def _quiet():
    """DCP warns that it runs in one process when no process group exists: that is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer, names: dict[str, str]) -> tuple[dict, dict]:
    """(flat DCP state {key: tensor or DTensor}, the optimizer state dict it aliases).
    `names` maps the module's parameter FQNs to checkpoint names. Creates the AdamW state if
    the optimizer has not stepped yet, so that a load has tensors to fill."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict  # why here: torch.distributed.checkpoint takes ~1.5 s to import; only saves and loads need it

    osd = get_optimizer_state_dict(model, opt)
    flat = {f"model.{names[n]}": p for n, p in model.named_parameters() if n in names}
    for fqn, st in osd["state"].items():
        for k, v in st.items():
            flat[f"optim.{names[fqn]}.{k}"] = v
    return flat, osd


def save_checkpoint(train_dir: Path, step: int, model: torch.nn.Module, opt: torch.optim.Optimizer,
                    names: dict[str, str], meta: dict[str, Any], info: DistInfo) -> Path:
    """Every rank writes its shards into a temporary folder; rank 0 adds meta.json, renames the
    folder into place, points `latest` at it and prunes old ones. Returns the folder."""
    import torch.distributed.checkpoint as dcp  # why here: torch.distributed.checkpoint takes ~1.5 s to import; only saves and loads need it

    name = step_dir_name(step)
    final = train_dir / name
    tmp = temp_dir(final, clear=info.is_main)
    if info.is_main:
        (tmp / STATE).mkdir(parents=True)
    barrier(info)
    flat, _ = _state(model, opt, names)
    with _quiet():
        dcp.save(flat, storage_writer=dcp.HuggingFaceStorageWriter(str(tmp / STATE), save_distributed=True))
    barrier(info)
    if info.is_main:
        for f in sorted((tmp / STATE).glob("*.safetensors")):  # the same state, the same bytes (resumed or not)
            canonicalize_safetensors(f)
        sums = {f.name: sha256_file(f) for f in sorted((tmp / STATE).glob("*.safetensors"))}
        atomic_write_json(tmp / "meta.json", {**meta, "step": step, "world_size": info.world_size, "rng": rng_state(),
                                              "state_sha256": sums})
        replace_dir(tmp, final)  # fsyncs the shards; replaces the same step saved before (a rerun of a finished run)
        atomic_write_text(train_dir / LATEST, name + "\n")
        steps = sorted((int(m.group(1)), p) for p in train_dir.iterdir() if (m := STEP_RE.match(p.name)) and p.is_dir())
        for _, p in steps[:-KEEP]:
            if p != final:
                shutil.rmtree(p, ignore_errors=True)
    barrier(info)
    return final


def find_latest(train_dir: Path) -> Optional[Path]:
    """The folder `latest` names; if it is gone, the newest complete step folder; else None."""
    pointer = train_dir / LATEST
    if pointer.exists():
        name = pointer.read_text(errors="replace").strip()
        if not STEP_RE.match(name):  # a bare step-NNNNNN name: nothing outside train/ is ever read
            raise DraftsmithError(f"{pointer}: names {name[:80]!r}, not a step folder of this run (step-NNNNNN); "
                                  f"delete {pointer} to resume from the newest step folder")
        p = train_dir / name
        if (p / "meta.json").exists():
            return p
    steps = sorted((int(m.group(1)), p) for p in train_dir.glob("step-*") if (m := STEP_RE.match(p.name)) and (p / "meta.json").exists())
    return steps[-1][1] if steps else None


def load_checkpoint(folder: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, names: dict[str, str]) -> dict:
    """Fill the (possibly sharded) model and optimizer from a step folder, whatever world size
    wrote it. Returns meta.json."""
    # why here: torch.distributed.checkpoint takes ~1.5 s to import; only saves and loads need it
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    meta = read_json(folder / "meta.json")
    files = sorted((folder / STATE).glob("*.safetensors"))
    sums = meta.get("state_sha256") if isinstance(meta, dict) else None
    if isinstance(sums, dict):  # checkpoints written since the checksums were recorded
        found = {f.name for f in files}
        if found != set(sums):
            raise DraftsmithError(f"{folder / STATE}: holds {sorted(found)[:4]}, meta.json lists {sorted(sums)[:4]}; the checkpoint "
                                  f"is incomplete, delete {folder} to resume from the previous one")
        for f in files:
            if sha256_file(f) != sums[f.name]:
                raise DraftsmithError(f"{f}: checksum does not match {folder / 'meta.json'}; the checkpoint is corrupt, "
                                      f"delete {folder} to resume from the previous one")
    try:
        saved = set()
        for f in files:
            with safe_open(str(f), framework="pt") as h:
                saved.update(h.keys())
    except (SafetensorError, OSError) as e:
        raise DraftsmithError(f"{folder}: unreadable checkpoint ({e}); delete this folder to resume from the previous one") from None
    flat, osd = _state(model, opt, names)
    if saved != set(flat):
        diff = sorted(saved ^ set(flat))
        raise DraftsmithError(f"{folder / STATE}: checkpoint tensors differ from the drafter's ({diff[:4]}); "
                              f"the drafter shape changed, delete {folder.parent} to start over")
    try:
        with _quiet():
            dcp.load(flat, storage_reader=dcp.HuggingFaceStorageReader(str(folder / STATE)))
    except (Exception, dcp.api.CheckpointException) as e:  # DCP wraps errors in CheckpointException, a BaseException
        raise DraftsmithError(f"{folder / STATE}: cannot load the checkpoint ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                              f"delete {folder} to resume from the previous one") from None
    set_optimizer_state_dict(model, opt, osd)
    return meta
