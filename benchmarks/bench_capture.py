"""Capture cost vs a plain forward, and bytes per token of bf16 and fp8 capture shards.

    python benchmarks/bench_capture.py --target /path/to/hf-model --out benchmarks/results/capture.json
    python benchmarks/bench_capture.py --smoke            # tiny random llama on CPU, seconds

capture_over_forward = capture tokens/s / plain forward tokens/s, on the same target, batch and
dtype. Capture = what the capture stage does per batch (decoder forward with the aux-layer hooks,
copy to host in the storage dtype, fp8 encode for fp8); plain forward = the decoder forward alone
(no hooks, no lm_head, nothing copied). Goal: >= 0.90. bytes_per_token_* are measured from shards
actually written (file size / tokens), not computed. The forward and the two captures are timed
interleaved, --repeats times; the figures are medians, *_range the lowest and highest ratio.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from draftsmith.fileio import atomic_write_text
from draftsmith.data.shards import Sample, write_shard
from draftsmith.target.online import capture_samples
from draftsmith.target.model import load_target


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device: torch.device, iters: int) -> float:
    fn()  # warm-up
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)
    return (time.perf_counter() - t0) / iters


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", help="local Hugging Face model folder")
    ap.add_argument("--smoke", action="store_true", help="tiny random llama on CPU")
    ap.add_argument("--batch", type=int, default=8, help="sequences per batch")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=10, help="timed calls per measurement")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved forward / capture measurements; medians reported")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device-map", default=None, help="e.g. auto: spread the target over the visible GPUs")
    ap.add_argument("--out", help="write the JSON here as well as to stdout")
    args = ap.parse_args(argv)

    tmp = tempfile.TemporaryDirectory()
    if args.smoke:
        from draftsmith.testing import make_model_dir

        path = make_model_dir(Path(tmp.name) / "tiny", num_layers=4, hidden_size=64)
        args.batch, args.seq_len, args.iters, args.repeats, args.device, args.dtype = 2, 64, 3, 3, "cpu", "float32"
    elif args.target:
        path = Path(args.target)
    else:
        ap.error("give --target or --smoke")
    target = load_target(path, args.device, args.dtype, with_tokenizer=False, device_map=args.device_map)
    dev = target.device
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.vocab_size, (args.batch, args.seq_len), generator=g)
    samples = [Sample(row.clone(), torch.ones(args.seq_len, dtype=torch.bool), j) for j, row in enumerate(ids)]
    batch_tokens = args.batch * args.seq_len  # one forward batch, as the stage would form it
    ids_dev, mask_dev = ids.to(dev), torch.ones_like(ids).to(dev)

    @torch.inference_mode()
    def plain():  # the decoder alone: aux-layer hooks detached for the call
        saved = [dict(layer._forward_hooks) for layer in target.layers]
        for layer in target.layers:
            layer._forward_hooks.clear()
        try:
            target.decoder(input_ids=ids_dev, attention_mask=mask_dev, use_cache=False)
        finally:
            for layer, h in zip(target.layers, saved):
                layer._forward_hooks.update(h)

    def capture_fn(storage: str):
        def capture():
            return capture_samples(target, samples, batch_tokens, storage)[0]
        return capture

    storages = ("bfloat16", "float8_e4m3")
    # Interleaved repeats: forward, bf16 capture, fp8 capture, again; each ratio compares timings
    # taken side by side, and the spread over repeats shows how steady the machine was.
    reps = [{"forward": _time(plain, dev, args.iters), **{s: _time(capture_fn(s), dev, args.iters) for s in storages}}
            for _ in range(args.repeats)]
    med = {k: statistics.median(r[k] for r in reps) for k in reps[0]}
    ratios = {s: [r["forward"] / r[s] for r in reps] for s in storages}
    bytes_per_token = {}
    for storage in storages:
        entry = write_shard(Path(tmp.name) / f"{storage}.safetensors", capture_fn(storage)(), storage_dtype=storage)
        bytes_per_token[storage] = (Path(tmp.name) / f"{storage}.safetensors").stat().st_size / entry["num_tokens"]
    tokens = args.batch * args.seq_len
    out = {
        "capture_over_forward": round(statistics.median(ratios["bfloat16"]), 4),
        "capture_over_forward_fp8": round(statistics.median(ratios["float8_e4m3"]), 4),
        "capture_over_forward_range": [round(min(ratios["bfloat16"]), 4), round(max(ratios["bfloat16"]), 4)],
        "capture_over_forward_fp8_range": [round(min(ratios["float8_e4m3"]), 4), round(max(ratios["float8_e4m3"]), 4)],
        "bytes_per_token_bf16": round(bytes_per_token["bfloat16"], 2),
        "bytes_per_token_fp8": round(bytes_per_token["float8_e4m3"], 2),
        "forward_tokens_per_s": round(tokens / med["forward"], 1),
        "capture_tokens_per_s_bf16": round(tokens / med["bfloat16"], 1),
        "capture_tokens_per_s_fp8": round(tokens / med["float8_e4m3"], 1),
        "target": str(path) if not args.smoke else "tiny-random-llama (smoke)",
        "architecture": type(target.model).__name__, "hidden_size": target.hidden_size,
        "num_layers": target.num_layers, "aux_layer_ids": target.aux_layer_ids,
        "batch": args.batch, "seq_len": args.seq_len, "iters": args.iters, "repeats": args.repeats,
        "device": str(dev), "dtype": str(target.dtype).replace("torch.", ""),
        "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
        "versions": {"torch": torch.__version__, "python": sys.version.split()[0]},
    }
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(Path(args.out), text + "\n")
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
