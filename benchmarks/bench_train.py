"""Drafter training throughput: tokens/s, MFU and peak memory.

Two modes:
    synthetic (default)  per (hidden, sequence): one random sample of `seq` tokens per step, and
                         the longest sequence a Kimi-K2-shaped drafter trains at on one device
    real (--capture)     the train stage's own data path on a capture directory: its CaptureIndex,
                         epoch plans and packed (or padded) micro-batches read by the background
                         Loader, TTTLoss, clip and AdamW as in train/loop.py; a fixed number of
                         steps after warm-up, each timed on its own (tokens/s = real tokens, not
                         padding; median over steps, with the step-time spread max/min so swings
                         show) and the compile counters of torch._dynamo (graphs, recompiles)

    python benchmarks/bench_train.py --out benchmarks/out/bench_train.json  # synthetic, on the GPU
    OMP_NUM_THREADS=1 python benchmarks/bench_train.py --smoke              # tiny shapes on CPU
    python benchmarks/bench_train.py --capture RUN/capture --vocab RUN/vocab --out real.json

One optimizer step (synthetic) = forward + backward of the TTT loss (k steps, train.ttt.TTTLoss,
the module the train stage runs) over one sample of `seq` tokens, clip, AdamW; bf16 autocast
with float32 master weights on CUDA. MFU = tokens/s * train.flops.train_flops_per_token /
peak FLOP/s (train.flops.PEAK_BF16_TFLOPS or --peak-tflops). JSON keys: train_mfu_h2048 and
train_tokens_per_s_h2048 (best sequence length at hidden 2048), kimi_max_seq_len (the longest
sequence that trained; kimi_stopped says why the probe stopped: out of memory or --budget-s), runs[].
Real mode: train_mfu_real_h{H} and train_tokens_per_s_real_h{H} (medians), the spread, the
per-step times (step_s). The drafter's shape comes from the target (draft.build.drafter_config,
default DraftConfig), the target from --target or the run's recipe.yaml.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import yaml

from draftsmith.fileio import atomic_write_json
from draftsmith.manifests import require_complete, verify_shards
from draftsmith.config import DraftConfig
from draftsmith.draft.build import drafter_config, init_drafter
from draftsmith.draft.model import Eagle3Config, Eagle3Drafter
from draftsmith.target.model import read_target_embeddings
from draftsmith.train.data import CaptureIndex, Loader, epoch_plan, micro_batching
from draftsmith.train.flops import peak_flops, train_flops_per_token
from draftsmith.train.state import ADAM_BETAS, compile_loss
from draftsmith.train.ttt import TTTLoss, position_weights
from draftsmith.draft.vocab import VOCAB_FILE, draft_ids, load_vocab


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


def measure_real(a, device: torch.device, peak: float | None) -> dict:
    """Train on a capture directory the way train/loop.py does; see the module docstring."""
    # why here: torch._dynamo takes seconds to import; only --capture reads its counters
    import torch._dynamo
    from torch._dynamo.utils import counters

    capture_dir, vocab_dir = Path(a.capture), Path(a.vocab)
    cap_m = require_complete(capture_dir, "capture")
    target_path = a.target or yaml.safe_load((capture_dir.parent / "recipe.yaml").read_text())["target"]["path"]
    embed, lm_head, tcfg = read_target_embeddings(target_path)
    d2t, t2d = load_vocab(vocab_dir / VOCAB_FILE)
    aux_ids = list(cap_m["aux_layer_ids"])
    cfg = drafter_config(tcfg, DraftConfig(), d2t.numel(), aux_ids)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    k = a.ttt_steps
    compiled = compile_loss(a.compile, device, a.layout, a.attention)
    model = TTTLoss(init_drafter(cfg, embed, d2t, t2d, seed=0).to(device), k, 0.8, a.attention, "inductor" if compiled else None)
    head = lm_head[draft_ids(d2t)].to(device=device, dtype=dtype)
    del embed, lm_head
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, betas=ADAM_BETAS, eps=1e-8)
    autocast = torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else nullcontext()

    micro, per_step = micro_batching(a.batch_tokens, a.micro_batch_tokens, 1)
    packed = micro if a.layout == "packed" else None
    max_length = min(a.max_length, micro) if packed else a.max_length
    index = CaptureIndex(verify_shards(capture_dir, cap_m, check_hash=False), max_length, cfg.target_hidden_size, len(aux_ids))
    weights = torch.stack([position_weights(m, k) for m in index.loss_mask])
    lengths = index.lengths
    pin = device.type == "cuda"
    loader = Loader(lambda ids: index.batch(ids, packed, pin), device)
    total = a.warmup + a.steps

    def steps():  # the loop's schedule: a step's micro-batches from one epoch's plan
        epoch = 0
        while True:
            plan = epoch_plan(lengths, micro, 0, epoch, a.layout)
            for i in range(0, len(plan), per_step):
                yield plan[i:i + per_step]
            epoch += 1

    schedule = steps()
    queued = []
    for _ in range(min(2, total)):
        queued.append(next(schedule))
        for ids in queued[-1]:
            loader.ahead(ids)
    torch._dynamo.reset()
    counters.clear()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, tokens, slots, graphs_after_warmup = [], [], [], None
    try:
        for step in range(total):
            micro_ids = queued.pop(0)
            if step + len(queued) + 1 < total:
                queued.append(next(schedule))
                for ids in queued[-1]:
                    loader.ahead(ids)
            t0 = time.perf_counter()
            wt = weights[[j for b in micro_ids for j in b]].sum(0)
            wt = (wt.pin_memory() if pin else wt).to(device, non_blocking=True)
            for ids in micro_ids:
                batch = loader.next()
                with autocast:
                    out = model(batch.input_ids, batch.loss_mask, batch.aux_hidden, batch.final_hidden, head, wt,
                                batch.position_ids, batch.doc_ids)
                out[0].backward()
            torch.nn.utils.clip_grad_norm_(params, 0.5)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if step >= a.warmup:
                times.append(time.perf_counter() - t0)
                tokens.append(sum(lengths[j] for b in micro_ids for j in b))
                slots.append(len(micro_ids) * micro if packed else sum(len(b) * max(lengths[j] for j in b) for b in micro_ids))
            elif step == a.warmup - 1:
                graphs_after_warmup = int(counters["stats"]["unique_graphs"])
    finally:
        loader.close()
    tps = [n / t for n, t in zip(tokens, times)]
    mean_context = sum(n * (n + 1) / 2 for n in lengths) / max(1, sum(lengths))
    fpt = train_flops_per_token(cfg, k, mean_context)
    med = statistics.median(tps)
    return {"capture": str(capture_dir), "target": str(target_path), "hidden": cfg.hidden_size,
            "drafter": {"heads": cfg.num_attention_heads, "kv_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
                        "intermediate": cfg.intermediate_size, "draft_vocab": cfg.draft_vocab_size, "target_vocab": cfg.vocab_size,
                        "params_trainable": sum(p.numel() for p in params)},
            "samples": len(lengths), "tokens_per_epoch": sum(lengths), "mean_sample_length": round(sum(lengths) / len(lengths), 1),
            "layout": a.layout, "compiled": compiled, "micro_batch_tokens": micro, "micro_batches_per_step": per_step, "attention": a.attention,
            "ttt_steps": k, "warmup_steps": a.warmup, "steps": a.steps,
            "tokens_per_s": round(med, 1), "tokens_per_s_min": round(min(tps), 1), "tokens_per_s_max": round(max(tps), 1),
            "step_s_median": round(statistics.median(times), 4), "step_s_spread": round(max(times) / min(times), 3),
            "real_token_fraction": round(sum(tokens) / sum(slots), 4), "train_flops_per_token": fpt,
            "mfu": round(med * fpt / peak, 4) if peak else None,
            "compiled_graphs_after_warmup": graphs_after_warmup, "compiled_graphs": int(counters["stats"]["unique_graphs"]),
            "recompiles": int(sum(counters["recompiles"].values())) if counters["recompiles"] else 0,
            "peak_memory_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None,
            "step_s": [round(t, 4) for t in times]}


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
    real = ap.add_argument_group("real mode (train on a capture directory)")
    real.add_argument("--capture", default=None, help="RUN_DIR/capture: train on it instead of the synthetic sweep")
    real.add_argument("--vocab", default=None, help="RUN_DIR/vocab (default: beside --capture)")
    real.add_argument("--target", default=None, help="the target folder (embedding, lm_head, config); default: the run's recipe.yaml")
    real.add_argument("--steps", type=int, default=20, help="timed optimizer steps")
    real.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation, allocator)")
    real.add_argument("--batch-tokens", type=int, default=65536)
    real.add_argument("--micro-batch-tokens", type=int, default=16384)
    real.add_argument("--max-length", type=int, default=2048)
    real.add_argument("--layout", default="packed", choices=["packed", "padded"])
    real.add_argument("--compile", default="auto", choices=["auto", "on", "off"], help="train.compile (auto: CUDA + packed + flex)")
    a = ap.parse_args()
    t_start = time.perf_counter()
    device = torch.device("cpu" if a.smoke or not torch.cuda.is_available() else "cuda")
    peak = peak_flops(device, a.peak_tflops)
    if a.capture:
        a.vocab = a.vocab or str(Path(a.capture).parent / "vocab")
        r = measure_real(a, device, peak)
        r.update(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", torch=torch.__version__,
                 peak_flops=peak, **{f"train_mfu_real_h{r['hidden']}": r["mfu"], f"train_tokens_per_s_real_h{r['hidden']}": r["tokens_per_s"]})
        if a.out:
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(Path(a.out), r)
        print(json.dumps({k: v for k, v in r.items() if k != "step_s"}, indent=2))
        return
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
