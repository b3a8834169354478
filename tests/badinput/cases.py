"""The bad-input corpus: every way users' data, recipes, run folders and disks arrive broken.

Each case sets up one broken thing in a fresh folder (files under sources/ are the broken
conversation files themselves), runs one `draftsmith` command through `cli.main`, and states
what must happen:

    error      exit 2, a one-line `error: FILE: RECORD: what; fix` message matching `match`,
               no temp file left, the failing stage's manifest not marked complete
    skip:KEY   exit 0 and the stage manifest counts KEY > 0 (a counted skip)
    truncated  exit 0, the complete records kept and the cut reported in `truncated_source`
    ok         exit 0 (input that looks odd but is valid)

tests/test_badinput.py runs them all; docs/reliability.md holds the table of them, generated
by `python tests/badinput/cases.py --write docs/reliability.md` (a test checks it is current).
"""
from __future__ import annotations

import errno
import json
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import yaml

SOURCES = Path(__file__).parent / "sources"


def base_recipe(run_dir: Path, target: Path, source: Path) -> dict:
    """The small good run every case starts from."""
    return {
        "name": "badinput", "run_dir": str(run_dir),
        "target": {"path": str(target), "device": "cpu", "dtype": "float32"},
        "prepare": {"source": str(source), "max_length": 64, "samples_per_shard": 4},
        "capture": {"batch_tokens": 512, "storage_dtype": "float32"},
        "vocab": {"draft_vocab_size": 64},
        "train": {"ttt_steps": 2, "max_steps": 4, "batch_tokens": 128, "warmup_steps": 1, "save_every": 2,
                  "log_every": 2, "device": "cpu", "dtype": "float32"},
        "export": {"formats": ["sglang"], "dtype": "float32"},
    }


@dataclass
class Ctx:
    """What a case's setup gets: a fresh folder, the complete good run, pytest's monkeypatch."""

    tmp: Path
    base: Path  # a run folder with every stage up to export complete (from base_recipe)
    target: Path
    monkeypatch: Any
    finalizers: list = field(default_factory=list)
    """Called after the case (stop a server or a lock holder the setup started)."""

    @property
    def run_dir(self) -> Path:
        return self.tmp / "run"

    def recipe(self, source: Optional[Path] = None, target: Optional[Path] = None, raw: Optional[str] = None,
               **sections: dict) -> str:
        """Write recipe.yaml (the base recipe with `sections` merged in, or `raw` text); returns its path."""
        r = base_recipe(self.run_dir, target or self.target, source or SOURCES / "good.json")
        for k, v in sections.items():
            r[k] = {**r.get(k, {}), **v} if isinstance(v, dict) else v
        path = self.tmp / "recipe.yaml"
        path.write_text(raw if raw is not None else yaml.safe_dump(r))
        return str(path)

    def copy(self, *stage_dirs: str) -> None:
        """Copy complete stage folders of the good run (same recipe, so same fingerprints)."""
        for d in stage_dirs:
            shutil.copytree(self.base / d, self.run_dir / d)

    def edit_manifest(self, stage_dir: str, fn: Callable[[dict], Any]) -> None:
        p = self.run_dir / stage_dir / "manifest.json"
        m = json.loads(p.read_text())
        fn(m)
        p.write_text(json.dumps(m))

    def target_copy(self) -> Path:
        dest = self.tmp / "target"
        shutil.copytree(self.target, dest)
        return dest

    def tokenizer_config(self, target: Path, **updates) -> None:
        p = target / "tokenizer_config.json"
        cfg = json.loads(p.read_text())
        cfg.update(updates)
        p.write_text(json.dumps(cfg))
        (target / "chat_template.jinja").unlink(missing_ok=True)


@dataclass
class Case:
    id: str
    group: str
    what: str
    """The bad input, in words."""
    command: str
    """The draftsmith command the case runs."""
    expect: str
    """error | skip:COUNT_KEY | truncated | ok"""
    match: str = ""
    """Regex the error message must match (names the file/record)."""
    setup: Callable[[Ctx], list[str]] = field(default=lambda c: [c.recipe()])
    """Prepares the folder, returns the command's arguments."""
    then_rerun_ok: bool = False
    """After the failure, the same command without the fault must finish (disk full cases)."""
    xfail: str = ""
    """Known gap (strict xfail), with the reason."""
    check: Optional[Callable[[Ctx, str], None]] = None
    """ok cases of commands without a stage folder: checks what the command wrote (given its stdout)."""


def src(name: str, *extra: str) -> Callable[[Ctx], list[str]]:
    return lambda c: [c.recipe(SOURCES / name), *extra]


def _copy_then(dirs: tuple[str, ...], fn: Callable[[Ctx], None]) -> Callable[[Ctx], list[str]]:
    def setup(c: Ctx) -> list[str]:
        args = [c.recipe()]
        c.copy(*dirs)
        fn(c)
        return args
    return setup


# ----------------------------------------------------------------------------- helpers for setups


def _template(template: str) -> Callable[[Ctx], list[str]]:
    def setup(c: Ctx) -> list[str]:
        t = c.target_copy()
        c.tokenizer_config(t, chat_template=template)
        return [c.recipe(target=t)]
    return setup


def _no_template(c: Ctx) -> list[str]:
    t = c.target_copy()
    cfg = json.loads((t / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (t / "tokenizer_config.json").write_text(json.dumps(cfg))
    (t / "chat_template.jinja").unlink(missing_ok=True)
    return [c.recipe(target=t)]


def _foreign_tokenizer(c: Ctx) -> list[str]:
    """The target folder holds another tokenizer, with more tokens than the model's embedding;
    prepare (tokenizer only) succeeds, capture (the model) must refuse the ids."""
    import random

    from draftsmith.cli import main
    from draftsmith.testing import train_tokenizer

    t = c.target_copy()
    rng = random.Random(0)
    texts = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(400)) for _ in range(200)]
    train_tokenizer(texts, 2000, t)
    data = c.tmp / "words.json"
    data.write_text(json.dumps([{"id": str(i), "conversations": [{"from": "human", "value": "say"},
                                                                   {"from": "gpt", "value": texts[i][:200]}]} for i in range(4)]))
    args = [c.recipe(source=data, target=t)]
    assert main(["prepare", *args]) == 0
    return args


def _flip_last_byte(p: Path) -> None:
    b = p.read_bytes()
    p.write_bytes(b[:-1] + bytes([b[-1] ^ 0xFF]))


def _shard_path(c: Ctx, stage_dir: str, i: int = 0) -> Path:
    return c.run_dir / stage_dir / f"shard-{i:05d}.safetensors"


def _rewrite_capture(c: Ctx, poison: Callable[[Any], None]) -> None:
    """Rewrite every capture shard with `poison` applied to its aux_hidden and fix the manifest's
    checksums: bad values that a stage wrote itself, not a corrupt file."""
    from safetensors.torch import load_file

    from draftsmith.fileio import atomic_save_safetensors

    m = json.loads((c.run_dir / "capture" / "manifest.json").read_text())
    for entry in m["shards"]:
        p = c.run_dir / "capture" / entry["file"]
        t = load_file(str(p))
        poison(t)
        entry["sha256"] = atomic_save_safetensors(p, t)
    (c.run_dir / "capture" / "manifest.json").write_text(json.dumps(m))


def _rewrite_vocab(c: Ctx, edit: Callable[[dict], None]) -> None:
    """Rewrite vocab/vocab.safetensors with `edit` applied and fix the checksum the manifest lists:
    a vocab that is wrong inside, not a corrupt file."""
    from safetensors.torch import load_file

    from draftsmith.fileio import atomic_save_safetensors

    p = c.run_dir / "vocab" / "vocab.safetensors"
    t = load_file(str(p))
    edit(t)
    sha = atomic_save_safetensors(p, t)
    c.edit_manifest("vocab", lambda m: [f.update(sha256=sha) for f in m.get("files", []) if f.get("file") == p.name])


def _junk_data_shard(c: Ctx) -> None:
    """data/shard-00000 overwritten with junk, the manifest's checksum updated to match: passes the
    checksum, fails when read."""
    import hashlib

    p = _shard_path(c, "data")
    p.write_bytes(b"junk" * 64)
    sha = hashlib.sha256(p.read_bytes()).hexdigest()
    c.edit_manifest("data", lambda m: [s.update(sha256=sha) for s in m["shards"] if s["file"] == p.name])


def _unmark_t2d(t) -> None:
    t["t2d"][:] = False  # t2d marks none of the target tokens d2t maps onto


def _poison_first_sample(t) -> None:
    a, b = int(t["offsets"][0]), int(t["offsets"][1])
    t["aux_hidden"][a:b] = float("nan")


def _poison_all(t) -> None:
    t["aux_hidden"][:] = float("inf")


def _nan_rows_in_target(every: int) -> Callable[[Ctx], list[str]]:
    """The target itself produces NaN for some samples (every `every`-th row of a batch; all if 1)."""
    def setup(c: Ctx) -> list[str]:
        import torch

        from draftsmith.target.model import Target

        forward = Target.forward

        def nan_forward(self, input_ids, *a, **kw):
            out = forward(self, input_ids, *a, **kw)
            with torch.inference_mode():
                out.aux_hidden[::every] = float("nan")
            return out

        c.monkeypatch.setattr(Target, "forward", nan_forward)
        c.copy("data")
        return [c.recipe()]
    return setup


def _drafter_state(fn: Callable[[dict], None]) -> Callable[[Ctx], list[str]]:
    def setup(c: Ctx) -> list[str]:
        from safetensors.torch import load_file, save_file

        args = [c.recipe()]
        c.copy("data", "capture", "vocab", "train")
        p = c.run_dir / "train" / "drafter" / "model.safetensors"
        state = load_file(str(p))
        fn(state)
        save_file(state, str(p))
        return args
    return setup


def _misshape(state: dict) -> None:
    import torch

    state["fc.weight"] = torch.zeros(state["fc.weight"].shape[0] + 1, state["fc.weight"].shape[1])


def _resume_train_with(fn: Callable[[Path], None]) -> Callable[[Ctx], list[str]]:
    """A train stage that was killed (manifest running) and whose latest checkpoint is then damaged."""
    def setup(c: Ctx) -> list[str]:
        args = [c.recipe()]
        c.copy("data", "capture", "vocab", "train")
        c.edit_manifest("train", lambda m: m.update(status="running"))
        latest = c.run_dir / "train" / (c.run_dir / "train" / "latest").read_text().strip()
        fn(latest)
        return args
    return setup


def _misshaped_checkpoint(step_dir: Path) -> None:
    """Every tensor file of the step folder with its first tensor one element short (metadata kept)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    for f in step_dir.rglob("*.safetensors"):
        with safe_open(str(f), framework="pt") as h:
            metadata = h.metadata()
        state = load_file(str(f))
        name = sorted(state)[0]
        state[name] = state[name].flatten()[:-1].clone()
        save_file(state, str(f), metadata=metadata)


def _garbage_checkpoint(step_dir: Path) -> None:
    for f in step_dir.rglob("*.safetensors"):
        f.write_bytes(b"garbage")


def _disk_full(after_writes: int, stages: tuple[str, ...] = (), force: bool = False) -> Callable[[Ctx], list[str]]:
    """os.fsync fails with ENOSPC from the `after_writes`-th file on (the disk fills up mid-stage)."""
    def setup(c: Ctx) -> list[str]:
        import os

        args = [c.recipe()]
        c.copy(*stages)
        calls = {"n": 0}
        fsync = os.fsync

        def full(fd):
            calls["n"] += 1
            if calls["n"] > after_writes:
                raise OSError(errno.ENOSPC, "No space left on device")
            return fsync(fd)

        c.monkeypatch.setattr(os, "fsync", full)
        return args
    return setup


def _small_disk(c: Ctx) -> list[str]:
    from draftsmith.target import capture

    args = [c.recipe()]
    c.copy("data")
    c.monkeypatch.setattr(capture.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000))
    return args


# ----------------------------------------------------------------------------- more setups (issue 21)


def _write(c: Ctx, name: str, data: bytes | str) -> Path:
    p = c.tmp / name
    p.write_bytes(data if isinstance(data, bytes) else data.encode())
    return p


GOOD_REC = {"id": "g", "conversations": [{"from": "human", "value": "Count from 1 to 4."}, {"from": "gpt", "value": "1 2 3 4. Done!"}]}
GOOD_MSGS = {"messages": [{"role": "user", "content": "Count from 1 to 4."}, {"role": "assistant", "content": "1 2 3 4. Done!"}]}


def _made(name: str, data: Callable[[], bytes]) -> Callable[[Ctx], list[str]]:
    """A conversation file written by code (bytes a text editor would mangle), then prepare."""
    return lambda c: [c.recipe(_write(c, name, data()))]


def _jsonl(*lines: bytes) -> bytes:
    return b"".join(lines)


def _good_line(n: int = 3) -> bytes:
    return (json.dumps(GOOD_MSGS) + "\n").encode() * n


def _deep_record(depth: int = 100_000) -> bytes:
    return _jsonl(_good_line(2), b'{"messages": ' + b"[" * depth + b"]" * depth + b"}\n", _good_line(1))


def _gzip_bomb(c: Ctx) -> list[str]:
    import gzip

    from draftsmith.data import readers

    c.monkeypatch.setattr(readers, "GZIP_MIN_BOMB", 1 << 20)
    p = c.tmp / "bomb.jsonl.gz"
    with gzip.open(p, "wb") as f:
        f.write(_good_line(1))
        for _ in range(4):
            f.write(b" " * (1 << 20))
    return [c.recipe(p)]


def _large_line(c: Ctx) -> list[str]:
    from draftsmith.data import readers

    c.monkeypatch.setattr(readers, "MAX_RECORD_BYTES", 4096)
    big = json.dumps({"messages": [{"role": "user", "content": "x" * 10_000}, {"role": "assistant", "content": "y"}]})
    return [c.recipe(_write(c, "large_line.jsonl", _good_line(2) + big.encode() + b"\n" + _good_line(1)))]


def _raw_recipe(text: str | bytes, name: str = "recipe.yaml") -> Callable[[Ctx], list[str]]:
    return lambda c: [str(_write(c, name, text))]


ALIAS_BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 9)}]\n" for i in range(8)) + "name: boom\n"


def _run_dir_is_file(c: Ctx) -> list[str]:
    (c.tmp / "run").write_text("not a folder")
    return [c.recipe()]


def _stage_symlink(c: Ctx) -> list[str]:
    args = [c.recipe()]
    c.run_dir.mkdir()
    (c.tmp / "elsewhere").mkdir()
    (c.run_dir / "data").symlink_to(c.tmp / "elsewhere")
    return args


def _locked(c: Ctx) -> list[str]:
    """Another process holds the run directory's lock (an open file description flocked from here
    stands for it: flock locks belong to open file descriptions, so the stage's own open conflicts)."""
    import fcntl
    import os

    args = [c.recipe()]
    c.run_dir.mkdir()
    f = open(c.run_dir / ".lock", "a+")
    fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    f.write(json.dumps({"pid": os.getpid(), "command": "draftsmith train other.yaml", "started_at": 0}))
    f.flush()
    c.finalizers.append(f.close)
    return args


def _refused_rerun(c: Ctx) -> list[str]:
    """A complete prepare, rerun with other inputs that the stage refuses: the complete output stays."""
    c.copy("data")
    return [c.recipe(prepare={"min_loss_tokens": 100_000})]


def _target_edit(fn: Callable[[Path], None], stages: tuple[str, ...] = ("data",)) -> Callable[[Ctx], list[str]]:
    def setup(c: Ctx) -> list[str]:
        t = c.target_copy()
        fn(t)
        args = [c.recipe(target=t)]
        c.copy(*stages)
        return args
    return setup


def _drop_layer(t: Path) -> None:
    from safetensors.torch import load_file, save_file

    f = t / "model.safetensors"
    state = load_file(str(f))
    for k in [k for k in state if ".layers.2." in k]:
        del state[k]
    save_file(state, str(f), metadata={"format": "pt"})


def _edit_json(path_in_target: str, value: Any) -> Callable[[Path], None]:
    def fn(t: Path) -> None:
        p = t / path_in_target
        if callable(value):
            cfg = json.loads(p.read_text())
            value(cfg)
            p.write_text(json.dumps(cfg))
        else:
            p.write_text(value)
    return fn


def _resume_train_with_sums(fn: Callable[[Path], None]) -> Callable[[Ctx], list[str]]:
    """_resume_train_with on a checkpoint written before meta.json listed its checksums (so the
    damage reaches the loader, not the checksum check)."""
    def drop_sums(step_dir: Path) -> None:
        meta = json.loads((step_dir / "meta.json").read_text())
        meta.pop("state_sha256", None)
        (step_dir / "meta.json").write_text(json.dumps(meta))
        fn(step_dir)
    return _resume_train_with(drop_sums)


def _flip_checkpoint(step_dir: Path) -> None:
    _flip_last_byte(sorted((step_dir / "state").glob("*.safetensors"))[0])


def _latest_outside(c: Ctx) -> list[str]:
    args = [c.recipe()]
    c.copy("data", "capture", "vocab", "train")
    c.edit_manifest("train", lambda m: m.update(status="running"))
    (c.run_dir / "train" / "latest").write_text("../../../etc/step-000004\n")
    return args


def _resume_with_flipped_capture(c: Ctx) -> list[str]:
    args = [c.recipe()]
    c.copy("data", "capture", "vocab", "train")
    c.edit_manifest("train", lambda m: m.update(status="running"))
    _flip_last_byte(_shard_path(c, "capture"))
    return args


def _prompts(c: Ctx, lines: list[dict] | bytes) -> Path:
    data = lines if isinstance(lines, bytes) else "".join(json.dumps(x) + "\n" for x in lines).encode()
    return _write(c, "prompts.jsonl", data)


def _evaluate(prompts: Callable[[Ctx], Any], **evaluate) -> Callable[[Ctx], list[str]]:
    def setup(c: Ctx) -> list[str]:
        bench = prompts(c)
        args = [c.recipe(evaluate={"benchmarks": [str(bench)], "max_new_tokens": 8, "draft_steps": 2, "step_costs": False,
                                   "methods": ["eagle3_chain", "plain"], "max_turns": 1, **evaluate})]
        c.copy("data", "capture", "vocab", "train")
        return args
    return setup


def _import(fn: Optional[Callable[[Path], None]] = None, out: str = "imported") -> Callable[[Ctx], list[str]]:
    """import-drafter of the good run's SGLang export (edited by `fn`) into a new folder."""
    def setup(c: Ctx) -> list[str]:
        src = c.tmp / "drafter"
        shutil.copytree(c.base / "export" / "sglang", src)
        if fn is not None:
            fn(src)
        return [str(src), "--target", str(c.target), "--out", str(c.tmp / out)]
    return setup


def _imported_ok(c: Ctx, out: str) -> None:
    """the imported folder holds config.json and weights that load back as a drafter"""
    from draftsmith.draft.io import load_drafter

    d = c.tmp / "imported"
    assert (d / "model.safetensors").stat().st_size > 0 and json.loads((d / "config.json").read_text())
    load_drafter(d, "cpu")  # loads back as a drafter


def _stub(c: Ctx, **kw) -> Any:
    from draftsmith.serve.stub import StubServer

    s = StubServer(step_s=0.0005, **kw).__enter__()
    c.finalizers.append(s.close)
    return s


def _bench(*flags: str, stub: Optional[dict] = None, url: Optional[str] = None, env: Optional[dict] = None
           ) -> Callable[[Ctx], list[str]]:
    def setup(c: Ctx) -> list[str]:
        prompts = _prompts(c, [{"prompt": f"question {i}"} for i in range(3)])
        u = url
        if stub is not None:
            u = _stub(c, **stub).url
        for k, v in (env or {}).items():
            c.monkeypatch.setenv(k, v)
        return ["--url", u, "--prompts", str(prompts), "--concurrency", "[1]", "--requests_per_level", "2", "--max_tokens", "4",
                "--warmup_requests", "0", "--progress", "false", "--out_dir", str(c.tmp / "bench"),
                "--request_timeout_s", "10", *flags]
    return setup


def _bench_ok(c: Ctx, out: str) -> None:
    """results.json counts every request ok and the plot is written"""
    res = json.loads((c.tmp / "bench" / "results.json").read_text())
    assert res["levels"]["A"][0]["ok"] == 2 and (c.tmp / "bench" / "bench_serve.png").stat().st_size > 1000


def _status_ok(c: Ctx, out: str) -> None:
    """status renders the run and names capture (after prepare) as the next step"""
    assert "## Immediate next step" in out and "run `draftsmith capture" in out, out[-800:]


def _status_names_broken_manifest(c: Ctx, out: str) -> None:
    """status renders the run, naming the broken manifest and the fix"""
    assert re.search(r"prepare failed: \S*data/manifest\.json: not valid JSON .*delete it", out), out[-800:]


def _copied_run(*dirs: str, edit: Optional[Callable[[Ctx], None]] = None) -> Callable[[Ctx], list[str]]:
    def setup(c: Ctx) -> list[str]:
        c.recipe()
        c.copy(*dirs)
        shutil.copy(c.base / "ledger.jsonl", c.run_dir / "ledger.jsonl")
        if edit is not None:
            edit(c)
        return [str(c.run_dir)]
    return setup


# ----------------------------------------------------------------------------- the corpus

E = "error"
CASES: list[Case] = [
    # -- conversation files (prepare) ---------------------------------------------------------
    Case("json_truncated_mid_record", "source", "ShareGPT array cut off inside a record", "prepare", "truncated",
         setup=src("json_truncated_mid_record.json")),
    Case("json_malformed_mid_array", "source", "a record with unbalanced brackets in the middle of a ShareGPT array",
         "prepare", "skip:skipped_unbalanced", setup=src("json_malformed_mid_array.json")),
    Case("json_invalid_record_mid_array", "source", "a record that is not valid JSON (brackets balanced) mid-array",
         "prepare", "skip:skipped_invalid_json",
         setup=_made("invalid_mid.json", lambda: ("[" + json.dumps(GOOD_REC) + ', {"id": "x", "conversations": [1 2]}, '
                                                  + json.dumps(GOOD_REC) + "]").encode())),
    Case("json_top_level_object", "source", "a JSON object instead of an array", "prepare", E,
         r"json_top_level_object\.json: not a JSON array", src("json_top_level_object.json")),
    Case("json_empty_file", "source", "an empty .json file", "prepare", E, r"json_empty_file\.json: not a JSON array",
         src("json_empty_file.json")),
    Case("json_empty_array", "source", "an empty array `[]`", "prepare", E, r"json_empty_array\.json: no sample kept",
         src("json_empty_array.json")),
    Case("json_non_utf8", "source", "Latin-1 bytes inside a ShareGPT array", "prepare", "skip:skipped_not_utf8",
         setup=src("json_non_utf8.json")),
    Case("json_item_not_object", "source", "an array item that is a string", "prepare", E,
         r"json_item_not_object\.json: record 1 .*expected a JSON object", src("json_item_not_object.json")),
    Case("json_utf8_bom", "source", "a ShareGPT file starting with a UTF-8 byte-order mark", "prepare", "ok",
         setup=src("json_utf8_bom.json")),
    Case("jsonl_malformed_line", "source", "a JSONL line that is not valid JSON", "prepare", "skip:skipped_invalid_json",
         setup=src("jsonl_malformed_line.jsonl")),
    Case("jsonl_truncated_last_line", "source", "a JSONL file whose last line is cut off", "prepare", "truncated",
         setup=src("jsonl_truncated_last_line.jsonl")),
    Case("jsonl_non_utf8_line", "source", "a JSONL line with invalid UTF-8 bytes", "prepare", "skip:skipped_not_utf8",
         setup=src("jsonl_non_utf8_line.jsonl")),
    Case("jsonl_line_is_array", "source", "a JSONL line holding an array", "prepare", E,
         r"jsonl_line_is_array\.jsonl:2: expected a JSON object", src("jsonl_line_is_array.jsonl")),
    Case("jsonl_no_messages_key", "source", "a record with neither `messages` nor `conversations`", "prepare", E,
         r"jsonl_no_messages_key\.jsonl:2: record has neither", src("jsonl_no_messages_key.jsonl")),
    Case("jsonl_messages_not_list", "source", "`messages` is a string", "prepare", E,
         r"jsonl_messages_not_list\.jsonl:1: .*not a list", src("jsonl_messages_not_list.jsonl")),
    Case("jsonl_message_not_object", "source", "a message that is a bare string", "prepare", E,
         r"jsonl_message_not_object\.jsonl:1: message 0 is str", src("jsonl_message_not_object.jsonl")),
    Case("jsonl_content_not_text", "source", "message content that is a number", "prepare", E,
         r"jsonl_content_not_text\.jsonl:1: message 0: message content is int", src("jsonl_content_not_text.jsonl")),
    Case("jsonl_gzip_corrupt", "source", "a .jsonl.gz that is not gzip data", "prepare", E,
         r"jsonl_gzip_corrupt\.jsonl\.gz: .*gzip", src("jsonl_gzip_corrupt.jsonl.gz")),
    Case("jsonl_gzip_cut_off", "source", "a .jsonl.gz cut off mid-stream", "prepare", E,
         r"jsonl_gzip_cut_off\.jsonl\.gz: .*gzip", src("jsonl_gzip_cut_off.jsonl.gz")),
    Case("jsonl_blank_lines_only", "source", "a JSONL file of blank lines", "prepare", E,
         r"jsonl_blank_lines_only\.jsonl: no sample kept out of 0", src("jsonl_blank_lines_only.jsonl")),
    Case("unknown_role_skipped", "source", "a conversation with role `gpt4` (default on_unknown_role: skip)", "prepare",
         "skip:skipped_unknown_role", setup=src("unknown_role_skipped.json")),
    Case("unknown_role_fail", "source", "role `gpt4` with prepare.on_unknown_role: fail", "prepare", E,
         r"unknown_role_fail\.json: record 2 .*role 'gpt4' .*prepare.role_map",
         src("unknown_role_fail.json", "--prepare.on_unknown_role", "fail")),
    Case("all_roles_unknown", "source", "every conversation uses unmapped roles", "prepare", E,
         r"all_roles_unknown\.json: no sample kept .*role_map", src("all_roles_unknown.json")),
    Case("empty_conversation", "source", "a conversation with no messages", "prepare", "skip:skipped_empty",
         setup=src("empty_conversation.json")),
    Case("assistant_less", "source", "a conversation without an assistant turn", "prepare", "skip:skipped_no_assistant",
         setup=src("assistant_less.json")),
    Case("only_prompts", "source", "a file of user-only conversations", "prepare", E,
         r"only_prompts\.jsonl: no sample kept .*no assistant turns", src("only_prompts.jsonl")),
    Case("mtbench_questions", "source", "MT-Bench questions given as training data", "prepare", E,
         r"mtbench_questions\.jsonl: no sample kept .*no assistant turns", src("mtbench_questions.jsonl")),
    Case("blank_turns", "source", "blank user/assistant turns", "prepare", "skip:skipped_empty",
         setup=src("blank_turns.json")),
    Case("role_break", "source", "two assistant turns in a row", "prepare", "skip:cut_at_role_break",
         setup=src("role_break.json")),
    Case("missing_role_field", "source", "a message without `from`/`role`", "prepare", "skip:skipped_unknown_role",
         setup=src("missing_role_field.json")),
    Case("over_length", "source", "a sample longer than prepare.max_length", "prepare", "skip:truncated",
         setup=src("over_length.json")),
    Case("prompt_fills_max_length", "source", "a prompt so long no assistant token fits in max_length", "prepare",
         "skip:skipped_no_loss_tokens", setup=src("prompt_fills_max_length.json")),
    Case("unicode_everywhere", "source", "emoji, CJK, RTL override, NUL and private-use characters", "prepare", "ok",
         setup=src("unicode_everywhere.json")),
    Case("unknown_extension", "source", "a .txt file", "prepare", E, r"unknown_extension\.txt: cannot tell the format",
         src("unknown_extension.txt")),
    Case("missing_source", "source", "prepare.source names no file", "prepare", E, r"no_such_file\.json: no such file",
         lambda c: [c.recipe(SOURCES / "no_such_file.json")]),
    # -- chat template / tokenizer -------------------------------------------------------------
    Case("template_without_assistant", "template", "a chat template that renders only user turns", "prepare", E,
         r"chat template renders no assistant content",
         _template("{% for m in messages %}{% if m['role'] == 'user' %}<|user|>{{ m['content'] }}<|end|>{% endif %}{% endfor %}")),
    Case("template_missing", "template", "a tokenizer without a chat template", "prepare", E, r"has no chat template",
         _no_template),
    Case("template_raises", "template", "a chat template that calls raise_exception", "prepare", E,
         r"chat template failed .*roles are not supported",
         _template("{{ raise_exception('roles are not supported') }}")),
    Case("tokenizer_vocab_mismatch", "template", "a tokenizer with more tokens than the model's embedding", "capture", E,
         r"token id \d+ .*vocab_size", _foreign_tokenizer),
    # -- recipes ---------------------------------------------------------------------------------
    Case("recipe_unknown_key", "recipe", "a recipe key that does not exist (train.bogus)", "prepare", E,
         r"recipe\.yaml: .*bogus", lambda c: [c.recipe(train={"bogus": 1})]),
    Case("recipe_wrong_type", "recipe", "prepare.max_length: long", "prepare", E, r"recipe\.yaml: .*max_length",
         lambda c: [c.recipe(prepare={"max_length": "long"})]),
    Case("recipe_bad_literal", "recipe", "capture.storage_dtype: int4", "prepare", E, r"recipe\.yaml: .*storage_dtype",
         lambda c: [c.recipe(capture={"storage_dtype": "int4"})]),
    Case("recipe_bad_yaml", "recipe", "a recipe that is not valid YAML", "prepare", E, r"recipe\.yaml: ",
         lambda c: [c.recipe(raw="prepare: {max_length: [64\n  source: x\n")]),
    Case("recipe_not_a_mapping", "recipe", "a recipe that is a YAML list", "prepare", E, r"recipe\.yaml: ",
         lambda c: [c.recipe(raw="- prepare\n- capture\n")]),
    Case("recipe_missing", "recipe", "a recipe path that does not exist", "prepare", E, r"nope\.yaml: recipe not found",
         lambda c: [str(c.tmp / "nope.yaml")]),
    Case("recipe_bad_value", "recipe", "prepare.samples_per_shard: 0", "prepare", E, r"prepare\.samples_per_shard 0: must be >= 1",
         lambda c: [c.recipe(prepare={"samples_per_shard": 0})]),
    Case("recipe_target_missing", "recipe", "target.path without a model", "prepare", E,
         r"config\.json: target model not found", lambda c: [c.recipe(target=c.tmp / "no_model")]),
    # -- run folder edited by hand ---------------------------------------------------------------
    Case("manifest_bad_json", "manifest", "data/manifest.json is not valid JSON", "capture", E,
         r"data/manifest\.json: not valid JSON",
         _copy_then(("data",), lambda c: (c.run_dir / "data" / "manifest.json").write_text('{"status": "compl'))),
    Case("manifest_wrong_status", "manifest", "data/manifest.json status edited to `done`", "capture", E,
         r"data/manifest\.json: stage prepare is not complete",
         _copy_then(("data",), lambda c: c.edit_manifest("data", lambda m: m.update(status="done")))),
    Case("manifest_not_a_manifest", "manifest", "data/manifest.json without status/fingerprint", "capture", E,
         r"data/manifest\.json: not a draftsmith manifest",
         _copy_then(("data",), lambda c: c.edit_manifest("data", lambda m: m.pop("status")))),
    Case("manifest_path_escape", "manifest", "a shard path `../../etc/passwd` in data/manifest.json", "capture", E,
         r"data/manifest\.json: path '\.\./\.\./etc/passwd' escapes the run directory",
         _copy_then(("data",), lambda c: c.edit_manifest("data", lambda m: m["shards"][0].update(file="../../etc/passwd")))),
    Case("manifest_absolute_path", "manifest", "an absolute shard path `/etc/passwd`", "capture", E,
         r"data/manifest\.json: path '/etc/passwd' escapes the run directory",
         _copy_then(("data",), lambda c: c.edit_manifest("data", lambda m: m["shards"][0].update(file="/etc/passwd")))),
    Case("manifest_shard_without_file", "manifest", "a shard entry without `file`", "capture", E,
         r"data/manifest\.json: shard entry 0 .*redo the stage with `draftsmith prepare \S+/run/recipe\.yaml --force`",
         _copy_then(("data",), lambda c: c.edit_manifest("data", lambda m: m["shards"][0].pop("file")))),
    Case("manifest_shards_not_list", "manifest", "`shards` edited to a string", "capture", E,
         r"data/manifest\.json: .*shards",
         _copy_then(("data",), lambda c: c.edit_manifest("data", lambda m: m.update(shards="shard-00000.safetensors")))),
    Case("shard_missing", "manifest", "a listed data shard deleted", "capture", E,
         r"data/manifest\.json: shard shard-00001\.safetensors is listed but missing; redo the stage with "
         r"`draftsmith prepare \S+/run/recipe\.yaml --force`, then rerun the command that stopped here$",
         _copy_then(("data",), lambda c: _shard_path(c, "data", 1).unlink())),
    Case("shard_checksum_mismatch", "manifest", "one byte of a data shard changed", "capture", E,
         r"shard-00000\.safetensors: checksum does not match .*; the shard is corrupt, redo the stage with "
         r"`draftsmith prepare \S+/run/recipe\.yaml --force`",
         _copy_then(("data",), lambda c: _flip_last_byte(_shard_path(c, "data")))),
    Case("capture_hidden_size_edited", "manifest", "capture/manifest.json hidden_size edited", "train", E,
         r"capture/manifest\.json: hidden_size 7 differs",
         _copy_then(("data", "capture", "vocab"), lambda c: c.edit_manifest("capture", lambda m: m.update(hidden_size=7)))),
    Case("vocab_file_garbage", "manifest", "vocab/vocab.safetensors overwritten with garbage", "train", E,
         r"vocab\.safetensors: checksum does not match",
         _copy_then(("data", "capture", "vocab"), lambda c: (c.run_dir / "vocab" / "vocab.safetensors").write_bytes(b"junk" * 9))),
    # fixes that name whole commands: the run's recipe.yaml, every stage to redo (test_badinput runs them)
    Case("vocab_map_disagrees", "manifest", "vocab/vocab.safetensors whose d2t and t2d disagree (checksum fixed)", "train", E,
         r"vocab\.safetensors: d2t and t2d disagree; rerun `draftsmith vocab \S+/run/recipe\.yaml --force`, "
         r"then `draftsmith train \S+/run/recipe\.yaml --force`$",
         _copy_then(("data", "capture", "vocab"), lambda c: _rewrite_vocab(c, _unmark_t2d))),
    Case("capture_shard_lacks_key", "manifest", "a capture shard without final_hidden (checksum fixed)", "train", E,
         r"shard-\d+\.safetensors: capture shard lacks \['final_hidden'\]; rerun `draftsmith capture \S+/run/recipe\.yaml "
         r"--force`, then `draftsmith train \S+/run/recipe\.yaml --force`$",
         _copy_then(("data", "capture", "vocab"), lambda c: _rewrite_capture(c, lambda t: t.pop("final_hidden")))),
    Case("data_shard_junk", "manifest", "a data shard overwritten with junk (checksum fixed)", "capture", E,
         r"data/shard-00000\.safetensors: unreadable shard .*; redo the stage with `draftsmith prepare \S+/run/recipe\.yaml "
         r"--force`, then rerun the command that stopped here$", _copy_then(("data",), _junk_data_shard)),
    Case("upstream_not_complete", "manifest", "train in a fresh run folder (nothing before it ran)", "train", E,
         r"capture/manifest\.json: stage capture is not complete; run `draftsmith capture \S+/run/recipe\.yaml` first "
         r"\(or `draftsmith run \S+/run/recipe\.yaml`\)$"),
    # -- non-finite hidden states -----------------------------------------------------------------
    Case("nan_from_target_some", "hidden", "the target gives NaN hidden states for some samples", "capture",
         "skip:rejected_nonfinite", setup=_nan_rows_in_target(2)),
    Case("nan_from_target_all", "hidden", "the target gives NaN hidden states for every sample", "capture", E,
         r"capture.* NaN/inf .*every sample", _nan_rows_in_target(1)),
    Case("nan_in_capture_shard", "hidden", "NaN aux states in one sample of each capture shard", "train",
         "skip:skipped_nonfinite",
         setup=_copy_then(("data", "capture", "vocab"), lambda c: _rewrite_capture(c, _poison_first_sample))),
    Case("inf_in_every_capture_shard", "hidden", "inf in every aux state", "train", E,
         r"capture/shard-\d+\.safetensors: 10 training steps in a row had a non-finite loss",
         lambda c: [*_copy_then(("data", "capture", "vocab"), lambda c: _rewrite_capture(c, _poison_all))(c),
                    "--train.max_steps", "12"]),
    # -- drafter checkpoints ---------------------------------------------------------------------
    Case("drafter_missing_key", "drafter", "train/drafter/model.safetensors lacks fc.weight", "export", E,
         r"drafter/model\.safetensors: not a drafter .*missing: fc\.weight", _drafter_state(lambda s: s.pop("fc.weight"))),
    Case("drafter_extra_key", "drafter", "train/drafter/model.safetensors has an extra tensor", "export", E,
         r"drafter/model\.safetensors: not a drafter .*unexpected: extra\.weight",
         _drafter_state(lambda s: s.update({"extra.weight": s["norm.weight"].clone()}))),
    Case("drafter_misshaped_key", "drafter", "train/drafter/model.safetensors with a mis-shaped fc.weight", "export", E,
         r"drafter/model\.safetensors: not a drafter .*wrong shape: fc\.weight", _drafter_state(_misshape)),
    Case("drafter_not_safetensors", "drafter", "train/drafter/model.safetensors is not safetensors", "export", E,
         r"drafter/model\.safetensors: ",
         _copy_then(("data", "capture", "vocab", "train"),
                    lambda c: (c.run_dir / "train" / "drafter" / "model.safetensors").write_bytes(b"\x80\x04pickle?"))),
    Case("drafter_config_bad_json", "drafter", "train/drafter/config.json is not valid JSON", "export", E,
         r"drafter/config\.json: ",
         _copy_then(("data", "capture", "vocab", "train"),
                    lambda c: (c.run_dir / "train" / "drafter" / "config.json").write_text("{"))),
    Case("checkpoint_misshaped", "drafter", "the checkpoint train resumes from has a mis-shaped tensor", "train", E,
         r"step-\d+.*(do not match|differ|cannot load)", _resume_train_with_sums(_misshaped_checkpoint)),
    Case("checkpoint_unreadable", "drafter", "the checkpoint train resumes from is garbage", "train", E,
         r"step-\d+: unreadable checkpoint",
         _resume_train_with_sums(_garbage_checkpoint)),
    # -- more conversation files (issue 21) ----------------------------------------------------------
    Case("jsonl_utf8_bom", "source", "a JSONL file starting with a byte-order mark", "prepare", "ok",
         setup=_made("bom.jsonl", lambda: b"\xef\xbb\xbf" + _good_line())),
    Case("jsonl_crlf", "source", "a JSONL file with Windows (CRLF) line ends", "prepare", "ok",
         setup=_made("crlf.jsonl", lambda: _good_line().replace(b"\n", b"\r\n"))),
    Case("json_crlf_bom", "source", "a ShareGPT array with a BOM and CRLF line ends", "prepare", "ok",
         setup=_made("crlf.json", lambda: b"\xef\xbb\xbf[\r\n" + json.dumps(GOOD_REC).encode() + b",\r\n"
                     + json.dumps(GOOD_REC).encode() + b"\r\n]\r\n")),
    Case("json_trailing_comma", "source", "a ShareGPT array with a trailing comma", "prepare", "ok",
         setup=_made("comma.json", lambda: ("[" + json.dumps(GOOD_REC) + ", " + json.dumps(GOOD_REC) + ",]").encode())),
    Case("json_double_comma", "source", "two commas in a row inside a ShareGPT array", "prepare", "skip:skipped_empty_item",
         setup=_made("commas.json", lambda: ("[" + json.dumps(GOOD_REC) + ",, " + json.dumps(GOOD_REC) + "]").encode())),
    Case("jsonl_deep_nesting", "source", "a 200 kB record of nested brackets", "prepare", "skip:skipped_too_deep",
         setup=_made("deep.jsonl", _deep_record)),
    Case("json_deep_nesting", "source", "a 200 kB item of nested brackets in a ShareGPT array", "prepare",
         "skip:skipped_too_deep", setup=_made("deep.json", lambda: b"[" + json.dumps(GOOD_REC).encode() + b', {"id": "d", '
                                              b'"conversations": ' + b"[" * 100_000 + b"]" * 100_000 + b"}]")),
    Case("jsonl_line_too_large", "source", "a line over the record size limit", "prepare", "skip:skipped_too_large",
         setup=_large_line),
    Case("jsonl_all_lines_broken", "source", "every line invalid JSON or invalid UTF-8", "prepare", E,
         r"all_broken\.jsonl: no sample kept .*invalid_json 2.*not_utf8 1",
         _made("all_broken.jsonl", lambda: b'{"messages": [\n\xff\xfe\n{"messages": \n')),
    Case("gzip_bomb", "source", "a .jsonl.gz that expands over 500x (a decompression bomb)", "prepare", E,
         r"bomb\.jsonl\.gz: expands to more than 500x", _gzip_bomb),
    Case("content_part_text_number", "source", "a content part whose `text` is a number", "prepare", E,
         r"parts\.jsonl:1: message 0: content part 0 has `text` of type int",
         _made("parts.jsonl", lambda: (json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]},
                                                                {"role": "assistant", "content": "x"}]}) + "\n").encode())),
    Case("huge_message_cut_before_tokenizing", "source", "a 4 MB assistant message (max_length 64)", "prepare",
         "skip:truncated", setup=_made("huge.jsonl", lambda: (json.dumps({"messages": [
             {"role": "user", "content": "Tell me a story."}, {"role": "assistant", "content": "once upon a time " * 250_000}]})
             + "\n").encode() + _good_line(1))),
    # -- more recipes: values refused at parse time ------------------------------------------------
    Case("recipe_negative_max_steps", "recipe", "train.max_steps: -5", "train", E,
         r"recipe\.yaml: train\.max_steps -5: must be >= 1", lambda c: [c.recipe(train={"max_steps": -5})]),
    Case("recipe_zero_ttt_steps", "recipe", "train.ttt_steps: 0", "prepare", E, r"recipe\.yaml: train\.ttt_steps 0: must be >= 1",
         lambda c: [c.recipe(train={"ttt_steps": 0})]),
    Case("recipe_million_draft_steps", "recipe", "evaluate.draft_steps: 1000000", "prepare", E,
         r"recipe\.yaml: evaluate\.draft_steps 1000000: must be <= 64", lambda c: [c.recipe(evaluate={"draft_steps": 10**6})]),
    Case("recipe_zero_batch_tokens", "recipe", "capture.batch_tokens: 0", "capture", E,
         r"recipe\.yaml: capture\.batch_tokens 0: must be >= 1", lambda c: [c.recipe(capture={"batch_tokens": 0})]),
    Case("recipe_negative_tree_budget", "recipe", "evaluate.tree_budget: -1", "evaluate", E,
         r"recipe\.yaml: evaluate\.tree_budget -1: must be >= 1", lambda c: [c.recipe(evaluate={"tree_budget": -1})]),
    Case("recipe_zero_max_new_tokens", "recipe", "regenerate.max_new_tokens: 0", "prepare", E,
         r"recipe\.yaml: regenerate\.max_new_tokens 0: must be >= 1", lambda c: [c.recipe(regenerate={"max_new_tokens": 0})]),
    Case("recipe_nan_lr", "recipe", "train.lr: .nan", "prepare", E, r"recipe\.yaml: train\.lr nan: not a finite number",
         lambda c: [c.recipe(train={"lr": float("nan")})]),
    # a bad value names its source: the flag when it came from the command line, the file when it is in the recipe
    Case("recipe_negative_flag", "recipe", "--train.save_every -1 on the command line", "prepare", E,
         r"^error: command line --train\.save_every: train\.save_every -1: must be >= 1; fix the value on the command line$",
         lambda c: [c.recipe(), "--train.save_every", "-1"]),
    Case("recipe_flag_wrong_type", "recipe", "--train.lr abc on the command line (the recipe file is fine)", "prepare", E,
         r"^error: command line --train\.lr: .*train\.lr.*abc; fix the flag", lambda c: [c.recipe(), "--train.lr", "abc"]),
    Case("recipe_flag_bad_method", "recipe", "--evaluate.methods '[foo]' on the command line", "prepare", E,
         r"^error: command line --evaluate\.methods: evaluate\.methods 'foo': not a method; .*\(on the command line\)$",
         lambda c: [c.recipe(), "--evaluate.methods", "[foo]"]),
    Case("recipe_flag_micro_batch", "recipe", "--train.micro_batch_tokens larger than the recipe's train.batch_tokens", "prepare", E,
         r"^error: command line --train\.micro_batch_tokens: train\.micro_batch_tokens 4096 > train\.batch_tokens 128",
         lambda c: [c.recipe(), "--train.micro_batch_tokens", "4096"]),
    Case("recipe_file_value_beside_flags", "recipe", "train.save_every: -1 in the file, other keys given as flags", "prepare", E,
         r"^error: \S*recipe\.yaml: train\.save_every -1: must be >= 1; fix the value in the recipe$",
         lambda c: [c.recipe(train={"save_every": -1}), "--train.lr", "1e-3"]),
    Case("recipe_file_type_beside_flags", "recipe", "train.lr: abc in the file, overridden by --train.lr 1e-3", "prepare", E,
         r"^error: \S*recipe\.yaml: .*train\.lr.*abc; fix the key or value in the recipe",
         lambda c: [c.recipe(train={"lr": "abc"}), "--train.lr", "1e-3"]),
    Case("recipe_file_method_beside_flags", "recipe", "evaluate.methods: [foo] in the file, --evaluate.draft_steps 3 as a flag",
         "prepare", E, r"^error: \S*recipe\.yaml: evaluate\.methods 'foo': not a method; .*\(in the recipe\)$",
         lambda c: [c.recipe(evaluate={"methods": ["foo"]}), "--evaluate.draft_steps", "3"]),
    Case("recipe_yaml_alias_bomb", "recipe", "a recipe whose YAML aliases expand to 9^9 values", "prepare", E,
         r"recipe\.yaml: its aliases expand to more than 100,000 values", _raw_recipe(ALIAS_BOMB)),
    Case("recipe_too_large", "recipe", "a 2 MB recipe file", "prepare", E, r"recipe\.yaml: 2,097,\d+ bytes, too large",
         _raw_recipe("name: big\n" + "#" * (2 << 20) + "\n")),
    Case("recipe_is_a_folder", "recipe", "the recipe path is a folder", "prepare", E, r"folder\.yaml: not a file",
         lambda c: [str((c.tmp / "folder.yaml").mkdir() or c.tmp / "folder.yaml")]),
    Case("recipe_not_utf8", "recipe", "a recipe in Latin-1", "prepare", E, r"recipe\.yaml: not UTF-8 text",
         _raw_recipe(b"name: caf\xe9\n")),
    # -- more run folders ----------------------------------------------------------------------------
    Case("run_dir_is_a_file", "run dir", "run_dir names a file", "prepare", E, r"run: run_dir is a file", _run_dir_is_file),
    Case("stage_dir_symlink", "run dir", "the data/ folder is a symlink", "prepare", E, r"data: the stage folder is a symlink",
         _stage_symlink),
    Case("run_dir_locked", "run dir", "another process holds the run directory's lock", "prepare", E,
         r"run: run directory is locked by pid \d+ \(`draftsmith train other\.yaml`", _locked),
    Case("refused_rerun_keeps_output", "run dir", "a complete prepare rerun with inputs it refuses", "prepare", E,
         r"good\.json: no sample kept", _refused_rerun),
    Case("token_counts_flipped", "manifest", "one byte of data/token_counts.safetensors changed", "vocab", E,
         r"token_counts\.safetensors: checksum does not match .*redo the stage with `draftsmith prepare \S+/run/recipe\.yaml --force`",
         _copy_then(("data",), lambda c: _flip_last_byte(c.run_dir / "data" / "token_counts.safetensors"))),
    Case("capture_shard_flipped_on_resume", "manifest", "a capture shard changed under a half-done train", "train", E,
         r"capture/shard-00000\.safetensors: checksum does not match", _resume_with_flipped_capture),
    Case("capture_resume_shard_missing", "manifest", "a half-done capture whose listed shard was deleted", "capture", "ok",
         setup=_copy_then(("data", "capture"), lambda c: (c.edit_manifest("capture", lambda m: m.update(status="running")),
                                                         _shard_path(c, "capture", 1).unlink()))),
    Case("capture_resume_shard_corrupt", "manifest", "a half-done capture whose listed shard changed", "capture", "ok",
         setup=_copy_then(("data", "capture"), lambda c: (c.edit_manifest("capture", lambda m: m.update(status="running")),
                                                         _flip_last_byte(_shard_path(c, "capture", 0))))),
    # -- more targets --------------------------------------------------------------------------------
    Case("target_config_corrupt_prepare", "target", "target config.json is not valid JSON (prepare)", "prepare", E,
         r"config\.json: not a valid model config", _target_edit(_edit_json("config.json", "{"), ())),
    Case("target_config_corrupt_capture", "target", "target config.json is not valid JSON (capture)", "capture", E,
         r"target.*(config\.json|cannot read the model files)", _target_edit(_edit_json("config.json", "{"))),
    Case("target_config_is_list", "target", "target config.json is a JSON list", "capture", E,
         r"target.*(config\.json|cannot read the model files|cannot load)", _target_edit(_edit_json("config.json", "[]"))),
    Case("target_missing_layer", "target", "the target's weights lack decoder layer 2", "capture", E,
         r"target: the weights lack \d+ tensor\(s\) its config\.json needs \(model\.layers\.2\.", _target_edit(_drop_layer)),
    Case("target_weights_garbage", "target", "the target's model.safetensors is garbage", "capture", E,
         r"target: cannot (read the model files|load the model)",
         _target_edit(lambda t: (t / "model.safetensors").write_bytes(b"\x00" * 64))),
    Case("target_no_weights", "target", "the target folder has no safetensors", "capture", E, r"target: no \*\.safetensors",
         _target_edit(lambda t: (t / "model.safetensors").unlink())),
    # -- more checkpoints ----------------------------------------------------------------------------
    Case("checkpoint_checksum_flipped", "drafter", "one byte of the checkpoint train resumes from changed", "train", E,
         r"step-\d+/state/.*: checksum does not match .*meta\.json", _resume_train_with(_flip_checkpoint)),
    Case("checkpoint_file_missing", "drafter", "a state file of the checkpoint train resumes from deleted", "train", E,
         r"step-\d+/state: holds .*meta\.json lists",
         _resume_train_with(lambda d: sorted((d / "state").glob("*.safetensors"))[0].unlink())),
    Case("latest_points_outside", "drafter", "train/latest names ../../../etc/step-000004", "train", E,
         r"train/latest: names '\.\./\.\./\.\./etc/step-000004', not a step folder", _latest_outside),
    # -- evaluate ------------------------------------------------------------------------------------
    Case("evaluate_benchmark_missing", "evaluate", "evaluate.benchmarks names no file", "evaluate", E,
         r"nope\.jsonl: no such file", _evaluate(lambda c: c.tmp / "nope.jsonl")),
    Case("evaluate_no_prompts", "evaluate", "a benchmark whose records have no prompt", "evaluate", E,
         r"prompts\.jsonl:1: record has no `prompt`", _evaluate(lambda c: _prompts(c, [{"question": "hi"}]))),
    Case("evaluate_prompt_too_long", "evaluate", "a prompt longer than the target's positions", "evaluate",
         "skip:prompts_too_long", setup=_evaluate(lambda c: _prompts(c, [{"prompt": "Count from 1 to 4."},
                                                                          {"prompt": "word " * 3000}]))),
    Case("evaluate_every_prompt_too_long", "evaluate", "every prompt longer than the target's positions", "evaluate", E,
         r"no prompt fits the target's positions", _evaluate(lambda c: _prompts(c, [{"prompt": "word " * 3000}]))),
    Case("evaluate_new_tokens_past_positions", "evaluate", "evaluate.max_new_tokens past the target's positions", "evaluate",
         E, r"evaluate\.max_new_tokens 5000: .*max_position_embeddings",
         _evaluate(lambda c: _prompts(c, [{"prompt": "hi"}]), max_new_tokens=5000)),
    # -- import-drafter (exports) ---------------------------------------------------------------------
    Case("import_ok", "export", "import-drafter of the run's own SGLang export", "import-drafter", "ok", setup=_import(),
         check=_imported_ok),
    Case("import_config_is_list", "export", "import-drafter: config.json is a JSON list", "import-drafter", E,
         r"drafter/config\.json: a JSON list, not an object", _import(lambda d: (d / "config.json").write_text("[]"))),
    Case("import_hidden_size_string", "export", "import-drafter: hidden_size is the string `big`", "import-drafter", E,
         r"drafter/config\.json: a missing or malformed value",
         _import(lambda d: _edit_json("config.json", lambda cfg: cfg.update(hidden_size="big"))(d))),
    Case("import_missing_key", "export", "import-drafter: config.json without hidden_size", "import-drafter", E,
         r"drafter/config\.json: a missing or malformed value \(key 'hidden_size'\)",
         _import(lambda d: _edit_json("config.json", lambda cfg: cfg.pop("hidden_size"))(d))),
    Case("import_weights_garbage", "export", "import-drafter: model.safetensors is garbage", "import-drafter", E,
         r"model\.safetensors: unreadable safetensors", _import(lambda d: (d / "model.safetensors").write_bytes(b"junk" * 4))),
    Case("import_bad_aux_ids", "export", "import-drafter --aux-layer-ids a,b", "import-drafter", E,
         r"--aux-layer-ids 'a,b': not a comma-separated list", lambda c: [*_import()(c), "--aux-layer-ids", "a,b"]),
    Case("import_src_missing", "export", "import-drafter of a folder that does not exist", "import-drafter", E,
         r"nowhere: no such folder", lambda c: [str(c.tmp / "nowhere"), "--target", str(c.target), "--out", str(c.tmp / "o")]),
    # -- bench-serve (URLs, metrics, credentials) ------------------------------------------------------
    Case("bench_url_not_http", "serve", "bench-serve --url ftp://host/v1", "bench-serve", E, r"--url 'ftp://host/v1': not an http",
         _bench(url="ftp://host/v1")),
    Case("bench_url_bad_port", "serve", "bench-serve --url with a port that is not a number", "bench-serve", E,
         r"--url 'http://127\.0\.0\.1:notaport/v1': not an http", _bench(url="http://127.0.0.1:notaport/v1")),
    Case("bench_no_server", "serve", "bench-serve against a port nothing listens on", "bench-serve", E,
         r"http://127\.0\.0\.1:9/v1: cannot list the served models", _bench(url="http://127.0.0.1:9/v1")),
    Case("bench_credentials_in_error", "serve", "a URL with user:password to a dead server", "bench-serve", E,
         r"http://\*\*\*@127\.0\.0\.1:9/v1: cannot list", _bench(url="http://me:pa55word@127.0.0.1:9/v1")),
    Case("bench_api_key_env_unset", "serve", "--api_key_env names an unset variable", "bench-serve", E,
         r"--api_key_env NO_SUCH_KEY_VAR: the environment variable NO_SUCH_KEY_VAR is not set",
         _bench("--api_key_env", "NO_SUCH_KEY_VAR", url="http://127.0.0.1:9/v1")),
    Case("bench_wrong_api_key", "serve", "a server that refuses the API key", "bench-serve", E,
         r"cannot list the served models \(GET /models answered HTTP 401",
         _bench("--api_key_env", "K", stub={"api_key": "right"}, env={"K": "wrong"})),
    Case("bench_concurrency_zero", "serve", "bench-serve --concurrency [0]", "bench-serve", E, r"--concurrency \[0\]: not a list of positive levels; give positive",
         _bench("--concurrency", "[0]", url="http://127.0.0.1:9/v1")),
    Case("bench_metrics_bad_labels", "serve", "/metrics with a non-numeric position label and garbage lines", "bench-serve",
         "ok", setup=_bench(stub={"spec_k": 2, "extra_metrics": 'vllm:spec_decode_num_accepted_tokens_per_pos_total'
                                  '{position="x"} 3\nthis is not prometheus\nvllm:foo{a="b"} notanumber\n'}),
         check=_bench_ok),
    Case("bench_api_key_ok", "serve", "a server that needs the API key given by --api_key_env", "bench-serve", "ok",
         setup=_bench("--api_key_env", "K", stub={"api_key": "right-key"}, env={"K": "right-key"}), check=_bench_ok),
    # -- plan ------------------------------------------------------------------------------------------
    Case("plan_config_size_not_number", "plan", "plan --target a config whose hidden_size is `x`", "plan", E,
         r"cfg\.json: a size in the config is not a number", lambda c: ["--target", str(_write(c, "cfg.json", '{"hidden_size": "x", '
                                                                  '"num_hidden_layers": 2, "vocab_size": 10}'))]),
    Case("plan_config_is_list", "plan", "plan --target a config.json that is a JSON list", "plan", E,
         r"list\.json: a JSON list, not a model config", lambda c: ["--target", str(_write(c, "list.json", "[]"))]),
    Case("plan_config_missing", "plan", "plan --target a file that does not exist", "plan", E, r"nope\.json: file not found",
         lambda c: ["--target", str(c.tmp / "nope.json")]),
    # -- status and doctor ---------------------------------------------------------------------------
    Case("status_no_run_dir", "status", "status of a folder that does not exist", "status", E, r"nope: no such run directory",
         lambda c: [str(c.tmp / "nope")]),
    Case("status_garbage_ledger", "status", "a ledger with torn and garbage lines", "status", "ok",
         setup=_copied_run("data", edit=lambda c: open(c.run_dir / "ledger.jsonl", "ab").write(b'{"torn": \n\xff\xfe garbage\n[1, 2]\n')),
         check=_status_ok),
    Case("status_manifest_garbage", "status", "status with data/manifest.json not JSON (reported, not raised)", "status", "ok",
         setup=_copied_run("data", edit=lambda c: (c.run_dir / "data" / "manifest.json").write_text("{")),
         check=_status_names_broken_manifest),
    Case("doctor_bad_recipe", "status", "doctor with a recipe value it refuses", "doctor", E,
         r"recipe\.yaml: train\.max_steps 0: must be >= 1", lambda c: [c.recipe(train={"max_steps": 0})]),
    # -- full disk ---------------------------------------------------------------------------------
    Case("disk_full_prepare", "disk", "the disk fills up after prepare wrote 3 files", "prepare", E,
         r"data/.*: cannot write \(No space left on device\)", _disk_full(3), then_rerun_ok=True),
    Case("disk_full_capture_preflight", "disk", "less free space than the capture needs", "capture", E,
         r"capture: capture needs .* GiB but only", _small_disk, then_rerun_ok=True),
    Case("disk_full_capture", "disk", "the disk fills up after capture wrote 2 files", "capture", E,
         r"capture/.*: cannot write \(No space left on device\)", _disk_full(2, ("data",)), then_rerun_ok=True),
    Case("disk_full_train_checkpoint", "disk", "the disk fills up while train writes a checkpoint", "train", E,
         r"train/.*: cannot write \(No space left on device\)", _disk_full(2, ("data", "capture", "vocab")),
         then_rerun_ok=True),
    Case("disk_full_export", "disk", "the disk fills up while export writes", "export", E,
         r"export/.*: cannot write \(No space left on device\)", _disk_full(1, ("data", "capture", "vocab", "train")),
         then_rerun_ok=True),
]


# ----------------------------------------------------------------------------- the docs table

BEGIN, END = "<!-- badinput-table:begin -->", "<!-- badinput-table:end -->"


def behaviour(case: Case) -> str:
    if case.expect == "error":
        return "one-line error, exit 2, nothing half-written"
    if case.expect == "truncated":
        return "complete records kept, the cut reported (`truncated_source`)"
    if case.expect.startswith("skip:"):
        return f"skipped and counted (`counts.{case.expect[5:]}`)"
    if case.check is not None:
        doc = (case.check.__doc__ or "").strip().split("\n")[0]
        return f"accepted, exit 0{': ' + doc if doc else ''}"
    return "accepted, exit 0: stage complete, every listed shard present and matching its checksum"


def table() -> str:
    rows = ["| case | group | bad input | command | behaviour |", "|---|---|---|---|---|"]
    for c in CASES:
        note = f" **known gap:** {c.xfail}" if c.xfail else ""
        rerun = "; rerun finishes" if c.then_rerun_ok else ""
        rows.append(f"| `{c.id}` | {c.group} | {c.what} | `{c.command}` | {behaviour(c)}{rerun}{note} |")
    return "\n".join(rows)


def doc_section(doc: str) -> str:
    return doc.split(BEGIN, 1)[1].split(END, 1)[0].strip() if BEGIN in doc and END in doc else ""


if __name__ == "__main__":
    # python tests/badinput/cases.py [--write docs/reliability.md]
    if sys.argv[1:2] == ["--write"]:
        path = Path(sys.argv[2])
        doc = path.read_text()
        head, rest = doc.split(BEGIN, 1)
        path.write_text(f"{head}{BEGIN}\n{table()}\n{END}{rest.split(END, 1)[1]}")
    else:
        print(table())
