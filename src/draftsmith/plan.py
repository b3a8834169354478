"""`draftsmith plan`: is speculative decoding worth it for this target, on this hardware, at these
batch sizes? A prediction before training, from the target's config.json alone (docs/planner.md).

    tokens per step   E = 1 + sum_i prod_{j<=i} a_j          (Leviathan et al., per-position a_j)
    step time         k * t_draft(b) + t_verify(b * (k + 1))  (chain of k drafts, batch b)
    speedup           E * t_verify(b) / step time             (plain decoding emits 1 token per t_verify(b))

t_verify(T) is the target's forward over T tokens. Either measured (`step_costs`, the shape the
evaluate stage writes: {"target_forward_ms": {"1": ms, ...}, "draft_step_ms": ms}) or a roofline:
weight bytes read (MoE: n * (1 - (1 - t/n)^T) distinct experts per layer for T tokens), KV-cache
bytes, FLOPs, and a tensor-parallel AllReduce term (latency + bytes over the interconnect),
optionally calibrated to a measured single-stream decode time and communication share.

    predict(accept, cost, batch_sizes)  -> {"rows": [...]}: E, step ms, tokens/s, speedup per method
    plan(PlanConfig)                    -> the same, with the cost and acceptance built from flags
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Optional, Protocol, Sequence, Union

from .artifacts import DraftsmithError, atomic_write_json, load_manifest, read_json, stage_dir

# ----------------------------------------------------------------------------- acceptance


def expected_tokens(accept: Sequence[float]) -> float:
    """Tokens emitted per verification for a chain whose draft i is accepted with probability
    accept[i] given drafts 0..i-1 were: E = 1 + sum_i prod_{j<=i} a_j. With a_j = alpha this is
    Leviathan's (1 - alpha^(k+1)) / (1 - alpha)."""
    e, p = 1.0, 1.0
    for a in accept:
        p *= a
        e += p
    return e


def leviathan_tokens(alpha: float, k: int) -> float:
    """Leviathan et al. (2023), eq. 1: expected tokens per step for k drafts at acceptance alpha."""
    return k + 1.0 if alpha == 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def profile(accept: Union[float, Sequence[float]], k: int) -> list[float]:
    """Per-position acceptance for k positions: a constant alpha, or a measured list whose last
    value is repeated past its end (positions never measured are assumed no better)."""
    if isinstance(accept, (int, float)):
        return [float(accept)] * k
    acc = [float(a) for a in accept if a is not None]
    if not acc:
        raise DraftsmithError("acceptance profile: empty; give --alpha or an eval manifest with accept_rate_per_position")
    return (acc + [acc[-1]] * k)[:k]


def tree_tokens(accept: Union[float, Sequence[float]], nodes: int, max_depth: int = 16) -> tuple[float, int, int]:
    """Expected tokens per verification of the best draft tree with `nodes` draft tokens.

    Model: at depth i the drafter's r-th ranked candidate is the target's token with probability
    a_i (1 - a_i)^(r-1) given its parent was (each extra sibling catches a share a_i of what is
    left). A node's value is the product along its path; expanding the best frontier node first
    (values never grow along a path or across siblings) gives the optimal tree for this model.
    Returns (E, depth, widest level)."""
    import heapq

    a = profile(accept, max_depth)
    frontier = [(-a[0], 0, 1, 1.0)]  # (-value, depth, sibling rank, parent's value): the root's first child
    e, depth_count = 1.0, [0] * max_depth
    for _ in range(nodes):
        if not frontier:
            break
        neg, d, r, parent = heapq.heappop(frontier)
        e += -neg
        depth_count[d] += 1
        if a[d] < 1:  # the next sibling
            heapq.heappush(frontier, (-parent * a[d] * (1 - a[d]) ** r, d, r + 1, parent))
        if d + 1 < max_depth:  # the first child
            heapq.heappush(frontier, (neg * a[d + 1], d + 1, 1, -neg))
    depth = sum(1 for c in depth_count if c)
    return e, depth, max(depth_count)


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


def _text_config(cfg: dict) -> dict:
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
    """TargetSpec from a config.json path, a model folder, or a config dict.

    Weight bytes: the config's dtype (2 for bf16), except that a quantization_config's bit width
    applies to routed experts (INT4 MoE checkpoints such as Kimi-K2.5 quantize only the experts),
    plus one 16-bit scale per 32 weights. `weight_bits`/`expert_weight_bits` override."""
    from .compat import mtp_layers

    if not isinstance(config, dict):
        p = Path(config)
        p = p / "config.json" if p.is_dir() else p
        config = read_json(p)
        name = p.parent.name
    else:
        name = config.get("_name_or_path", "target")
    full, c = config, _text_config(config)
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
    c = _text_config(config or {})
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
    # The seed project's machine: 8 PCIe GPUs, no NVLink. Per-GPU figures of a 96 GB PCIe 5 card;
    # calibrate with --decode_ms_per_token and --comm_share, which is what docs/planner.md does.
    "pcie-8x": Hardware("pcie-8x", num_gpus=8, memory_gb=96, mem_bw_gbps=1792, tflops=500, interconnect_gbps=50,
                        allreduce_latency_us=40),
}


class StepCost(Protocol):
    def verify_ms(self, tokens: int, batch: int) -> float: ...
    def draft_ms(self, batch: int) -> float: ...


@dataclass
class MeasuredCost:
    """Step costs measured on the real stack: target forward time for 1..N tokens verified and the
    drafter's step time. Between measured token counts, linear interpolation; past the last, linear
    extrapolation from the last two points (a forward grows at least linearly once compute-bound)."""

    target_forward_ms: dict[int, float]
    draft_step_ms: float
    round_overhead_ms: float = 0.0
    """Per speculative round, what the engine spends beyond k drafter steps and one verification
    forward (host work, the committed-row feed): evaluate measures it on the chain it ran."""
    plain_overhead_ms: float = 0.0
    """Per plain decoding step, beyond one target forward (evaluate measures it too)."""

    @classmethod
    def from_json(cls, d: dict, where: str = "step_costs") -> "MeasuredCost":
        try:
            pts = {int(k): float(v) for k, v in d["target_forward_ms"].items()}
            draft = float(d.get("draft_step_ms") or 0.0)
            rnd, plain = float(d.get("round_overhead_ms") or 0.0), float(d.get("plain_overhead_ms") or 0.0)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise DraftsmithError(f"{where}: expected {{'target_forward_ms': {{'1': ms, ...}}, 'draft_step_ms': ms}} "
                                  f"({type(e).__name__}: {e}); rerun evaluate or fix the file") from None
        if 1 not in pts:
            raise DraftsmithError(f"{where}: target_forward_ms has no entry for 1 token (plain decoding); measure it")
        return cls(pts, draft, max(rnd, 0.0), max(plain, 0.0))

    def verify_ms(self, tokens: int, batch: int = 1) -> float:
        xs = sorted(self.target_forward_ms)
        ys = [self.target_forward_ms[x] for x in xs]
        if tokens in self.target_forward_ms:
            return self.target_forward_ms[tokens]
        if len(xs) == 1:
            return ys[0] * tokens
        i = next((i for i, x in enumerate(xs) if x > tokens), len(xs) - 1)
        i = max(i, 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return max(y0 + (y1 - y0) * (tokens - x0) / (x1 - x0), 0.0)

    def draft_ms(self, batch: int = 1) -> float:
        return self.draft_step_ms * (self.verify_ms(batch) / self.verify_ms(1))  # drafter scales like the target


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

    def draft_ms(self, batch: int = 1) -> float:
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


# ----------------------------------------------------------------------------- prediction


KS = tuple(range(1, 9))
TREE_BUDGETS = (8, 16, 32, 64)


def _row(method: str, batch: int, e: float, step_ms: float, plain_ms: float, **extra) -> dict:
    return {"method": method, "batch": batch, "tokens_per_step": round(e, 4), "step_ms": round(step_ms, 4),
            "tokens_per_s": round(batch * e / step_ms * 1e3, 2), "plain_tokens_per_s": round(batch / plain_ms * 1e3, 2),
            "speedup": round(e * plain_ms / step_ms, 4), **extra}


def predict(accept: Union[float, Sequence[float]], cost: Union[StepCost, dict], batch_sizes: Sequence[int] = (1,),
            ks: Sequence[int] = KS, tree_budgets: Sequence[int] = TREE_BUDGETS,
            ngram_accept: Union[float, Sequence[float], None] = None, ngram_ms: float = 0.0) -> dict:
    """Predicted tokens per step and speedup of EAGLE-3 chains (k in ks), trees (draft-token
    budgets) and n-gram lookup, per batch size. `cost` is a StepCost or measured step costs
    ({"target_forward_ms": {"1": ms, ...}, "draft_step_ms": ms}). Every row is a sequence's view:
    tokens_per_step per sequence, step_ms for the whole batch."""
    if isinstance(cost, dict):
        cost = MeasuredCost.from_json(cost)
    rows = []
    overhead = getattr(cost, "round_overhead_ms", 0.0)  # measured engine time per round (MeasuredCost)
    for b in batch_sizes:
        plain = cost.verify_ms(b, b) + getattr(cost, "plain_overhead_ms", 0.0)
        draft = cost.draft_ms(b)
        for k in ks:
            e = expected_tokens(profile(accept, k))
            rows.append(_row("eagle3-chain", b, e, k * draft + cost.verify_ms(b * (k + 1), b) + overhead, plain, k=k,
                             verified_tokens=k + 1))
        for n in tree_budgets:
            e, depth, width = tree_tokens(accept, n - 1)
            # one drafter step per level, each over the widest level's rows
            step = depth * cost.draft_ms(b * width) + cost.verify_ms(b * n, b) + overhead
            rows.append(_row("eagle3-tree", b, e, step, plain, budget=n, depth=depth, width=width, verified_tokens=n))
        if ngram_accept is not None:
            best = max((_row("ngram", b, expected_tokens(profile(ngram_accept, k)),
                             k * ngram_ms + cost.verify_ms(b * (k + 1), b) + overhead, plain, k=k, verified_tokens=k + 1)
                        for k in ks), key=lambda r: r["speedup"])
            rows.append(best)
    best = {}
    for r in rows:
        if r["speedup"] > best.get(r["batch"], {"speedup": 0})["speedup"]:
            best[r["batch"]] = r
    return {"rows": rows, "best": {str(b): r for b, r in best.items()}}


# ----------------------------------------------------------------------------- CLI


@dataclass
class PlanConfig:
    """Predict what speculative decoding buys for a target on given hardware and batch sizes."""

    target: Optional[str] = None
    """Target config.json or model folder (default: the run's recipe target)."""
    run_dir: Optional[str] = None
    """A run directory: acceptance (and step_costs) from its eval manifest; writes RUN_DIR/plan.json."""
    hardware: str = "h200"
    """Hardware preset: h200, h100, a100-pcie, pcie-8x."""
    num_gpus: Optional[int] = None
    mem_bw_gbps: Optional[float] = None
    tflops: Optional[float] = None
    interconnect_gbps: Optional[float] = None
    allreduce_latency_us: Optional[float] = None
    decode_ms_per_token: Optional[float] = None
    """Measured single-stream decode time per token; calibrates the roofline."""
    comm_share: Optional[float] = None
    """Measured share of a decode step spent in communication (AllReduce), 0..1."""
    step_costs: Optional[str] = None
    """JSON file (or an eval manifest) with measured step costs; replaces the roofline."""
    alpha: Optional[float] = None
    """Assumed acceptance rate per position (default: measured, else 0.7)."""
    accept: Optional[list[float]] = None
    """Per-position acceptance rates (overrides alpha and the eval manifest)."""
    ngram_alpha: float = 0.3
    """Assumed per-position acceptance of n-gram (prompt lookup) drafting."""
    batch_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])
    context: int = 2048
    """Tokens of KV cache per sequence."""
    draft_vocab_size: int = 32000
    weight_bits: Optional[float] = None
    """Override the bits per weight of every weight (default: from config.json)."""
    expert_weight_bits: Optional[float] = None
    """Override the bits per weight of routed experts."""
    json: bool = False
    """Print JSON instead of tables."""


def _eval_metrics(run_dir: Path) -> tuple[Optional[list[float]], Optional[dict], Optional[str]]:
    m = load_manifest(stage_dir(run_dir, "evaluate"))
    if not m or m.get("status") != "complete":
        return None, None, None
    src = str(stage_dir(run_dir, "evaluate") / "manifest.json")
    sc = m.get("step_costs") or m.get("metrics", {}).get("step_costs")
    return m.get("metrics", {}).get("accept_rate_per_position"), sc, src


def plan(cfg: PlanConfig) -> dict:
    """Build the acceptance profile and the cost model from cfg; predict; say where each input came from."""
    import yaml

    sources: dict[str, str] = {}
    accept, step_costs = None, None
    recipe = {}
    if cfg.run_dir:
        run = Path(cfg.run_dir)
        if (run / "recipe.yaml").exists():
            recipe = yaml.safe_load((run / "recipe.yaml").read_text()) or {}
        accept, step_costs, src = _eval_metrics(run)
        if accept:
            sources["accept"] = f"{src}: metrics.accept_rate_per_position"
        if step_costs:
            sources["step_costs"] = f"{src}: step_costs"
    target = cfg.target or (recipe.get("target") or {}).get("path")
    if cfg.step_costs:
        d = read_json(cfg.step_costs)
        step_costs = d.get("step_costs") or d.get("metrics", {}).get("step_costs") or d
        sources["step_costs"] = cfg.step_costs
    if cfg.accept:
        accept, sources["accept"] = cfg.accept, "--accept"
    elif cfg.alpha is not None:
        accept, sources["accept"] = cfg.alpha, "--alpha"
    elif not accept:
        accept, sources["accept"] = 0.7, "assumed alpha 0.7 (no evaluation yet; pass --alpha or --run_dir)"
    if accept is None or (not isinstance(accept, float) and not [a for a in accept if a is not None]):
        raise DraftsmithError("acceptance profile is empty; pass --alpha")

    out: dict = {"accept": accept, "sources": sources}
    if step_costs:
        cost: StepCost = MeasuredCost.from_json(step_costs, sources["step_costs"])
        out["cost_model"] = "measured"
    else:
        if not target:
            raise DraftsmithError("no target: pass --target CONFIG.json (or --run_dir of a run whose recipe names it)")
        spec = target_spec(target, cfg.weight_bits, cfg.expert_weight_bits)
        if cfg.hardware not in HARDWARE:
            raise DraftsmithError(f"--hardware {cfg.hardware!r}: unknown; choose one of {', '.join(HARDWARE)}")
        hw = HARDWARE[cfg.hardware]
        over = {k: getattr(cfg, k) for k in ("num_gpus", "mem_bw_gbps", "tflops", "interconnect_gbps",
                                              "allreduce_latency_us") if getattr(cfg, k) is not None}
        hw = replace(hw, **over)
        cost = RooflineCost(spec, hw, cfg.context, drafter_params(spec, cfg.draft_vocab_size, _target_dict(target)))
        if cfg.decode_ms_per_token:
            cost = cost.calibrate(cfg.decode_ms_per_token, cfg.comm_share)
        sources["target"] = str(target)
        out.update(cost_model="roofline", target=asdict(spec), hardware=asdict(cost.hw),
                   drafter_params=cost.drafter_params, weight_gb=round(spec.weight_bytes() / 1e9, 2),
                   plain_decode_ms={str(b): round(cost.verify_ms(b, b), 4) for b in cfg.batch_sizes},
                   comm_share={str(b): round(cost.comm_ms(b, spec.num_layers) / cost.verify_ms(b, b), 4)
                               for b in cfg.batch_sizes})
    out.update(predict(accept, cost, cfg.batch_sizes, ngram_accept=cfg.ngram_alpha))
    return out


def _target_dict(target: str) -> dict:
    p = Path(target)
    return read_json(p / "config.json" if p.is_dir() else p)


def to_table(result: dict) -> str:
    """One table per batch size: chains k=1..8, trees, n-gram."""
    lines = []
    for b in sorted({r["batch"] for r in result["rows"]}):
        lines.append(f"batch {b}" + (f" (plain decode {result['plain_decode_ms'][str(b)]:.2f} ms/step, "
                                       f"{result['comm_share'][str(b)]:.0%} communication)" if "plain_decode_ms" in result else ""))
        lines.append(f"  {'method':<14}{'verified':>9}{'tok/step':>10}{'step ms':>10}{'tok/s':>10}{'speedup':>9}")
        for r in (r for r in result["rows"] if r["batch"] == b):
            label = {"eagle3-chain": f"chain k={r.get('k')}", "eagle3-tree": f"tree {r.get('budget')}",
                     "ngram": f"n-gram k={r.get('k')}"}[r["method"]]
            lines.append(f"  {label:<14}{r['verified_tokens']:>9}{r['tokens_per_step']:>10.2f}{r['step_ms']:>10.2f}"
                         f"{r['tokens_per_s']:>10.1f}{r['speedup']:>8.2f}x")
        best = result["best"][str(b)]
        lines.append(f"  best: {best['method']} {best.get('k') or best.get('budget')} -> {best['speedup']:.2f}x\n")
    lines.append("inputs: " + "; ".join(f"{k} from {v}" for k, v in result["sources"].items()))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """`draftsmith plan [--target CONFIG] [--run_dir RUN] [--hardware h200] ...`."""
    from jsonargparse import ArgumentParser

    p = ArgumentParser(prog="draftsmith plan", description=PlanConfig.__doc__, default_env=False)
    p.add_class_arguments(PlanConfig, None)
    cfg = PlanConfig(**{k: v for k, v in p.parse_args(argv).as_dict().items() if k in PlanConfig.__dataclass_fields__})
    result = plan(cfg)
    if cfg.run_dir:
        atomic_write_json(Path(cfg.run_dir) / "plan.json", {"config": asdict(cfg), **result})
    print(json.dumps(result, indent=2) if cfg.json else to_table(result))
    return 0


def speedup_at(result: dict, batch: int, k: int) -> Optional[float]:
    """The predicted chain speedup at (batch, k) from a plan result, or None."""
    return next((r["speedup"] for r in result["rows"] if r["method"] == "eagle3-chain" and r["batch"] == batch
                 and r.get("k") == k), None)


__all__ = ["expected_tokens", "leviathan_tokens", "tree_tokens", "target_spec", "TargetSpec", "Hardware", "HARDWARE",
           "MeasuredCost", "RooflineCost", "predict", "plan", "PlanConfig"]
