"""benchmarks/reference_target.py reads the corpus's token ids plain or gzipped (pack_gpu_data.py ships
them gzipped so that a device call's 64 MiB holds the repository, the wheels and build/gpu)."""
from __future__ import annotations

import gzip
import sys
from pathlib import Path

import torch
from safetensors.torch import save, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import reference_target  # noqa: E402


def test_tokens_load_the_same_plain_or_gzipped(tmp_path):
    tokens = {"train": torch.randint(0, 4096, (1000,), dtype=torch.int16), "val": torch.arange(7, dtype=torch.int16)}
    with gzip.open(tmp_path / "tokens.safetensors.gz", "wb") as f:
        f.write(save(tokens))
    got = reference_target.load_tokens(tmp_path)
    assert sorted(got) == ["train", "val"] and all(torch.equal(got[k], tokens[k]) for k in tokens)
    save_file({"train": tokens["train"][:10], "val": tokens["val"]}, str(tmp_path / "tokens.safetensors"))
    assert reference_target.load_tokens(tmp_path)["train"].numel() == 10  # the plain file, where both are
