"""benchmarks/bench_verify_attention.py on a CPU (--smoke): every variant it would time on the GPU
computes the same attention as the math kernel, so its timings compare like with like."""
import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_smoke_variants_agree(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_verify_attention", ROOT / "benchmarks" / "bench_verify_attention.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "b.json"
    assert mod.main(["--smoke", "--rows", "1", "4", "--cols", "40", "--out", str(out)]) == 0
    res = json.loads(out.read_text())["variants"]
    assert {"hf", "gqa", "hf_math", "draftsmith"} <= set(res)
    for name in ("hf", "gqa", "hf_math", "fold_mm", "draftsmith"):  # run on every machine; the fused kernels may refuse a CPU
        for key in ("N1_S40", "N4_S40"):
            r = res[name][key]
            assert r["us"] > 0 and r["max_abs_err"] < 1e-5, (name, key, r)
    assert res["gqa"]["N4_S40"]["over_one_row"] > 0
    assert json.loads(out.read_text())["draftsmith_kernel"] == {"N1": "sdpa", "N4": "fold_mm"}  # both branches ran
