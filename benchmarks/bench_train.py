"""Drafter training throughput on synthetic data: tokens/s, MFU and peak memory per (hidden,
sequence), and the longest sequence a Kimi-K2-shaped drafter trains at on one device.

    python benchmarks/bench_train.py --out benchmarks/results/h200.json     # on the GPU
    OMP_NUM_THREADS=1 python benchmarks/bench_train.py --smoke              # tiny shapes on CPU

One optimizer step = forward + backward of the TTT loss (k steps, train.ttt.TTTLoss, the
module the train stage runs) over one sample of `seq` tokens, clip, AdamW; bf16 autocast
with float32 master weights on CUDA. MFU = tokens/s * train.flops.train_flops_per_token /
peak FLOP/s (train.flops.PEAK_BF16_TFLOPS or --peak-tflops). JSON keys: train_mfu_h2048 and
train_tokens_per_s_h2048 (best sequence length at hidden 2048), kimi_max_seq_len (the longest
sequence that trained; kimi_stopped says why the probe stopped: out of memory or --budget-s), runs[].
"""
from __future__ import annotations

import argparse
import json
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from draftsmith.artifacts import atomic_write_json
from draftsmith.draft.model import Eagle3Config, Eagle3Drafter
from draftsmith.train.flops import peak_flops, train_flops_per_token
from draftsmith.train.ttt import TTTLoss, position_weights


def drafter_cfg(hidden: int, target_vocab: int, draft_vocab: int, heads: int, kv_heads: int, head_dim: int,
                intermediate: int) -> Eagle3Config:
    return Eagle3Config(hidden_size=hidden, target_hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
                        head_dim=head_dim, intermediate_size=intermediate, vocab_size=target_vocab, draft_vocab_size=draft_vocab,
                        max_position_embeddings=1 << 17)


def measure(cfg: Eagle3Config, seq: int, steps: int, device: torch.device, attention: str, iters: int, warmup: int,
            peak: float | None) -> dict:
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with device:  # built on the device: no host initialisation and copy of a 1.2B-entry embedding
        model = TTTLoss(Eagle3Drafter(cfg), steps, 0.8, attention)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95))
    H = cfg.hidden_size
    ids = torch.randint(0, cfg.vocab_size, (1, seq), device=device)
    mask = torch.ones(1, seq, device=device)
    aux = torch.randn(1, seq, cfg.num_aux_layers * H, device=device, dtype=dtype)
    fin = torch.randn(1, seq, H, device=device, dtype=dtype)
    head = torch.randn(cfg.draft_vocab_size, H, device=device, dtype=dtype) / H ** 0.5
    wt = position_weights(mask.cpu(), steps)
    autocast = torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else nullcontext()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    def step():
        with autocast:
            loss = model(ids, mask, aux, fin, head, wt)[0]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t = time.perf_counter()
    for _ in range(iters):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dt = (time.perf_counter() - t) / iters
    tokens_per_s = seq / dt
    fpt = train_flops_per_token(cfg, steps, (seq + 1) / 2)
    mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return {"hidden": H, "seq": seq, "tokens_per_s": round(tokens_per_s, 1), "step_s": round(dt, 4),
            "train_flops_per_token": fpt, "mfu": round(tokens_per_s * fpt / peak, 4) if peak else None,
            "peak_memory_gib": round(mem, 2) if mem is not None else None}


def is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (checks the script, not the figures)")
    ap.add_argument("--ttt-steps", type=int, default=7)
    ap.add_argument("--attention", default="auto", choices=["auto", "chunked", "flex", "reference"])
    ap.add_argument("--peak-tflops", type=float, default=None)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", default=None, help="write the JSON here (also printed); rewritten after every run")
    ap.add_argument("--hiddens", type=int, nargs="*", default=None,
                    help="drafter hidden sizes of the sweep (default 1024 2048 4096; none: only the Kimi probe)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no new Kimi-shaped run after this many seconds (the result says where it stopped)")
    a = ap.parse_args()
    t_start = time.perf_counter()
    device = torch.device("cpu" if a.smoke or not torch.cuda.is_available() else "cuda")
    peak = peak_flops(device, a.peak_tflops)
    if a.smoke:
        hiddens, seqs, vocab, draft_vocab, kimi = [64, 128], [64, 128], 512, 256, (256, 4, 4, 64, 512, 2048, 1024)
        kimi_seqs, iters, warmup = [128, 256], 1, 1
    else:
        hiddens, seqs, vocab, draft_vocab = [1024, 2048, 4096], [2048, 8192], 128_256, 32_000
        # Kimi-K2: H 7168, 64 heads (MLA, v_head_dim 128 -> drafter head_dim 128), dense FFN 18432
        kimi = (7168, 64, 64, 128, 18432, 163_840, 32_000)
        kimi_seqs, iters, warmup = [4096, 8192, 16384, 32768, 65536], a.iters, 2
    if a.hiddens is not None:
        hiddens = a.hiddens
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "smoke": a.smoke,
              "torch": torch.__version__, "ttt_steps": a.ttt_steps, "attention": a.attention, "peak_flops": peak,
              "kimi_shape": dict(zip(["hidden", "heads", "kv_heads", "head_dim", "intermediate", "target_vocab",
                                      "draft_vocab"], kimi)),
              "runs": [], "kimi_runs": [], "kimi_max_seq_len": None, "kimi_stopped": None}
    runs, kimi_runs = result["runs"], result["kimi_runs"]

    def save() -> None:  # after every run, so a step killed at its time limit keeps what it measured
        h2048 = [r for r in runs if r["hidden"] == (128 if a.smoke else 2048) and "error" not in r]
        best = max(h2048, key=lambda r: r["tokens_per_s"] * r["train_flops_per_token"], default={})
        result.update(train_mfu_h2048=best.get("mfu"), train_tokens_per_s_h2048=best.get("tokens_per_s"),
                      train_h2048_seq=best.get("seq"))
        if a.out:
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(Path(a.out), result)

    for H in hiddens:
        heads = max(4, H // 128)
        cfg = drafter_cfg(H, vocab, draft_vocab, heads, max(1, heads // 4), H // heads, int(8 * H / 3 // 256 * 256) or 2 * H)
        for seq in seqs:
            try:
                r = measure(cfg, seq, a.ttt_steps, device, a.attention, iters, warmup, peak)
            except RuntimeError as e:
                if not is_oom(e):
                    raise
                r = {"hidden": H, "seq": seq, "error": "out of memory"}
            runs.append(r)
            print(json.dumps(r), flush=True)
            save()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    kcfg = drafter_cfg(**result["kimi_shape"])  # by name: an earlier version passed the sweep's last H here
    for seq in kimi_seqs:
        if a.budget_s is not None and time.perf_counter() - t_start > a.budget_s:
            result["kimi_stopped"] = f"time budget ({a.budget_s:.0f} s) spent before seq {seq}"
            break
        t0 = time.perf_counter()
        try:
            r = measure(kcfg, seq, a.ttt_steps, device, a.attention, 1, 1, peak)
        except RuntimeError as e:
            if not is_oom(e):
                raise
            kimi_runs.append({"seq": seq, "error": "out of memory"})
            result["kimi_stopped"] = f"out of memory at seq {seq}"
            print(json.dumps(kimi_runs[-1]), flush=True)
            break
        r["wall_s"] = round(time.perf_counter() - t0, 1)
        result["kimi_max_seq_len"] = seq
        kimi_runs.append(r)
        print(json.dumps(r), flush=True)
        save()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    save()
    print(json.dumps(result, indent=2))

if __name__ == "__main__":
    main()
