"""Plain decoding speed on each decoding path, as a fraction of the memory-bandwidth limit.

Random-weight Llamas shaped like Llama-3.2-1B and Llama-3.1-8B (speed does not depend on the
weights), batch 1, bf16: eager transformers (DynamicCache, one forward per token, the host picks
each token) against draftsmith's fast paths (speculate/fast.py: static cache, CUDA graphs, and
torch.compile + CUDA graphs; the token fed back on the GPU). Then the MoE expert kernels of the
DeepSeek-V3-architecture reference target (random weights): a prefill-sized forward and a decode
step with transformers' eager, batched_mm and grouped_mm experts.

    python benchmarks/bench_fast.py --out benchmarks/out/bench_fast.json            # GPU
    python benchmarks/bench_fast.py --smoke                                          # CPU check

Keys: plain_decode_bw_fraction_1b, plain_decode_bw_fraction_8b (best fast path, fraction of the
copy-measured bandwidth), per model and path: tokens/s, fraction of measured and data-sheet bandwidth.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from draftsmith.fileio import atomic_write_json# noqa: E402
from draftsmith.speculate.cache import CAPTURE_FALLBACKS  # noqa: E402
from draftsmith.evaluate.costs import decode_roofline  # noqa: E402
from draftsmith.evaluate.measure import timed  # noqa: E402
from draftsmith.speculate.engine import plain_generate  # noqa: E402
from draftsmith.speculate.fast import FastTarget  # noqa: E402
from draftsmith.target.model import Target  # noqa: E402

SHAPES = {  # Llama-3.2-1B and Llama-3.1-8B
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False),
    "smoke": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=512, tie_word_embeddings=False),
}


def random_target(cfg, device, dtype) -> Target:
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.eval().requires_grad_(False)
    t = Target(model, None, None)
    t._install_final_hook()
    return t


def decode_rates(target: Target, paths: list[str], prompt_len: int, new_tokens: int) -> dict:
    dev = target.device
    prompt = torch.randint(0, target.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    out = {}
    ref = None
    for path in paths:
        try:
            if path == "off":
                run = lambda n: [plain_generate(target, prompt, n)]  # noqa: E731
            else:
                ft = FastTarget(target, path, max_len=prompt_len + new_tokens + 8)
                run = lambda n, ft=ft: [plain_generate(target, prompt, n, fast=ft)]  # noqa: E731
            t0 = time.perf_counter()
            run(8)  # warm-up: allocation, kernel choice, graph capture, compilation
            warm_s = time.perf_counter() - t0
            (tokens,), s = timed(dev, lambda: run(new_tokens))
            # the prefill is part of `s`; take it out so the rate is the per-token decode rate
            (_,), s1 = timed(dev, lambda: run(1))
            rate = (len(tokens) - 1) / max(s - s1, 1e-9)
            ref = ref or tokens
            diff = next((i for i, (x, y) in enumerate(zip(tokens, ref)) if x != y), None)
            roof = decode_roofline(target, rate)
            out[path] = {"tokens_per_s": rate, "warmup_s": warm_s, "first_token_differing_from_first_path": diff,
                         "fraction_of_measured_bw": roof["fraction_of_measured_bw"],
                         "fraction_of_nominal_bw": roof["fraction_of_nominal_bw"],
                         "limit_tokens_per_s_measured_bw": roof["limit_tokens_per_s_measured_bw"],
                         "weight_bytes_per_step": roof["weight_bytes_per_step"],
                         "measured_bw_gbps": roof["measured_bw_gbps"], "nominal_bw_gbps": roof["nominal_bw_gbps"]}
        except Exception as e:  # a path that fails is reported, the others still run
            out[path] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
        print(f"[fast] {path}: {json.dumps(out[path])}", flush=True)
    return out


@torch.inference_mode()
def eager_forward_ms(target: Target, context: int = 128, repeats: int = 20) -> float:
    """Median time of one eager single-token forward over a DynamicCache (no host loop)."""
    dev = target.device
    out = target.forward(torch.zeros(1, context, dtype=torch.long, device=dev), use_cache=True)
    cache = out.past_key_values
    x, ts = torch.zeros(1, 1, dtype=torch.long, device=dev), []
    for i in range(repeats):
        pos = torch.tensor([[context]], device=dev)
        ts.append(timed(dev, lambda: target.forward(x, past_key_values=cache, position_ids=pos, use_cache=True))[1])
        cache.crop(context)
    return 1000 * sorted(ts)[len(ts) // 2]


def moe_experts(target_dir: str, device, dtype, batch: int, seq: int) -> dict:
    """Forward (capture-sized) and decode-step (graphs) time per experts implementation."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(target_dir)
    res = {}
    for impl in ("grouped_mm", "batched_mm", "eager"):  # eager last, and without graphs (it syncs the host)
        try:
            with torch.device(device):
                model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, experts_implementation=impl)
            model.eval().requires_grad_(False)
            t = Target(model, None, None)
            t._install_final_hook()
            ids = torch.randint(0, cfg.vocab_size, (batch, seq), device=device)
            with torch.inference_mode():
                t.forward(ids, with_logits=False)
                ts = [timed(device, lambda: t.forward(ids, with_logits=False))[1] for _ in range(3)]
            r = {"forward_tokens_per_s": batch * seq / min(ts)}
            for path in (("off",) if impl == "eager" else ("off", "graphs")):
                try:
                    r[f"decode_{path}"] = decode_rates(t, [path], 256, 128)[path].get("tokens_per_s")
                except Exception as e:
                    r[f"decode_{path}"] = f"{type(e).__name__}: {str(e)[:200]}"
            res[impl] = r
            del model, t
            torch.cuda.empty_cache()
        except Exception as e:
            res[impl] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
        print(f"[moe] {impl}: {json.dumps(res[impl])}", flush=True)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/out/bench_fast.json")
    ap.add_argument("--models", nargs="+", default=["1b", "8b"])
    ap.add_argument("--paths", nargs="+", default=["off", "static", "graphs", "compile"],
                    help="compile last: it compiles the model's regions in place")
    ap.add_argument("--prompt_len", type=int, default=128)
    ap.add_argument("--new_tokens", type=int, default=256)
    ap.add_argument("--moe_target", default=None, help="a model folder (config.json) of an MoE target, e.g. /tmp/ref")
    ap.add_argument("--smoke", action="store_true", help="a 2-layer model, static path, on the CPU")
    a = ap.parse_args(argv)
    from transformers import LlamaConfig

    device = torch.device("cuda" if torch.cuda.is_available() and not a.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if a.smoke:
        a.models, a.paths, a.new_tokens = ["smoke"], ["off", "static"], 16
    res = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
           "prompt_len": a.prompt_len, "new_tokens": a.new_tokens, "models": {}}
    for name in a.models:
        t = random_target(LlamaConfig(**SHAPES[name]), device, dtype)
        print(f"[fast] model {name}: {sum(p.numel() for p in t.model.parameters()) / 1e9:.2f}B params", flush=True)
        res["models"][name] = decode_rates(t, a.paths, a.prompt_len, a.new_tokens)
        res["models"][name]["eager_forward_ms_1_token"] = eager_forward_ms(t)
        print(f"[fast] eager forward, 1 token: {res['models'][name]['eager_forward_ms_1_token']:.2f} ms", flush=True)
        best = max((r.get("fraction_of_measured_bw") or 0) for p, r in res["models"][name].items()
                   if p != "off" and isinstance(r, dict))
        res[f"plain_decode_bw_fraction_{name}"] = best or None
        del t
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if a.moe_target:
        res["moe_experts"] = moe_experts(a.moe_target, device, dtype, 8, 1024)
    res["capture_fallbacks"] = list(CAPTURE_FALLBACKS)  # captures that went eager: those paths' timings are eager
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(Path(a.out), res)
    print(json.dumps({k: v for k, v in res.items() if not isinstance(v, dict)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
