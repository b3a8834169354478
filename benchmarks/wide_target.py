"""A random-weight Llama of a chosen width as a local model folder with the reference tokenizer,
so that the pipeline's own stages make captures of that width on the GPU for
`bench_train.py --capture` (drafter training speed at H 512 / 2048 / 4096).

What is real and what is not: the token sequences are ShareGPT conversations prepared by
`draftsmith prepare` with the reference tokenizer (their lengths and loss masks are what a
drafter trains on), the states come from a real forward through `draftsmith capture`, and the
drafter gets the shapes of a model of that width (4096: Llama-3.1-8B's hidden size, heads, kv
heads, MLP width and 128,256-token vocab; draft vocab 32,000 from `draftsmith vocab`). The weights
are random (N(0, 0.02)) and the target has 8 layers, not 32 (the drafter reads 3 aux layers and
the final state; depth changes nothing in its training cost): the states are fine for
throughput, meaningless for acceptance.

    python3 benchmarks/wide_target.py --width 4096 --tokenizer build/gpu/tokenizer --out /tmp/wide4096
    python3 -m draftsmith.cli prepare benchmarks/recipes/h200_wide.yaml --target.path /tmp/wide4096 --run_dir /tmp/runs/w4096
    (then capture and vocab the same way; benchmarks/h200.sh step `trainreal` runs all of it)
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

# Llama shapes by hidden size: 2048 is Llama-3.2-1B's, 4096 Llama-3.1-8B's; 512 a small chat
# model's (head_dim 64), the size of drafters for the repo's reference targets.
WIDTHS = {
    512: dict(hidden_size=512, intermediate_size=1536, num_attention_heads=8, num_key_value_heads=2),
    2048: dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8),
    4096: dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8),
}
LLAMA3_VOCAB = 128_256


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, required=True, choices=sorted(WIDTHS))
    ap.add_argument("--tokenizer", required=True, help="a tokenizer folder (tokenizer.json, its config, chat template)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=LLAMA3_VOCAB, help="the model's vocab (>= the tokenizer's)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM  # why here: seconds to import; --help needs none of it

    t0 = time.time()
    out, tok_dir = Path(a.out), Path(a.tokenizer)
    tokens = len(AutoTokenizer.from_pretrained(str(tok_dir)))
    if tokens > a.vocab:
        raise SystemExit(f"{tok_dir}: the tokenizer has {tokens} tokens, more than --vocab {a.vocab}")
    cfg = LlamaConfig(vocab_size=a.vocab, num_hidden_layers=a.layers, max_position_embeddings=8192, rms_norm_eps=1e-5,
                      rope_theta=500_000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                      **WIDTHS[a.width])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(a.seed)
    with torch.device(device):  # built where it runs: no host init of billions of weights
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.02)
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(str(out))
    for f in tok_dir.iterdir():
        if f.is_file():
            shutil.copy(f, out / f.name)
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}))
    params = sum(p.numel() for p in model.parameters())
    print(json.dumps({"out": str(out), "width": a.width, "layers": a.layers, "vocab": a.vocab, "tokenizer_tokens": tokens,
                      "params": params, "seconds": round(time.time() - t0, 1)}))


if __name__ == "__main__":
    main()
