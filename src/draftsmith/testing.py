"""Tiny models and tokenizers built from configs, for tests, benchmarks and the reference target.

Nothing here downloads anything: tokenizers are trained on a few sentences (or on ShareGPT
for the reference target) with the `tokenizers` library, models are built from configs with
random weights.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterable, NamedTuple, Optional

import torch

from .config import DraftConfig
from .draft.build import drafter_config, init_drafter
from .draft.io import save_drafter
from .target.model import load_target, model_class
from .train import loop

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
    # why here: tokenizers and transformers take seconds to import; only the model builders need them
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


ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3", "gpt_oss", "llava")
"""Architectures tiny_config builds. llava wraps a text decoder (deepseek_v3 by default, as in
Kimi-K2.5) under `model.language_model`, beside a tiny CLIP vision tower."""


def tiny_config(arch: str = "llama", vocab_size: int = 512, hidden_size: int = 64, num_layers: int = 4,
                text_arch: str = "deepseek_v3", **overrides):
    """A tiny transformers config of the given architecture (see ARCHS)."""
    import transformers as tf  # why here: seconds to import; only the model builders need it

    H = hidden_size
    common = dict(vocab_size=vocab_size, hidden_size=H, intermediate_size=H * 2, num_hidden_layers=num_layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    moe = dict(moe_intermediate_size=H // 2, num_experts_per_tok=2)
    if arch == "llava":
        # One extra id for the image placeholder, so no text token is ever taken for an image.
        text = tiny_config(text_arch, vocab_size + 1, hidden_size, num_layers, **overrides)
        vision = tf.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                     image_size=32, patch_size=16)
        return tf.LlavaConfig(vision_config=vision, text_config=text, image_token_id=vocab_size)
    if arch == "llama":
        cls, kw = tf.LlamaConfig, dict(rope_theta=10000.0)
    elif arch in ("qwen2", "qwen3"):
        cls, kw = (tf.Qwen2Config if arch == "qwen2" else tf.Qwen3Config), {}
    elif arch == "qwen3_moe":
        cls, kw = tf.Qwen3MoeConfig, dict(moe, num_experts=4, decoder_sparse_step=1, norm_topk_prob=True)
    elif arch == "deepseek_v3":  # MLA + MoE; layer 0 dense (first_k_dense_replace), the rest MoE
        cls, kw = tf.DeepseekV3Config, dict(moe, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4, n_group=1,
                                            topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=32,
                                            qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16)
    elif arch == "gpt_oss":  # MoE, attention sinks, alternating sliding-window layers
        cls, kw = tf.GptOssConfig, dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=8)
    else:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {', '.join(ARCHS)}")
    common.update(kw)
    common.update(overrides)
    return cls(**common)


def make_model_dir(out_dir: str | Path, arch: str = "llama", seed: int = 0, tokenizer_texts: Optional[list[str]] = None,
                   vocab_size: int = 512, dtype: torch.dtype = torch.float32, **config_overrides) -> Path:
    """Write a random-weight model of `arch` with a trained tiny tokenizer into out_dir."""
    out_dir = Path(out_dir)
    train_tokenizer(tokenizer_texts or _SENTENCES * 4, vocab_size, out_dir)
    from transformers import AutoTokenizer  # why here: seconds to import; only the model builders need it

    real_vocab = len(AutoTokenizer.from_pretrained(str(out_dir)))
    cfg = tiny_config(arch, vocab_size=max(real_vocab, 8), **config_overrides)
    torch.manual_seed(seed)
    model = model_class(cfg).from_config(cfg, dtype=dtype)
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


class TinyDrafter(NamedTuple):
    """What make_tiny_drafter builds: `root/target` (model_dir) and `root/drafter`."""

    root: Path
    model_dir: Path
    target: Any  # draftsmith.target.model.Target, float32 on CPU
    drafter: Any  # draftsmith.draft.model.Eagle3Drafter, eval mode


def random_norms(model: torch.nn.Module, seed: int) -> None:
    """Every norm weight of `model` set to its own random non-unit values (0.5..1.5), so a test
    fails when two norms are swapped or one is dropped (all-ones norms are interchangeable)."""
    gen = torch.Generator().manual_seed(1000 + int(seed))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.copy_(0.5 + torch.rand(p.shape, generator=gen))


def make_tiny_drafter(root: str | Path, num_layers: int = 8, draft_vocab_size: int = 100, seed: int = 1,
                      std: float = 0.2, **config_overrides) -> TinyDrafter:
    """A tiny llama target in root/target (8 layers: internal aux layers [1, 3, 4]) and a
    trained-looking drafter for it in root/drafter: a draft vocab of `draft_vocab_size` random
    target tokens, linears ~ N(0, std) (larger than training's init, so outputs differ clearly).
    `config_overrides` go to the target's config (e.g. rope_parameters)."""
    root = Path(root)
    model_dir = make_model_dir(root / "target", num_layers=num_layers, **config_overrides)
    target = load_target(model_dir, device="cpu", dtype="float32")
    V, Vd = target.vocab_size, draft_vocab_size
    chosen = torch.sort(torch.randperm(V, generator=torch.Generator().manual_seed(0))[:Vd]).values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[chosen] = True
    cfg = drafter_config(target.config, DraftConfig(), Vd, target.aux_layer_ids)
    drafter = init_drafter(cfg, target.input_embeddings(), chosen - torch.arange(Vd), t2d, seed=seed, std=std).eval()
    random_norms(drafter, seed)
    save_drafter(drafter, root / "drafter")
    return TinyDrafter(root, model_dir, target, drafter)


@contextlib.contextmanager
def killed_at_step(monkeypatch, step: int):
    """Inside the block, the train loop raises KeyboardInterrupt when it is about to log `step`, as a
    kill at that moment would stop it (resume tests); the real logger is back afterwards."""
    real = loop.append_jsonl

    def crash(path, rec):
        if rec["step"] == step:
            raise KeyboardInterrupt
        real(path, rec)

    monkeypatch.setattr(loop, "append_jsonl", crash)
    try:
        yield
    finally:
        monkeypatch.setattr(loop, "append_jsonl", real)


def interpreted_or_skip(module, starter: str):
    """`module` (whose Triton kernels the test runs) in a process started with TRITON_INTERPRET=1, where
    they run on a CPU; elsewhere the test is skipped (`starter`, run_interpreted's test, starts one)."""
    import pytest

    from .tritonlib import INTERPRET, triton

    if not (INTERPRET and triton is not None):
        pytest.skip(f"needs Triton and TRITON_INTERPRET=1 at start ({starter})")
    return module


def run_interpreted(test_file: str | Path, keyword: str, basetemp: str | Path) -> None:
    """The tests of test_file whose names hold `keyword`, in a pytest process started with TRITON_INTERPRET=1
    (Triton reads it when it is imported, so the Triton kernels run on a CPU only in a process started with
    it): asserts that they ran and passed, none skipped. Skipped in that process itself and without Triton."""
    import pytest

    from .tritonlib import INTERPRET, triton

    if triton is None:
        pytest.skip("Triton is not installed")
    if INTERPRET:
        pytest.skip("this process is the interpreted one")
    src = str(Path(__file__).resolve().parents[1])  # the draftsmith this process imported
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-k", keyword,
                        str(test_file), "--basetemp", str(basetemp)],
                       env=env, cwd=Path(test_file).resolve().parent.parent, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "skipped" not in r.stdout.splitlines()[-1], r.stdout[-2000:]
