"""One dataclass per stage, the run recipe that nests them, and the parser that reads a recipe.

Field docstrings are the CLI help (jsonargparse reads them). Model shapes come from the
target's config.json, never from flags. The resolved recipe is written to
`RUN_DIR/recipe.yaml` with every default spelled out.

    parse_recipe(["recipes/quickstart.yaml", "--train.lr", "1e-3"]) -> (Recipe, force)
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import math
import re
import textwrap
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional, Union

import yaml
from jsonargparse import ActionConfigFile, ArgumentParser, set_parsing_settings

from .messages import DraftsmithError


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
    device_map: Optional[str] = None
    """Spread a target too large for one GPU over the visible GPUs (e.g. auto, balanced;
    needs accelerate). Unset: the whole target on `device`."""
    experts_implementation: Optional[str] = None
    """MoE targets: transformers' expert kernel (eager, batched_mm, grouped_mm, ...). Unset:
    transformers' default (grouped_mm where it can run, else eager). Capture, regeneration and
    evaluation all use it; evaluate's CUDA graphs switch an eager one to a graph-safe one."""


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
class RegenerateConfig:
    """Optional: the target rewrites the assistant turns (prepare -> regenerate -> capture). A
    conversation ends before the first turn whose prompt already fills prepare.max_length (training
    would cut that turn off), so long conversations cost no generation past the training window."""

    enabled: bool = False
    """Regenerate the answers; capture then reads regen/ instead of data/."""
    server_url: Optional[str] = None
    """OpenAI-compatible base URL (`vllm serve`, SGLang), e.g. http://127.0.0.1:8000/v1.
    Unset: the target decodes locally on target.device (`fast` picks the path)."""
    server_model: Optional[str] = None
    """Model name sent to the server; unset: the first id of GET {server_url}/models."""
    max_new_tokens: int = 1024
    """Longest answer; an answer cut here is left out and written to regen/errors.jsonl
    (unless keep_truncated)."""
    max_turns: Optional[int] = None
    """Regenerate at most this many assistant turns per conversation; the conversation ends after
    the last (unset: every turn). 1 = first answers only, the cheapest data the target wrote."""
    keep_truncated: bool = False
    """Keep answers cut at max_new_tokens (the chat template still closes the turn). For small
    targets whose greedy answers rarely end, e.g. the quickstart's."""
    temperature: float = 0.0
    """0: greedy. > 0: sampled; local decoding draws each chunk from a generator seeded by (seed,
    chunk), so the same recipe writes the same answers, resumed or not; a server's requests carry a
    `seed` made of (seed, chunk, the messages). The seed is then part of the stage's fingerprint."""
    batch_size: int = 16
    """Conversations per local decoding batch (every batch is padded to this size, so the fast
    path keeps one KV cache and one set of CUDA graphs)."""
    fast: Literal["auto", "off", "static", "graphs", "compile"] = "auto"
    """Local decoding path: off = transformers `generate` (dynamic KV cache); static, graphs,
    compile = the plain decoding that evaluate measures (static KV cache, CUDA graphs, the
    token fed back on the device; see evaluate.fast). auto = graphs on a GPU, off on a CPU. At
    temperature > 0 the fast path samples the full softmax; `generate` also applies the target's
    generation_config (top_k, top_p)."""
    concurrency: int = 16
    """Requests in flight to the server. This and the three below never change an answer, so
    changing them does not regenerate a complete stage (unless requests failed in it)."""
    timeout_s: float = 600.0
    """Per request."""
    max_retries: int = 3
    """Retries of a failed request (connection errors, 5xx, 429), with exponential backoff."""
    retry_delay_s: float = 1.0
    """First backoff delay; doubles each retry."""


@dataclass
class CaptureConfig:
    """Target forward -> aux hidden states and final hidden state, written as shards."""

    batch_tokens: int = 8192
    """Token budget per forward batch (samples are length-sorted within a shard)."""
    storage_dtype: Literal["bfloat16", "float16", "float32", "float8_e4m3"] = "bfloat16"
    """Dtype of stored hidden states. float8_e4m3 stores fp8 values plus a float32 scale per
    token and aux layer: about half the bytes of bfloat16."""


@dataclass
class VocabConfig:
    """Draft vocabulary: the most frequent target tokens under the loss mask."""

    draft_vocab_size: int = 32000
    """Size of the drafter's output vocabulary (clipped to the target vocab size)."""


@dataclass
class DraftConfig:
    """Drafter shape. Unset fields are taken from the target's config."""

    num_attention_heads: Optional[int] = None
    """Attention heads; unset: the target's."""
    num_key_value_heads: Optional[int] = None
    """Key/value heads; unset: the target's (num_attention_heads itself when that is set and the
    target's count does not divide it)."""
    head_dim: Optional[int] = None
    """Width of each head; unset: the target's (MLA targets: their value-head width)."""
    intermediate_size: Optional[int] = None
    """SwiGLU MLP width; unset: the target's dense intermediate_size, else 8/3 x hidden, rounded up."""
    norm_before_fc: bool = False
    """RMSNorm over the concatenated aux states before fc (speculators' and vLLM's `norm_before_fc`).
    vLLM loads it; SGLang's EAGLE-3 Llama has no such norm, so the SGLang export refuses it."""
    norm_before_residual: bool = False
    """The decoder layer's residual is hidden_norm(h) instead of h (`norm_before_residual`). vLLM
    loads it; SGLang's EAGLE-3 Llama has no such option, so the SGLang export refuses it."""
    norm_output: bool = True
    """Each draft step after the first reads norm(g), the state the lm_head reads, instead of the
    raw layer output g (EAGLE-3.1 `norm_output`): the hidden state keeps its scale however deep
    the drafter runs. On by default: with ttt_decay 1 it won the ablation at equal batch (held-out
    acceptance higher at every position, most past the trained depth; MT-Bench tree tau above the
    `speculators` peer's, BENCHMARKS.md "New defaults"), and speculators trains Llama drafters with
    it too. Loaded by vLLM since vllm-project/vllm#46488 and SGLang releases with EAGLE-3.1
    support; an older server ignores the key and drafts worse without an error (docs/serving.md):
    false gives a plain EAGLE-3 drafter."""


@dataclass
class TrainConfig:
    """EAGLE-3 training with training-time test (TTT)."""

    ttt_steps: int = 7
    """Unrolled draft steps per position; step i has loss weight decay**i."""
    ttt_decay: float = 1.0
    """Loss weight decay per TTT step: step i weighs ttt_decay**i. 1.0 (every step weighs the
    same, as speculators trains) beat EAGLE-3's 0.8 together with draft.norm_output (BENCHMARKS.md
    "New defaults")."""
    ttt_align_topk: int = 0
    """0: every TTT step learns at every row. k > 0: step i > 0 learns at a row only while the
    target's token stayed within the drafter's top-k at every earlier step of that row (GRIFFIN's
    token-alignable training, arXiv 2502.11018, with k = 1): past a miss the row's later drafts
    are never verified, yet they would train on a hidden state paired with a token the drafter did
    not propose. k = 1 matches chain decoding; a tree also follows a miss into its other top-k
    children. The accuracies logged stay over every row (comparable across settings). Off by
    default: on the CPU lab (Muon 3e-3, 630 steps) top-4 gave MT-Bench tree tau 1.930 over three
    seeds against 1.972 without, top-1 1.872 against 1.859 on one (BENCHMARKS.md, eleventh session);
    on the H200 top-1 gave 4.22 against 4.32 (one seed, twelfth session)."""
    ttt_target_temperature: float = 1.0
    """The distribution the drafter learns at each TTT step: the target's softmax(logits / T) over
    the draft vocab. 1: the target's own distribution (soft CE, as EAGLE-3 and speculators train);
    below 1 sharper, toward the token greedy verification accepts; 0: that token alone (hard labels).
    0.5 wins greedy decoding at the GPU recipe: on an H100 (peer data, 287 steps, held-out top-1 0.87),
    MT-Bench tree tau 4.84 against 4.46 at 1 over 160 turns (one seed; 123 turns won, 8 lost), so the
    benchmark recipe (greedy) sets it. On the CPU lab (Muon 3e-3, held-out top-1 0.3-0.6) 0.5 does
    not win: tree tau 1.970 against 1.972 over three seeds at 630 steps, 1.984 against 2.044 at four
    epochs of regenerated answers and 2.273 against 2.510 at eight (one seed each: the sharper target
    fits the training answers faster and generalizes worse); 0 gave 1.882 against 1.859 with lower
    held-out top-1 (BENCHMARKS.md, thirteenth, seventeenth and eighteenth sessions).
    Every figure above is greedy. Sampled serving accepts by the overlap of the drafter's law with the
    target's at the serving temperature, and there 0.5 loses: on an H100 at evaluate.temperature 1,
    MT-Bench chain tau 1.580 against 2.130 at 1 (160 turns, one seed; BENCHMARKS.md, nineteenth
    session; CPU lab 1.330 against 1.348). So the default, and recipes/gpu.yaml, stay at 1: set 0.5
    only for a server that decodes greedily."""
    epochs: float = 1.0
    """Whole passes over the training samples (fractions allowed): the steps of each epoch are
    counted from its batch plan, and a step never spans two epochs (an epoch's last step takes
    the micro-batches that are left)."""
    max_steps: Optional[int] = None
    """Stop after this many optimizer steps (overrides epochs)."""
    max_tokens: int = 0
    """Token budget (0 = off): train ceil(max_tokens / batch_tokens) optimizer steps (batch_tokens
    is a step's token budget, padding included), the lr schedule decaying over them. Overrides
    epochs; with max_steps set too, the smaller step count wins."""
    max_minutes: float = 0.0
    """Wall-clock budget of the training loop in minutes, summed over resumed sessions (0 = off).
    At the first step past it training stops cleanly: a held-out evaluation, a checkpoint, the
    drafter, and a complete manifest with `stopped: budget`. The lr schedule cannot know where
    that falls: it decays over max_steps / max_tokens / epochs, so set one of those near what fits.
    Not in the train fingerprint: on a complete stage, a larger budget continues a run it stopped (from
    its last checkpoint), one the run already fits leaves it complete, a smaller one retrains."""
    batch_tokens: int = 4096
    """Global batch: tokens per optimizer step, over all ranks and micro-batches."""
    micro_batch_tokens: Optional[int] = None
    """Tokens per forward/backward, padding included: the length of a packed micro-batch (samples
    longer than this are cut to it), or the padded budget B * longest; a step takes
    batch_tokens // micro_batch_tokens consecutive micro-batches, dealt round-robin to the ranks
    (gradient accumulation). Unset: batch_tokens / world size. Set it to get the same global
    batches at any world size."""
    batch_layout: Literal["packed", "padded"] = "packed"
    """packed: whole samples end to end in one fixed [1, micro_batch_tokens] row, positions
    restarting at 0 and attention kept inside each sample (every micro-batch has the same
    shape: compiled attention compiles once, little padding). padded: samples of similar length
    right-padded to the longest, one per row (the shape changes from batch to batch)."""
    max_length: int = 2048
    """Samples longer than this are cut."""
    lr: float = 3e-3
    """Peak learning rate (AdamW), reached after the warmup. 3e-3 won the training ablation
    against 3e-4 and 1e-3 on real captures at equal data (benchmarks/bench_ablation.py, variants
    lr*), and with head_init target it beat the `speculators` peer (benchmarks/bench_peer.py)."""
    weight_decay: float = 0.0
    """AdamW weight decay of the weight matrices (norms get none)."""
    optimizer: Literal["adamw", "muon"] = "adamw"
    """adamw: AdamW (betas 0.9/0.95) on every trained tensor. muon: torch.optim.Muon on the 2-D
    weight matrices of fc, attention and MLP (lr `muon_lr`, RMS matched to AdamW's update, weight
    decay `muon_weight_decay`), AdamW (lr) on the norms and the lm_head; speculators' default.
    Muon won where training took hundreds of steps and lost where it took about a hundred (on the
    CPU the batch differed too; BENCHMARKS.md, tenth session): at lr 3e-3 on the CPU lab, 630 steps
    of 1,024 tokens, MT-Bench tree tau 1.97 vs AdamW's 1.73 over three seeds, but 128 steps of 4,096
    tokens held-out top-1 0.24 ... 0.16 vs 0.24 ... 0.20, and the quickstart's 90 steps 1.24 vs 1.29
    held-out simulated tau; on the H200 (573 steps, lr 1e-3) held-out top-1 0.91 vs 0.89, and at
    284 steps lr 3e-3 beat 1e-3 (MT-Bench tree tau 4.53 vs 4.32, one seed; speculators' 4.25 over
    three). The GPU recipes train with it at 3e-3; the default stays adamw."""
    muon_lr: Optional[float] = None
    """Learning rate of the Muon matrices; unset: lr."""
    muon_weight_decay: float = 0.1
    """Weight decay of the Muon matrices (train.optimizer muon)."""
    warmup_steps: int = 20
    """Optimizer steps of linear learning-rate warmup."""
    lr_schedule: Literal["cosine", "linear"] = "cosine"
    """After warmup: cosine or linear decay to lr * min_lr_ratio at the last step."""
    min_lr_ratio: float = 0.1
    """The decay ends at lr * min_lr_ratio."""
    grad_clip: float = 0.5
    """Clip the gradient norm to this; 0: no clipping."""
    save_every: int = 100
    """Checkpoint every N steps (and at the end). Changing it does not retrain a complete stage."""
    log_every: int = 10
    """Print a line (and write TensorBoard scalars) every N optimizer steps. Changing it does not
    retrain a complete stage."""
    device: str = "auto"
    """auto, cpu, cuda or cuda:N; under torchrun, auto and cuda mean each rank's own GPU."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Compute dtype for the drafter (master weights stay float32)."""
    attention: Literal["auto", "chunked", "flex", "reference"] = "auto"
    """TTT attention kernel: auto = compiled flex attention on CUDA, a memory-lean chunked
    kernel elsewhere; reference = naive [L, L+i] scores (tests)."""
    compile: Literal["auto", "on", "off"] = "auto"
    """torch.compile the TTT loss (its unrolled steps as one graph: norms, rotary, SwiGLU and the
    draft-vocab softmax fused, flex attention inside; train.ttt.TTTLoss). auto: on with CUDA,
    packed batches and flex attention (fixed shapes: one compile, paid in the first steps); off
    otherwise (the chunked kernel does not trace, padded shapes would recompile, and compiling
    on a CPU takes minutes)."""
    heldout_samples: Union[int, Literal["auto"]] = "auto"
    """Samples held out of training to measure the drafter on data it never saw: whole
    conversations, chosen by the seed, so no conversation is on both sides. auto = min(256, 5 %
    of the samples, rounded down); 0 = none (no held-out figures, the last step's drafter is the
    drafter)."""
    eval_every: Union[int, Literal["auto"]] = "auto"
    """Evaluate on the held-out samples every N steps (and at the end): teacher-forced accuracy
    per TTT position, its simulated tau, the learning curve (train/learning_curve.png) and an
    OVERFITTING line in the log when the held-out figure falls while the training figure rises.
    The best drafter by held-out figure (keep_best) is kept in train/best/ and becomes train/drafter/
    (what evaluate and export use); the last step's is train/last/. auto = about 10 evaluations
    per run; 0 = only at the end. Changing it retrains: another cadence can pick another best."""
    keep_best: Literal["greedy", "sampled"] = "greedy"
    """The held-out figure that picks train/best/ (and so train/drafter/): greedy = simulated tau
    of greedy decoding (teacher-forced top-1 per TTT position); sampled = simulated tau of
    speculative sampling at evaluate.temperature (1 when evaluate is greedy), for a server that
    samples. With sampled, changing evaluate.temperature retrains a complete stage (another
    temperature can pick another best); the learning curve and the OVERFITTING line follow the
    chosen figure."""
    heldout_engine_prompts: int = 16
    """At the end, the best drafter's tau measured by evaluate's speculative decoding (greedy
    EAGLE-3 chain, depth ttt_steps capped by evaluate.draft_steps, 64 new tokens per prompt, batch
    1) on the first user turn of this many held-out conversations, beside the simulated tau
    (manifest metrics.heldout.engine, `status`). Offline it loads the target as evaluate does;
    online it reuses the training one. 0 = off. Changing it does not retrain a complete stage (to
    measure a complete one, rerun train with --force)."""
    peak_tflops: Optional[float] = None
    """Peak dense TFLOP/s of one device in the compute dtype, for MFU; default from a device table.
    Changing it does not retrain a complete stage."""
    head_init: Literal["random", "target"] = "target"
    """Initial drafter lm_head: the target's lm_head rows of the draft vocab (the drafter then
    starts by reading its hidden state the way the target reads its own), or random. target won
    the training ablation (benchmarks/bench_ablation.py, variant head_target; with lr 3e-3 the
    combination that beat the `speculators` peer); a frozen head (train_head false), Muon and
    ttt_decay 1 alone lost there (4,096 tokens a step)."""
    train_head: bool = True
    """Train the lm_head. false: it keeps its initial value (with head_init target: the target's
    own head, frozen, as speculators trains)."""
    online: bool = False
    """Run the target forward inside training on prepare's token shards (data/, or regen/)
    instead of reading capture/: the capture stage is skipped and nothing is written for the
    hidden states. The target (target.*) is loaded next to the drafter; its states are batched
    by capture.batch_tokens and rounded to capture.storage_dtype, as offline, so the same data
    and seed train the same drafter."""


SPEC_METHODS = ("eagle3_chain", "eagle3_tree", "ngram", "hybrid")
"""The speculative decoders evaluate measures, in the order it runs them (evaluate/measure.py)."""
EVALUATE_METHODS = (*SPEC_METHODS, "plain")
"""Every name evaluate.methods takes: the speculative decoders and plain decoding (the reference)."""


@dataclass
class EvaluateConfig:
    """Speculative decoding with the trained drafter, against plain decoding."""

    benchmarks: list[str] = field(default_factory=lambda: ["mtbench"])
    """mtbench, humaneval, or paths to JSONL files with a `prompt` or `turns` field."""
    max_prompts: Optional[int] = None
    """Use at most this many prompts per benchmark."""
    max_new_tokens: int = 128
    """Longest answer per prompt and turn, in tokens."""
    draft_steps: int = 5
    """Chain length k: tokens drafted per target verification."""
    check_lossless: bool = True
    """Assert that speculative output equals plain greedy output on every prompt (at temperature > 0,
    whose outputs are draws: on the first 4 turns decoded greedily as well, 64 new tokens). Turning it
    off after it stopped resumes the evaluation with the turns already measured."""
    methods: list[str] = field(default_factory=lambda: list(EVALUATE_METHODS))
    """Decoders to measure: eagle3_chain, eagle3_tree, ngram (prompt lookup, the baseline), hybrid
    (the drafter's tree and the n-gram continuation in one verification tree), plain (the
    reference; always run)."""
    max_turns: int = 2
    """Turns per multi-turn prompt (MT-Bench has 2); turn n follows the target's own answer to turn n-1."""
    tree_depth: int = 5
    """EAGLE-2 tree: maximum draft depth."""
    tree_topk: int = 4
    """EAGLE-2 tree: children expanded per node, and nodes expanded per depth."""
    tree_budget: int = 16
    """EAGLE-2 tree: draft tokens verified per target forward: the chain (the top-1 path to
    tree_depth), then the best by draft probability."""
    ngram_max: int = 3
    """Prompt lookup: longest n-gram matched against the context (down to 1)."""
    ngram_steps: Optional[int] = None
    """Prompt lookup: tokens drafted per verification; unset: draft_steps. The baseline's own setting,
    so that evaluating a drafter at its trained depth does not shorten n-gram's drafts too."""
    hybrid_trust_ngram: int = 0
    """The hybrid method: a round whose prompt lookup matched at least this many tokens and filled its
    draft length verifies the lookup alone (the drafter drafts no tree; its feed still runs), so a
    round that copies pays no drafter. 0: the drafter drafts every round (both in one tree)."""
    temperature: float = 0.0
    """0 = greedy (lossless check applies); > 0 samples, verified by speculative rejection sampling.
    The temperature you serve at: the headline figures, `status` and train.keep_best use it."""
    temperatures: Optional[list[float]] = None
    """Temperatures to measure at in one run, e.g. [0, 0.7, 1.0] (each row of results.json and each
    table of the report names its own); `temperature` is measured too when the list leaves it out.
    Unset: [temperature]."""
    seed: int = 0
    """Seed of the sampling generators (temperature > 0)."""
    batch_sizes: list[int] = field(default_factory=lambda: [1])
    """Batch sizes to measure; 1 gives the per-prompt report, larger ones speedup at that batch size."""
    step_costs: bool = True
    """Measure the target's forward time over 1..64 tokens and the drafter's step time (for `plan`)."""
    fast: Literal["auto", "off", "static", "graphs", "compile"] = "auto"
    """Decoding path, the same for plain decoding (the baseline) and every method: off = eager
    transformers with its dynamic KV cache; static = static KV caches; graphs = static caches and
    CUDA graphs; compile = graphs around a torch.compile'd target forward. auto = graphs on a GPU,
    off on a CPU."""
    verify_gemm: Literal["auto", "cublas", "skinny"] = "cublas"
    """The target's matmuls of up to 16 rows on a fast path (static/graphs/compile), plain decoding's
    one-row step and every verify forward alike: cublas = torch's F.linear; skinny = a Triton kernel
    that reads each weight once whatever the row count, tuned per weight shape at the fast path's start
    (speculate/skinny.py; a verify row then rounds as the one-row step does); auto = skinny where it
    runs (CUDA, Triton, bf16/fp16), else cublas. Measured on an H100 (8B-shaped Llama, BENCHMARKS.md,
    twenty-seventh session): skinny is the faster at every row count, one row included (7.64 against
    7.98 ms a forward); the default stays cublas until a pipeline run on the GPU reference target uses it.
    skinny where the kernel cannot run is an error."""
    resident: bool = True
    """true (default): EAGLE-3 (chain or tree, greedy or sampled) on a fast path (static/graphs/compile;
    `fast: auto` on a GPU) runs each round on the device: drafting, tree selection, verification,
    acceptance and the cache updates as tensor ops (one CUDA graph per round under graphs), the host
    reading one flag per round. Eager decoding and other proposers take the host loop. false: the host
    loop for everything, which reads drafts and the target's tokens back every round. Greedy: the same
    outputs and statistics either way; sampled: the same law (tests; docs/fast-paths.md)."""
    compile_round: Literal["auto", "on", "off"] = "auto"
    """Resident rounds only: torch.compile (inductor, fullgraph, static shapes) the round's pure tensor
    parts (tree selection and masks, acceptance, the bookkeeping of the commit and the drafter's feed),
    fusing their small kernels inside the round's CUDA graph (CPU count, 12-layer reference-shaped
    chain round: 167 -> 24 kernels; benchmarks/count_round_ops.py). Compiling costs seconds per round
    shape (batch size, tree, max_new_tokens). auto = off until an H200 measurement shows the gain
    (`bench_resident.py --compile_round`); on = compile (a CPU too); off = eager parts. Same outputs
    and statistics either way (tests)."""


EXPORT_FORMATS = ("sglang", "vllm")
"""Every name export.formats takes: one converter each (export/sglang.py, export/vllm.py)."""


@dataclass
class ExportConfig:
    """Converters to serving formats."""

    formats: list[str] = field(default_factory=lambda: ["sglang"])
    """Any of: sglang, vllm."""
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """Dtype of the exported weights (d2t and t2d keep theirs)."""
    verifier: Optional[str] = None
    """The target as the serving machine names it (hub id or path), written into the vLLM
    export's speculators_config.verifier; default target.path."""
    num_speculative_tokens: int = 3
    """Draft tokens per step written into the vLLM export (vLLM's default for the drafter)."""
    with_embeddings: Optional[bool] = None
    """Write embed_tokens (the target's input embedding). Unset: in the vLLM export, not in the
    SGLang one. SGLang always uses the target's; speculators' own loader does not fill a missing
    one (it drafts with random rows, no error), so the vLLM (speculators-format) export ships it."""


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
    """Seed of training: the drafter's initial weights, the held-out split and the batch order."""
    target: TargetConfig = field(default_factory=TargetConfig)
    prepare: PrepareConfig = field(default_factory=PrepareConfig)
    regenerate: RegenerateConfig = field(default_factory=RegenerateConfig)
    capture: CaptureConfig = field(default_factory=CaptureConfig)
    vocab: VocabConfig = field(default_factory=VocabConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    export: ExportConfig = field(default_factory=ExportConfig)


STAGES = ("prepare", "regenerate", "capture", "vocab", "train", "evaluate", "export")


def heldout_sample_temperature(recipe: Recipe) -> float:
    """The temperature of train's held-out sampled figure: evaluate's when it samples, else 1."""
    return float(recipe.evaluate.temperature) or 1.0


def field_docs(cls: type) -> dict[str, str]:
    """Field name -> the docstring under it in a dataclass body: the help of commands whose flags
    argparse builds (jsonargparse reads the same docstrings itself)."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    return {a.target.id: " ".join(b.value.value.split()) for a, b in zip(body, body[1:])
            if isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name) and isinstance(b, ast.Expr)
            and isinstance(b.value, ast.Constant) and isinstance(b.value.value, str)}


def cli_parser(prog: str, description: str, **kwargs) -> ArgumentParser:
    """A jsonargparse parser whose dataclass flags show their field's docstring as help."""
    set_parsing_settings(docstring_parse_attribute_docstrings=True)  # jsonargparse leaves them out by default
    return ArgumentParser(prog=prog, description=description, default_env=False, **kwargs)


def recipe_parser(prog: str, description: str) -> ArgumentParser:
    """The parser of `draftsmith STAGE [RECIPE.yaml] [--section.key value ...]`: every Recipe field is a flag."""
    p = cli_parser(prog, description, exit_on_error=False)
    p.add_argument("--config", action=ActionConfigFile, help="recipe YAML (the first positional path is taken as this)")
    p.add_argument("--force", type=bool, nargs="?", const=True, default=False,
                   help="redo the stage(s) even when complete (a plain flag; `--force true/false` also works)")
    p.add_class_arguments(Recipe, None, fail_untyped=True)
    return p


MAX_RECIPE_BYTES = 1 << 20
MAX_YAML_NODES = 100_000
"""A recipe is a few hundred nodes; past this many (aliases expanded) it is an alias bomb."""


def check_yaml_file(path: Path) -> None:
    """Refuse a YAML file that is too large, or whose aliases expand past MAX_YAML_NODES nodes (the
    "billion laughs": a few lines whose expansion would take every byte of memory downstream)."""
    try:
        size = path.stat().st_size
        if not path.is_file():
            raise DraftsmithError(f"{path}: not a file; give a recipe YAML file")
        if size > MAX_RECIPE_BYTES:
            raise DraftsmithError(f"{path}: {size:,} bytes, too large for a recipe (limit {MAX_RECIPE_BYTES:,}); "
                                  "give the recipe YAML, not a data file")
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise DraftsmithError(f"{path}: not UTF-8 text (byte {e.start}); save the recipe as UTF-8") from None
    except OSError as e:
        raise DraftsmithError(f"{path}: cannot read the recipe ({e.strerror or e}); check the path and its permissions") from None
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        raise DraftsmithError(f"{path}: not valid YAML ({' '.join(str(e).split())[:200]}); fix the recipe") from None
    sizes: dict[int, int] = {}

    def expanded(node) -> int:  # nodes after alias expansion; shared nodes are counted once per use, computed once
        key = id(node)
        if key not in sizes:
            sizes[key] = 1  # a cycle (a recursive alias) counts once instead of looping
            children = node.value if isinstance(node.value, list) else []
            total = 1
            for c in children:
                total += sum(expanded(x) for x in c) if isinstance(c, tuple) else expanded(c)
                if total > MAX_YAML_NODES:
                    break
            sizes[key] = total
        return sizes[key]

    if root is not None and expanded(root) > MAX_YAML_NODES:
        raise DraftsmithError(f"{path}: its aliases expand to more than {MAX_YAML_NODES:,} values (a YAML alias bomb); "
                              "write the recipe without nested aliases")


def _limits(recipe: "Recipe") -> list[tuple[str, object, Optional[float], Optional[float], bool]]:
    """(key, value, lowest, highest, may be unset) of every count, size and budget in a recipe."""
    p, r, c, v, t, e, x = recipe.prepare, recipe.regenerate, recipe.capture, recipe.vocab, recipe.train, recipe.evaluate, recipe.export
    big = 1 << 24  # tokens in one sample / answer: far past any model's positions
    return [
        ("prepare.max_length", p.max_length, 2, big, False), ("prepare.samples_per_shard", p.samples_per_shard, 1, 1 << 20, False),
        ("prepare.skip_samples", p.skip_samples, 0, None, False), ("prepare.max_samples", p.max_samples, 0, None, True),
        ("prepare.min_loss_tokens", p.min_loss_tokens, 1, big, False),
        ("regenerate.max_new_tokens", r.max_new_tokens, 1, big, False), ("regenerate.max_turns", r.max_turns, 1, big, True),
        ("regenerate.batch_size", r.batch_size, 1, 1 << 16, False),
        ("regenerate.concurrency", r.concurrency, 1, 1 << 12, False), ("regenerate.timeout_s", r.timeout_s, 1e-3, None, False),
        ("regenerate.max_retries", r.max_retries, 0, 100, False), ("regenerate.retry_delay_s", r.retry_delay_s, 0, 3600, False),
        ("regenerate.temperature", r.temperature, 0, 100, False),
        ("capture.batch_tokens", c.batch_tokens, 1, 1 << 30, False),
        ("vocab.draft_vocab_size", v.draft_vocab_size, 1, 1 << 24, False),
        ("train.ttt_steps", t.ttt_steps, 1, MAX_DRAFT_STEPS, False), ("train.ttt_decay", t.ttt_decay, 1e-6, 1, False),
        ("train.ttt_align_topk", t.ttt_align_topk, 0, 1 << 24, False),
        ("train.ttt_target_temperature", t.ttt_target_temperature, 0, 100, False),
        ("train.epochs", t.epochs, 1e-9, 1e6, False), ("train.max_steps", t.max_steps, 1, 1e9, True),
        ("train.max_tokens", t.max_tokens, 0, None, False), ("train.max_minutes", t.max_minutes, 0, None, False),
        ("train.batch_tokens", t.batch_tokens, 1, 1 << 32, False), ("train.micro_batch_tokens", t.micro_batch_tokens, 1, 1 << 32, True),
        ("train.max_length", t.max_length, 3, big, False), ("train.lr", t.lr, 1e-12, 10, False),
        ("train.weight_decay", t.weight_decay, 0, 10, False), ("train.muon_lr", t.muon_lr, 1e-12, 10, True),
        ("train.warmup_steps", t.warmup_steps, 0, 1e9, False), ("train.min_lr_ratio", t.min_lr_ratio, 0, 1, False),
        ("train.grad_clip", t.grad_clip, 0, None, False), ("train.save_every", t.save_every, 1, None, False),
        ("train.log_every", t.log_every, 1, None, False), ("train.heldout_samples", t.heldout_samples, 0, None, False),
        ("train.eval_every", t.eval_every, 0, None, False),
        ("train.heldout_engine_prompts", t.heldout_engine_prompts, 0, 1 << 20, False), ("train.peak_tflops", t.peak_tflops, 1e-6, None, True),
        ("evaluate.max_prompts", e.max_prompts, 1, None, True), ("evaluate.max_new_tokens", e.max_new_tokens, 1, big, False),
        ("evaluate.draft_steps", e.draft_steps, 1, MAX_DRAFT_STEPS, False), ("evaluate.max_turns", e.max_turns, 1, 100, False),
        ("evaluate.tree_depth", e.tree_depth, 1, MAX_DRAFT_STEPS, False), ("evaluate.tree_topk", e.tree_topk, 1, 64, False),
        ("evaluate.tree_budget", e.tree_budget, 1, 4096, False), ("evaluate.ngram_max", e.ngram_max, 1, 64, False),
        ("evaluate.ngram_steps", e.ngram_steps, 1, MAX_DRAFT_STEPS, True),
        ("evaluate.hybrid_trust_ngram", e.hybrid_trust_ngram, 0, 64, False),
        ("evaluate.temperature", e.temperature, 0, 100, False),
        *((f"evaluate.batch_sizes[{i}]", b, 1, 4096, False) for i, b in enumerate(e.batch_sizes)),
        ("export.num_speculative_tokens", x.num_speculative_tokens, 1, MAX_DRAFT_STEPS, False),
    ]


MAX_DRAFT_STEPS = 64
"""Draft steps / TTT steps / tree depth: EAGLE-3 drafters accept a handful; past this a value is a typo."""

_LOWEST_MEANS = {"train.max_tokens": "0 = no budget", "train.max_minutes": "0 = no budget"}
"""What the lowest value of a limit means, where it is a setting of its own (said in the error)."""


COMMAND_LINE = "command line"
"""The source label of a value given as a flag (`command line --train.lr`), beside recipe file paths."""

Where = Union[str, "RecipeSources"]
"""Where checked values came from: one label for every key (a recipe file path), or a RecipeSources
that names, key by key, the recipe file or the command-line flag that set it."""


def source_of(where: Where, key: str) -> tuple[str, str]:
    """(label, where to fix it) of `key`: ("recipe.yaml", "in the recipe") or
    ("command line --train.lr", "on the command line")."""
    label = where.label(key) if isinstance(where, RecipeSources) else str(where)
    return label, "on the command line" if label.startswith(COMMAND_LINE) else "in the recipe"


def check_choices(key: str, values: list[str], choices: tuple[str, ...], noun: str, where: Where,
                  allow_empty: bool = True) -> None:
    """Refuse a name in a list setting that is not one of `choices` (a typo found at parse time, not
    after training), and an empty list where one is needed."""
    label, place = source_of(where, key)
    bad = [v for v in values if v not in choices]
    if bad:
        raise DraftsmithError(f"{label}: {key} {', '.join(map(repr, bad))}: not a {noun}; "
                              f"choose from {', '.join(choices)} ({place})")
    if not values and not allow_empty:
        raise DraftsmithError(f"{label}: {key} is empty; choose from {', '.join(choices)} ({place})")


def check_methods(methods: list[str], where: Where) -> None:
    """evaluate.methods: decoders evaluate runs."""
    check_choices("evaluate.methods", methods, EVALUATE_METHODS, "method", where)


def check_formats(formats: list[str], where: Where) -> None:
    """export.formats: converters export has, at least one."""
    check_choices("export.formats", formats, EXPORT_FORMATS, "format", where, allow_empty=False)


def recipe_keys() -> list[tuple[str, type, object]]:
    """(dotted key, type hint, default) of every recipe key: the top-level ones (`seed`) and every
    key of every section (`train.lr`), in the dataclasses' order."""
    out = []
    for f in dataclasses.fields(Recipe):
        hint = typing.get_type_hints(Recipe)[f.name]
        if dataclasses.is_dataclass(hint):
            out += [(f"{f.name}.{g.name}", h, getattr(hint(), g.name))
                    for g, h in ((g, typing.get_type_hints(hint)[g.name]) for g in dataclasses.fields(hint))]
        else:
            out.append((f.name, hint, getattr(Recipe(), f.name)))
    return out


SECTIONS = tuple(f.name for f in dataclasses.fields(Recipe) if dataclasses.is_dataclass(typing.get_type_hints(Recipe)[f.name]))
"""Recipe keys that hold a section of keys (`train:` and its keys under it)."""


def _allows_none(hint) -> bool:
    return hint is type(None) or (typing.get_origin(hint) is Union and type(None) in typing.get_args(hint))


def _kind_of(hint) -> str:
    """What a value of `hint` is, in words, for an error: `a number`, `one of skip, fail`."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return "one of " + ", ".join(map(str, args))
    if origin is Union:
        return " or ".join(_kind_of(a) for a in args if a is not type(None))
    if hint is bool:
        return "true or false"
    if hint in (int, float):
        return "a number"
    if hint is str:
        return "a string"
    return {list: "a list", dict: "a mapping"}.get(origin, f"a {getattr(hint, '__name__', hint)}")


def check_sections(path: Path) -> None:
    """Refuse a recipe file whose top-level value is not a mapping of keys, or one of whose sections
    (`train:`) holds something other than its keys (`train: 5`, an empty `train:`), naming the key:
    the parser would fail with a traceback on either."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8-sig"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return  # check_yaml_file said why
    if data is None or not isinstance(data, dict):
        return  # the parser's own one-line error ("Unexpected config")
    for name in SECTIONS:
        if name in data and not isinstance(data[name], dict):
            value = data[name]
            what = "empty" if value is None else f"{json.dumps(value, default=str)[:60]}, not a mapping of its keys"
            raise DraftsmithError(f"{path}: section {name} is {what}; write {name}'s keys indented under `{name}:` "
                                  f"(`draftsmith run --help` lists them), or leave {name} out for its defaults (in the recipe)")


def check_recipe(recipe: "Recipe", where: Where, only: Optional[tuple[str, ...]] = None) -> None:
    """Refuse, at parse time, counts, sizes and budgets that are negative, zero where a stage needs
    one, or absurd (a million draft steps): before any stage starts or touches its output. With
    `only`, just those sections ("vocab") or keys ("train.ttt_steps"): a stage checking the values it
    cannot run without in a Recipe built in code (which never went through parse_recipe). Each error
    names where the value came from (`where`: the recipe file, or the flag that set it)."""
    def wanted(key: str) -> bool:
        return only is None or key in only or key.split(".")[0] in only

    for key, hint, _ in recipe_keys():  # a null where the key needs a value: a stage would fail on it much later
        section, _, name = key.rpartition(".")
        if wanted(key) and getattr(getattr(recipe, section) if section else recipe, name) is None and not _allows_none(hint):
            label, place = source_of(where, key)
            raise DraftsmithError(f"{label}: {key} is null; give {_kind_of(hint)} {place}")
    for key, value, lo, hi, optional in _limits(recipe):
        if not wanted(key):
            continue
        if value == "auto":  # the fields that take "auto" (heldout_samples, eval_every): the parser checked the type
            continue
        label, place = source_of(where, key)
        if value is None:
            if optional:
                continue
            raise DraftsmithError(f"{label}: {key} is null; give a number {place}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (isinstance(value, float) and not math.isfinite(value)):
            raise DraftsmithError(f"{label}: {key} {value!r}: not a finite number; fix the value {place}")
        if lo is not None and value < lo:
            notes = [n for n in ("or null" if optional else None, _LOWEST_MEANS.get(key)) if n]
            said = f" ({'; '.join(notes)})" if notes else ""
            raise DraftsmithError(f"{label}: {key} {value}: must be >= {lo:g}{said}; fix the value {place}")
        if hi is not None and value > hi:
            raise DraftsmithError(f"{label}: {key} {value}: must be <= {hi:g} (larger is not a real setting); fix the value {place}")
    if wanted("evaluate.methods"):
        check_methods(recipe.evaluate.methods, where)
    if wanted("export.formats"):
        check_formats(recipe.export.formats, where)
    if wanted("evaluate.temperatures") and recipe.evaluate.temperatures is not None:
        label, place = source_of(where, "evaluate.temperatures")
        temps = recipe.evaluate.temperatures
        if not isinstance(temps, (list, tuple)) or not temps:
            raise DraftsmithError(f"{label}: evaluate.temperatures {temps!r} is empty or not a list; give a list such as "
                                  f"[0, 0.7, 1.0], or leave it unset for evaluate.temperature alone, {place}")
        for t in temps:
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or not 0 <= t <= 100:
                raise DraftsmithError(f"{label}: evaluate.temperatures {list(temps)!r}: {t!r} is not a temperature (a number, "
                                      f"0 for greedy, up to 100); fix the list {place}")
    if wanted("evaluate.batch_sizes") and not recipe.evaluate.batch_sizes:
        label, place = source_of(where, "evaluate.batch_sizes")
        raise DraftsmithError(f"{label}: evaluate.batch_sizes is empty; give at least one, e.g. [1], {place}")
    if wanted("train.micro_batch_tokens") and recipe.train.micro_batch_tokens is not None \
            and recipe.train.micro_batch_tokens > recipe.train.batch_tokens:
        # the flag that set either side, if one did (that is the value the user just typed), else the file
        labels = [source_of(where, k) for k in ("train.micro_batch_tokens", "train.batch_tokens")]
        label, place = next((s for s in labels if s[1] == "on the command line"), labels[0])
        raise DraftsmithError(f"{label}: train.micro_batch_tokens {recipe.train.micro_batch_tokens} > train.batch_tokens "
                              f"{recipe.train.batch_tokens}; make the micro-batch at most the batch {place}")


BOOL_WORDS = ("true", "false", "yes", "no", "on", "off")
"""What may follow `--force` as its value (jsonargparse's bool words); anything else is the next argument."""


class RecipeSources:
    """Which input set each recipe key, read from the argv of `parse_recipe`: recipe files
    (`--config FILE`, the positional recipe becomes one) and `--section.key value` flags, the later
    one winning as in the parser. A key nobody set (a default) is the first recipe file's, where one
    was given: that is where the user would set it."""

    def __init__(self, argv: list[str]):
        self.setters: list[tuple[str, set[str]]] = []  # (label, keys it sets), in argv order
        self.files: list[str] = []
        i = 0
        while i < len(argv):
            arg = argv[i]
            if arg.startswith("--") and len(arg) > 2:
                name, eq, value = arg[2:].partition("=")
                if name == "config":
                    path = value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
                    if path:
                        self.files.append(path)
                        self.setters.append((path, _yaml_keys(Path(path))))
                elif name not in ("force", "help", "print_config"):
                    self.setters.append((f"{COMMAND_LINE} --{name}", {name}))
            i += 1

    def label(self, key: str) -> str:
        key = key.split("[")[0]  # evaluate.batch_sizes[2] -> evaluate.batch_sizes
        for label, keys in reversed(self.setters):
            if any(k == key or key.startswith(k + ".") for k in keys):
                return label
        return self.files[0] if self.files else COMMAND_LINE


def _yaml_keys(path: Path) -> set[str]:
    """Dotted keys a recipe file sets (`train.lr`); empty when it cannot be read (the parser says why)."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8-sig"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return set()
    keys: set[str] = set()

    def walk(node, prefix: str) -> None:
        for k, v in node.items() if isinstance(node, dict) else ():
            name = f"{prefix}{k}"
            keys.add(name)
            walk(v, name + ".")

    walk(data, "")
    return keys


def _config_args(argv: list[str]) -> list[tuple[list[str], str]]:
    """The `--config FILE` arguments of argv, each as it is given (one or two items), with its FILE."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] == "--config" and i + 1 < len(argv):
            out.append((argv[i:i + 2], argv[i + 1]))
            i += 2
            continue
        if argv[i].startswith("--config="):
            out.append(([argv[i]], argv[i].partition("=")[2]))
        i += 1
    return out


def _parse_error(p: ArgumentParser, argv: list[str], err: BaseException, prog: str) -> DraftsmithError:
    """The one-line error of a recipe the parser refused, naming its source: the recipe file whose
    value or key is wrong (its files are parsed alone, one more at a time, to find it), else the
    command line and, where the parser names it, the flag."""
    keys = f"`{prog if prog.split()[-1] in (*STAGES, 'run') else 'draftsmith run'} --help` lists the keys"  # doctor's, probe's --help do not
    for n, (_, path) in enumerate(configs := _config_args(argv)):
        try:
            p.parse_args([a for args, _ in configs[:n + 1] for a in args])
        except (argparse.ArgumentError, SystemExit) as e:
            return DraftsmithError(f"{path}: {' '.join(str(e).split())}; fix the key or value in the recipe ({keys})")
    msg = " ".join(str(err).split())
    key = re.search(r'(?:Parser key|Key) "([^"]+)"', msg)
    label = f"{COMMAND_LINE} --{key.group(1)}" if key else COMMAND_LINE
    return DraftsmithError(f"{label}: {msg}; fix the flag ({keys})")


def parse_recipe(argv: list[str], prog: str = "draftsmith run") -> tuple[Recipe, bool]:
    """Parse a recipe from `[RECIPE.yaml] [--section.key value ...]`; values are checked (check_recipe).
    An error names the source of the bad value: the recipe file, or `command line --section.key`."""
    if argv[:1] == ["--force"] and len(argv) > 1 and not argv[1].startswith("-") and argv[1].lower() not in BOOL_WORDS:
        argv = [*argv[1:], "--force"]  # `draftsmith run --force RECIPE.yaml`: the flag, then the recipe
    if argv and not argv[0].startswith("-"):
        argv = ["--config", argv[0], *argv[1:]]
    for _, name in _config_args(argv):  # the positional recipe and any further --config FILE
        path = Path(name)
        if not path.exists():
            raise DraftsmithError(f"{path}: recipe not found; give a YAML file such as recipes/quickstart.yaml")
        check_yaml_file(path)
        check_sections(path)
    p = recipe_parser(prog, "")
    try:
        cfg = p.parse_args(argv)
    except (argparse.ArgumentError, SystemExit) as e:
        raise _parse_error(p, argv, e, prog) from None
    force = bool(cfg.pop("force", False))
    cfg.pop("config", None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            init = p.instantiate_classes(cfg)
        except (TypeError, ValueError) as e:  # a section given as something else than its keys (e.g. by a flag)
            raise DraftsmithError(f"{RecipeSources(argv).files[0] if RecipeSources(argv).files else COMMAND_LINE}: "
                                  f"{' '.join(str(e).split())[:200]}; give each section's keys under it "
                                  "(`draftsmith run --help` lists them)") from None
    recipe = Recipe(**{k: init[k] for k in Recipe.__dataclass_fields__})
    check_recipe(recipe, RecipeSources(argv))
    return recipe, force
