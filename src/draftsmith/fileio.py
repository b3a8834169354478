"""Atomic file I/O: a file is written to a temporary name in its folder, fsynced and renamed, so a
reader never sees half a file (DESIGN.md §2); JSON, JSONL and safetensors writers and readers, checksums."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import threading
from pathlib import Path
from typing import Any, Iterable, Sequence

from .messages import DraftsmithError


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
    from safetensors.torch import (
        save,  # why here: it imports torch (~1.5 s); status and plan read the run directory without it
    )

    data = save({k: tensors[k].contiguous() for k in sorted(tensors)},
                metadata=None if metadata is None else {k: metadata[k] for k in sorted(metadata)})
    head, body = _canonical_safetensors_header(data), memoryview(data)[8 + int.from_bytes(data[:8], "little"):]
    atomic_write_bytes(path, (head, body))  # the tensor bytes are written from `data`, never copied
    sha = hashlib.sha256(head)
    sha.update(body)
    return sha.hexdigest()


def canonicalize_safetensors(path: str | Path) -> None:
    """Rewrite the header of a safetensors file another library wrote (torch.distributed.checkpoint's
    HuggingFaceStorageWriter) in the canonical form atomic_save_safetensors writes: its writer puts
    `__metadata__` in Rust hash order, so the same checkpoint saved twice (a resumed run's, an
    unbroken run's) differed in its bytes. The header is overwritten in place when its length stays
    (the usual case: the same keys in another order), else the file is copied behind the new one.
    Only for a file no reader sees yet: one in a temp folder that replace_dir moves into place."""
    path = Path(path)
    with open(path, "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        head = f.read(n)
        canon = _canonical_safetensors_header(n.to_bytes(8, "little") + head)
        if canon[8:] == head:
            return
        if len(canon) == 8 + n:
            f.seek(0)
            f.write(canon)
            f.flush()
            os.fsync(f.fileno())
            return
    tmp = aside_path(path, TEMP_FILE_TAG, f"{os.getpid()}-{threading.get_ident()}")
    with open(path, "rb") as src, open(tmp, "wb") as dst:
        dst.write(canon)
        src.seek(8 + n)
        shutil.copyfileobj(src, dst, 1 << 24)
        dst.flush()
        os.fsync(dst.fileno())
    os.replace(tmp, path)


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


JSON_ERRORS = (ValueError, RecursionError)
"""What json.loads raises on bad input: JSONDecodeError and UnicodeDecodeError (bytes that are not UTF-8)
are ValueErrors; RecursionError for nesting deeper than the interpreter's recursion limit."""


def json_error(e: BaseException) -> str:
    """A json.loads error in a few words on one line, for a message that names the file and the fix."""
    if isinstance(e, RecursionError):
        return "nested too deeply"
    if isinstance(e, UnicodeDecodeError):
        return f"not UTF-8 at byte {e.start}"
    return " ".join(str(e).split())[:200]


def read_json(path: str | Path) -> Any:
    """A JSON file's value; any file that is missing, unreadable or not JSON is a one-line DraftsmithError."""
    path = Path(path)
    try:
        return json.loads(path.read_bytes())
    except FileNotFoundError:
        raise DraftsmithError(f"{path}: file not found; run the stage that writes it first") from None
    except OSError as e:
        raise DraftsmithError(f"{path}: cannot read ({e.strerror or e}); check the path and its permissions") from None
    except JSON_ERRORS as e:
        raise DraftsmithError(f"{path}: not valid JSON ({json_error(e)}); delete it and rerun the stage that writes it") from None


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
        except JSON_ERRORS:  # torn, garbled or absurdly nested: not a record this code wrote
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def read_jsonl_whole(path: str | Path, required: Sequence[str], fix: str) -> list[dict]:
    """The records of a JSONL file that is written whole (atomically, never appended to), each a JSON
    object with the `required` keys; any other line means the file was damaged or edited: a one-line
    DraftsmithError naming `path:line` and `fix`. A missing file has no records."""
    path = Path(path)
    if not path.exists():
        return []
    try:
        lines = path.read_bytes().splitlines()
    except OSError as e:
        raise DraftsmithError(f"{path}: cannot read ({e.strerror or e}); {fix}") from None
    out = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except JSON_ERRORS as e:
            raise DraftsmithError(f"{path}:{lineno}: not valid JSON ({json_error(e)}); {fix}") from None
        missing = [k for k in required if k not in rec] if isinstance(rec, dict) else None
        if missing is None or missing:
            what = f"a JSON {type(rec).__name__}, not an object" if missing is None else f"no {', '.join(missing)}"
            raise DraftsmithError(f"{path}:{lineno}: not a record of this file ({what}); {fix}")
        out.append(rec)
    return out


def iter_lines(path: Path) -> Iterable[tuple[int, str]]:
    with open(path, "rb") as f:
        for i, raw in enumerate(f, 1):
            yield i, raw.decode("utf-8", errors="strict") if raw else ""
