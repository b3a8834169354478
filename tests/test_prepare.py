"""The prepare stage end to end on a tiny model folder: shards, token counts, manifest counts, resume after an
interruption (byte-identical to an uninterrupted run), truncated sources and the nothing-kept error."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.manifests import load_manifest
from draftsmith.messages import DraftsmithError
from draftsmith.config import PrepareConfig, Recipe, TargetConfig
from draftsmith.data import prepare
from draftsmith.data.readers import ReadStats, read_conversations
from draftsmith.data.shards import read_shard
from draftsmith.data.template import render_with_mask
from draftsmith.target.model import load_tokenizer
from draftsmith.testing import make_model_dir

DATA = Path(__file__).parent / "data"
LONG = "The quick brown fox jumps over the lazy dog. " * 12


def conversation(i: int) -> dict:
    return {"id": f"c{i}", "conversations": [
        {"from": "human", "value": f"Write a short poem about the sea. {i}"},
        {"from": "gpt", "value": f"Sure, here is a poem about the sea and the sky. {i}"},
        {"from": "human", "value": "Thank you very much!"},
        {"from": "gpt", "value": "Hello! How can I help you today?"}]}


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("prep") / "tgt")


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    recs = [conversation(i) for i in range(9)]
    recs[2] = {"id": "no-answer", "conversations": [{"from": "human", "value": "Anyone there?"}]}
    recs[4] = {"id": "odd-role", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt4", "value": "Hello"}]}
    recs[6] = {"id": "empty", "conversations": []}
    recs[7] = {"id": "long-question", "conversations": [{"from": "human", "value": LONG},  # no assistant token fits
                                                        {"from": "gpt", "value": "Yes."}]}
    recs.append({"id": "long-answer", "conversations": [{"from": "human", "value": "Tell me a story."},
                                                        {"from": "gpt", "value": LONG}]})  # truncated, kept
    recs += [conversation(i) for i in range(10, 14)]
    path = tmp_path_factory.mktemp("src") / "convs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def make_recipe(target: Path, source: Path, run_dir: Path, **prep) -> Recipe:
    cfg = PrepareConfig(source=str(source), **{"samples_per_shard": 3, "max_length": 64, **prep})
    return Recipe(run_dir=str(run_dir), target=TargetConfig(path=str(target)), prepare=cfg)


def output_bytes(run_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((run_dir / "data").glob("*.safetensors"))}


def test_prepare_end_to_end(target, source, tmp_path):
    run_dir = tmp_path / "run"
    m = prepare.run(make_recipe(target, source, run_dir), run_dir, "fp")
    assert m["status"] == "complete" and m["stage"] == "prepare"
    c = m["counts"]
    assert (c["read"], c["kept"], c["skipped_no_assistant"], c["skipped_unknown_role"], c["skipped_empty"],
            c["skipped_no_loss_tokens"], c["truncated"]) == (14, 10, 1, 1, 1, 1, 1)
    assert m["source"]["format"] == "jsonl" and m["truncated_source"] is None
    assert [s["file"] for s in m["shards"]] == [f"shard-0000{i}.safetensors" for i in range(4)]
    assert [s["num_samples"] for s in m["shards"]] == [3, 3, 3, 1]

    tok = load_tokenizer(target)
    samples = [s for sh in m["shards"] for s in read_shard(run_dir / "data" / sh["file"])]
    assert [s.sample_index for s in samples] == [0, 1, 3, 5, 8, 9, 10, 11, 12, 13]
    assert [s.source_id for s in samples] == ["c0", "c1", "c3", "c5", "c8", "long-answer", "c10", "c11", "c12", "c13"]
    convs = {cv.index: cv for cv in read_conversations(source, "jsonl", ReadStats())}
    for s in samples:
        ids, mask, _ = render_with_mask(tok, convs[s.sample_index].messages, 64)
        assert s.input_ids.tolist() == ids and s.loss_mask.int().tolist() == mask
    first = samples[0]
    assert tok.decode(first.input_ids[first.loss_mask]) == ("Sure, here is a poem about the sea and the sky. 0<|end|>"
                                                            "Hello! How can I help you today?<|end|>")
    assert max(len(s) for s in samples) == 64  # the long answer, truncated

    counts = load_file(str(run_dir / "data" / "token_counts.safetensors"))["counts"]
    assert counts.dtype == torch.int64 and counts.shape == (len(tok),)
    expect = sum(torch.bincount(s.input_ids[s.loss_mask], minlength=len(tok)) for s in samples)
    assert torch.equal(counts, expect)
    assert int(counts.sum()) == c["loss_tokens"] == sum(int(s.loss_mask.sum()) for s in samples)
    assert c["tokens"] == sum(len(s) for s in samples)

    mtime = (run_dir / "data" / "shard-00000.safetensors").stat().st_mtime_ns
    assert prepare.run(make_recipe(target, source, run_dir), run_dir, "fp")["finished_at"] == m["finished_at"]
    assert (run_dir / "data" / "shard-00000.safetensors").stat().st_mtime_ns == mtime  # complete: not redone


def test_sharegpt_parts_stay_on_one_side_of_the_heldout_split(target, tmp_path):
    """ShareGPT's parts `x_0`, `x_1` of one long conversation: prepare keeps each record's id in its
    shard, train's index reads them back, and the held-out split keeps the parts together."""
    from draftsmith.train.data import TokenIndex
    from draftsmith.data.conversations import conversation_keys
    from draftsmith.train.heldout import split_by_conversation

    ids = ["x_0", "x_1", "y_0", "z_0", "z_2", "w_0", "v_0", "u_0"]
    path = tmp_path / "parts.json"
    path.write_text(json.dumps([{**conversation(i), "id": sid} for i, sid in enumerate(ids)]))
    run_dir = tmp_path / "run"
    m = prepare.run(make_recipe(target, path, run_dir), run_dir, "fp")
    index = TokenIndex([run_dir / "data" / sh["file"] for sh in m["shards"]], 64)
    assert index.source_id == ids and index.sample_index == list(range(8))
    keys = conversation_keys(index.source_id, index.sample_index)
    assert keys == ["x", "x", "y", "z", "z", "w", "v", "u"]
    sides = set()
    for seed in range(10):
        train, held = split_by_conversation(keys, 1, seed)
        assert not {keys[j] for j in train} & {keys[j] for j in held}
        sides.add(0 in held)
        assert (0 in held) == (1 in held) and (3 in held) == (4 in held)
    assert sides == {True, False}  # x is held out under some seeds, trained on under others


def test_resume_after_interruption_is_byte_identical(target, source, tmp_path, monkeypatch):
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    ref = prepare.run(make_recipe(target, source, ref_dir, skip_samples=1, max_samples=12), ref_dir, "fp")

    real_write, calls = prepare.write_shard, []

    def crash_on_second_shard(path, samples, metadata=None):
        entry = real_write(path, samples, metadata)  # the shard file is written ...
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt  # ... but the run dies before listing it
        return entry

    monkeypatch.setattr(prepare, "write_shard", crash_on_second_shard)
    recipe = make_recipe(target, source, run_dir, skip_samples=1, max_samples=12)
    with pytest.raises(KeyboardInterrupt):
        prepare.run(recipe, run_dir, "fp")
    half = load_manifest(run_dir / "data")
    assert half["status"] == "running" and [s["file"] for s in half["shards"]] == ["shard-00000.safetensors"]
    assert half["state"]["next_record"] == half["shards"][0]["last_record"] + 1

    monkeypatch.setattr(prepare, "write_shard", real_write)
    m = prepare.run(recipe, run_dir, "fp")
    assert m["status"] == "complete" and m["counts"] == ref["counts"]
    assert [s["sha256"] for s in m["shards"]] == [s["sha256"] for s in ref["shards"]]
    assert output_bytes(run_dir) == output_bytes(ref_dir)
    assert ref["shards"][0]["first_record"] == 1 and ref["counts"]["read"] == 12


def test_other_fingerprint_starts_over(target, source, tmp_path):
    run_dir = tmp_path / "run"
    prepare.run(make_recipe(target, source, run_dir, max_samples=3), run_dir, "fp1")
    m = prepare.run(make_recipe(target, source, run_dir), run_dir, "fp2")
    assert m["fingerprint"] == "fp2" and m["counts"]["read"] == 14


def test_truncated_sharegpt_source_is_reported(target, tmp_path):
    run_dir = tmp_path / "run"
    src = tmp_path / "sg.json"
    shutil.copy(DATA / "sharegpt_truncated.json", src)
    m = prepare.run(make_recipe(target, src, run_dir), run_dir, "fp")
    assert m["truncated_source"]["complete_records"] == 5 and m["truncated_source"]["byte_offset"] == src.stat().st_size
    assert (m["counts"]["read"], m["counts"]["kept"], m["counts"]["dropped_leading_assistant"]) == (5, 4, 1)


def test_nothing_kept_is_an_error_with_a_hint(target, tmp_path):
    with pytest.raises(DraftsmithError, match=r"no sample kept out of 80 conversations .*no assistant turns"):
        prepare.run(make_recipe(target, "mtbench", tmp_path / "run"), tmp_path / "run", "fp")
    with pytest.raises(DraftsmithError, match=r"prepare.samples_per_shard 0: must be >= 1"):
        prepare.run(make_recipe(target, DATA / "sharegpt_truncated.json", tmp_path / "r2", samples_per_shard=0),
                    tmp_path / "r2", "fp")


def test_long_text_is_cut_to_max_length_before_tokenizing(tmp_path, monkeypatch):
    """A 2 MB answer with max_length 64: the tokenizer sees a bounded prefix, and the sample is the
    same as the one cut after tokenizing the whole text."""
    from draftsmith.data import template
    from draftsmith.testing import make_model_dir

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(make_model_dir(tmp_path / "m", num_layers=2, hidden_size=32)))
    msgs = [{"role": "user", "content": "Tell me a long story."}, {"role": "assistant", "content": "once upon a time " * 120_000}]
    seen = []
    call = type(tok).__call__

    def spy(self, text, *a, **kw):
        seen.append(len(text))
        return call(self, text, *a, **kw)

    monkeypatch.setattr(type(tok), "__call__", spy)
    r = template.render(tok, msgs, 64)
    assert max(seen) < 20_000 and r.truncated and len(r.input_ids) == 64
    monkeypatch.setattr(template, "max_token_chars", lambda t: 10**9)  # no cut: the whole text tokenized
    full = template.render(tok, msgs, 64)
    assert (full.input_ids, full.loss_mask, full.truncated) == (r.input_ids, r.loss_mask, r.truncated)
