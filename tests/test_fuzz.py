"""Property-based fuzz (hypothesis) of every reader and every recipe key (issue 51 item 4): whatever the
input, a reader returns or raises one DraftsmithError whose one line names the file; never another
exception (a traceback), never a message of several lines.

Readers: the conversation readers (ShareGPT .json, .jsonl, .jsonl.gz) and format detection, the
prompt readers (MT-Bench, HumanEval, JSONL prompts), the recipe parser (random values for every key of
every section, enumerated from the dataclasses, and random section values), manifests (load_manifest,
require_complete, verify_shards, verify_listed_file), read_json, read_jsonl and the ledger, regenerate's
errors.jsonl, the vocab file, token and hidden-state shards, the drafter's config.json and weights,
and train's `latest` pointer.

The budget is fixed (`BUDGET`: max_examples per test, derandomized, no example database), so CI time
is bounded and a run is the same every time. Each input hypothesis (or the soak) found that broke the
rule is kept as data in tests/fuzz_corpus/*.json and replayed by test_corpus_case, after the fix, for
good: {"reader": one of CHECKS, "input": {...}, "found": what happened before the fix}. An input is
{"text": str} or {"b64": str} (a file's bytes) with optional {"repeat": [[str, n], ...]} appended
(n copies each; deep nesting without a megabyte of JSON in the corpus), or {"recipe": {...}} (a
recipe mapping, written as YAML), or {"manifest": {...}} (a manifest's JSON value), or {"tensors":
{name: [dtype, shape, values]}} (a safetensors file).

Round trips and truncations of the conversation readers are tested in tests/test_properties.py; the
atheris fuzzer fuzz/fuzz_readers.py (not a CI dependency) runs the same conversation check for longer.
"""
from __future__ import annotations

import base64
import gzip
import json
import math
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from draftsmith.config import SECTIONS, parse_recipe, recipe_keys
from draftsmith.messages import DraftsmithError

CORPUS = Path(__file__).parent / "fuzz_corpus"
BUDGET = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                  suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


_fresh = iter(range(1 << 62))


def fresh(tmp: Path) -> Path:
    """A new folder for one example: a file loaded with mmap (safetensors) must never be rewritten in
    place while a tensor of an earlier example may still map it (SIGBUS); draftsmith's writers rename."""
    d = tmp / f"ex{next(_fresh)}"
    d.mkdir(parents=True)
    return d


def one_line_error(e: DraftsmithError, path: Path | None = None) -> None:
    msg = str(e)
    assert msg and "\n" not in msg, repr(msg)
    if path is not None:
        assert path.name in msg or str(path.parent) in msg, f"the error does not name {path}: {msg}"


def outcome(fn: Callable[[], Any], path: Path | None = None) -> str:
    """Run a reader: 'ok' or 'error' (a one-line DraftsmithError); any other exception fails the test."""
    try:
        fn()
    except DraftsmithError as e:
        one_line_error(e, path)
        return "error"
    return "ok"


# ----------------------------------------------------------------------------- inputs


json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12), st.floats(allow_nan=True),
                         st.text(max_size=12))
json_values = st.recursive(json_scalars, lambda kids: st.one_of(st.lists(kids, max_size=4),
                                                                 st.dictionaries(st.text(max_size=8), kids, max_size=4)),
                           max_leaves=12)
RECORD_KEYS = ["conversations", "messages", "from", "value", "role", "content", "id", "turns", "prompt", "question_id",
               "task_id", "category", "text", "type"]
record_like = st.recursive(
    st.one_of(json_scalars, st.sampled_from(["human", "gpt", "user", "assistant", "system", "gpt4", "", " "])),
    lambda kids: st.one_of(st.lists(kids, max_size=4), st.dictionaries(st.sampled_from(RECORD_KEYS), kids, max_size=4)),
    max_leaves=16)
nesting = st.tuples(st.sampled_from(["[", "{\"a\":", "[{\"conversations\":"]), st.integers(1, 3000))


@st.composite
def file_bytes(draw, records=record_like) -> bytes:
    """A file of JSON-ish records (an array, lines, or a broken mix), sometimes cut, corrupted or deeply nested."""
    recs = draw(st.lists(records, max_size=5))
    shape = draw(st.sampled_from(["array", "lines", "concat", "raw"]))
    if shape == "array":
        data = json.dumps(recs, ensure_ascii=draw(st.booleans())).encode()
    elif shape == "lines":
        data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs).encode()
    elif shape == "concat":
        data = "".join(json.dumps(r) for r in recs).encode()
    else:
        data = draw(st.binary(max_size=200))
    edit = draw(st.sampled_from(["none", "cut", "flip", "nest", "bom", "latin1"]))
    if edit == "cut" and data:
        data = data[:draw(st.integers(0, len(data)))]
    elif edit == "flip" and data:
        i = draw(st.integers(0, len(data) - 1))
        data = data[:i] + bytes([draw(st.integers(0, 255))]) + data[i + 1:]
    elif edit == "nest":
        opener, n = draw(nesting)
        data = (opener * n).encode() + data
    elif edit == "bom":
        data = b"\xef\xbb\xbf" + data
    elif edit == "latin1":
        data = data + "é".encode("latin-1")
    return data


def materialize(inp: dict) -> bytes:
    data = inp["text"].encode() if "text" in inp else base64.b64decode(inp.get("b64", ""))
    for part, n in inp.get("repeat", []):
        data += part.encode() * n
    return data


# ----------------------------------------------------------------------------- checks, one per reader
# Each takes (tmp_path, input) and returns "ok" or "error"; hypothesis tests and the corpus call them.


def check_conversations(tmp: Path, data: bytes) -> str:
    from draftsmith.data import readers

    results = []
    for name, fmt, blob in (("in.json", "sharegpt", data), ("in.jsonl", "jsonl", data),
                            ("in.jsonl.gz", "jsonl", gzip.compress(data))):
        path = tmp / name
        path.write_bytes(blob)

        def read() -> None:
            for conv in readers.read_conversations(path, fmt, readers.ReadStats(), on_unknown_role="skip"):
                assert conv.messages and conv.messages[-1]["role"] == "assistant", conv
        results.append(outcome(read, path))
    return "error" if "error" in results else "ok"


def check_resolve_source(tmp: Path, data: bytes) -> str:
    from draftsmith.data.readers import resolve_source

    results = []
    for name in ("in.json", "in.jsonl", "in.jsonl.gz"):
        path = tmp / name
        path.write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
        results.append(outcome(lambda: resolve_source(str(path)), path))
    return "error" if "error" in results else "ok"


def check_prompts(tmp: Path, data: bytes) -> str:
    """MT-Bench, HumanEval and JSONL prompt files (format decided by the first record, as evaluate reads them)."""
    from draftsmith.data.readers import load_prompts

    path = tmp / "prompts.jsonl"
    path.write_bytes(data)
    return outcome(lambda: load_prompts(str(path), max_prompts=50), path)


def check_read_json(tmp: Path, data: bytes) -> str:
    from draftsmith.fileio import read_json

    path = tmp / "x.json"
    path.write_bytes(data)
    return outcome(lambda: read_json(path), path)


def check_read_jsonl(tmp: Path, data: bytes) -> str:
    """read_jsonl and the ledger never raise: a line that is not a record is skipped."""
    from draftsmith.fileio import read_jsonl
    from draftsmith.rundir import LEDGER, Ledger

    (tmp / LEDGER).write_bytes(data)
    recs = read_jsonl(tmp / LEDGER)
    assert all(isinstance(r, dict) for r in recs) and Ledger(tmp).read() == recs
    return "ok"


def check_regen_errors(tmp: Path, data: bytes) -> str:
    from draftsmith.data.regenerate import ERRORS_FILE, read_errors
    from draftsmith.rundir import stage_dir

    path = stage_dir(tmp, "regenerate") / ERRORS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return outcome(lambda: read_errors(tmp), path)


def check_recipe(tmp: Path, recipe: Any) -> str:
    path = tmp / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, allow_unicode=True), encoding="utf-8")
    return outcome(lambda: parse_recipe([str(path)]), path)


def check_manifest(tmp: Path, manifest: Any) -> str:
    """A stage folder's manifest.json with the given JSON value (and one real shard beside it)."""
    from draftsmith.manifests import load_manifest, require_complete, verify_listed_file, verify_shards

    d = tmp / "run" / "data"
    d.mkdir(parents=True, exist_ok=True)
    (tmp / "run" / "recipe.yaml").write_text("name: x\n")
    (d / "shard-00000.safetensors").write_bytes(b"shard")
    (d / "manifest.json").write_text(json.dumps(manifest, allow_nan=True))

    def read() -> None:
        m = load_manifest(d)
        if m is not None:
            verify_shards(d, m)
            verify_listed_file(d / "token_counts.safetensors")
            require_complete(d, "prepare")
    return outcome(read, d / "manifest.json")


def write_tensors(path: Path, spec: dict) -> None:
    from safetensors.torch import save_file

    tensors = {}
    for name, (dtype, shape, values) in spec.items():
        n = math.prod(shape)
        t = torch.tensor((list(values) * (n // max(len(values), 1) + 1))[:n] if values else [0] * n, dtype=torch.float64)
        tensors[name] = t.reshape(shape).to(getattr(torch, dtype))
    save_file(tensors, str(path))


def check_safetensors_reader(tmp: Path, inp: dict, name: str, read) -> str:
    """A file `name` made of `inp` (its tensors, or raw bytes), read by `read`."""
    path = tmp / name
    if "tensors" in inp:
        write_tensors(path, inp["tensors"])
    else:
        path.write_bytes(materialize(inp))
    return outcome(lambda: read(path), path)


def check_vocab(tmp: Path, inp: dict) -> str:
    from draftsmith.draft.vocab import load_vocab

    return check_safetensors_reader(tmp, inp, "vocab.safetensors", load_vocab)


def check_shard(tmp: Path, inp: dict) -> str:
    from draftsmith.data.shards import read_shard

    return check_safetensors_reader(tmp, inp, "shard-00000.safetensors", read_shard)


def check_drafter_config(tmp: Path, config: Any) -> str:
    """A drafter folder whose config.json holds `config`: read_drafter_config, then load_drafter."""
    from draftsmith.draft.io import load_drafter, read_drafter_config

    d = tmp / "drafter"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(config, allow_nan=True))
    (d / "model.safetensors").write_bytes(b"not safetensors")

    def read() -> None:
        read_drafter_config(d / "config.json")
        load_drafter(d)
    return outcome(read, d / "config.json")


def check_latest(tmp: Path, data: bytes) -> str:
    from draftsmith.train.checkpoint import find_latest

    d = tmp / "train"
    d.mkdir(exist_ok=True)
    (d / "latest").write_bytes(data)
    return outcome(lambda: find_latest(d), d / "latest")


BYTES_READERS = {"conversations": check_conversations, "resolve_source": check_resolve_source, "prompts": check_prompts,
                 "read_json": check_read_json, "read_jsonl": check_read_jsonl, "regen_errors": check_regen_errors,
                 "latest": check_latest}
CHECKS: dict[str, Callable[[Path, dict], str]] = {
    **{name: (lambda fn: lambda tmp, inp: fn(tmp, materialize(inp)))(fn) for name, fn in BYTES_READERS.items()},
    "recipe": lambda tmp, inp: check_recipe(tmp, inp["recipe"]),
    "manifest": lambda tmp, inp: check_manifest(tmp, inp["manifest"]),
    "drafter_config": lambda tmp, inp: check_drafter_config(tmp, inp["config"]),
    "vocab": check_vocab,
    "shard": check_shard,
}
"""Reader name (a corpus case's `reader`) -> its check."""


# ----------------------------------------------------------------------------- the fuzz


@pytest.mark.parametrize("reader", sorted(BYTES_READERS))
def test_bytes_readers(reader, tmp_path):
    @BUDGET
    @given(data=file_bytes())
    def fuzz(data):
        BYTES_READERS[reader](fresh(tmp_path), data)
    fuzz()


KEYS = recipe_keys()


def value_for(hint_default) -> st.SearchStrategy:
    """Random values for a key: its own kind of value (near its default) mixed with any JSON value."""
    _, default = hint_default
    near = st.just(default)
    if isinstance(default, bool):
        near = st.booleans()
    elif isinstance(default, int):
        near = st.integers(-3, 10**7) | st.sampled_from([0, -1, 2**63, default])
    elif isinstance(default, float):
        near = st.floats(allow_nan=True) | st.sampled_from([0.0, -1.0, default])
    elif isinstance(default, str):
        near = st.text(max_size=12) | st.just(default)
    elif isinstance(default, list):
        near = st.lists(json_scalars, max_size=3)
    return st.one_of(near, json_values)


@settings(BUDGET, max_examples=25)  # a parse takes most of a second (jsonargparse)
@given(data=st.data())
def test_recipe_every_key(data, tmp_path):
    """A recipe of the shape of recipes/quickstart.yaml with random values put into several keys of any
    sections, or a section replaced by a random value."""
    recipe: dict = {"target": {"path": "assets/tiny-llama-sharegpt"}}
    for key, hint, default in data.draw(st.lists(st.sampled_from(KEYS), min_size=1, max_size=4)):
        section, _, name = key.rpartition(".")
        value = data.draw(value_for((hint, default)), label=key)
        (recipe.setdefault(section, {}) if section else recipe)[name] = value
    if data.draw(st.integers(0, 9)) == 0:
        recipe[data.draw(st.sampled_from(SECTIONS))] = data.draw(json_values, label="section")
    check_recipe(fresh(tmp_path), recipe)


def test_every_key_null_is_one_line_naming_it():
    """Every key set to null (as YAML's `key:` with nothing after it gives) in a Recipe: refused in one
    line naming the key, unless the key takes null (Optional). check_recipe is what parse_recipe runs on
    the parsed recipe (the parser lets a null through from a recipe file); one file per kind of key is
    parsed whole below, as parsing takes a good part of a second."""
    import dataclasses as dc

    from draftsmith.config import Recipe, check_recipe

    refused = 0
    for key, hint, _ in KEYS:
        section, _, name = key.rpartition(".")
        r = Recipe()
        r = dc.replace(r, **{section: dc.replace(getattr(r, section), **{name: None})}) if section else dc.replace(r, **{name: None})
        try:
            check_recipe(r, "recipe.yaml")
        except DraftsmithError as e:
            one_line_error(e)
            assert str(e).startswith(f"recipe.yaml: {key} is null; give "), str(e)
            refused += 1
        else:
            assert "None" in str(hint) or "Optional" in str(hint), f"{key} ({hint}) accepted null"
    assert refused > len(KEYS) // 2


@pytest.mark.parametrize("key", ["seed", "name", "prepare.source", "prepare.role_map", "evaluate.methods",
                                 "evaluate.batch_sizes", "train.lr", "prepare.format", "train.heldout_samples"])
def test_recipe_file_null_is_one_line_naming_the_key(key, tmp_path):
    section, _, name = key.rpartition(".")
    recipe: dict = {}
    (recipe.setdefault(section, {}) if section else recipe)[name] = None
    with pytest.raises(DraftsmithError) as e:
        parse_recipe([str(_write(tmp_path, recipe))])
    one_line_error(e.value, tmp_path / "recipe.yaml")
    assert f"{key} is null" in str(e.value)


def _write(tmp: Path, recipe: dict) -> Path:
    path = tmp / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe), encoding="utf-8")
    return path


@pytest.mark.parametrize("section", SECTIONS)
def test_recipe_section_not_a_mapping(section, tmp_path):
    for value in (5, None, [1, 2], "train", True):
        with pytest.raises(DraftsmithError) as e:
            parse_recipe([str(_write(tmp_path, {section: value}))])
        one_line_error(e.value, tmp_path / "recipe.yaml")
        assert f"section {section}" in str(e.value)


MANIFEST_KEYS = ["status", "fingerprint", "shards", "files", "stage", "counts", "file", "sha256"]
manifest_like = st.recursive(
    st.one_of(json_scalars, st.sampled_from(["complete", "running", "shard-00000.safetensors", "../../etc/passwd",
                                             "/etc/passwd", "a\x00b", "token_counts.safetensors", "prepare"])),
    lambda kids: st.one_of(st.lists(kids, max_size=3), st.dictionaries(st.sampled_from(MANIFEST_KEYS), kids, max_size=5)),
    max_leaves=14)


@BUDGET
@given(manifest=manifest_like)
def test_manifests(manifest, tmp_path):
    check_manifest(fresh(tmp_path), manifest)


DTYPES = ["float32", "int64", "int32", "bool", "bfloat16", "uint8", "float16"]
tensor_spec = st.tuples(st.sampled_from(DTYPES), st.lists(st.integers(0, 5), max_size=3),
                        st.lists(st.integers(-20, 300), max_size=6))
VOCAB_NAMES = ["d2t", "t2d", "x"]
SHARD_NAMES = ["input_ids", "loss_mask", "offsets", "sample_index", "aux_hidden", "final_hidden", "aux_hidden_scale"]


@BUDGET
@given(spec=st.dictionaries(st.sampled_from(VOCAB_NAMES), tensor_spec, max_size=3), raw=st.binary(max_size=64),
       as_raw=st.booleans())
def test_vocab_file(spec, raw, as_raw, tmp_path):
    check_vocab(fresh(tmp_path), {"b64": base64.b64encode(raw).decode()} if as_raw else {"tensors": spec})


@BUDGET
@given(spec=st.dictionaries(st.sampled_from(SHARD_NAMES), tensor_spec, max_size=7), raw=st.binary(max_size=64),
       as_raw=st.booleans())
def test_shard_file(spec, raw, as_raw, tmp_path):
    check_shard(fresh(tmp_path), {"b64": base64.b64encode(raw).decode()} if as_raw else {"tensors": spec})


DRAFTER_KEYS = ["hidden_size", "target_hidden_size", "vocab_size", "draft_vocab_size", "num_attention_heads",
                "num_key_value_heads", "head_dim", "intermediate_size", "aux_layer_ids", "rope_theta", "rope_scaling",
                "rms_norm_eps", "max_position_embeddings", "norm_output"]


@BUDGET
@given(config=st.one_of(json_values, st.dictionaries(st.sampled_from(DRAFTER_KEYS), json_values, max_size=6)))
def test_drafter_config(config, tmp_path):
    check_drafter_config(fresh(tmp_path), config)


# ----------------------------------------------------------------------------- the corpus


def corpus_cases() -> list[Path]:
    return sorted(CORPUS.glob("*.json"))


@pytest.mark.parametrize("case", corpus_cases(), ids=lambda p: p.stem)
def test_corpus_case(case, tmp_path):
    """Every input that once broke the rule, replayed: each reads or fails in one line now."""
    c = json.loads(case.read_text(encoding="utf-8"))
    assert c["reader"] in CHECKS, f"{case}: reader {c['reader']!r} is not one of {sorted(CHECKS)}"
    got = CHECKS[c["reader"]](fresh(tmp_path), c["input"])
    if "expect" in c:
        assert got == c["expect"], f"{case}: {got}, want {c['expect']}"


def test_corpus_is_not_empty():
    assert len(corpus_cases()) >= 5
