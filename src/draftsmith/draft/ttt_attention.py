"""Attention of a training-time-test (TTT) step, without the O(L^2 * k) score matrices.

At TTT step i a query at row t attends to the step-0 keys at rows <= t (causal) and to its
own row's keys from steps 1..i (the "diagonal" keys). Packed batches hold several samples end
to end in one row; a `TTTMask` with document ids (the sample of each row) then also keeps every
step-0 key of another sample out (document masking). The diagonal keys are the query's own row,
so only the step-0 part needs the document ids. Three implementations, same result:

    reference  scores [L, L + i] per step, softmax, in plain torch (kept for tests; small L)
    chunked    a flash-style autograd Function: query blocks, running log-sum-exp, scores
               recomputed in backward; memory O(block * L) per step, any device; with document
               ids a query block reads only the keys from its first row's document start on
    flex       torch.nn.attention.flex_attention over the concatenated keys of steps 0..i with
               a block mask (causal, same-document step-0 blocks + diagonal blocks); compiled on
               CUDA. The block mask is built per batch from the document ids (tensor ops over
               blocks, no per-element mask evaluation); the compiled kernel depends only on the
               shapes, so a fixed-shape packed batch compiles once per TTT step, not per batch

Step 0 is plain causal attention: F.scaled_dot_product_attention in chunked/flex modes without
document ids; with them flex uses its block mask and chunked one causal SDPA call per sample of
a one-row (packed) batch. All take q [B, nh, L, hd] and the per-step keys/values ks, vs: lists of
[B, nkv, L, hd] (step 0 first) and return [B, nh, L, hd].
"""
from __future__ import annotations

import functools
from typing import Literal, Optional

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

AttentionImpl = Literal["auto", "reference", "chunked", "flex"]
CHUNK_SCORES = 1 << 22  # score elements per query block of the chunked kernel (16 MiB in fp32)
FLEX_BLOCK = 128
PAD_DOC = torch.iinfo(torch.int32).max  # document id of flex's padding rows: after every real document


class TTTMask:
    """Which step-0 keys a TTT query row sees: rows <= its own and, with document ids, only
    those of its own document. `docs` [B, L] integer, non-decreasing along L (packed samples in
    order, padding last as a document of its own); None: the whole row is one document (padded
    batches: the padding comes after the sample and causality keeps it out). Built once per
    batch and shared by its TTT steps: it caches what the kernels derive from the ids."""

    def __init__(self, docs: Optional[torch.Tensor] = None):
        self.docs = docs
        self._flex: dict[int, object] = {}
        self._key_starts: Optional[list[int]] = None

    def prepare(self, impl: str, steps: int, B: int, L: int, device: torch.device) -> "TTTMask":
        """Build now what kernel `impl` will ask for over `steps` TTT steps, so that a compiled
        loss finds it ready (block masks are built eagerly and passed in, as flex expects)."""
        if impl == "flex":
            for s in range(1, steps + 1):
                self.flex_block_mask(s, B, L, device)
        elif impl == "chunked" and self.docs is not None:
            self.key_starts()
        return self

    def key_starts(self) -> list[int]:
        """Per row t: the first row of t's document, minimum over the batch (host list, read once)."""
        if self._key_starts is None:
            B, L = self.docs.shape
            rows = torch.arange(L, device=self.docs.device).expand(B, L)
            new = torch.ones(B, L, dtype=torch.bool, device=self.docs.device)
            new[:, 1:] = self.docs[:, 1:] != self.docs[:, :-1]
            starts = torch.where(new, rows, torch.zeros_like(rows)).cummax(-1).values
            self._key_starts = starts.amin(0).tolist()
        return self._key_starts

    def documents(self) -> list[tuple[int, int]]:
        """(first row, end row) of each document of a one-row batch (host list, read once)."""
        starts = self.key_starts()
        cuts = [t for t in range(1, len(starts)) if starts[t] == t] + [len(starts)]
        return list(zip([0] + cuts[:-1], cuts))

    def flex_block_mask(self, steps: int, B: int, L: int, device: torch.device):
        if steps not in self._flex:
            docs = torch.zeros(B, L, dtype=torch.int32, device=device) if self.docs is None else self.docs.to(torch.int32)
            self._flex[steps] = _flex_block_mask(docs, steps)
        return self._flex[steps]


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, nkv, L, hd] -> [B, nkv * n_rep, L, hd]: each key/value head serves n_rep query heads (GQA)."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


def resolve_impl(impl: AttentionImpl, device: torch.device) -> str:
    """auto: flex (compiled) on CUDA, the chunked kernel elsewhere."""
    if impl != "auto":
        return impl
    return "flex" if device.type == "cuda" else "chunked"


def ttt_attention(q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor], scale: float,
                  impl: AttentionImpl = "auto", mask: Optional[TTTMask] = None) -> torch.Tensor:
    impl = resolve_impl(impl, q.device)
    mask = mask or TTTMask()
    n_rep = q.shape[1] // ks[0].shape[1]
    if impl == "reference":
        return ttt_attention_reference(q, ks, vs, scale, mask.docs)
    if len(ks) == 1 and mask.docs is None:  # step 0 of a padded batch: causal attention, a fused kernel on every device
        return F.scaled_dot_product_attention(q, repeat_kv(ks[0], n_rep), repeat_kv(vs[0], n_rep), is_causal=True, scale=scale)
    if impl == "flex":
        return ttt_attention_flex(q, ks, vs, scale, mask=mask)
    if impl == "chunked":
        B, _, L, hd = q.shape
        if len(ks) == 1 and B == 1:  # step 0 of a packed row: causal attention per sample, a fused kernel each
            return torch.cat([F.scaled_dot_product_attention(q[:, :, a:b], repeat_kv(ks[0][:, :, a:b], n_rep),
                                                             repeat_kv(vs[0][:, :, a:b], n_rep), is_causal=True, scale=scale)
                              for a, b in mask.documents()], dim=2)
        if len(ks) > 1:
            kd = torch.stack([repeat_kv(k, n_rep) for k in ks[1:]], dim=3)  # [B, nh, L, i, hd]
            vd = torch.stack([repeat_kv(v, n_rep) for v in vs[1:]], dim=3)
        else:  # step 0 of a packed batch of several rows: no diagonal keys
            kd = vd = q.new_zeros(B, q.shape[1], L, 0, hd)
        starts = None if mask.docs is None else mask.key_starts()
        return _ChunkedTTTAttention.apply(q, repeat_kv(ks[0], n_rep), repeat_kv(vs[0], n_rep), kd, vd, scale, mask.docs, starts)
    raise ValueError(f"unknown TTT attention implementation {impl!r} (auto, reference, chunked, flex)")


def _visible(docs: Optional[torch.Tensor], q_rows: torch.Tensor, k_rows: torch.Tensor) -> torch.Tensor:
    """Bool [B or 1, 1, len(q_rows), len(k_rows)]: key row <= query row, in the same document."""
    ok = (k_rows[None, :] <= q_rows[:, None])[None, None]
    if docs is not None:
        ok = ok & (docs[:, q_rows][:, :, None] == docs[:, k_rows][:, None, :])[:, None]
    return ok


def ttt_attention_reference(q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor], scale: float,
                            docs: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The naive form: [L, L] step-0 scores plus i diagonal scores per row, one softmax."""
    n_rep = q.shape[1] // ks[0].shape[1]
    k0, v0 = repeat_kv(ks[0], n_rep), repeat_kv(vs[0], n_rep)
    L = q.shape[2]
    rows = torch.arange(L, device=q.device)
    s0 = (q @ k0.transpose(-1, -2)) * scale  # [B, nh, L, L]
    s0 = s0.masked_fill(~_visible(docs, rows, rows), float("-inf"))
    diag = [(q * repeat_kv(kj, n_rep)).sum(-1, keepdim=True) * scale for kj in ks[1:]]
    s = torch.cat([s0, *diag], dim=-1).to(_acc(q)).softmax(-1).to(q.dtype)
    o = s[..., :L] @ v0
    for j, vj in enumerate(vs[1:]):
        o = o + s[..., L + j:L + j + 1] * repeat_kv(vj, n_rep)
    return o


def _acc(x: torch.Tensor) -> torch.dtype:
    """Softmax/accumulation dtype: float32, or float64 for float64 inputs (gradcheck)."""
    return torch.promote_types(x.dtype, torch.float32)


def _block_rows(B: int, H: int, L: int) -> int:
    return max(1, min(L, CHUNK_SCORES // max(1, B * H * L)))


class _ChunkedTTTAttention(torch.autograd.Function):
    """Exact TTT attention in query blocks with a saved log-sum-exp (flash-attention style):
    forward keeps only o and lse; backward recomputes each block's probabilities.
    q, k0, v0 [B, nh, L, hd]; kd, vd [B, nh, L, i, hd] (diagonal keys/values of steps 1..i,
    i may be 0); docs [B, L] document ids or None; starts[t] the first key row any query
    row t of the batch can see (TTTMask.key_starts; None: 0)."""

    @staticmethod
    def forward(ctx, q, k0, v0, kd, vd, scale, docs=None, starts=None):
        B, H, L, _ = q.shape
        o = torch.empty_like(q)
        lse = torch.empty(B, H, L, dtype=_acc(q), device=q.device)
        C = _block_rows(B, H, L)
        for a in range(0, L, C):
            b = min(L, a + C)
            lo = starts[a] if starts is not None else 0
            s, sd = _block_scores(q, k0, kd, a, b, lo, scale, docs)
            m = s.amax(-1)
            if sd.shape[-1]:
                m = torch.maximum(m, sd.amax(-1))
            lse_b = m + torch.log(torch.exp(s - m[..., None]).sum(-1) + torch.exp(sd - m[..., None]).sum(-1))
            p, pd = torch.exp(s - lse_b[..., None]), torch.exp(sd - lse_b[..., None])
            o[:, :, a:b] = (p.to(q.dtype) @ v0[:, :, lo:b] + (pd.to(q.dtype)[..., None] * vd[:, :, a:b]).sum(-2))
            lse[:, :, a:b] = lse_b
        ctx.save_for_backward(q, k0, v0, kd, vd, o, lse, docs)
        ctx.scale, ctx.starts = scale, starts
        return o

    @staticmethod
    def backward(ctx, do):
        q, k0, v0, kd, vd, o, lse, docs = ctx.saved_tensors
        scale, starts = ctx.scale, ctx.starts
        B, H, L, _ = q.shape
        f32 = _acc(q)
        dq = torch.empty_like(q, dtype=f32)
        dk0, dv0 = torch.zeros_like(k0, dtype=f32), torch.zeros_like(v0, dtype=f32)
        dkd, dvd = torch.empty_like(kd, dtype=f32), torch.empty_like(vd, dtype=f32)
        delta = (do.to(f32) * o.to(f32)).sum(-1)  # [B, H, L]
        C = _block_rows(B, H, L)
        for a in range(0, L, C):
            b = min(L, a + C)
            lo = starts[a] if starts is not None else 0
            s, sd = _block_scores(q, k0, kd, a, b, lo, scale, docs)
            p, pd = torch.exp(s - lse[:, :, a:b, None]), torch.exp(sd - lse[:, :, a:b, None])
            do_b, q_b = do[:, :, a:b].to(f32), q[:, :, a:b].to(f32)
            dv0[:, :, lo:b] += p.transpose(-1, -2) @ do_b
            dvd[:, :, a:b] = pd[..., None] * do_b[..., None, :]
            ds = p * (do_b @ v0[:, :, lo:b].to(f32).transpose(-1, -2) - delta[:, :, a:b, None])
            dsd = pd * ((do_b[..., None, :] * vd[:, :, a:b].to(f32)).sum(-1) - delta[:, :, a:b, None])
            dq[:, :, a:b] = (ds @ k0[:, :, lo:b].to(f32) + (dsd[..., None] * kd[:, :, a:b].to(f32)).sum(-2)) * scale
            dk0[:, :, lo:b] += (ds.transpose(-1, -2) @ q_b) * scale
            dkd[:, :, a:b] = dsd[..., None] * q_b[..., None, :] * scale
        return dq.to(q.dtype), dk0.to(k0.dtype), dv0.to(v0.dtype), dkd.to(kd.dtype), dvd.to(vd.dtype), None, None, None


def _block_scores(q, k0, kd, a: int, b: int, lo: int, scale: float, docs: Optional[torch.Tensor]):
    """Scores (float32 or float64) of query rows a:b: step-0 [B, H, b-a, b-lo] over key rows lo:b
    (-inf above the diagonal and across documents) and diagonal [B, H, b-a, i]."""
    q_b = q[:, :, a:b]
    s = (q_b @ k0[:, :, lo:b].transpose(-1, -2)).to(_acc(q)) * scale
    s = s.masked_fill(~_visible(docs, torch.arange(a, b, device=q.device), torch.arange(lo, b, device=q.device)), float("-inf"))
    sd = (q_b[..., None, :] * kd[:, :, a:b]).sum(-1).to(_acc(q)) * scale
    return s, sd


# -- flex attention ------------------------------------------------------------------------

def _flex_block_mask(docs: torch.Tensor, steps: int):
    """The BlockMask over cat(keys of steps 0..steps-1) for document ids docs [B, L]: step-0
    blocks that hold a visible key (causal, same document; "full" when every pair is visible),
    and the diagonal block of each later step. Built from per-block first/last document ids
    (docs are non-decreasing), so it costs O(B * (L/128)^2 * steps) small tensor ops, not a pass of the
    mask over every (query, key) pair as create_block_mask would."""
    B, L = docs.shape
    Lp = -(-L // FLEX_BLOCK) * FLEX_BLOCK
    docs = F.pad(docs, (0, Lp - L), value=PAD_DOC)
    n = Lp // FLEX_BLOCK
    first, last = docs[:, ::FLEX_BLOCK], docs[:, FLEX_BLOCK - 1::FLEX_BLOCK]  # [B, n] per block
    qb = torch.arange(n, device=docs.device)[:, None]
    kb = torch.arange(n, device=docs.device)[None, :]
    any0 = (kb <= qb) & (last[:, None, :] >= first[:, :, None])  # [B, query block, key block]
    full0 = (kb < qb) & (first[:, None, :] == last[:, :, None])
    diag = torch.eye(n, dtype=torch.bool, device=docs.device).expand(B, n, n)
    partial = torch.cat([any0 & ~full0] + [diag] * (steps - 1), dim=-1)
    full = torch.cat([full0] + [torch.zeros_like(diag)] * (steps - 1), dim=-1)

    def blocks(m):  # dense [B, n, steps*n] -> (count [B, 1, n], indices [B, 1, n, steps*n]) listed first
        idx = torch.argsort(m.to(torch.uint8), dim=-1, descending=True, stable=True)
        return m.sum(-1, dtype=torch.int32)[:, None], idx.to(torch.int32)[:, None]

    def mask_mod(b, h, q_idx, kv_idx):
        pos = kv_idx % Lp
        return (pos == q_idx) | ((kv_idx < Lp) & (pos <= q_idx) & (docs[b, pos] == docs[b, q_idx]))

    return BlockMask.from_kv_blocks(*blocks(partial), *blocks(full), BLOCK_SIZE=FLEX_BLOCK, mask_mod=mask_mod,
                                    seq_lengths=(Lp, steps * Lp))


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    import torch._dynamo  # why here: ~2.5 s to import; only the compiled (CUDA) path needs it

    # One compiled kernel per (padded L, step): a fixed-shape (packed) batch needs ttt_steps of
    # them; padded batches up to max_length/128 * ttt_steps, and past dynamo's default limit it
    # would fall back to eager flex, which materialises the scores.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 512)
    return torch.compile(flex_attention, dynamic=False)


def ttt_attention_flex(q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor], scale: float,
                       compiled: bool | None = None, mask: Optional[TTTMask] = None) -> torch.Tensor:
    """flex_attention over cat(keys of steps 0..i) with the TTT block mask. L is padded to a
    multiple of the block size; padded keys are masked (causality, or their own document),
    padded query rows are dropped. Compiled on CUDA (eager flex materialises the scores: use it
    only to check the mask)."""
    B, _, L, _ = q.shape
    Lp = -(-L // FLEX_BLOCK) * FLEX_BLOCK
    pad = (0, 0, 0, Lp - L)
    k = torch.cat([F.pad(t, pad) for t in ks], dim=2)
    v = torch.cat([F.pad(t, pad) for t in vs], dim=2)
    block_mask = (mask or TTTMask()).flex_block_mask(len(ks), B, L, q.device)
    if torch.compiler.is_compiling():  # inside a compiled loss: flex is compiled as part of its graph
        fn = flex_attention
    else:
        fn = _compiled_flex() if (q.device.type == "cuda" if compiled is None else compiled) else flex_attention
    o = fn(F.pad(q, pad), k, v, block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return o[:, :, :L]
