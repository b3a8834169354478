"""benchmarks/bench_verify_rows.py --small on the CPU: every part runs (F.linear standing in for the
kernels that need CUDA) and writes the keys the GPU run is read by; candidates that cannot run here
carry their reason instead of numbers."""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_verify_rows  # noqa: E402

from draftsmith.speculate import skinny  # noqa: E402


def test_bench_verify_rows_small(tmp_path, monkeypatch):
    monkeypatch.setattr(skinny, "INTERPRET", False)  # the CPU as CI sees it: skinny is F.linear, its setting an error
    out = tmp_path / "v.json"
    assert bench_verify_rows.main(["--small", "--out", str(out), "--reps", "1", "--forward_reps", "1",
                                   "--passes", "1"]) == 0
    d = json.loads(out.read_text())
    rows = [str(r) for r in bench_verify_rows.ROWS]
    assert set(d["linears"]) == set(bench_verify_rows.linear_shapes(d["dims"]))
    for row in d["linears"].values():
        c = row["candidates"]
        assert list(c["cublas"]["ms"]) == rows and c["cublas"]["ratio_to_own_1"]["1"] == 1.0
        assert list(c["skinny"]["ms"]) == rows and c["skinny"]["kernel"] is False
        assert "needs CUDA" in c["cublaslt"]["error"] and "needs CUDA" in c["compile"]["error"]
    assert set(d["linear_forward_ms"]) == {"cublas", "skinny"}
    assert all(r["skinny"]["rows_equal_1row"]["1"] for r in d["correctness"].values())
    # cublas_flash: decode_attention finds no kernel on a CPU and runs fold_mm / SDPA, as cublas
    assert list(d["forward_ms"]) == ["cublas", "cublas_flash"] and list(d["forward_ms"]["cublas"]) == rows
    assert "evaluate.verify_gemm skinny" in d["forward_errors"]["skinny"]
    assert "evaluate.verify_gemm skinny" in d["forward_errors"]["skinny_flash"]
    assert d["verify_rows16_cost_ratio"] == d["verify_rows_cost_ratio"]["16"] > 0
    assert d["plain_ms_per_step"]["cublas"] > 0 and "equal" in d["row0_equal_1row"]["cublas"]
    assert d["skipped"] == [] and d["capture_fallbacks"] == []
