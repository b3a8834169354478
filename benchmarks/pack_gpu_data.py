"""Pack what the GPU benchmark needs into build/gpu (the GPU machine has no network and a 64 MiB upload):
the first 12M training tokens of build/corpus (gzipped safetensors; from `reference_target.py corpus`), its tokenizer,
ShareGPT records 12,000 to the end of the truncated file (17,671 records; gzipped JSONL: never seen by
either reference target), MT-Bench questions and HumanEval.

    python benchmarks/pack_gpu_data.py
"""
import gzip
import json
import shutil
import sys
from pathlib import Path

from safetensors.torch import load_file, save

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from draftsmith.data.readers import ReadStats, iter_records, resolve_source  # noqa: E402

src, out = Path("build/corpus"), Path("build/gpu")
out.mkdir(parents=True, exist_ok=True)
d = load_file(str(src / "tokens.safetensors"))
with gzip.open(out / "tokens.safetensors.gz", "wb", compresslevel=1) as f:  # 10.6 MB, not 24: a device call carries 64 MiB
    f.write(save({"train": d["train"][:12_000_000].clone(), "val": d["val"]}))
meta = json.loads((src / "corpus.json").read_text())
meta.update(train_tokens=12_000_000, note="first 12M train tokens of build/corpus")
(out / "corpus.json").write_text(json.dumps(meta, indent=2))
shutil.copytree(src / "tokenizer", out / "tokenizer", dirs_exist_ok=True)
path, fmt = resolve_source("sharegpt")
n = 0
with gzip.open(out / "sharegpt_12000_end.jsonl.gz", "wt") as f:
    for index, _, rec in iter_records(path, fmt, ReadStats(), start=12000):
        f.write(json.dumps(rec) + "\n")
        n += 1
shutil.copy(resolve_source("mtbench")[0], out / "mtbench_question.jsonl")
shutil.copy(resolve_source("humaneval")[0], out / "HumanEval.jsonl.gz")
print(f"packed {out}: ShareGPT records 12,000..{12000 + n - 1}")
