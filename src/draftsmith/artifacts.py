"""Run-directory artifacts: atomic writes, fingerprints, manifests, the ledger.

The run directory is the contract between stages (DESIGN.md §2). Every file a stage
produces is written to a temporary name in the same folder, fsynced and renamed, so a
reader never sees half a file. A shard is listed in its stage's manifest only after it
is complete, with its checksum; a manifest is the only thing a later stage trusts.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import platform
import shlex
import shutil
import socket
import sys
import threading
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

MANIFEST = "manifest.json"
LEDGER = "ledger.jsonl"


class DraftsmithError(Exception):
    """A user-facing error: one line naming the file, the record and the fix.

    The CLI prints it as `error: <message>` and exits with status 2, without a traceback.
    """


# ----------------------------------------------------------------------------- atomic I/O


def fsync_dir(path: Path) -> None:
    """fsync a folder, so a rename into it survives a crash (best effort: not every filesystem can)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


TEMP_FILE_TAG = ".tmp-"
"""`.NAME.tmp-PID-THREAD`: the file atomic_write_bytes writes before renaming it to NAME."""
TEMP_DIR_TAG = ".tmp"
"""`.NAME.tmp`: the folder temp_dir gives, written before replace_dir moves it in as NAME."""
OLD_DIR_TAG = ".old"
"""`.NAME.old`: the folder replace_dir moves aside while the new one takes its place."""
PREVIOUS_DIR_TAG = ".previous"
"""`.STAGE.previous`: a complete stage output set aside while a new run replaces it (pipeline.previous_dir)."""
TEMP_TAGS = (TEMP_FILE_TAG, TEMP_DIR_TAG, OLD_DIR_TAG, PREVIOUS_DIR_TAG)
"""Every tag of a name the code writes beside a file or folder while replacing it (aside_path):
is_temp_name recognises them all, so a check for leftovers cannot miss one."""


def aside_path(path: str | Path, tag: str, suffix: str = "") -> Path:
    """`.NAME<tag><suffix>` beside `path`: the one way a temp or set-aside name is made (tag: one of TEMP_TAGS)."""
    if tag not in TEMP_TAGS:
        raise ValueError(f"{tag!r} is not one of TEMP_TAGS {TEMP_TAGS}")
    path = Path(path)
    return path.with_name(f".{path.name}{tag}{suffix}")


def is_temp_name(name: str) -> bool:
    """True for a name aside_path makes: a temp file or folder, or an output set aside."""
    return name.startswith(".") and any(tag in name[1:] if tag.endswith("-") else name.endswith(tag) for tag in TEMP_TAGS)


def atomic_write_bytes(path: str | Path, data: bytes | Sequence[bytes | memoryview]) -> None:
    """Write `data` (bytes, or chunks written one after another) to `path` so that readers see
    either the old file or the whole new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = aside_path(path, TEMP_FILE_TAG, f"{os.getpid()}-{threading.get_ident()}")
    try:
        with open(tmp, "wb") as f:
            for chunk in ((data,) if isinstance(data, (bytes, bytearray, memoryview)) else data):
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise DraftsmithError(f"{path}: cannot write ({e.strerror or e}); free disk space or fix permissions and rerun") from e
    fsync_dir(path.parent)


def temp_dir(final: Path, clear: bool = True) -> Path:
    """The folder (`.NAME.tmp`, beside `final`) in which `final` is written before `replace_dir`
    moves it into place; emptied first when `clear` (leave it False on ranks that only share it)."""
    tmp = aside_path(final, TEMP_DIR_TAG)
    if clear:
        shutil.rmtree(tmp, ignore_errors=True)
    return tmp


def replace_dir(tmp: Path, final: Path) -> None:
    """Move the finished folder `tmp` (see `temp_dir`) into place as `final`: its files and folders
    are fsynced, a folder already at `final` is renamed aside (`.NAME.old`), `tmp` renamed in, the
    old one removed. A reader sees the old folder or the whole new one, never half of either."""
    for root, _, files in os.walk(tmp):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(Path(root))
    old = aside_path(final, OLD_DIR_TAG)
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def remove_temp_files(directory: str | Path, recursive: bool = False) -> None:
    """Delete the temp files (`.NAME.tmp-PID`) that atomic writes killed mid-way left in
    `directory` (and below it when `recursive`). Call it only where no other process is writing."""
    d = Path(directory)
    for stale in (d.rglob if recursive else d.glob)(f".*{TEMP_FILE_TAG}*"):
        stale.unlink(missing_ok=True)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(to_jsonable(obj), indent=2, sort_keys=False) + "\n")


def atomic_save_safetensors(path: str | Path, tensors: dict, metadata: dict[str, str] | None = None) -> str:
    """Save tensors atomically as safetensors; returns the file's sha256.

    The bytes depend only on the tensors and the metadata, not on either dict's insertion
    order: keys are sorted before saving, and the header is rewritten canonically, because
    safetensors emits `__metadata__` in Rust hash order, which changes from call to call."""
    from safetensors.torch import save  # why here: it imports torch (~1.5 s); status and plan read artifacts without it

    data = save({k: tensors[k].contiguous() for k in sorted(tensors)},
                metadata=None if metadata is None else {k: metadata[k] for k in sorted(metadata)})
    head, body = _canonical_safetensors_header(data), memoryview(data)[8 + int.from_bytes(data[:8], "little"):]
    atomic_write_bytes(path, (head, body))  # the tensor bytes are written from `data`, never copied
    sha = hashlib.sha256(head)
    sha.update(body)
    return sha.hexdigest()


def _canonical_safetensors_header(data: bytes) -> bytes:
    """The 8-byte length and JSON header of `data` (a safetensors file) in one canonical form:
    `__metadata__` first with sorted keys, then the tensors in the order of their data offsets,
    compact JSON, padded with spaces to 8 bytes as safetensors pads it. The tensor bytes that
    follow the header stay as they are."""
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    out: dict[str, Any] = {}
    if "__metadata__" in header:
        md = header.pop("__metadata__")
        out["__metadata__"] = {k: md[k] for k in sorted(md)} if isinstance(md, dict) else md
    for name in sorted(header, key=lambda k: (header[k]["data_offsets"], k)):
        out[name] = header[name]
    blob = json.dumps(out, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    blob += b" " * (-len(blob) % 8)
    return len(blob).to_bytes(8, "little") + blob


def read_json(path: str | Path) -> Any:
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DraftsmithError(f"{path}: file not found; run the stage that writes it first") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DraftsmithError(f"{path}: not valid JSON ({e}); delete it and rerun the stage that writes it") from None


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def file_stamp(path: str | Path) -> dict:
    """A file's size and mtime_ns: what any rewrite, truncation or copy over it changes."""
    st = os.stat(path)
    return {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns}


def checksum_matches(path: Path, sha256: str, verified: dict) -> bool:
    """Whether the file has `sha256`, hashing it only when its size or mtime_ns differ from the stamp
    recorded in `verified` (file name -> {sha256, bytes, mtime_ns}) the last time its checksum was
    computed or matched; a match records the stamp. A resume checks a day's shards this way in
    milliseconds; an edit that keeps both size and mtime_ns passes here, so the reader that loads
    a shard (train: verify_shards) still hashes it."""
    if not path.is_file():
        return False
    stamp = {"sha256": sha256, **file_stamp(path)}
    if verified.get(path.name) == stamp:
        return True
    if sha256_file(path) != sha256:
        verified.pop(path.name, None)
        return False
    verified[path.name] = stamp
    return True


# ----------------------------------------------------------------------------- fingerprints


def to_jsonable(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, float) and obj != obj:  # NaN is not JSON
        return None
    return obj


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


# ----------------------------------------------------------------------------- environment


def torchrun_ranks() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's environment; (0, 1, 0) in a plain process.
    The one reader of these variables (distributed.init_distributed, process_rank)."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_RANK", "0"))


def process_rank() -> int:
    """This process's global rank: torch.distributed's when a process group is up, else
    torchrun's RANK variable, else 0. torch.distributed is not imported for this: a process
    that never imported it has no process group."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    try:
        return torchrun_ranks()[0]
    except ValueError:
        return 0


def is_main_rank() -> bool:
    """True on rank 0 (and in a single process). Under torchrun only rank 0 writes the run
    directory's bookkeeping (stage manifests, the ledger); the other ranks only read it."""
    return process_rank() == 0


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
        import torch  # why here: ~1.5 s to import; status and plan read artifacts without it

        info["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception:  # hardware info must never stop a stage
        pass
    return info


# ----------------------------------------------------------------------------- manifests


STAGE_DIRS = {"prepare": "data", "regenerate": "regen", "evaluate": "eval"}
"""Stage name -> its folder in the run directory (DESIGN.md §2), where the two differ."""


def relative_hint(path: str | Path) -> str:
    """For a not-found error: where a relative path was looked for ("" for an absolute one). A run
    folder's recipe.yaml keeps the paths as given, relative to where the run was started."""
    return "" if Path(path).expanduser().is_absolute() else f" (relative to the current directory {Path.cwd()})"


def stage_dir(run_dir: str | Path, stage: str) -> Path:
    return Path(run_dir) / STAGE_DIRS.get(stage, stage)


RECIPE_FILE = "recipe.yaml"
"""The run's resolved recipe in its run directory (pipeline.write_recipe): a recipe any command takes."""


def stage_command(stage: str, run_dir: str | Path, force: bool = False) -> str:
    """`draftsmith STAGE RUN_DIR/recipe.yaml [--force]`: a stage (or `run`) on the run's resolved recipe,
    which the pipeline writes before a stage starts, the path shell-quoted where it needs it, so the
    command can be pasted as is."""
    return f"draftsmith {stage} {shlex.quote(str(Path(run_dir) / RECIPE_FILE))}{' --force' if force else ''}"


def rerun_command(stage: str, run_dir: str | Path, force: bool = True) -> str:
    """The command an error's fix names, in backticks: stage_command, with --force by default."""
    return f"`{stage_command(stage, run_dir, force)}`"


def run_dir_of(path: str | Path, levels: int = 4) -> Optional[Path]:
    """The run directory that holds `path` (a stage folder or a file in one): the nearest folder at
    most `levels` up, `path` itself included, with the run's recipe.yaml in it. None outside a run."""
    p = Path(path)
    for d in [p, *p.parents][:levels + 1]:
        if (d / RECIPE_FILE).is_file():
            return d
    return None


def fix_command(stage: str, path: str | Path, force: bool = True, then: Sequence[str] = (), levels: int = 4) -> str:
    """A fix naming whole commands for a file or folder of a run: `draftsmith STAGE RUN/recipe.yaml
    --force`, then `draftsmith THEN RUN/recipe.yaml --force` for each later stage to redo. Outside a
    run directory (a file given by hand) the recipe is left for the user to name."""
    run_dir = run_dir_of(path, levels)
    if run_dir is None:
        return ", then ".join(f"`draftsmith {s} RECIPE.yaml{' --force' if force else ''}` (with that run's recipe)"
                             for s in (stage, *then))
    return ", then ".join(rerun_command(s, run_dir, force) for s in (stage, *then))


def redo_stage_hint(directory: str | Path, manifest: Any) -> str:
    """The fix for a stage folder whose files are damaged: the command that redoes that stage (its
    manifest names it; trusted only when the run directory's folder for that stage is `directory`),
    then the command that stopped. Else (no run, an edited `stage`): delete the folder, rerun its stage."""
    directory = Path(directory)
    stage = manifest.get("stage") if isinstance(manifest, dict) else None
    run_dir = run_dir_of(directory.parent, 0)
    if isinstance(stage, str) and run_dir is not None and stage_dir(run_dir, stage) == directory:
        return f"redo the stage with {rerun_command(stage, run_dir)}, then rerun the command that stopped here"
    return f"delete {directory} and rerun its stage"


def token_stage(recipe, run_dir: str | Path) -> tuple[Path, str]:
    """(folder, stage) of the token shards that capture, vocab and online training read: regen/
    when regenerate is enabled, else data/. `recipe` is a config.Recipe."""
    stage = "regenerate" if recipe.regenerate.enabled else "prepare"
    return stage_dir(run_dir, stage), stage


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
        if not p.exists():
            raise DraftsmithError(f"{directory / MANIFEST}: shard {s['file']} is listed but missing; {redo_stage_hint(directory, manifest)}")
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
    p = (root / rel).resolve()
    if p != root and root not in p.parents:
        raise DraftsmithError(f"{root / MANIFEST}: path {rel!r} escapes the run directory; the manifest was edited, delete it and rerun")
    return p


# ----------------------------------------------------------------------------- run lock

LOCK = ".lock"
_held_locks: dict[str, list] = {}  # resolved run dir -> [open lock file, depth]: re-entrant within a process


def process_start_time(pid: int) -> Optional[int]:
    """When process `pid` started, in clock ticks since boot (/proc/PID/stat field 22), or None
    where /proc is missing or the process is gone. With the PID it names one process: a PID the
    kernel hands to a later process comes with a later start time."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def process_started_at() -> float:
    """When this process started, in seconds since the epoch (/proc/stat's boot time, whole seconds,
    plus the start in clock ticks: never later than the true start); where /proc is missing, now."""
    try:
        btime = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime "))
        ticks = process_start_time(os.getpid())
        if ticks is not None:
            return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        pass
    return time.time()


def process_cmdline(pid: int) -> Optional[str]:
    """The command line of process `pid` (arguments joined by spaces), or None."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return None


def _lock_holder(path: Path) -> str:
    try:
        h = json.loads(path.read_text())
        return f"pid {h['pid']} (`{h.get('command', '?')}`, since {time.strftime('%H:%M:%S', time.localtime(h['started_at']))})"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"


class RunLock:
    """An exclusive lock on a run directory (flock on RUN_DIR/.lock), held while a stage runs, so
    two processes never run stages in one run directory at once. The holder writes its pid and
    command into the file; a second process names them in its error, or waits (`wait=True`).
    Re-entrant within a process (`run` holds it across its stages). The kernel drops the lock
    when the holder dies, so a killed run never leaves a stale lock."""

    def __init__(self, run_dir: str | Path, wait: bool = False, poll_s: float = 0.5):
        self.run_dir, self.wait, self.poll_s = Path(run_dir), wait, poll_s
        self.key = str(self.run_dir.resolve())

    def __enter__(self) -> "RunLock":
        import fcntl  # why here: POSIX only; imported where a lock is taken

        if self.key in _held_locks:
            _held_locks[self.key][1] += 1
            return self
        path = self.run_dir / LOCK
        f = open(path, "a+")
        told = False
        while True:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not self.wait:
                    f.close()
                    raise DraftsmithError(f"{self.run_dir}: run directory is locked by {_lock_holder(path)}; wait for it to "
                                          "finish (or add --wait-lock to wait), or use another run_dir") from None
                if not told:
                    log(f"[lock] {self.run_dir} is held by {_lock_holder(path)}; waiting (--wait-lock)")
                    told = True
                time.sleep(self.poll_s)
        f.seek(0)
        f.truncate()
        f.write(json.dumps({"pid": os.getpid(), "pid_start": process_start_time(os.getpid()),
                            "command": (process_cmdline(os.getpid()) or " ".join(sys.argv))[:300], "started_at": time.time()}))
        f.flush()
        _held_locks[self.key] = [f, 1]
        return self

    def __exit__(self, *exc) -> None:
        entry = _held_locks[self.key]
        entry[1] -= 1
        if entry[1] == 0:
            del _held_locks[self.key]
            entry[0].close()  # closing the file releases the flock


# ----------------------------------------------------------------------------- ledger


class Ledger:
    """Append-only JSONL log of what happened in a run: stage events, measurements, decisions.

    Only rank 0 appends (one line per event under torchrun, not one per rank); every rank reads."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / LEDGER

    def append(self, event: str, **fields: Any) -> None:
        if not is_main_rank():
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        rec = {"time": round(time.time(), 3), "event": event, **to_jsonable(fields)}
        try:
            append_jsonl(self.path, rec)
        except OSError as e:  # a full disk must not hide the error being reported; read() skips a torn line
            log(f"warning: {self.path}: cannot append {event!r} ({e.strerror or e})")

    def read(self) -> list[dict]:
        """All complete records; a torn last line (a crash mid-append) is ignored."""
        return read_jsonl(self.path)


def append_jsonl(path: str | Path, record: dict) -> None:
    """Append one JSON line and fsync it. A crash mid-append leaves at most a torn last line,
    which read_jsonl skips."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_jsonl(path: str | Path) -> list[dict]:
    """The complete records (JSON objects, one a line) of an append-only file; a torn or garbled
    line (a crash mid-append) is skipped; a missing file has none."""
    path = Path(path)
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def iter_lines(path: Path) -> Iterable[tuple[int, str]]:
    with open(path, "rb") as f:
        for i, raw in enumerate(f, 1):
            yield i, raw.decode("utf-8", errors="strict") if raw else ""


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
