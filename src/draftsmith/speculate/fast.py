"""Fast paths: static KV caches and CUDA graphs around the target's and the drafter's forwards.

Eager transformers decoding on a GPU is bound by the CPU (Python and kernel launches), not by
memory bandwidth, so it flatters any drafter. The cure is the one serving engines use: every
tensor keeps its address (a static KV cache of `max_len` columns, inputs copied into static
buffers) and each forward is replayed as one CUDA graph.

    FastTarget        the target over a transformers StaticCache. `verify` runs [B, N] rows under
                      the engine's tree mask (one graph per N), `keep` moves the accepted rows
                      (one graph); `verify_rows`, `move_columns` and `fn` (one forward) are the
                      graph-safe pieces the resident loop (resident.py) replays inside its own graphs,
                      plain decoding's step among them.
(The drafter's side, StaticDraftCache and FastDraft, lives in cache.py and eagle3.py; Graphed in cache.py.)

The target's attention on this path is draft.attention.decode_attention (the kernel picked by the
number of rows, no K/V copies, a boolean mask): registered in transformers' AttentionInterface as
DECODE_ATTENTION and switched on for FastTarget's forwards only (hfmodel.py, with what else the fast
path changes in the model: fused norms, joint rotaries, graph-safe experts, regional compile).

Modes (`evaluate.fast`): off = eager, transformers' DynamicCache; static = static caches without
graphs (what a CPU runs; the tests); graphs = static + CUDA graphs; compile = graphs around a
torch.compile'd target forward. Column bookkeeping is the engine's: sequence b owns the columns
[start_b, end_b); a forward writes its N rows at [past, past + N) with past = max_b end_b, and
the mask hides every other column, so the cache is never cropped or re-allocated. The forwards
attend over the first W columns only (`attend`: a power of two that holds the generation), so
attention reads what the context uses, not every column allocated.
"""
from __future__ import annotations

import functools
from typing import Any, Optional

import torch

from ..messages import DraftsmithError, log
from ..target.model import Target, TargetOutput
from .cache import Graphed, additive, copy_columns, h2d
from .hfmodel import (DECODE_ATTENTION, DECODE_ATTENTION_CALLS, compile_regions, decode_attention_configs, fuse_rms_norms,
                      graph_safe_experts, join_rotaries)
from .skinny import linear_modules, resolve_verify_gemm, switched
from .tree import committed_columns, device_tree_mask, prefill_mask

MODES = ("off", "static", "graphs", "compile")


def resolve_mode(mode: str, device: torch.device, key: str = "evaluate.fast") -> str:
    """auto -> graphs on CUDA, off elsewhere; graphs/compile on a CPU is a config error. `key`
    names the recipe field in messages."""
    if mode == "auto":
        return "graphs" if device.type == "cuda" else "off"
    if mode not in MODES:
        raise DraftsmithError(f"{key} {mode!r}: unknown; use one of auto, {', '.join(MODES)}")
    if mode in ("graphs", "compile") and device.type != "cuda":
        raise DraftsmithError(f"{key} {mode!r} needs a CUDA device (the target is on {device}); "
                              f"use {key}: static or auto on a CPU")
    return mode


def choose_mode(requested: str, target: Target, key: str = "evaluate.fast") -> str:
    """resolve_mode for this target: CUDA graphs need the target on one device, so `auto` on a
    target spread over several GPUs (target.device_map) becomes static; an explicit graphs/compile errs."""
    mode = resolve_mode(requested, target.device, key)
    n_devices = len({p.device for p in target.model.parameters()})
    if mode in ("graphs", "compile") and n_devices > 1:
        if requested != "auto":
            raise DraftsmithError(f"{key} {requested!r}: the target is spread over {n_devices} devices "
                                  f"(target.device_map) and CUDA graphs need one; use {key}: static or off")
        log(f"[{key.split('.')[0]}] fast path: the target spans several GPUs; static caches without CUDA graphs")
        mode = "static"
    return mode


def fast_target_or_none(target: Target, mode: str, requested: str, key: str, fallback: str,
                        **kw) -> Optional["FastTarget"]:
    """FastTarget(target, mode, **kw); where the target cannot run it (e.g. sliding-window layers)
    an explicit `requested` mode errs and `auto` gets None, logged with `fallback` (what runs instead)."""
    try:
        return FastTarget(target, mode, key=key, **kw)
    except DraftsmithError as e:
        if requested != "auto":
            raise
        log(f"[{key.split('.')[0]}] fast path unavailable ({e}); {fallback}")
        return None


# ----------------------------------------------------------------------------- target


def in_stack(t: torch.Tensor, stack: torch.Tensor) -> bool:
    """Whether t is a view of stack (its storage; a view made under inference mode keeps no _base)."""
    return t.untyped_storage().data_ptr() == stack.untyped_storage().data_ptr()


class FastTarget:
    """The target over a static KV cache, optionally CUDA-graphed. Same interface as
    verify.EagerVerifier (prefill, verify, keep, past: host tensors in, what the host loop calls), plus
    the graph-safe pieces the resident round calls inside its own graph: verify_rows, move_columns."""

    def __init__(self, target: Target, mode: str = "graphs", batch_size: int = 1, max_len: int = 2048,
                 key: str = "evaluate.fast", verify_gemm: str = "cublas"):
        if mode not in MODES[1:]:
            raise ValueError(f"FastTarget mode {mode!r}: one of {MODES[1:]}")
        self.target, self.mode, self.device, self.key = target, mode, target.device, key  # key: the recipe field, for messages
        self.graphs = mode in ("graphs", "compile") and graph_safe_experts(target.model)
        self.fn = self._forward
        self.attn_configs = decode_attention_configs(target.model)  # [] = transformers' attention, additive mask
        self.attn_checked = False
        fuse_rms_norms(target.model)
        join_rotaries(target.model)
        if mode == "compile":
            compile_regions(target.model)
        # evaluate.verify_gemm: every forward here (plain steps and verify rows alike) runs the same matmuls
        gemm_key = key.split(".")[0] + ".verify_gemm"
        self.verify_gemm = resolve_verify_gemm(verify_gemm, target.model, gemm_key)
        self.linears = linear_modules(target.model) if self.verify_gemm == "skinny" else []  # tuned here, before any capture
        self.B = self.S = 0
        self.reallocations = 0
        self.ensure(batch_size, max_len)

    # -- allocation ---------------------------------------------------------------------

    def ensure(self, batch_size: int, needed: int) -> None:
        """A cache of batch_size rows and at least `needed` columns (+1 spare); new graphs if it grows."""
        if batch_size == self.B and needed < self.S:
            return
        from transformers import StaticCache

        S = max(needed + 1, self.S if batch_size == self.B else 0)
        S = -(-S // 256) * 256
        self.cache = StaticCache(config=self.target.model.config, max_cache_len=S)
        for layer in self.cache.layers:
            if getattr(layer, "is_sliding", False) or not hasattr(layer, "cumulative_length"):
                raise DraftsmithError(f"{type(self.target.model).__name__}: the fast path needs a plain static KV cache "
                                      f"(transformers >= 5 StaticLayer, no sliding-window layers); set {self.key}: off")
        for layer in self.cache.layers:  # every layer writes at the forward's columns (write_cols): no per-layer arange
            layer.update = functools.partial(self._write, layer)
        self.B, self.S = batch_size, S
        self.W = S  # the columns the forwards attend over, [0, W): set per generation by prefill (attend)
        self.reallocations += 1
        self.cols = torch.arange(S, device=self.device)
        self.length = torch.zeros((), dtype=torch.long, device=self.device)  # every layer's cumulative_length (_write)
        self.verify_g = Graphed(self.verify_rows, self.graphs)
        self.keep_g = Graphed(self.move_columns, self.graphs)
        self.resident: dict[tuple, Any] = {}  # resident.py's plain decoding over this cache, by its shape (dropped with it)
        self.past = 0
        self.stacked: Optional[tuple] = None  # every layer's keys and values as views of two stacks (_adopt); () = none

    def attend(self, needed: int) -> int:
        """The attention width for a generation that uses `needed` columns: the smallest of 256, 512,
        1024, ... that holds them, at most S. The forwards attend over columns [0, W) only, so a step's
        attention reads what the context uses, not the whole cache (at batch 16 with 2,304 columns
        allocated and ~260 used, 4.8 GB a step at Llama-8B shapes instead of 1.1); one graph per width
        (a handful: powers of two). Only decode_attention reads fewer columns; transformers' own
        attention gets the mask widened to S again."""
        W = 256
        while W < needed:
            W *= 2
        self.W = min(W, self.S)
        return self.W

    # -- the forwards -------------------------------------------------------------------

    def _write(self, layer, key_states, value_states, *args, **kwargs):
        """StaticLayer.update at this forward's columns past .. past + N - 1 (write_cols, made once per
        forward): transformers' own makes them in every layer (an arange and an add) and advances the
        layer's cumulative_length (one more kernel). The layers' cumulative_length is one shared tensor
        (self.length, set to past by each forward: one kernel, not one per layer), read by a model only
        when no position_ids are given; a layer on another device keeps its own, set per forward."""
        if not layer.is_initialized:
            layer.lazy_initialization(key_states, value_states)
            self._adopt(layer)
            if layer.cumulative_length.device == self.length.device:
                layer.cumulative_length = self.length
        cols = self.write_cols[:key_states.shape[-2]]
        if cols.device != layer.keys.device:  # a target spread over devices (device_map): this layer's copy
            cols = cols.to(layer.keys.device)
        layer.keys.index_copy_(2, cols, key_states)
        layer.values.index_copy_(2, cols, value_states)
        return layer.keys, layer.values

    def _adopt(self, layer) -> None:
        """A layer's keys and values, just allocated by transformers (zeros, in the first forward), become
        views of two stacks [layers, B, heads, S, d] made at the first layer's allocation, and its own
        tensors are freed: moving the accepted columns in every layer is then one gather and one scatter
        per stack (copy_columns), not two per layer and tensor, and no cache is ever held twice. A layer
        of another shape, dtype or device: no stacks (every layer its own tensors again)."""
        if self.stacked is not None and not self.stacked:
            return
        own = (layer.keys, layer.values)
        if self.stacked is None:
            n = len(self.cache.layers)
            self.stacked = tuple(torch.zeros((n,) + t.shape, dtype=t.dtype, device=t.device) for t in own)
        i = self.cache.layers.index(layer)
        if any(t.shape != s.shape[1:] or t.dtype != s.dtype or t.device != s.device for t, s in zip(own, self.stacked)):
            for other in self.cache.layers:  # layers adopted before this one get tensors of their own back
                if other.is_initialized and other is not layer and in_stack(other.keys, self.stacked[0]):
                    other.keys, other.values = other.keys.clone(), other.values.clone()
            self.stacked = ()
            return
        layer.keys, layer.values = self.stacked[0][i], self.stacked[1][i]
        for t in (layer.keys, layer.values):
            torch._dynamo.mark_static_address(t)  # as transformers marks its own (compiled forwards)

    def _forward(self, ids, pos, past, mask):
        """ids/pos [B, N], past a 0-d tensor (where the N rows are written), mask bool [B, N, W] over
        the cache's first W <= S columns. The attention is decode_attention with the boolean mask,
        over those W columns (attn_configs switched for this forward only: other users of the model
        keep theirs), else transformers' with an additive mask over all S. Under verify_gemm skinny the
        model's linears run speculate/skinny.py's kernel for this forward only."""
        with switched(self.linears):
            return self._forward_rows(ids, pos, past, mask)

    def _forward_rows(self, ids, pos, past, mask):
        self.length.copy_(past)
        for layer in self.cache.layers:  # layers of their own length: on another device (device_map)
            if layer.is_initialized and layer.cumulative_length is not self.length:
                layer.cumulative_length.copy_(past)
        self.write_cols = past + self.cols[:ids.shape[1]]  # where every layer writes this forward's rows
        kw = dict(past_key_values=self.cache, position_ids=pos, use_cache=True)
        if not self.attn_configs:
            if mask.shape[-1] < self.S:
                mask = torch.nn.functional.pad(mask, (0, self.S - mask.shape[-1]))  # False: hidden
            out = self.target.forward(ids, attention_mask=additive(mask, self.target.dtype), **kw)
            return out.logits, out.aux_hidden, out.final_hidden
        saved = [c._attn_implementation_internal for c in self.attn_configs]
        for c in self.attn_configs:
            c._attn_implementation_internal = DECODE_ATTENTION
        try:
            out = self.target.forward(ids, attention_mask=mask[:, None], **kw)
        finally:
            for c, s in zip(self.attn_configs, saved):
                c._attn_implementation_internal = s
        return out.logits, out.aux_hidden, out.final_hidden

    def verify_rows(self, ids, pos, past, start, end, anc, cols):
        """The verify forward from device tensors only (graph-safe; `verify` graphs it, resident rounds
        call it inside theirs): [B, N] rows written at `past` (0-d), each seeing its sequence's columns
        [start_b, end_b) and the new rows anc allows, attending over the columns `cols` (arange(W): an
        input, so that each width has its own graph). Returns (logits, aux_hidden, final_hidden)."""
        anc = anc.bool()  # sent as int64 with the other inputs
        return self.fn(ids, pos, past, device_tree_mask(committed_columns(cols, start, end), past, anc))

    def move_columns(self, b, src, dst):
        """Cache columns src -> dst of batch rows b in every layer (device index tensors; graph-safe)."""
        tensors = self.stacked or [t for layer in self.cache.layers for t in (layer.keys, layer.values)]
        copy_columns(tensors, b, src, dst)
        return ()

    # -- the engine's interface ---------------------------------------------------------

    def prefill(self, ids: torch.Tensor, pos: torch.Tensor, pad: torch.Tensor, max_new_tokens: int,
                max_rows: int = 1) -> TargetOutput:
        """Left-padded prompts [B, P] into columns [0, P) (eager: prompt lengths vary)."""
        B, P = ids.shape
        self.ensure(B, P + max_new_tokens + max_rows)
        self.attend(P + max_new_tokens + max_rows + 1)
        mask = torch.zeros(B, P, self.W, dtype=torch.bool, device=ids.device)
        mask[:, :, :P] = prefill_mask(pad, P)
        calls = DECODE_ATTENTION_CALLS[0]
        logits, aux, final = self._forward(ids, pos, h2d(0, ids.device), mask)
        if self.attn_configs and not self.attn_checked:
            if DECODE_ATTENTION_CALLS[0] == calls:  # the model's attention ignored the switch: it read a bool mask
                log(f"[fast] {type(self.target.model).__name__}: the attention does not go through transformers' "
                    "AttentionInterface; the fast path keeps the model's own attention (additive mask)")
                self.attn_configs = []
                logits, aux, final = self._forward(ids, pos, h2d(0, ids.device), mask)
            self.attn_checked = True
        self.past = P
        return TargetOutput(logits=logits, aux_hidden=aux, final_hidden=final)

    def verify(self, ids: torch.Tensor, pos: torch.Tensor, start: torch.Tensor, end: torch.Tensor,
               anc: torch.Tensor, n_rows: int = 0) -> TargetOutput:
        """[B, N] rows at [past, past + N): row i of b sees b's committed columns and the rows j
        with anc[b, i, j]. Rows are padded to n_rows (one graph per padded size). The inputs are
        host tensors: padded on the host and sent in one copy that does not wait for the GPU."""
        B, N = ids.shape
        if n_rows > N:  # padding rows: token 0, seeing only themselves
            pad = n_rows - N
            ids = torch.cat([ids, ids.new_zeros(B, pad)], 1)
            pos = torch.cat([pos, pos[:, -1:].expand(B, pad)], 1)
            a = torch.eye(n_rows, dtype=torch.bool).repeat(B, 1, 1)
            a[:, :N, :N] = anc
            anc = a
        M = ids.shape[1]
        if self.past + M >= self.W:
            raise DraftsmithError(f"fast path: {self.past + M} cache columns needed, {self.W} attended ({self.S} allocated) "
                                  "(prefill's max_new_tokens/max_rows too small)")
        parts = (ids, pos, start, end, torch.tensor([self.past]), anc)
        buf = h2d(torch.cat([x.reshape(-1).long() for x in parts]), self.device)
        ids, pos, start, end, past, anc = (v.view(x.shape) for v, x in zip(buf.split([x.numel() for x in parts]), parts))
        logits, aux, final = self.verify_g(ids, pos, past.reshape(()), start, end, anc, self.cols[:self.W])
        return TargetOutput(logits=logits[:, :N], aux_hidden=aux[:, :N], final_hidden=final[:, :N])

    def keep(self, b: list[int], src: list[int], dst: list[int], length: int, n_moves: int = 0) -> None:
        """Copy the rows src -> dst of sequences b (one graph: padded with no-op copies of the
        spare last column to n_moves), then past = length."""
        if b:
            pad = max(n_moves - len(b), 0)
            spare = self.S - 1
            idx = h2d([b + [0] * pad, src + [spare] * pad, dst + [spare] * pad], self.device)
            if not self.keep_g.captured(*idx):  # a capture runs its call twice (warm-up, first replay) and a move
                n = len(b) + pad                # is not safe to repeat (a -> b, then c -> a): capture a no-op one
                self.keep_g(*h2d([[0] * n, [spare] * n, [spare] * n], self.device))
            self.keep_g(*idx)
        self.past = length
