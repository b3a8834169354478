"""Shard write throughput: `write_shard` (pack, fp8 encoding, safetensors serialisation, the
canonical header, fsync, sha256) on synthetic capture shards, per storage dtype, median of repeats.

    python benchmarks/bench_write.py --tokens 16384 --hidden 768 --repeats 5 --out write.json
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from draftsmith.fileio import atomic_write_json# noqa: E402
from draftsmith.data.shards import Sample, write_shard  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=16384, help="tokens per shard")
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--aux", type=int, default=3)
    ap.add_argument("--sample_len", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    g = torch.Generator().manual_seed(0)
    n = a.tokens // a.sample_len
    base = [(torch.randint(0, 32000, (a.sample_len,), generator=g), torch.randn(a.sample_len, a.aux * a.hidden, generator=g),
             torch.randn(a.sample_len, a.hidden, generator=g)) for _ in range(n)]
    result = {"tokens": n * a.sample_len, "hidden": a.hidden, "aux": a.aux, "repeats": a.repeats, "torch": torch.__version__}
    with tempfile.TemporaryDirectory(dir=a.dir) as d:
        for sd, hold in (("bfloat16", torch.bfloat16), ("float8_e4m3", torch.float32)):
            samples = [Sample(i, torch.ones(len(i), dtype=torch.bool), j, x.to(hold), f.to(hold))
                       for j, (i, x, f) in enumerate(base)]
            times = []
            for r in range(a.repeats):
                t0 = time.perf_counter()
                write_shard(Path(d) / f"shard-{r}.safetensors", samples, {"stage": "capture"}, sd)
                times.append(time.perf_counter() - t0)
            size = (Path(d) / "shard-0.safetensors").stat().st_size
            med = sorted(times)[len(times) // 2]
            result[sd] = {"bytes": size, "median_s": round(med, 4), "mb_per_s": round(size / med / 1e6, 1),
                          "tokens_per_s": round(n * a.sample_len / med)}
            print(f"[bench_write] {sd}: {size / 1e6:.0f} MB in {med:.3f} s = {size / med / 1e6:.0f} MB/s, "
                  f"{n * a.sample_len / med:,.0f} tokens/s", flush=True)
    if a.out:
        atomic_write_json(a.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
