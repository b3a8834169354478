"""Stage manifests and fingerprints: a shard is listed in its stage's manifest only after it is complete,
with its checksum; a manifest is the only thing a later stage trusts (DESIGN.md §2)."""
from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import socket
import time
import types
import typing
from dataclasses import dataclass, field, fields
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Optional, Self

from .distributed.ranks import is_main_rank
from .fileio import atomic_write_json, read_json, sha256_file, to_jsonable
from .messages import DraftsmithError
from .rundir import fix_command, redo_stage_hint, rerun_command

MANIFEST = "manifest.json"


def fingerprint(*parts: Any) -> str:
    """A short stable hash of JSON-able parts (configs, input fingerprints)."""
    blob = json.dumps([to_jsonable(p) for p in parts], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def fingerprint_path(path: str | Path) -> str:
    """Fingerprint a file or a folder by names, sizes and content hashes of its files."""
    path = Path(path)
    if path.is_file():
        return sha256_file(path)[:16]
    if not path.is_dir():
        raise DraftsmithError(f"{path}: not found; give an existing file or folder")
    entries = []
    for p in sorted(path.rglob("*")):
        if p.is_file() and not p.name.startswith("."):
            entries.append((str(p.relative_to(path)), p.stat().st_size, sha256_file(p)[:16]))
    return fingerprint(entries)


def package_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in ("draftsmith", "torch", "transformers", "safetensors", "tokenizers"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    out["draftsmith_code"] = code_fingerprint()
    return out


@functools.cache
def code_fingerprint() -> str:
    """sha256 (16 hex) of draftsmith's own source files: which code wrote a manifest, an edited
    checkout included (the version number does not change with each edit). Benchmarks that reuse
    a complete evaluation compare it, so a figure never comes from older code."""
    root, h = Path(__file__).resolve().parent, hashlib.sha256()
    for p in sorted(root.rglob("*.py")):
        h.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:16]


def hardware_info() -> dict[str, Any]:
    info: dict[str, Any] = {"host": socket.gethostname(), "platform": platform.platform(),
                            "cpu_count": os.cpu_count()}
    try:
        import torch  # why here: ~1.5 s to import; status and plan read manifests without it

        info["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception:  # hardware info must never stop a stage
        pass
    return info


def load_manifest(directory: str | Path) -> dict | None:
    """The manifest of a stage folder, or None when the stage has not written one."""
    p = Path(directory) / MANIFEST
    if not p.exists():
        return None
    m = read_json(p)
    if not isinstance(m, dict) or "status" not in m or "fingerprint" not in m:
        raise DraftsmithError(f"{p}: not a draftsmith manifest (no status/fingerprint); delete the folder {p.parent} and rerun")
    return m


def output_fingerprint(manifest: dict) -> str:
    """What a downstream stage's fingerprint takes from this complete manifest: its
    `output_fingerprint` where the stage writes one (train: its fingerprint and the drafter's
    checksum, as a run continued under a larger train.max_minutes changes the drafter, not the
    fingerprint), else its fingerprint."""
    return manifest.get("output_fingerprint") or manifest["fingerprint"]


def require_complete(directory: str | Path, what: str) -> dict:
    """Manifest of an upstream stage that must be complete, else a one-line error."""
    m = load_manifest(directory)
    if m is None or m.get("status") != "complete":
        state = "missing" if m is None else m.get("status")
        raise DraftsmithError(f"{Path(directory) / MANIFEST}: {what} stage is {state}; run "
                              f"{fix_command(what, Path(directory).parent, force=False, levels=0)} first")
    return m


def new_manifest(stage: str, fp: str, config: Any, inputs: dict[str, str]) -> dict:
    return {
        "stage": stage,
        "status": "running",
        "fingerprint": fp,
        "config": to_jsonable(config),
        "inputs": inputs,
        "versions": package_versions(),
        "hardware": hardware_info(),
        "started_at": time.time(),
        "counts": {},
        "timings": {},
        "metrics": {},
        "shards": [],
    }


def write_manifest(directory: str | Path, manifest: dict) -> None:
    """Write a stage's manifest; a no-op on ranks other than 0 (see `is_main_rank`)."""
    if not is_main_rank():
        return
    atomic_write_json(Path(directory) / MANIFEST, manifest)


def finish_manifest(directory: str | Path, manifest: dict) -> dict:
    """Mark `manifest` complete and write it (rank 0 only); returns it on every rank."""
    shards = manifest.get("shards")
    for s in shards if isinstance(shards, list) else []:  # never "complete" over a listed shard that is gone
        if isinstance(s, dict) and isinstance(s.get("file"), str) and not safe_join(directory, s["file"]).is_file():
            stage, run_dir = manifest.get("stage"), Path(directory).parent
            again = rerun_command(stage, run_dir, force=False) if isinstance(stage, str) else "the stage"
            raise DraftsmithError(f"{Path(directory) / MANIFEST}: shard {s['file']} is listed but missing; rerun {again} "
                                  "(it resumes, writing the missing shard again)")
    manifest["status"] = "complete"
    manifest["finished_at"] = time.time()
    manifest["timings"].setdefault("wall_s", round(manifest["finished_at"] - manifest["started_at"], 3))
    write_manifest(directory, manifest)
    return manifest


def verify_shards(directory: str | Path, manifest: dict, check_hash: bool = True) -> list[Path]:
    """Paths of the manifest's shards, each checked to exist (and match its sha256)."""
    directory = Path(directory)
    paths = []
    shards = manifest.get("shards", [])
    if not isinstance(shards, list):
        raise DraftsmithError(f"{directory / MANIFEST}: `shards` is {type(shards).__name__}, not a list; the manifest was edited, "
                              f"{redo_stage_hint(directory, manifest)}")
    for i, s in enumerate(shards):
        if not (isinstance(s, dict) and isinstance(s.get("file"), str) and isinstance(s.get("sha256"), str)):
            raise DraftsmithError(f"{directory / MANIFEST}: shard entry {i} lacks a `file`/`sha256` string; the manifest was "
                                  f"edited, {redo_stage_hint(directory, manifest)}")
        p = safe_join(directory, s["file"])
        if not p.is_file():  # missing, or a folder (an empty `file` names the stage folder itself)
            what = "missing" if not p.exists() else "not a file"
            raise DraftsmithError(f"{directory / MANIFEST}: shard {s['file']} is listed but {what}; "
                                  f"{redo_stage_hint(directory, manifest)}")
        if check_hash and sha256_file(p) != s["sha256"]:
            raise DraftsmithError(f"{p}: checksum does not match {directory / MANIFEST}; the shard is corrupt, "
                                  f"{redo_stage_hint(directory, manifest)}")
        paths.append(p)
    return paths


def verify_listed_file(path: str | Path) -> None:
    """Check a stage file (token counts, vocab, ...) against the sha256 its folder's manifest lists
    for it. A file the manifest does not list (an older run) is not checked."""
    path = Path(path)
    m = load_manifest(path.parent)
    files = (m or {}).get("files")
    if not isinstance(files, list):
        return
    entry = next((f for f in files if isinstance(f, dict) and f.get("file") == path.name), None)
    if entry is None or not isinstance(entry.get("sha256"), str):
        return
    if not path.exists():
        raise DraftsmithError(f"{path.parent / MANIFEST}: {path.name} is listed but missing; {redo_stage_hint(path.parent, m)}")
    if sha256_file(path) != entry["sha256"]:
        raise DraftsmithError(f"{path}: checksum does not match {path.parent / MANIFEST}; the file is corrupt or was edited, "
                              f"{redo_stage_hint(path.parent, m)}")


def safe_join(root: str | Path, rel: str) -> Path:
    """Join a manifest-relative path to root, refusing anything that escapes root."""
    root = Path(root).resolve()
    if "\x00" in rel:  # no file name holds one (the OS refuses it with a ValueError)
        raise DraftsmithError(f"{root / MANIFEST}: path {rel!r} holds a NUL byte; the manifest was edited, delete it and rerun")
    p = (root / rel).resolve()
    if p != root and root not in p.parents:
        raise DraftsmithError(f"{root / MANIFEST}: path {rel!r} escapes the run directory; the manifest was edited, delete it and rerun")
    return p


# ----------------------------------------------------------------------------- measured figures

BAD = object()
"""What `read_as` gives for a value of the wrong type: the field keeps its default."""


def absent_when_none(**kw: Any) -> Any:
    """A figure the stage writes only when it has it: None leaves the key out of to_dict (a written
    null is a figure the stage measured as none)."""
    return field(default=None, metadata={"absent_when_none": True}, **kw)


def section(cls: type) -> Any:
    """A nested section that is always there (an empty one when the manifest lacks it)."""
    return field(default_factory=cls)


class Figures:
    """The base of a stage's measured figures (draftsmith/figures/): a dataclass whose fields are the
    keys of a manifest section, nested sections being dataclasses too. The stage writes it with
    `to_dict`, `status` and `plan` read it with `from_manifest`, so a figure is named once; a renamed
    one fails tests/test_figures.py rather than a report.

    `from_manifest` reads whatever it is given: a missing key leaves the field's default (None, an
    empty section), and so does a value of the wrong type (a hand-edited manifest, an older writer),
    each such key noted in `problems` ("metrics.loss: a str, not a number") for the caller to show."""

    @classmethod
    def from_manifest(cls, m: Any, problems: list[str] | None = None, where: str = "") -> Self:
        if not isinstance(m, dict):
            _note(problems, where.rstrip(".") or "the manifest", m, "an object")
            m = {}
        kwargs = {}
        for f in fields(cls):  # type: ignore[arg-type]
            if f.name in m:
                v = read_as(_hints(cls)[f.name], m[f.name], f"{where}{f.name}", problems)
                if v is not BAD:
                    kwargs[f.name] = v
        return cls(**kwargs)

    def to_dict(self) -> dict:
        """The manifest section: every field by its name, nested sections as dicts; None written as
        null except for fields made with `absent_when_none`."""
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)  # type: ignore[arg-type]
                if not (getattr(self, f.name) is None and f.metadata.get("absent_when_none"))}


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


_KINDS = {float: "a number", int: "an integer", str: "a string", bool: "true/false", list: "a list", dict: "an object"}


def _note(problems: list[str] | None, key: str, v: Any, wanted: str) -> None:
    if problems is not None:
        found = "null" if v is None else f"a {type(v).__name__}"
        problems.append(f"{key}: {found}, not {wanted}")


def read_as(tp: Any, v: Any, key: str, problems: list[str] | None) -> Any:
    """v read as type tp (a Figures section, a scalar, list[...], dict[str, ...], Optional[...], Any), else BAD."""
    if tp is Any:
        return v
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if v is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1:
            raise TypeError(f"{key}: Figures fields are X or Optional[X], not {tp}")
        return read_as(inner[0], v, key, problems)
    if isinstance(tp, type) and issubclass(tp, Figures):
        if isinstance(v, dict):
            return tp.from_manifest(v, problems, f"{key}.")
        _note(problems, key, v, "an object")
        return BAD
    if origin is list:
        if not isinstance(v, list):
            _note(problems, key, v, "a list")
            return BAD
        out = [read_as(args[0], x, f"{key}[{i}]", problems) for i, x in enumerate(v)]
        return BAD if any(x is BAD for x in out) else out
    if origin is dict:
        if not isinstance(v, dict):
            _note(problems, key, v, "an object")
            return BAD
        out = {k: read_as(args[1], x, f"{key}.{k}", problems) for k, x in v.items()}
        return {k: x for k, x in out.items() if x is not BAD}  # a bad entry goes, its siblings stay
    ok = (isinstance(v, (int, float)) and not isinstance(v, bool) if tp is float else
          isinstance(v, int) and not isinstance(v, bool) if tp is int else isinstance(v, tp))
    if not ok:
        _note(problems, key, v, _KINDS.get(tp, tp.__name__))
        return BAD
    return v


def _plain(v: Any) -> Any:
    if isinstance(v, Figures):
        return v.to_dict()
    if isinstance(v, list):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v


@dataclass
class Hardware(Figures):
    host: Optional[str] = None
    platform: Optional[str] = None
    cpu_count: Optional[int] = None
    torch_threads: Optional[int] = absent_when_none()
    gpus: Optional[list[str]] = absent_when_none()


@dataclass
class ManifestHead(Figures):
    """What every manifest holds beside its stage's figures (new_manifest and finish_manifest write it),
    as `status` reads it."""
    stage: Optional[str] = None
    status: Optional[str] = None
    fingerprint: Optional[str] = None
    versions: dict[str, Any] = field(default_factory=dict)
    hardware: Hardware = field(default_factory=Hardware)
    started_at: Optional[float] = None
    finished_at: Optional[float] = None
    timings: dict[str, Optional[float]] = field(default_factory=dict)
