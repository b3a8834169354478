"""Fuzz the conversation readers with atheris (not a CI dependency: `pip install atheris`).

    python fuzz/fuzz_readers.py -max_total_time=60 -rss_limit_mb=4096 [CORPUS_DIR]

Each input is written as a ShareGPT .json, a .jsonl and a .jsonl.gz file and read through
`read_conversations` (and the prompt path `_prompt_turns` for JSONL). Reading may only ever
yield conversations or raise DraftsmithError with a one-line message; any other exception is a
bug and atheris stops with the input that caused it. Seeds: tests/badinput/sources/.
The same check runs in CI with a fixed budget (hypothesis): tests/test_fuzz.py::test_bytes_readers, whose
found inputs are kept in tests/fuzz_corpus/; put an input this fuzzer finds there too (docs/reliability.md).
Inputs nested deeper than MAX_DEPTH are not fed (the readers skip them unparsed, see
readers.MAX_DEPTH; the cut keeps the fuzzer on inputs that reach the parser).
"""
from __future__ import annotations

import gzip
import os
import sys
import tempfile
from pathlib import Path

import atheris

with atheris.instrument_imports():
    from draftsmith.messages import DraftsmithError
    from draftsmith.data import readers

MAX_DEPTH = 2000
WORK = Path(tempfile.mkdtemp(prefix="fuzz-readers-"))
FILES = {"sharegpt": WORK / "in.json", "jsonl": WORK / "in.jsonl", "gz": WORK / "in.jsonl.gz"}


def check(path: Path, fmt: str) -> None:
    stats = readers.ReadStats()
    try:
        for conv in readers.read_conversations(path, fmt, stats, on_unknown_role="skip"):
            assert conv.messages and conv.messages[-1]["role"] == "assistant", conv
            assert all(m["role"] in readers.ROLES and m["content"].strip() for m in conv.messages), conv
        if fmt == "jsonl":
            for _, where, rec in readers.iter_records(path, fmt, readers.ReadStats()):
                readers._prompt_turns(rec, where)
    except DraftsmithError as e:
        assert "\n" not in str(e), repr(str(e))


def test_one_input(data: bytes) -> None:
    if data.count(b"[") > MAX_DEPTH or data.count(b"{") > MAX_DEPTH:
        return
    FILES["sharegpt"].write_bytes(data)
    FILES["jsonl"].write_bytes(data)
    FILES["gz"].write_bytes(gzip.compress(data) if data[:1] != b"\x1f" else data)
    check(FILES["sharegpt"], "sharegpt")
    check(FILES["jsonl"], "jsonl")
    check(FILES["gz"], "jsonl")


if __name__ == "__main__":
    args = list(sys.argv)
    if not any(not a.startswith("-") for a in args[1:]):
        seeds = Path(__file__).resolve().parent.parent / "tests" / "badinput" / "sources"
        corpus = Path(tempfile.mkdtemp(prefix="fuzz-corpus-"))
        for p in seeds.iterdir():
            (corpus / p.name).write_bytes(p.read_bytes())
        args.append(str(corpus))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    atheris.Setup(args, test_one_input)
    atheris.Fuzz()
