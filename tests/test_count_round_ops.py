"""benchmarks/count_round_ops.py on a small target: the kernel counts behind docs/fast-paths.md.
A drafter step on the static path looks its rotation up (no cos/sin) and runs each of its four norms
as torch's one rms_norm kernel; a plain step runs the target's norms the same way; a resident round
costs more kernels than a plain step and its phases add up."""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import count_round_ops  # noqa: E402

from draftsmith.speculate.eagle3 import FastDraft  # noqa: E402
from draftsmith.speculate.fast import FastTarget  # noqa: E402
from draftsmith.target.model import load_target  # noqa: E402
from draftsmith.testing import make_model_dir  # noqa: E402
from test_engine import make_drafter  # noqa: E402


def test_step_counts_name_the_fused_kernels():
    target = load_target(make_model_dir(tempfile.mkdtemp(), arch="llama", num_layers=2), device="cpu", dtype="float32")
    ft, fd = FastTarget(target, "static"), FastDraft(make_drafter(target, draft_vocab=50, seed=1), graphs=False)
    c = count_round_ops.step_counts(ft, fd, [list(range(1, 20))], top=100)
    draft = dict(c["draft_step"]["top"])
    assert draft["aten::_fused_rms_norm"] == 4 and draft["aten::mm"] == 8  # 3 norms of the layer + the head's
    assert not {"aten::cos", "aten::sin", "aten::pow", "aten::rsqrt"} & set(draft)
    assert c["draft_step"]["kernels"] == sum(draft.values())
    plain = dict(c["plain_step"]["top_33_tokens"])
    assert plain["aten::_fused_rms_norm"] == 33 * (2 * 2 + 1)  # two per layer and the final norm, every step
    assert "aten::pow" not in plain and 0 < c["plain_step"]["kernels"] < sum(plain.values())


def test_round_counts_add_up():
    out = Path(tempfile.mkdtemp()) / "counts.json"
    assert count_round_ops.main(["--arch", "llama", "--layers", "2", "--max_new_tokens", "12", "--methods", "chain",
                                 "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    ph = d["methods"]["chain"]["phases"]
    assert d["methods"]["chain"]["rounds"] > 0
    assert abs(ph["round"]["kernels"] - sum(ph[p]["kernels"] for p in count_round_ops.PHASES)) < 1e-6
    assert ph["round"]["kernels"] > d["plain_step"]["kernels"] > 0
