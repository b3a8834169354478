"""Property-based tests (hypothesis): d2t/t2d, reader round trips and cut-off files, shard round
trips, batch plans, manifest path joins, mask truncation. (Mask contents: tests/test_masks.py;
role normalization: tests/test_readers.py.)"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from draftsmith.manifests import safe_join
from draftsmith.messages import DraftsmithError
from draftsmith.data.readers import ReadStats, read_conversations
from draftsmith.data.shards import Sample, read_shard, write_shard
from draftsmith.data.shards import length_batches
from draftsmith.train.data import PACK_CHUNK_BATCHES, epoch_plan
from draftsmith.draft.vocab import draft_ids, load_vocab
from draftsmith.vocab import build_vocab

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


# ----------------------------------------------------------------------------- d2t / t2d


@SETTINGS
@given(counts=st.lists(st.integers(0, 50), min_size=1, max_size=200), extra=st.integers(0, 40),
       draft=st.integers(1, 260))
def test_vocab_invariants(counts, extra, draft, tmp_path):
    V = len(counts) + extra
    c = torch.tensor(counts, dtype=torch.int64)
    d2t, t2d = build_vocab(c, V, draft)
    ids = draft_ids(d2t)
    size = min(draft, V)
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert d2t.numel() == size and t2d.numel() == V and int(t2d.sum()) == size
    assert bool((ids[1:] > ids[:-1]).all()) and int(ids.min()) >= 0 and int(ids.max()) < V  # sorted, unique, in range
    assert bool(t2d[ids].all())
    full = torch.zeros(V, dtype=torch.int64)
    full[:len(counts)] = c
    chosen, rest = full[t2d], full[~t2d]
    if rest.numel():
        assert int(chosen.min()) >= int(rest.max())  # the most frequent tokens
        tie = int(chosen.min())
        if int(rest.max()) == tie:  # ties go to the lower ids
            assert int(ids[full[ids] == tie].max()) < int(torch.nonzero((full == tie) & ~t2d).min())
    from safetensors.torch import save_file

    save_file({"d2t": d2t, "t2d": t2d}, str(tmp_path / "v.safetensors"))
    d2, t2 = load_vocab(tmp_path / "v.safetensors")
    assert torch.equal(d2, d2t) and torch.equal(t2, t2d)


# ----------------------------------------------------------------------------- readers

text = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=40).filter(lambda s: s.strip())
conversation = st.lists(st.tuples(text, text), min_size=1, max_size=4)  # (user, assistant) turns
conversations = st.lists(conversation, min_size=1, max_size=6)


def as_messages(conv) -> list[dict]:
    return [m for u, a in conv for m in ({"role": "user", "content": u}, {"role": "assistant", "content": a})]


def write_source(tmp: Path, convs, fmt: str) -> Path:
    if fmt == "sharegpt":
        path = tmp / "data.json"
        recs = [{"id": f"r{i}", "conversations": [{"from": {"user": "human", "assistant": "gpt"}[m["role"]], "value": m["content"]}
                                                  for m in as_messages(c)]} for i, c in enumerate(convs)]
        path.write_text(json.dumps(recs, ensure_ascii=bool(len(convs) % 2)), encoding="utf-8")
    else:
        path = tmp / "data.jsonl"
        path.write_text("".join(json.dumps({"messages": as_messages(c)}, ensure_ascii=False) + "\n" for c in convs),
                        encoding="utf-8")
    return path


def read_all(path: Path, fmt: str) -> tuple[list, ReadStats]:
    stats = ReadStats()
    return [c.messages for c in read_conversations(path, fmt, stats)], stats


@SETTINGS
@given(convs=conversations, fmt=st.sampled_from(["sharegpt", "jsonl"]))
def test_reader_round_trip(convs, fmt, tmp_path):
    got, stats = read_all(write_source(tmp_path, convs, fmt), fmt)
    assert got == [as_messages(c) for c in convs]
    assert stats.read == len(convs) and stats.truncated_source is None and not stats.counts


@SETTINGS
@given(convs=conversations, fmt=st.sampled_from(["sharegpt", "jsonl"]), cut=st.floats(0, 1))
def test_cut_off_file_gives_a_prefix_or_an_error(convs, fmt, cut, tmp_path):
    """A file cut at any byte reads as the complete records before the cut (reported as a
    truncation) or stops with a one-line error; never a wrong or partial record."""
    path = write_source(tmp_path, convs, fmt)
    data = path.read_bytes()
    n = int(cut * len(data))
    path.write_bytes(data[:n])
    want = [as_messages(c) for c in convs]
    try:
        got, stats = read_all(path, fmt)
    except DraftsmithError as e:
        assert "\n" not in str(e) and str(path) in str(e)
        return
    assert got == want[:len(got)]
    if n < len(data) and len(got) < len(want):
        # jsonl: cut right after a newline is a clean file of fewer records
        assert stats.truncated_source is not None or (fmt == "jsonl" and (n == 0 or data[:n].endswith(b"\n")))


@SETTINGS
@given(start=st.integers(0, 7), stop=st.integers(0, 8), fmt=st.sampled_from(["sharegpt", "jsonl"]))
def test_start_stop_select_record_ranges(start, stop, fmt, tmp_path):
    convs = [[(f"question {i}", f"answer {i}")] for i in range(6)]
    path = write_source(tmp_path, convs, fmt)
    got = [c.index for c in read_conversations(path, fmt, ReadStats(), start=start, stop=stop)]
    assert got == list(range(start, min(stop, 6)))


# ----------------------------------------------------------------------------- shards, batches, paths


@SETTINGS
@given(lengths=st.lists(st.integers(0, 20), min_size=0, max_size=8), hidden=st.booleans())
def test_shard_round_trip(lengths, hidden, tmp_path):
    g = torch.Generator().manual_seed(len(lengths))
    samples = [Sample(torch.randint(0, 1000, (n,), generator=g), torch.rand(n, generator=g) > 0.5, 10 * i,
                      torch.randn(n, 6, generator=g) if hidden else None, torch.randn(n, 2, generator=g) if hidden else None)
               for i, n in enumerate(lengths)]
    assume(not hidden or lengths)
    entry = write_shard(tmp_path / "s.safetensors", samples)
    back = read_shard(tmp_path / "s.safetensors")
    assert entry["num_samples"] == len(samples) and entry["num_tokens"] == sum(lengths)
    assert len(back) == len(samples)
    for a, b in zip(samples, back):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
        assert a.sample_index == b.sample_index
        if hidden:
            assert torch.equal(a.aux_hidden, b.aux_hidden) and torch.equal(a.final_hidden, b.final_hidden)


@SETTINGS
@given(lengths=st.lists(st.integers(1, 64), min_size=1, max_size=60), budget=st.integers(1, 256),
       seed=st.integers(0, 5), epoch=st.integers(0, 3))
def test_batch_plans_partition_within_budget(lengths, budget, seed, epoch):
    for batches in (length_batches(lengths, budget), epoch_plan(lengths, budget, seed, epoch, "padded")):
        flat = [i for b in batches for i in b]
        assert sorted(flat) == list(range(len(lengths)))  # every sample once
        for b in batches:
            assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= budget
    packed = epoch_plan(lengths, budget, seed, epoch, "packed")
    assert sorted(i for b in packed for i in b) == list(range(len(lengths)))
    for b in packed:
        assert len(b) == 1 or sum(lengths[i] for i in b) <= budget
    # best-fit: no two bins could be merged (fits the budget), except across chunks
    if sum(lengths) < PACK_CHUNK_BATCHES * budget:
        loads = sorted(sum(lengths[i] for i in b) for b in packed)
        assert len(loads) < 2 or loads[0] + loads[1] > budget
    for layout in ("packed", "padded"):
        assert epoch_plan(lengths, budget, seed, epoch, layout) == epoch_plan(lengths, budget, seed, epoch, layout)


segment = st.sampled_from(["..", ".", "a", "b", "", "/", "etc", "passwd", "..\\x", "~"])


@SETTINGS
@given(parts=st.lists(segment, max_size=8), absolute=st.booleans())
def test_safe_join_never_leaves_the_root(parts, absolute, tmp_path):
    root = tmp_path / "run" / "data"
    root.mkdir(parents=True, exist_ok=True)
    rel = ("/" if absolute else "") + "/".join(parts)
    try:
        p = safe_join(root, rel)
    except DraftsmithError as e:
        assert "escapes the run directory" in str(e)
        return
    assert p == root.resolve() or root.resolve() in p.parents


def test_safe_join_refuses_a_symlink_out(tmp_path):
    root = tmp_path / "run"
    root.mkdir()
    (root / "link").symlink_to("/etc")
    with pytest.raises(DraftsmithError, match="escapes"):
        safe_join(root, "link/passwd")


# ----------------------------------------------------------------------------- masks


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from draftsmith.testing import train_tokenizer

    d = tmp_path_factory.mktemp("tok")
    train_tokenizer(["Hello there, how are you?", "Fine thanks! Ünïcödé 🚀 中文", "1 2 3 4 5"] * 4, 400, d)
    return AutoTokenizer.from_pretrained(str(d))


@SETTINGS
@given(conv=conversation, max_length=st.integers(2, 80))
def test_truncated_render_is_a_prefix_of_the_full_one(conv, max_length, tokenizer):
    from draftsmith.data.template import render

    full = render(tokenizer, as_messages(conv), 10**6)
    cut = render(tokenizer, as_messages(conv), max_length)
    assert cut.input_ids == full.input_ids[:max_length] and cut.loss_mask == full.loss_mask[:max_length]
    assert cut.truncated == (len(full.input_ids) > max_length)
    assert sum(full.loss_mask) >= len(conv)  # every assistant turn contributes loss tokens
