"""The EAGLE-3 drafter (Llama-style): a pure nn.Module. No optimizer, no loop, no process groups.

    h0   = fc(cat(aux_1, aux_2, aux_3))                 # 3*H_t -> H, first draft step only
    x    = cat(input_layernorm(embed(tok)), hidden_norm(h))   # width 2H, into q/k/v
    h'   = h + o_proj(attn(x))                           # residual is h, not x
    g    = h' + mlp(post_attention_layernorm(h'))        # pre-norm output, fed to the next step
    logits = lm_head(norm(g))                            # over the draft vocab

Three architecture flags (Eagle3Config; all off is the EAGLE-3 reference, SGLang's layout):
    norm_before_fc         fc(input_norm(cat(aux)))      one RMSNorm over the 3*H_t concatenation
    norm_before_residual   residual = hidden_norm(h)     instead of the raw h
    norm_output            the next step reads norm(g)   and logits = lm_head(norm(g)) as before
speculators trains with all three on by default. `forward` and `ttt_step` return what the next
step reads (g, or norm(g) under norm_output), and `logits` takes that value, so decoding loops
never need to know the flags.

Row t of a draft step pairs the hidden state of position t with the token at t+1 and
predicts the token at t+2; its rotary position is t (shifted by i at TTT step i).
Names follow SGLang's LlamaForCausalLMEagle3 (`midlayer.*`, `fc`, `norm`, `lm_head`, `d2t`, `t2d`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import decode_attention
from .rope import rope_cos_sin
from .ttt_attention import ttt_attention


@dataclass
class Eagle3Config:
    hidden_size: int
    target_hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # target vocab (embedding rows)
    draft_vocab_size: int
    num_aux_layers: int = 3
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None
    max_position_embeddings: int = 4096
    aux_layer_ids: list[int] = field(default_factory=list)  # internal convention (outputs of layer i)
    target_num_layers: int = 0
    norm_before_fc: bool = False  # RMSNorm `input_norm` over cat(aux) before fc
    norm_before_residual: bool = False  # the layer's residual is hidden_norm(h), not h
    norm_output: bool = False  # the next step reads norm(g), not g


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype:  # torch's rms_norm: one fused kernel on CUDA, the same float32 math
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        dtype = x.dtype  # float32 weights under autocast (training): the product is float32, as transformers'
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, nH, T, hd]; cos/sin: [B, T, hd]
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


class Eagle3Attention(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.cfg = cfg
        H, nh, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(2 * H, nh * hd, bias=False)
        self.k_proj = nn.Linear(2 * H, nkv * hd, bias=False)
        self.v_proj = nn.Linear(2 * H, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, H, bias=False)

    def qkv(self, x: torch.Tensor, position_ids: torch.Tensor, table: Optional[torch.Tensor] = None):
        """Project and rotate: q [B, nh, T, hd], k/v [B, nkv, T, hd]. The rotation of each position comes
        from `table` (rope.rope_table, in q's dtype: one gather) when given, else is computed."""
        B, T, _ = x.shape
        c = self.cfg
        q = self.q_proj(x).view(B, T, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        if table is None:
            cos, sin = rope_cos_sin(position_ids, c, q.dtype)  # honours cfg.rope_scaling
        else:
            cos, sin = table[:, position_ids].unbind(0)
        qk = apply_rope(torch.cat([q, k], 1), cos, sin)  # q and k rotated as one tensor: the same bits, fewer kernels
        return qk[:, :c.num_attention_heads], qk[:, c.num_attention_heads:], v

    def out(self, o: torch.Tensor) -> torch.Tensor:
        B, nh, T, hd = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(B, T, nh * hd))


class Eagle3DecoderLayer(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        H = cfg.hidden_size
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.self_attn = Eagle3Attention(cfg)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.mlp = nn.ModuleDict(dict(
            gate_proj=nn.Linear(H, cfg.intermediate_size, bias=False),
            up_proj=nn.Linear(H, cfg.intermediate_size, bias=False),
            down_proj=nn.Linear(cfg.intermediate_size, H, bias=False)))
        self.norm_before_residual = cfg.norm_before_residual

    def attn_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(attention input [.., 2H], residual [.., H])."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        return torch.cat([self.input_layernorm(embeds), normed], dim=-1), residual

    def finish(self, residual: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        h = residual + attn_out
        x = self.post_attention_layernorm(h)
        m = self.mlp
        return h + m["down_proj"](F.silu(m["gate_proj"](x)) * m["up_proj"](x))


class DraftKVCache:
    """Key/value cache of the drafter for inference: [B, nkv, S, hd] per tensor.

    `crop(n)` drops everything after the first n positions (rejected drafts)."""

    rope = None  # no rotary table (speculate.cache.StaticDraftCache carries one): positions are unbounded

    def __init__(self):
        self.k: Optional[torch.Tensor] = None
        self.v: Optional[torch.Tensor] = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor):
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v

    def crop(self, n: int) -> None:
        if self.k is not None:
            self.k, self.v = self.k[:, :, :n], self.v[:, :, :n]


class Eagle3Drafter(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)  # copied from the target, frozen
        if cfg.norm_before_fc:
            self.input_norm = RMSNorm(cfg.num_aux_layers * cfg.target_hidden_size, cfg.rms_norm_eps)
        self.fc = nn.Linear(cfg.num_aux_layers * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = Eagle3DecoderLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        # d2t[i] is an offset: target_id = i + d2t[i]; t2d is a mask over the target vocab.
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))

    # -- pieces shared by training and inference ------------------------------------------

    def project(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """[.., n_aux * H_t] target aux states -> [.., H] drafter hidden (first step only)."""
        x = aux_hidden.to(self.fc.weight.dtype)
        if self.cfg.norm_before_fc:
            x = self.input_norm(x)
        return self.fc(x)

    def output(self, g: torch.Tensor) -> torch.Tensor:
        """What the next step reads of a layer output g: g, or norm(g) under norm_output."""
        return self.norm(g) if self.cfg.norm_output else g

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Draft-vocab logits of a step's returned hidden state (`output`: already normed under norm_output)."""
        return self.lm_head(h if self.cfg.norm_output else self.norm(h))

    def compile_regions(self) -> bool:
        """torch.compile, in place, the pure pieces of a decoding step: the norms and concatenation
        before attention, q/k/v with rope, the o-projection, residual and MLP, the head. Their many
        small kernels fuse; the cache write and the attention stay eager (nothing that mutates state
        is traced). For decoding (evaluate.fast: compile); training compiles its whole loss. False
        when already done."""
        if getattr(self, "_compiled_regions", False):
            return False
        w = self.fc.weight
        rope_cos_sin(torch.zeros(1, 1, dtype=torch.long, device=w.device), self.cfg, w.dtype)  # its table, eagerly
        layer, attn = self.midlayer, self.midlayer.self_attn
        layer.attn_input, layer.finish = torch.compile(layer.attn_input), torch.compile(layer.finish)
        attn.qkv, attn.out = torch.compile(attn.qkv), torch.compile(attn.out)
        self.logits = torch.compile(self.logits)
        self._compiled_regions = True
        return True

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    # -- inference: one pass of the decoder layer with a KV cache -------------------------

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                cache: Optional[DraftKVCache] = None, attn_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One drafter step over T new rows.

        input_ids [B, T] (token t+1 of each row), hidden [B, T, H] (fc(aux) or a previous g),
        position_ids [B, T] (below the size of a cache's rotary table `cache.rope`, when it has one).
        With a cache, the new keys are appended and the rows attend to
        all cached rows plus, causally, each other; `attn_mask` [B or 1, T, S_total] (True =
        attend) overrides that (tree drafting). Returns the hidden state the next step reads
        [B, T, H] (`output`: g pre-norm, or norm(g) under norm_output)."""
        layer = self.midlayer
        attn = layer.self_attn
        emb = self.embed_tokens(input_ids).to(hidden.dtype)
        x, residual = layer.attn_input(emb, hidden)
        q, k, v = attn.qkv(x, position_ids, None if cache is None else cache.rope)
        past = 0
        if cache is not None:
            past = cache.length
            k, v = cache.append(k, v)
        T, S = q.shape[2], k.shape[2]
        if attn_mask is None:
            attn_mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(diagonal=past)[None]
        o = decode_attention(q, k, v, attn_mask[:, None], 1.0 / math.sqrt(self.cfg.head_dim))  # the kernel by row count
        return self.output(layer.finish(residual, attn.out(o)))

    # -- training: the same layer unrolled for TTT ----------------------------------------

    def ttt_step(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                 ttt_cache: list[tuple[torch.Tensor, torch.Tensor]], attention: str = "auto", mask=None) -> torch.Tensor:
        """Training-time-test step i = len(ttt_cache) over full rows [B, L].

        Row t attends to step-0 keys at rows <= t (causal; with `mask`, a
        draft.ttt_attention.TTTMask holding document ids, only those of its own sample) and to
        its own row's keys from steps 1..i. Appends this step's (k, v) to ttt_cache. `attention`
        picks the kernel (draft.ttt_attention: auto = flex on CUDA, a memory-lean chunked kernel
        elsewhere; reference = the naive [L, L + i] scores)."""
        layer = self.midlayer
        attn = layer.self_attn
        emb = self.embed_tokens(input_ids).to(hidden.dtype)
        x, residual = layer.attn_input(emb, hidden)
        q, k, v = attn.qkv(x, position_ids)
        ttt_cache.append((k, v))
        o = ttt_attention(q, [kv[0] for kv in ttt_cache], [kv[1] for kv in ttt_cache],
                          1.0 / math.sqrt(self.cfg.head_dim), attention, mask)
        return self.output(layer.finish(residual, attn.out(o)))
