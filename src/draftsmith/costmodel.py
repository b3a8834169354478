"""The cost model: what a target's forward costs, from its config.json alone or from measurements.
Shared by plan (predictions), evaluate (the bandwidth roofline of plain decoding, step-cost
overheads), status and doctor (target facts, memory fit). No torch: a leaf that reads JSON.

    TargetSpec / target_spec(config.json)   parameters, weight bytes (quantization-aware), KV bytes, FLOPs;
                                            MoE: n * (1 - (1 - t/n)^T) distinct experts per layer for T tokens
    drafter_params                          parameters an EAGLE-3 drafter reads per step
    Hardware / HARDWARE                     per-GPU bandwidth, FLOP/s, interconnect of known machines
    MeasuredCost                            step costs measured by the evaluate stage, interpolated
    RooflineCost                            max(bytes / bandwidth, FLOPs / FLOP/s) + tensor-parallel AllReduces,
                                            optionally calibrated to a measured decode step
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional, Protocol, Sequence, Union

from .fileio import read_json
from .messages import DraftsmithError
from .compat import mtp_layers


def expected_tokens(accept: Sequence[float]) -> float:
    """Tokens emitted per verification for a chain whose draft i is accepted with probability
    accept[i] given drafts 0..i-1 were: E = 1 + sum_i prod_{j<=i} a_j. With a_j = alpha this is
    Leviathan's (1 - alpha^(k+1)) / (1 - alpha). (plan's predictions; train's simulated tau.)"""
    e, p = 1.0, 1.0
    for a in accept:
        p *= a
        e += p
    return e

# ----------------------------------------------------------------------------- the target, from config.json


@dataclass
class TargetSpec:
    """What the cost model needs from a target's config.json (text config of a wrapper)."""

    name: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    dense_params: int
    """Parameters every token reads: attention, dense MLPs, shared experts, norms, lm_head."""
    expert_params: int = 0
    """Parameters of ONE routed expert (gate, up, down)."""
    moe_layers: int = 0
    num_experts: int = 0
    experts_per_token: int = 0
    kv_bytes_per_token: int = 0
    """KV-cache bytes per token over all layers."""
    attn_width: int = 0
    """heads * head_dim, for attention FLOPs over the context."""
    dense_bytes_per_param: float = 2.0
    expert_bytes_per_param: float = 2.0
    mtp_layers: int = 0

    def weight_bytes(self) -> float:
        """Bytes of all weights (what must fit in GPU memory)."""
        return self.dense_params * self.dense_bytes_per_param + \
            self.expert_params * self.moe_layers * self.num_experts * self.expert_bytes_per_param

    def total_params(self) -> int:
        return self.dense_params + self.expert_params * self.moe_layers * self.num_experts

    def experts_touched(self, tokens: int) -> float:
        """Distinct routed experts per MoE layer for `tokens` tokens with top-t routing over n
        experts, routing taken as uniform and independent: n * (1 - (1 - t/n)^tokens)."""
        n, t = self.num_experts, self.experts_per_token
        return n * (1 - (1 - t / n) ** tokens) if n else 0.0

    def bytes_read(self, tokens: int) -> float:
        """Weight bytes one forward over `tokens` tokens reads from memory."""
        return self.dense_params * self.dense_bytes_per_param + \
            self.expert_params * self.moe_layers * self.experts_touched(tokens) * self.expert_bytes_per_param

    def flops(self, tokens: int, context: int) -> float:
        active = self.dense_params + self.expert_params * self.moe_layers * self.experts_per_token
        return 2.0 * active * tokens + 4.0 * tokens * context * self.attn_width * self.num_layers


def text_config_dict(cfg: dict) -> dict:
    """The text model's part of a config.json dict (a multimodal wrapper nests it)."""
    return cfg.get("text_config") or cfg.get("language_config") or cfg


def _quant_bits(cfg: dict) -> Optional[int]:
    """Weight bits declared by a quantization_config (compressed-tensors, AWQ, GPTQ), else None."""
    q = cfg.get("quantization_config") or {}
    if not isinstance(q, dict):
        return None
    if q.get("bits"):
        return int(q["bits"])
    for group in (q.get("config_groups") or {}).values():
        bits = ((group or {}).get("weights") or {}).get("num_bits")
        if bits:
            return int(bits)
    return None


def target_spec(config: Union[str, Path, dict], weight_bits: Optional[float] = None,
                expert_weight_bits: Optional[float] = None) -> TargetSpec:
    """TargetSpec from a config.json path, a model folder, or a config dict (see _target_spec);
    a config that is not an object, or holds a size that is not a number, is one line."""
    where = config.get("_name_or_path", "target") if isinstance(config, dict) else str(config)
    if not isinstance(config, dict):
        p = Path(config)
        p = p / "config.json" if p.is_dir() else p
        where = str(p)
        config = read_json(p)
        if not isinstance(config, dict):
            raise DraftsmithError(f"{p}: a JSON {type(config).__name__}, not a model config; give the config.json of a causal LM")
        config = {**config, "_name_or_path": config.get("_name_or_path", p.parent.name)}
    try:
        return _target_spec(config, weight_bits, expert_weight_bits)
    except (ValueError, TypeError, AttributeError, ZeroDivisionError) as e:
        raise DraftsmithError(f"{where}: a size in the config is not a number ({' '.join(str(e).split())[:120]}); "
                              "give the config.json of a causal LM") from None


def _target_spec(config: dict, weight_bits: Optional[float] = None,
                 expert_weight_bits: Optional[float] = None) -> TargetSpec:
    """TargetSpec from a config.json path, a model folder, or a config dict.

    Weight bytes: the config's dtype (2 for bf16), except that a quantization_config's bit width
    applies to routed experts (INT4 MoE checkpoints such as Kimi-K2.5 quantize only the experts),
    plus one 16-bit scale per 32 weights. `weight_bits`/`expert_weight_bits` override."""
    if not isinstance(config, dict):
        p = Path(config)
        p = p / "config.json" if p.is_dir() else p
        config = read_json(p)
        name = p.parent.name
    else:
        name = config.get("_name_or_path", "target")
    full, c = config, text_config_dict(config)
    g = lambda *keys, default=None: next((c[k] for k in keys if c.get(k) is not None), default)  # noqa: E731
    try:
        H, L, V = int(c["hidden_size"]), int(c["num_hidden_layers"]), int(c["vocab_size"])
    except KeyError as e:
        raise DraftsmithError(f"{name} config.json: no {e.args[0]}; give the config.json of a causal LM "
                              "(hidden_size, num_hidden_layers, vocab_size)") from None
    heads = int(g("num_attention_heads", default=1))
    kv_heads = int(g("num_key_value_heads", default=heads))
    head_dim = int(g("head_dim", default=H // heads))
    dtype = str(g("torch_dtype", "dtype", default=full.get("torch_dtype") or "bfloat16"))
    dense_bytes = {"float32": 4.0, "float16": 2.0, "bfloat16": 2.0}.get(dtype, 2.0)

    if c.get("kv_lora_rank"):  # MLA (DeepSeek-V3, Kimi-K2): latent KV cache
        nope, rope, vh = int(c["qk_nope_head_dim"]), int(c["qk_rope_head_dim"]), int(c.get("v_head_dim") or nope)
        qr, kvr = c.get("q_lora_rank"), int(c["kv_lora_rank"])
        q = H * int(qr) + int(qr) * heads * (nope + rope) if qr else H * heads * (nope + rope)
        attn = q + H * (kvr + rope) + kvr * heads * (nope + vh) + heads * vh * H + int(qr or 0) + kvr  # + latent norms
        kv_per_layer, attn_width = (kvr + rope) * 2, heads * (nope + rope)
    else:
        attn = 2 * H * heads * head_dim + 2 * H * kv_heads * head_dim
        attn += 2 * head_dim if str(c.get("model_type", "")).startswith("qwen3") else 0  # q/k norms
        kv_per_layer, attn_width = 2 * kv_heads * head_dim * 2, heads * head_dim

    n_exp = int(g("n_routed_experts", "num_experts", "num_local_experts", default=0) or 0)
    top = int(g("num_experts_per_tok", "moe_topk", default=0) or 0)
    inter = int(g("intermediate_size", default=4 * H))
    moe_inter = int(g("moe_intermediate_size", default=inter))
    if n_exp and top:
        first_dense = int(g("first_k_dense_replace", default=0))
        step = int(g("moe_layer_freq", "decoder_sparse_step", default=1) or 1)
        moe_layers = sum(1 for i in range(first_dense, L) if i % step == 0) if step > 1 else L - first_dense
        shared = int(g("n_shared_experts", default=0) or 0) * 3 * H * moe_inter
        shared += 3 * H * int(g("shared_expert_intermediate_size", default=0) or 0)  # Qwen-MoE style
        mlp = (L - moe_layers) * 3 * H * inter + moe_layers * (shared + H * n_exp)  # + router
        expert = 3 * H * moe_inter
    else:
        moe_layers, expert, mlp, n_exp, top = 0, 0, L * 3 * H * inter, 0, 0
    tied = bool(full.get("tie_word_embeddings", c.get("tie_word_embeddings", False)))
    dense = L * attn + mlp + V * H * (1 if tied else 2) + (2 * L + 1) * H
    bits = _quant_bits(full)
    expert_bytes = dense_bytes
    if bits:
        expert_bytes = bits / 8 + 2 / 32
    if weight_bits:
        dense_bytes = expert_bytes = weight_bits / 8
    if expert_weight_bits:
        expert_bytes = expert_weight_bits / 8
    if not moe_layers and bits and not weight_bits:  # a quantized dense model quantizes its linears
        dense_bytes = expert_bytes
    return TargetSpec(name=name, num_layers=L, hidden_size=H, vocab_size=V, dense_params=int(dense),
                      expert_params=int(expert), moe_layers=moe_layers, num_experts=n_exp, experts_per_token=top,
                      kv_bytes_per_token=kv_per_layer * L, attn_width=attn_width, dense_bytes_per_param=dense_bytes,
                      expert_bytes_per_param=expert_bytes, mtp_layers=mtp_layers(full))


def drafter_params(spec_or_config: Union[TargetSpec, dict], draft_vocab_size: int = 32000,
                   config: Optional[dict] = None) -> int:
    """Parameters an EAGLE-3 drafter reads per step (DESIGN.md §4): fc 3H->H, one Llama layer with
    2H-wide q/k/v input, SwiGLU MLP, lm_head H->draft vocab. The frozen embedding is a lookup."""
    c = text_config_dict(config or {})
    H = spec_or_config.hidden_size if isinstance(spec_or_config, TargetSpec) else int(spec_or_config["hidden_size"])
    heads = int(c.get("num_attention_heads") or max(H // 128, 1))
    kv = int(c.get("num_key_value_heads") or heads)
    hd = int(c.get("v_head_dim") if c.get("kv_lora_rank") else c.get("head_dim") or H // heads)
    inter = int(c.get("intermediate_size") or 8 * H // 3)
    return 3 * H * H + 2 * H * (heads + 2 * kv) * hd + heads * hd * H + 3 * H * inter + H * draft_vocab_size


# ----------------------------------------------------------------------------- hardware and step costs


@dataclass
class Hardware:
    """One GPU's figures (dense bf16) and the interconnect between the GPUs."""

    name: str
    num_gpus: int = 1
    memory_gb: float = 80.0
    mem_bw_gbps: float = 3350.0
    """Memory bandwidth per GPU, GB/s."""
    tflops: float = 989.0
    """Dense bf16 TFLOP/s per GPU."""
    interconnect_gbps: float = 450.0
    """AllReduce bus bandwidth per GPU, GB/s (NVLink ~450, PCIe 4 ~25, PCIe 5 ~50)."""
    allreduce_latency_us: float = 10.0
    """Fixed cost of one small AllReduce (launch + synchronisation)."""
    mem_efficiency: float = 0.8
    flop_efficiency: float = 0.6


HARDWARE = {
    "h200": Hardware("h200", memory_gb=141, mem_bw_gbps=4800, tflops=989, interconnect_gbps=450, allreduce_latency_us=10),
    "h100": Hardware("h100", memory_gb=80, mem_bw_gbps=3350, tflops=989, interconnect_gbps=450, allreduce_latency_us=10),
    "a100-pcie": Hardware("a100-pcie", memory_gb=80, mem_bw_gbps=1935, tflops=312, interconnect_gbps=25,
                          allreduce_latency_us=30),
    # A server of 8 PCIe GPUs without NVLink (docs/planner.md's Kimi-K2.5 example). Per-GPU figures of a 96 GB PCIe 5 card;
    # calibrate with --decode_ms_per_token and --comm_share, which is what docs/planner.md does.
    "pcie-8x": Hardware("pcie-8x", num_gpus=8, memory_gb=96, mem_bw_gbps=1792, tflops=500, interconnect_gbps=50,
                        allreduce_latency_us=40),
}


class StepCost(Protocol):
    def verify_ms(self, tokens: int, batch: int) -> float: ...
    def draft_ms(self, batch: int, rows: int = 1) -> float: ...


def _interpolate(points: dict[int, float], x: float) -> float:
    """Linear between measured points; past the last, linear from the last two but never below the
    last (more rows never cost less: noisy timings can give the last two a falling slope, which
    reached 0 ms and a division by zero in `plan` on a loaded CPU); one point: proportional."""
    xs = sorted(points)
    if x in points:
        return points[x]
    ys = [points[k] for k in xs]
    if len(xs) == 1:
        return ys[0] * x / xs[0]
    i = max(next((i for i, k in enumerate(xs) if k > x), len(xs) - 1), 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    y = y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return max(y, ys[-1]) if x > xs[-1] else max(y, 0.0)


@dataclass
class BatchCost:
    """Step costs measured at one batch size b > 1 (evaluate measures them at each batch size it runs)."""

    target_forward_ms: dict[int, float]
    """Forward time over n new tokens PER SEQUENCE (b * n rows in all), keyed by n."""
    draft_step_ms: float
    """One drafter step over one row per sequence."""
    draft_step_ms_rows: dict[int, float] = field(default_factory=dict)
    """One drafter step over r rows per sequence (a tree's frontier), keyed by r."""
    round_overhead_ms: Optional[float] = None
    plain_overhead_ms: Optional[float] = None


@dataclass
class MeasuredCost:
    """Step costs measured on the real stack: target forward time for 1..N tokens verified and the
    drafter's step time. Between measured token counts, linear interpolation; past the last, linear
    extrapolation from the last two points (a forward grows at least linearly once compute-bound).
    `by_batch` holds the same measured at other batch sizes (BatchCost); where a batch size has
    none, the batch-1 figures are scaled (verify over b * tokens, drafting like the target)."""

    target_forward_ms: dict[int, float]
    draft_step_ms: float
    round_overhead_ms: float = 0.0
    """Per speculative round, what the engine spends beyond k drafter steps and one verification
    forward (host work, the committed-row feed): evaluate measures it on the chain it ran."""
    plain_overhead_ms: float = 0.0
    """Per plain decoding step, beyond one target forward (evaluate measures it too)."""
    draft_step_ms_rows: dict[int, float] = field(default_factory=dict)
    """Batch 1: one drafter step over r rows (a tree's frontier), keyed by r."""
    by_batch: dict[int, BatchCost] = field(default_factory=dict)

    @classmethod
    def from_json(cls, d: dict, where: str = "step_costs") -> "MeasuredCost":
        try:
            pts = {int(k): float(v) for k, v in d["target_forward_ms"].items()}
            draft = float(d.get("draft_step_ms") or 0.0)
            rnd, plain = float(d.get("round_overhead_ms") or 0.0), float(d.get("plain_overhead_ms") or 0.0)
            rows = {int(k): float(v) for k, v in (d.get("draft_step_ms_rows") or {}).items()}
            if d.get("draft_step_ms_4_rows") is not None:  # evaluate's older key
                rows.setdefault(4, float(d["draft_step_ms_4_rows"]))
            by_batch = {}
            for b, c in (d.get("by_batch") or {}).items():
                opt = lambda k: None if c.get(k) is None else float(c[k])  # noqa: E731
                by_batch[int(b)] = BatchCost({int(k): float(v) for k, v in c["target_forward_ms"].items()},
                                             float(c["draft_step_ms"]),
                                             {int(k): float(v) for k, v in (c.get("draft_step_ms_rows") or {}).items()},
                                             opt("round_overhead_ms"), opt("plain_overhead_ms"))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise DraftsmithError(f"{where}: expected {{'target_forward_ms': {{'1': ms, ...}}, 'draft_step_ms': ms}} "
                                  f"({type(e).__name__}: {e}); rerun evaluate or fix the file") from None
        if 1 not in pts:
            raise DraftsmithError(f"{where}: target_forward_ms has no entry for 1 token (plain decoding); measure it")
        return cls(pts, draft, max(rnd, 0.0), max(plain, 0.0), rows, by_batch)

    def verify_ms(self, tokens: int, batch: int = 1) -> float:
        """A forward over `tokens` rows in all (batch * tokens per sequence)."""
        if batch in self.by_batch:
            return _interpolate(self.by_batch[batch].target_forward_ms, tokens / batch)
        return _interpolate(self.target_forward_ms, tokens)

    def draft_ms(self, batch: int = 1, rows: int = 1) -> float:
        """One drafter step over `rows` rows per sequence, `batch` sequences."""
        if batch in self.by_batch:
            c = self.by_batch[batch]
            if rows == 1 or c.draft_step_ms_rows:
                return _interpolate({1: c.draft_step_ms, **c.draft_step_ms_rows}, rows)
            return c.draft_step_ms * self.verify_ms(batch * rows, batch) / self.verify_ms(batch, batch)
        if rows > 1 and self.draft_step_ms_rows:  # measured over `rows` rows at batch 1; batches scale like the target
            one = _interpolate({1: self.draft_step_ms, **self.draft_step_ms_rows}, rows)
            return one * self.verify_ms(batch * rows) / self.verify_ms(rows)
        return self.draft_step_ms * self.verify_ms(batch * rows) / self.verify_ms(1)  # scales like the target

    def round_overhead(self, batch: int = 1) -> float:
        c = self.by_batch.get(batch)
        return c.round_overhead_ms if c is not None and c.round_overhead_ms is not None else self.round_overhead_ms

    def plain_overhead(self, batch: int = 1) -> float:
        c = self.by_batch.get(batch)
        return c.plain_overhead_ms if c is not None and c.plain_overhead_ms is not None else self.plain_overhead_ms


@dataclass
class RooflineCost:
    """Time of a forward over T tokens (b sequences, `context` tokens of KV each) on `hw`:
    max(bytes / bandwidth, FLOPs / FLOP/s) split over the GPUs, plus 2 AllReduces per layer of
    T * hidden activations (tensor parallel), each costing latency + 2(g-1)/g * bytes / bandwidth."""

    spec: TargetSpec
    hw: Hardware
    context: int = 2048
    drafter_params: int = 0
    act_bytes: int = 2

    def compute_ms(self, tokens: int, batch: int, weight_bytes: float, flops: float) -> float:
        g, hw = self.hw.num_gpus, self.hw
        kv = batch * self.context * self.spec.kv_bytes_per_token
        mem_s = (weight_bytes + kv) / (g * hw.mem_bw_gbps * 1e9 * hw.mem_efficiency)
        flop_s = flops / (g * hw.tflops * 1e12 * hw.flop_efficiency)
        return 1e3 * max(mem_s, flop_s)

    def comm_ms(self, tokens: int, layers: int) -> float:
        g = self.hw.num_gpus
        if g <= 1:
            return 0.0
        per = self.hw.allreduce_latency_us * 1e-6 + \
            2 * (g - 1) / g * tokens * self.spec.hidden_size * self.act_bytes / (self.hw.interconnect_gbps * 1e9)
        return 1e3 * 2 * layers * per

    def verify_ms(self, tokens: int, batch: int = 1) -> float:
        return self.compute_ms(tokens, batch, self.spec.bytes_read(tokens), self.spec.flops(tokens, self.context)) + \
            self.comm_ms(tokens, self.spec.num_layers)

    def draft_ms(self, batch: int = 1, rows: int = 1) -> float:
        batch = batch * rows  # a step over `rows` rows per sequence reads the weights once, like a bigger batch
        s = self.spec
        w = self.drafter_params * 2.0
        flops = 2.0 * self.drafter_params * batch + 4.0 * batch * self.context * s.attn_width
        kv = batch * self.context * s.kv_bytes_per_token / max(s.num_layers, 1)
        g, hw = self.hw.num_gpus, self.hw
        mem_s = (w + kv) / (g * hw.mem_bw_gbps * 1e9 * hw.mem_efficiency)
        flop_s = flops / (g * hw.tflops * 1e12 * hw.flop_efficiency)
        return 1e3 * max(mem_s, flop_s) + self.comm_ms(batch, 1)

    def calibrate(self, decode_ms_per_token: float, comm_share: Optional[float] = None) -> "RooflineCost":
        """Fit the memory efficiency (and the AllReduce latency, given the communication share of a
        decode step) so that a single-stream decode step takes the measured time."""
        hw = self.hw
        if comm_share is not None and hw.num_gpus > 1:
            if not 0 <= comm_share < 1:
                raise DraftsmithError(f"--comm_share {comm_share}: a share of the decode step, in [0, 1)")
            comm = decode_ms_per_token * comm_share
            bw_part = self.comm_ms(1, self.spec.num_layers) - 2 * self.spec.num_layers * hw.allreduce_latency_us * 1e-3
            lat_us = max((comm - bw_part) / (2 * self.spec.num_layers) * 1e3, 0.0)
            hw = replace(hw, allreduce_latency_us=lat_us)
        probe = replace(self, hw=replace(hw, mem_efficiency=1.0, flop_efficiency=1.0))
        compute = decode_ms_per_token - probe.comm_ms(1, self.spec.num_layers)
        ideal = probe.compute_ms(1, 1, self.spec.bytes_read(1), self.spec.flops(1, self.context))
        if compute <= 0:
            raise DraftsmithError(f"--decode_ms_per_token {decode_ms_per_token}: less than the communication alone; "
                                  "check --comm_share and the hardware's interconnect figures")
        eff = ideal / compute
        return replace(self, hw=replace(hw, mem_efficiency=eff, flop_efficiency=min(hw.flop_efficiency, eff)))
