"""Capture at scale: fp8 storage, resume after kill -9 at random moments (byte-identical shards),
data parallel over 2 CPU ranks under torchrun (one merged manifest, same shards)."""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file

from draftsmith.manifests import load_manifest
from draftsmith.messages import DraftsmithError
from draftsmith.cli import main, parse_recipe
from draftsmith.data.shards import decode_fp8, decode_hidden, encode_fp8, read_hidden_rows, read_shard, round_to_storage
from draftsmith.pipeline import run_stage
from draftsmith.data.shards import bytes_per_token
from draftsmith.testing import make_model_dir

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> tuple[Path, Path]:
    """(recipe.yaml, run dir with a complete prepare stage: 16 shards of 4 samples)."""
    tmp = tmp_path_factory.mktemp("cap")
    target = make_model_dir(tmp / "target", num_layers=4, hidden_size=64)
    convs = [[{"from": "human", "value": f"Count from {i} to {i + 3 + i % 7}."},
              {"from": "gpt", "value": " ".join(str(j) for j in range(i, i + 4 + i % 7)) + ". Done!"}] for i in range(64)]
    (tmp / "convs.json").write_text(json.dumps([{"id": str(i), "conversations": c} for i, c in enumerate(convs)]))
    recipe = {"run_dir": str(tmp / "run"), "target": {"path": str(target), "device": "cpu", "dtype": "float32"},
              "prepare": {"source": str(tmp / "convs.json"), "max_length": 64, "samples_per_shard": 4},
              "capture": {"batch_tokens": 96, "storage_dtype": "float8_e4m3"}}
    path = tmp / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    run_stage("prepare", parse_recipe([str(path)])[0])
    return path, tmp / "run"


def _copy_prepared(prepared, dest: Path) -> list[str]:
    recipe, run_dir = prepared
    shutil.copytree(run_dir / "data", dest / "data")
    return [str(recipe), "--run_dir", str(dest)]


def _shards(run_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((run_dir / "capture").glob("shard-*.safetensors"))}


@pytest.fixture(scope="module")
def reference(prepared, tmp_path_factory) -> Path:
    """An uninterrupted fp8 capture (in this process)."""
    dest = tmp_path_factory.mktemp("ref")
    assert main(["capture", *_copy_prepared(prepared, dest)]) == 0
    return dest


def test_fp8_roundtrip():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3 * 32, generator=g) * torch.tensor([0.1, 5.0, 300.0]).repeat_interleave(32)
    values, scale = encode_fp8(x, groups=3)
    assert values.dtype == torch.float8_e4m3fn and scale.shape == (50, 3) and scale.dtype == torch.float32
    y = decode_fp8(values, scale)
    # e4m3 has 3 mantissa bits: relative error <= 2^-4 of each layer's own max
    err = (y - x).abs().reshape(50, 3, 32).amax(-1) / x.abs().reshape(50, 3, 32).amax(-1)
    assert float(err.max()) <= 2 ** -4
    assert torch.equal(round_to_storage(x, "float8_e4m3", 3), y)
    assert round_to_storage(x, "bfloat16").dtype == torch.bfloat16
    assert torch.equal(decode_fp8(*encode_fp8(torch.zeros(2, 8), 1)), torch.zeros(2, 8))


def test_bytes_per_token():
    assert bytes_per_token(3, 7168, "bfloat16") == 4 * 7168 * 2 + 5
    assert bytes_per_token(3, 7168, "float8_e4m3") == 4 * 7168 + 4 * 4 + 5


def test_fp8_capture_reads_back(prepared, reference, tmp_path):
    m = load_manifest(reference / "capture")
    assert m["status"] == "complete" and m["storage_dtype"] == "float8_e4m3"
    assert len(m["shards"]) == 16 and m["counts"]["samples"] == 64
    assert m["bytes_per_token"] == bytes_per_token(3, 64, "float8_e4m3")
    assert not list((reference / "capture").glob(".rank-*"))
    # same run in float32: the fp8 shards decode to it within fp8 precision
    assert main(["capture", *_copy_prepared(prepared, tmp_path), "--capture.storage_dtype", "float32"]) == 0
    shard = "shard-00003.safetensors"
    exact = read_shard(tmp_path / "capture" / shard)
    fp8 = read_shard(reference / "capture" / shard)
    raw = load_file(str(reference / "capture" / shard))
    assert raw["aux_hidden"].dtype == torch.float8_e4m3fn and raw["aux_hidden_scale"].shape == (raw["input_ids"].shape[0], 3)
    assert raw["final_hidden_scale"].shape == (raw["input_ids"].shape[0], 1)
    for a, b in zip(exact, fp8):
        assert b.aux_hidden.dtype == torch.float32
        for got, want in ((b.aux_hidden, a.aux_hidden), (b.final_hidden, a.final_hidden)):
            assert float((got - want).abs().max()) <= 2 ** -4 * float(want.abs().max())
    # row reads from a memory-mapped handle decode the same values
    with safe_open(str(reference / "capture" / shard), framework="pt") as h:
        rows = read_hidden_rows(h, "aux_hidden", 3, 9)
    assert torch.equal(rows, decode_hidden(raw, "aux_hidden")[3:9])


def test_disk_refusal(prepared, tmp_path, monkeypatch):
    import shutil as sh

    from draftsmith.target import capture

    args = _copy_prepared(prepared, tmp_path)
    monkeypatch.setattr(capture.shutil, "disk_usage", lambda p: sh._ntuple_diskusage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(DraftsmithError, match="capture needs .* GiB but only"):
        run_stage("capture", parse_recipe(args)[0])


def _kill_at_random(cmd: list[str], cap_dir: Path, rng: random.Random, timeout: float = 120) -> bool:
    """Start cmd, wait until it has written a shard, kill -9 it a random moment later.
    Returns False when it finished before the kill."""
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    before = len(list(cap_dir.glob("shard-*"))) if cap_dir.exists() else 0
    t0 = time.time()
    try:
        while time.time() - t0 < timeout:
            if proc.poll() is not None:
                return False
            if cap_dir.exists() and len(list(cap_dir.glob("shard-*"))) > before:
                time.sleep(rng.uniform(0, 0.15))
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return True
            time.sleep(0.01)
        raise AssertionError("capture wrote no shard in time")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_kill9_resume_byte_identical(prepared, reference, tmp_path):
    args = _copy_prepared(prepared, tmp_path)
    cmd = [sys.executable, "-m", "draftsmith.cli", "capture", *args]
    rng = random.Random(1234)
    kills = 0
    for _ in range(2):
        kills += _kill_at_random(cmd, tmp_path / "capture", rng)
        m = load_manifest(tmp_path / "capture")
        if m is not None and m["status"] == "complete":
            break
        listed = [s["file"] for s in m["shards"]] if m else []
        assert listed == sorted(listed) and len(set(listed)) == len(listed)
    assert kills >= 1
    assert main(["capture", *args]) == 0
    m, ref = load_manifest(tmp_path / "capture"), load_manifest(reference / "capture")
    assert m["shards"] == ref["shards"] and m["counts"] == ref["counts"]
    assert _shards(tmp_path) == _shards(reference)  # byte-identical, none missing, none extra
    assert not list((tmp_path / "capture").glob(".*"))  # no temp or rank files left


def test_kill_while_finishing_leaves_a_tidy_resumable_folder(prepared, reference, tmp_path, monkeypatch):
    """The window CI once hit at random: killed after the last shard, before the manifest says complete."""
    from draftsmith.target import capture

    class Killed(BaseException):
        pass

    def killed(*a, **k):
        raise Killed

    args = _copy_prepared(prepared, tmp_path)
    monkeypatch.setattr(capture, "finish_manifest", killed)
    with pytest.raises(Killed):
        run_stage("capture", parse_recipe(args)[0])
    m = load_manifest(tmp_path / "capture")
    assert m["status"] == "running" and m["shards"] == load_manifest(reference / "capture")["shards"]
    assert not list((tmp_path / "capture").glob(".*"))
    monkeypatch.undo()
    assert main(["capture", *args]) == 0
    assert load_manifest(tmp_path / "capture")["status"] == "complete"
    assert _shards(tmp_path) == _shards(reference)
    assert not list((tmp_path / "capture").glob(".*"))


def test_data_parallel_two_ranks(prepared, reference, tmp_path):
    args = _copy_prepared(prepared, tmp_path)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "draftsmith.cli", "capture", *args]
    out = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    m, ref = load_manifest(tmp_path / "capture"), load_manifest(reference / "capture")
    assert m["status"] == "complete" and m["world_size"] == 2
    assert m["shards"] == ref["shards"] and m["counts"] == ref["counts"]
    assert _shards(tmp_path) == _shards(reference)


def test_nonfinite_states_reject_only_their_sample_and_padding_is_ignored(tmp_path):
    """capture_samples checks NaN/inf over each sample's own tokens: a NaN in a padded column
    (beyond a short sample's end) rejects nothing; one in a sample's tokens rejects that sample."""
    from draftsmith.data.shards import Sample
    from draftsmith.target.online import capture_samples
    from draftsmith.target.model import TargetOutput, load_target

    target = load_target(make_model_dir(tmp_path / "m", num_layers=2), device="cpu", dtype="float32")
    forward = target.forward

    def poisoned(ids, **kw):
        out = forward(ids, **kw)
        aux = out.aux_hidden.clone()
        short, third = int((ids[:, -1] == 0).nonzero()[0]), int((ids[:, 0] == 3).nonzero()[0])  # rows are length-sorted
        aux[short, -1, 0] = float("nan")  # sample 1 is short: its last column is padding
        aux[third, 3, 5] = float("inf")   # sample 2's own token
        return TargetOutput(None, aux, out.final_hidden)

    target.forward = poisoned
    lengths = [12, 5, 12]
    samples = [Sample(torch.arange(1 + i, n + 1 + i), torch.ones(n, dtype=torch.bool), i) for i, n in enumerate(lengths)]
    good, rejected = capture_samples(target, samples, batch_tokens=10_000, storage_dtype="bfloat16")
    assert rejected == 1 and [s.sample_index for s in good] == [0, 1]
    assert [s.aux_hidden.shape[0] for s in good] == [12, 5]
    assert all(torch.isfinite(s.aux_hidden).all() for s in good)


def test_bench_capture_smoke(tmp_path):
    """benchmarks/bench_capture.py --smoke: interleaved repeats give a median ratio inside its own
    range, and fp8 shards take fewer bytes per token than bf16 ones (measured from written files)."""
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "capture.json"
    subprocess.run([sys.executable, str(root / "benchmarks/bench_capture.py"), "--smoke", "--out", str(out)],
                   env=ENV, check=True, capture_output=True, timeout=300)
    r = json.loads(out.read_text())
    assert r["repeats"] == 3
    for key in ("capture_over_forward", "capture_over_forward_fp8"):
        lo, hi = r[key + "_range"]
        assert 0 < lo <= r[key] <= hi
    assert r["bytes_per_token_fp8"] < r["bytes_per_token_bf16"]


def test_bench_write_smoke(tmp_path):
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "write.json"
    subprocess.run([sys.executable, str(root / "benchmarks/bench_write.py"), "--tokens", "256", "--hidden", "64",
                    "--sample_len", "64", "--repeats", "1", "--dir", str(tmp_path), "--out", str(out)],
                   check=True, capture_output=True, timeout=300)
    res = json.loads(out.read_text())
    # bf16: 256 tokens x (3 + 1) x 64 x 2 bytes of states; fp8 about half (plus its scales)
    assert res["bfloat16"]["bytes"] > 256 * 4 * 64 * 2 > res["float8_e4m3"]["bytes"] > 256 * 4 * 64
    assert res["bfloat16"]["mb_per_s"] > 0 and not list(tmp_path.glob("*.safetensors"))


def _flip_a_byte(path: Path, keep_mtime: bool) -> None:
    """Corrupt the shard's last byte in place, the size unchanged (and its mtime_ns too if asked)."""
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_resume_of_a_complete_capture_trusts_unchanged_shards_and_train_still_catches_corruption(prepared, reference,
                                                                                                 tmp_path, capsys):
    """Resuming a capture whose every shard is listed does not read them again: a shard whose size and
    mtime_ns are those stamped when its checksum was computed is trusted (milliseconds, where hashing
    terabytes took hours), one whose mtime changed is hashed and captured again; the reader that loads
    the shards (train) hashes every one, so a same-size, same-mtime corruption is caught before it is used."""
    args = _copy_prepared(prepared, tmp_path)
    assert main(["capture", *args]) == 0
    m = load_manifest(tmp_path / "capture")
    names = [s["file"] for s in m["shards"]]
    m["status"] = "running"  # as a kill -9 right before the manifest said complete leaves it
    (tmp_path / "capture" / "manifest.json").write_text(json.dumps(m))
    _flip_a_byte(tmp_path / "capture" / names[0], keep_mtime=True)
    _flip_a_byte(tmp_path / "capture" / names[1], keep_mtime=False)
    capsys.readouterr()
    assert main(["capture", *args]) == 0
    assert "1 listed shard(s) missing or not matching their checksum (" + names[1] in capsys.readouterr().err
    shards, ref = _shards(tmp_path), _shards(reference)
    assert shards[names[1]] == ref[names[1]] and shards[names[0]] != ref[names[0]]  # trusted by its stamp
    assert load_manifest(tmp_path / "capture")["status"] == "complete"
    assert main(["vocab", *args, "--vocab.draft_vocab_size", "32"]) == 0
    assert main(["train", *args, "--train.max_steps", "1", "--train.ttt_steps", "1", "--train.heldout_samples", "0"]) == 2
    err = capsys.readouterr().err
    assert f"{names[0]}: checksum does not match" in err and "Traceback" not in err


def test_a_refused_capture_rerun_leaves_the_complete_capture_done(prepared, reference, tmp_path, monkeypatch):
    """A rerun for a changed config that capture refuses (not enough disk) after clearing its folder,
    before writing anything, changes no stage's state: `status` still shows capture done (the
    refusal beside it), its manifest and shards the ones it had, recipe.yaml unchanged."""
    import shutil as sh

    from draftsmith import status
    from draftsmith.rundir import Ledger
    from draftsmith.target import capture

    args = _copy_prepared(prepared, tmp_path)
    assert main(["capture", *args]) == 0
    before = {p.name: p.read_bytes() for p in [*(tmp_path / "capture").iterdir(), tmp_path / "recipe.yaml"]}
    monkeypatch.setattr(capture.shutil, "disk_usage", lambda p: sh._ntuple_diskusage(10**9, 10**9 - 1000, 1000))
    assert main(["capture", *args, "--capture.storage_dtype", "bfloat16"]) == 2
    state = status.stage_state(tmp_path, "capture", Ledger(tmp_path).read())
    assert state["state"] == "done" and "capture needs" in state["refused"]
    assert Ledger(tmp_path).read()[-1]["event"] == "stage_refused"
    assert {p.name: p.read_bytes() for p in [*(tmp_path / "capture").iterdir(), tmp_path / "recipe.yaml"]} == before
