"""One dataclass per stage, and the run recipe that nests them.

Field docstrings are the CLI help (jsonargparse reads them). Model shapes come from the
target's config.json, never from flags. The resolved recipe is written to
`RUN_DIR/recipe.yaml` with every default spelled out.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional


@dataclass
class TargetConfig:
    """The target model whose drafter we train."""

    path: str = "assets/tiny-llama-sharegpt"
    """Local folder of a Hugging Face causal LM (config.json, safetensors, tokenizer)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Compute dtype; auto = float32 on CPU, bfloat16 on GPU."""
    device: str = "auto"
    """auto, cpu, cuda or cuda:N."""
    trust_remote_code: bool = False
    """Run code shipped with the model folder. Off unless you trust the folder."""
    aux_layer_ids: Optional[list[int]] = None
    """Decoder layers whose OUTPUTS feed the drafter (0-indexed, internal convention);
    default [1, N//2-1, N-4] for N layers."""


@dataclass
class PrepareConfig:
    """Conversations -> token shards with assistant-only loss masks."""

    source: str = "sharegpt"
    """A file (.json ShareGPT, .jsonl with messages/conversations, MT-Bench question.jsonl),
    or a builtin name: sharegpt, mtbench."""
    format: Literal["auto", "sharegpt", "jsonl", "mtbench"] = "auto"
    """Input format; auto decides from the file name and first record."""
    skip_samples: int = 0
    """Skip this many complete conversations at the start of the source."""
    max_samples: Optional[int] = None
    """Keep at most this many conversations (after skipping)."""
    max_length: int = 2048
    """Truncate rendered samples to this many tokens."""
    min_loss_tokens: int = 1
    """Skip (and count) samples with fewer assistant tokens than this after truncation."""
    role_map: dict[str, str] = field(default_factory=lambda: {
        "human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
        "bing": "assistant", "bard": "assistant", "assistant": "assistant", "system": "system"})
    """Source role name -> user/assistant/system."""
    on_unknown_role: Literal["skip", "fail"] = "skip"
    """What a conversation with an unmapped role does: skip it (counted) or stop with an error."""
    samples_per_shard: int = 256
    """Samples per output shard (the unit of resume)."""


@dataclass
class CaptureConfig:
    """Target forward -> aux hidden states and final hidden state, written as shards."""

    batch_tokens: int = 8192
    """Token budget per forward batch (samples are length-sorted within a shard)."""
    storage_dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """Dtype of stored hidden states."""


@dataclass
class VocabConfig:
    """Draft vocabulary: the most frequent target tokens under the loss mask."""

    draft_vocab_size: int = 32000
    """Size of the drafter's output vocabulary (clipped to the target vocab size)."""


@dataclass
class DraftConfig:
    """Drafter shape. Unset fields are taken from the target's config."""

    num_attention_heads: Optional[int] = None
    num_key_value_heads: Optional[int] = None
    head_dim: Optional[int] = None
    intermediate_size: Optional[int] = None


@dataclass
class TrainConfig:
    """EAGLE-3 training with training-time test (TTT)."""

    ttt_steps: int = 7
    """Unrolled draft steps per position; step i has loss weight decay**i."""
    ttt_decay: float = 0.8
    epochs: float = 1.0
    """Passes over the captured data (fractions allowed); steps = epochs * tokens / batch_tokens."""
    max_steps: Optional[int] = None
    """Stop after this many optimizer steps (overrides epochs)."""
    batch_tokens: int = 4096
    """Tokens per optimizer step (samples packed up to this budget)."""
    max_length: int = 2048
    """Samples longer than this are cut."""
    lr: float = 3e-4
    weight_decay: float = 0.0
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    """Cosine decay ends at lr * min_lr_ratio."""
    grad_clip: float = 0.5
    save_every: int = 100
    """Checkpoint every N steps (and at the end)."""
    log_every: int = 10
    device: str = "auto"
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Compute dtype for the drafter (master weights stay float32)."""


@dataclass
class EvaluateConfig:
    """Speculative decoding with the trained drafter, against plain decoding."""

    benchmarks: list[str] = field(default_factory=lambda: ["mtbench"])
    """mtbench, humaneval, or paths to JSONL files with a `prompt` or `turns` field."""
    max_prompts: Optional[int] = None
    """Use at most this many prompts per benchmark."""
    max_new_tokens: int = 128
    draft_steps: int = 5
    """Chain length k: tokens drafted per target verification."""
    check_lossless: bool = True
    """Assert that speculative output equals plain greedy output on every prompt."""


@dataclass
class ExportConfig:
    """Converters to serving formats."""

    formats: list[str] = field(default_factory=lambda: ["sglang"])
    """Any of: sglang, vllm."""
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"


@dataclass
class Recipe:
    """A whole run: target, data, and every stage's settings."""

    name: str = "quickstart"
    """Run name (used in reports)."""
    goal: str = "Train an EAGLE-3 drafter and measure its acceptance length and speedup."
    """What this run is for, in one sentence (shown by `draftsmith status`)."""
    run_dir: str = "runs/quickstart"
    """Folder that holds every stage's output."""
    seed: int = 0
    target: TargetConfig = field(default_factory=TargetConfig)
    prepare: PrepareConfig = field(default_factory=PrepareConfig)
    capture: CaptureConfig = field(default_factory=CaptureConfig)
    vocab: VocabConfig = field(default_factory=VocabConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    export: ExportConfig = field(default_factory=ExportConfig)


STAGES = ("prepare", "capture", "vocab", "train", "evaluate", "export")
