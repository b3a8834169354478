"""Tiny models and tokenizers built from configs, for tests, benchmarks and the reference target.

Nothing here downloads anything: tokenizers are trained on a few sentences (or on ShareGPT
for the reference target) with the `tokenizers` library, models are built from configs with
random weights.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Optional

import torch

# draftsmith's own chat template for its reference targets: role markers as special tokens,
# every turn closed by <|end|> (the end-of-turn token, also the EOS of generation).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]

_SENTENCES = [
    "Hello! How can I help you today?", "The quick brown fox jumps over the lazy dog.",
    "Write a short poem about the sea.", "Sure, here is a poem about the sea and the sky.",
    "def add(a, b):\n    return a + b\n", "What is the capital of France? Paris is the capital.",
    "Speculative decoding drafts tokens and verifies them in one forward pass.",
    "1 2 3 4 5 6 7 8 9 10", "Thank you very much, that was helpful!",
]


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: str | Path,
                    model_max_length: int = 4096) -> None:
    """Train a byte-level BPE tokenizer and save it (tokenizer.json + tokenizer_config.json)
    with the reference chat template, loadable by transformers' AutoTokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|end|>",
                                   pad_token="<|pad|>", model_max_length=model_max_length)
    fast.chat_template = CHAT_TEMPLATE
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))


def tiny_config(arch: str = "llama", vocab_size: int = 512, hidden_size: int = 64, num_layers: int = 4,
                **overrides):
    """A tiny transformers config of the given architecture."""
    from transformers import LlamaConfig

    if arch != "llama":
        raise ValueError(f"unknown tiny architecture {arch!r}")
    kw = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=hidden_size * 2,
              num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=10000.0,
              tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    kw.update(overrides)
    return LlamaConfig(**kw)


def make_model_dir(out_dir: str | Path, arch: str = "llama", seed: int = 0, tokenizer_texts: Optional[list[str]] = None,
                   vocab_size: int = 512, dtype: torch.dtype = torch.float32, **config_overrides) -> Path:
    """Write a random-weight model of `arch` with a trained tiny tokenizer into out_dir."""
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir)
    train_tokenizer(tokenizer_texts or _SENTENCES * 4, vocab_size, out_dir)
    from transformers import AutoTokenizer

    real_vocab = len(AutoTokenizer.from_pretrained(str(out_dir)))
    cfg = tiny_config(arch, vocab_size=max(real_vocab, 8), **config_overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    # Random init with std 0.02 gives near-uniform logits; a larger embedding/head scale makes
    # greedy decoding of a random model less tie-prone, which keeps lossless tests meaningful.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    model.save_pretrained(str(out_dir))
    gen = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    (out_dir / "generation_config.json").write_text(json.dumps(gen))
    return out_dir
