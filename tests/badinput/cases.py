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

    @property
    def run_dir(self) -> Path:
        return self.tmp / "run"

    def recipe(self, source: Optional[Path] = None, target: Optional[Path] = None, raw: Optional[str] = None,
               **sections: dict) -> str:
        """Write recipe.yaml (the base recipe with `sections` merged in, or `raw` text); returns its path."""
        r = base_recipe(self.run_dir, target or self.target, source or SOURCES / "good.json")
        for k, v in sections.items():
            r[k] = {**r[k], **v} if isinstance(v, dict) else v
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

    from draftsmith.artifacts import atomic_save_safetensors

    m = json.loads((c.run_dir / "capture" / "manifest.json").read_text())
    for entry in m["shards"]:
        p = c.run_dir / "capture" / entry["file"]
        t = load_file(str(p))
        poison(t)
        entry["sha256"] = atomic_save_safetensors(p, t)
    (c.run_dir / "capture" / "manifest.json").write_text(json.dumps(m))


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


# ----------------------------------------------------------------------------- the corpus

E = "error"
CASES: list[Case] = [
    # -- conversation files (prepare) ---------------------------------------------------------
    Case("json_truncated_mid_record", "source", "ShareGPT array cut off inside a record", "prepare", "truncated",
         setup=src("json_truncated_mid_record.json")),
    Case("json_malformed_mid_array", "source", "a broken record in the middle of a ShareGPT array", "prepare", E,
         r"json_malformed_mid_array\.json: record 2 .*invalid JSON", src("json_malformed_mid_array.json")),
    Case("json_top_level_object", "source", "a JSON object instead of an array", "prepare", E,
         r"json_top_level_object\.json: not a JSON array", src("json_top_level_object.json")),
    Case("json_empty_file", "source", "an empty .json file", "prepare", E, r"json_empty_file\.json: not a JSON array",
         src("json_empty_file.json")),
    Case("json_empty_array", "source", "an empty array `[]`", "prepare", E, r"json_empty_array\.json: no sample kept",
         src("json_empty_array.json")),
    Case("json_non_utf8", "source", "Latin-1 bytes inside a ShareGPT array", "prepare", E,
         r"json_non_utf8\.json: record 2 .*re-encode the file as UTF-8", src("json_non_utf8.json")),
    Case("json_item_not_object", "source", "an array item that is a string", "prepare", E,
         r"json_item_not_object\.json: record 1: expected a JSON object", src("json_item_not_object.json")),
    Case("json_utf8_bom", "source", "a ShareGPT file starting with a UTF-8 byte-order mark", "prepare", "ok",
         setup=src("json_utf8_bom.json")),
    Case("jsonl_malformed_line", "source", "a JSONL line that is not valid JSON", "prepare", E,
         r"jsonl_malformed_line\.jsonl:2: invalid JSON", src("jsonl_malformed_line.jsonl")),
    Case("jsonl_truncated_last_line", "source", "a JSONL file whose last line is cut off", "prepare", "truncated",
         setup=src("jsonl_truncated_last_line.jsonl")),
    Case("jsonl_non_utf8_line", "source", "a JSONL line with invalid UTF-8 bytes", "prepare", E,
         r"jsonl_non_utf8_line\.jsonl:2: not valid UTF-8", src("jsonl_non_utf8_line.jsonl")),
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
         r"unknown_role_fail\.json: record 2: role 'gpt4' .*prepare.role_map",
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
         r"data/manifest\.json: shard entry 0 .*delete",
         _copy_then(("data",), lambda c: c.edit_manifest("data", lambda m: m["shards"][0].pop("file")))),
    Case("manifest_shards_not_list", "manifest", "`shards` edited to a string", "capture", E,
         r"data/manifest\.json: .*shards",
         _copy_then(("data",), lambda c: c.edit_manifest("data", lambda m: m.update(shards="shard-00000.safetensors")))),
    Case("shard_missing", "manifest", "a listed data shard deleted", "capture", E,
         r"data/manifest\.json: shard shard-00001\.safetensors is listed but missing",
         _copy_then(("data",), lambda c: _shard_path(c, "data", 1).unlink())),
    Case("shard_checksum_mismatch", "manifest", "one byte of a data shard changed", "capture", E,
         r"shard-00000\.safetensors: checksum does not match",
         _copy_then(("data",), lambda c: _flip_last_byte(_shard_path(c, "data")))),
    Case("capture_hidden_size_edited", "manifest", "capture/manifest.json hidden_size edited", "train", E,
         r"capture/manifest\.json: hidden_size 7 differs",
         _copy_then(("data", "capture", "vocab"), lambda c: c.edit_manifest("capture", lambda m: m.update(hidden_size=7)))),
    Case("vocab_file_garbage", "manifest", "vocab/vocab.safetensors overwritten with garbage", "train", E,
         r"vocab\.safetensors: unreadable",
         _copy_then(("data", "capture", "vocab"), lambda c: (c.run_dir / "vocab" / "vocab.safetensors").write_bytes(b"junk" * 9))),
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
         r"step-\d+.*(do not match|differ|cannot load)", _resume_train_with(_misshaped_checkpoint)),
    Case("checkpoint_unreadable", "drafter", "the checkpoint train resumes from is garbage", "train", E,
         r"step-\d+: unreadable checkpoint",
         _resume_train_with(_garbage_checkpoint)),
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
    return "accepted"


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
