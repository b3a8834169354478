"""EAGLE-3 drafting for a whole batch: a chain, or an EAGLE-2 dynamic tree.

Drafter row t pairs the target's aux state at position t with token t+1 (rotary position t) and
predicts token t+2. Committed rows always come from the target's real aux states; the rows made
while drafting (fed the drafter's own g) are dropped after each round.

Tree (EAGLE-2, Li et al. 2024): depth 1 takes the top-k tokens of the last committed row; at each
further depth the k best nodes so far (by cumulative draft log-probability) are fed as k rows in
one drafter forward, each attending to the committed rows, its fed ancestors and itself, and each
proposes its top-k children. Of all nodes seen, the `budget` best by cumulative log-probability
form the tree (closed under ancestors, since log-probs only decrease along a path). One change to
EAGLE-2: the chain (the top-1 path to full depth) is always fed and always in the tree, so under
greedy verification a tree never accepts less than the chain of the same drafter from the same state.
Ranked by draft probability alone, a tree can leave the chain's deep nodes out: on the H200 two
drafters right 90 % of the time at every depth drafted trees of lower tau than their chains (3.89 vs
4.15, 3.90 vs 4.14; BENCHMARKS.md, tenth session). A chain is topk=1, budget=depth. At
temperature > 0 the chain's node at each depth is one draw from the drafter's law q (handed to
rejection sampling: accepted with min(1, p/q)); a tree's other nodes are its top-k children without
that draw (verified as point masses against the residual). A sampled chain is the tree with K = 1.
With top-k nodes alone a tree under sampling accepted a token with the target's probability of it,
which is low when the target's law is broad: on an H100 at temperature 1, tree tau 1.25 against the
sampled chain's 2.13 (BENCHMARKS.md, nineteenth session).

FastDraft (below) is the drafter's fast path: its static cache (cache.StaticDraftCache) and graphed
steps, and the whole `expand` of a round as one graph. `expand`, `step` and `graph_step` are public:
the resident round (resident.py) and evaluate's step costs call them.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from ..draft.model import DraftKVCache, Eagle3Drafter
from ..draft.rope import rope_table
from .cache import Graphed, StaticDraftCache, h2d, move_rows
from .tree import DraftTree, committed_columns, device_tree_mask, tree_mask


class Eagle3Proposer:
    def __init__(self, drafter: Eagle3Drafter, topk: int = 1, budget: int = 5, temperature: float = 0.0,
                 generator: Optional[torch.Generator] = None, fast: Optional[FastDraft] = None):
        self.drafter, self.topk, self.budget = drafter, topk, budget
        self.temperature, self.generator = temperature, generator
        self.fast = fast  # static cache + graphed steps (FastDraft below); None = eager

    @property
    def max_nodes(self) -> int:
        """Most tree nodes one round proposes (the engine pads every verify to 1 + this)."""
        return self.budget

    @property
    def device(self) -> torch.device:
        return self.drafter.fc.weight.device

    # ------------------------------------------------------------------ committed rows

    def start(self, tokens: list[list[int]], outs) -> None:
        B, dev = len(tokens), self.device
        self.cache = DraftKVCache() if self.fast is None else self.fast.reset(B, max(map(len, tokens)))
        self.start_col = torch.zeros(B, dtype=torch.long, device=dev)
        self.end_col = torch.zeros(B, dtype=torch.long, device=dev)
        self.end_host = [0] * B  # end_col on the host: bookkeeping without device reads
        self.rows = torch.zeros(B, dtype=torch.long, device=dev)  # committed rows = committed tokens - 1
        self.g_last = torch.zeros(B, self.drafter.cfg.hidden_size, dtype=self.drafter.fc.weight.dtype, device=dev)
        self._feed([t[1:] for t in tokens], outs)

    def commit(self, new_tokens: list[list[int]], outs) -> None:
        self._feed(new_tokens, outs)

    def _feed(self, inputs: list[list[int]], outs) -> None:
        """Append n_b committed rows per sequence (token, target aux state), behind its own rows."""
        d, dev = self.drafter, self.device
        n = [len(x) for x in inputs]
        T, B = max(n), len(inputs)
        if T == 0:
            return
        ids = torch.zeros(B, T, dtype=torch.long)  # host tensors, sent without a sync (h2d)
        aux = None
        for b, (x, o) in enumerate(zip(inputs, outs)):
            if not x:
                continue
            ids[b, :len(x)] = torch.tensor(x)
            a = o.aux_hidden[0, :len(x)]
            if aux is None:
                aux = torch.zeros(B, T, a.shape[-1], dtype=a.dtype, device=dev)
            aux[b, :len(x)] = a.to(dev)
        valid = torch.arange(T)[None] < torch.tensor(n)[:, None]
        anc = (torch.ones(T, T, dtype=torch.bool).tril()[None] & valid[:, None, :]) | torch.eye(T, dtype=torch.bool)[None]
        past = self.cache.length
        pos = self.rows[:, None] + torch.arange(T, device=dev)[None]
        g, _ = self.step(h2d(ids, dev), d.project(aux), pos, h2d(anc, dev), past)
        bs, src, dst = [], [], []
        for b in range(B):
            if n[b]:
                e = self.end_host[b]
                bs += [b] * n[b]
                src += list(range(past, past + n[b]))
                dst += list(range(e, e + n[b]))
                self.end_host[b] = e + n[b]
        # g_last[b] = g[b, n_b - 1] where n_b > 0, in one gather (no per-sequence device writes)
        last = h2d([[max(k - 1, 0), int(k > 0)] for k in n], dev)
        picked = g.gather(1, last[:, :1, None].expand(-1, 1, g.shape[-1]))[:, 0]
        self.g_last = torch.where(last[:, 1:].bool(), picked.to(self.g_last.dtype), self.g_last)
        n_t = last.new_tensor(n)
        self.end_col = self.end_col + n_t
        self.rows = self.rows + n_t
        move_rows(self.cache, bs, src, dst, max(self.end_host))

    def step(self, ids, hidden, pos, anc, mask_past: int):
        """One drafter forward over rows written behind the cache's rows; they see the committed
        columns (mask_past of them) and the drafting columns after them where anc says.
        Returns (g, logits or None)."""
        if self.fast is None:
            return self.drafter(ids, hidden, pos, self.cache,
                                attn_mask=tree_mask(self.start_col, self.end_col, mask_past, anc)), None
        at = self.cache.length
        g, logits = self.fast.step(ids, hidden, pos, *self.fast_inputs(ids.shape[1], anc, mask_past))
        self.cache.length = at + ids.shape[1]
        return g, logits

    def fast_inputs(self, n: int, anc, mask_past: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The fast step's mask and write position (on the device) for n rows behind the cache's rows,
        the cache grown first when they would not fit."""
        c = self.cache
        if c.length + n >= c.size:
            c = self.cache = self.fast.grow(c, c.length + n)
        return tree_mask(self.start_col, self.end_col, mask_past, anc, width=c.size), h2d(c.length, anc.device)

    # ------------------------------------------------------------------ drafting

    def _to_target_probs(self, q_draft: torch.Tensor) -> torch.Tensor:
        d = self.drafter
        q = torch.zeros(q_draft.shape[:-1] + (d.cfg.vocab_size,), dtype=torch.float32, device=q_draft.device)
        ids = d.draft_to_target(torch.arange(q_draft.shape[-1], device=q_draft.device))
        return q.index_copy_(-1, ids, q_draft.float())

    def expand(self, K: int, D: int, sampled: bool, step, g_last: torch.Tensor, rows: torch.Tensor):
        """EAGLE-2 expansion to depth D: (toks, scores, parents) [B, n_cand] over every candidate in
        creation order (parents first), and q_all [B, D, V] when sampling: the drafter's law of each
        depth's chain node, which is one draw from it (chain_candidates gives their indices). scores are cumulative
        draft log-probs, +inf on the chain (each depth's candidate 0: frontier slot 0's top-1 child),
        which the selection then always keeps. `step(tok, hidden, pos, anc, fed)` is one drafter
        forward whose rows go behind the `fed` drafting rows already written; with a graph-safe step
        the whole function is tensor ops (FastDraft graphs it)."""
        d, B, dev = self.drafter, g_last.shape[0], g_last.device

        def children(g: torch.Tensor, logits: Optional[torch.Tensor] = None):
            """top-k draft ids per row and their log-probs; sampled: row 0's first child is one draw from q
            (its siblings the top-k without it), and q of row 0 over the target vocab comes back too."""
            logits = d.logits(g) if logits is None else logits
            lp = torch.log_softmax(logits, -1, dtype=torch.float32)  # the cast inside: one kernel
            logp, idx = lp.topk(K, dim=-1)
            if not sampled:
                return idx, logp, None
            row0 = logits if logits.dim() == 2 else logits[:, 0]                   # the root, or frontier slot 0
            q = torch.softmax(row0.float() / self.temperature, -1)
            # one draw by the exponential race (argmax q / E, E ~ Exp(1)): no host sync, graph-safe
            x = (q / torch.empty_like(q).exponential_(generator=self.generator)).argmax(-1, keepdim=True)  # [B, 1]
            top = idx if logits.dim() == 2 else idx[:, 0]
            rest = top.gather(1, (top == x).to(torch.int8).argsort(dim=-1, stable=True))[:, :K - 1]  # siblings: x left out
            kids = torch.cat([x, rest], 1)
            kids_lp = (lp if logits.dim() == 2 else lp[:, 0]).gather(1, kids)
            if logits.dim() == 2:
                return kids, kids_lp, self._to_target_probs(q)
            return (torch.cat([kids[:, None], idx[:, 1:]], 1), torch.cat([kids_lp[:, None], logp[:, 1:]], 1),
                    self._to_target_probs(q))

        first = torch.zeros(1, dtype=torch.long, device=dev) if K > 1 else None  # a chain: no kernel for it

        def keep_chain(s: torch.Tensor) -> torch.Tensor:  # candidate 0 of a depth is the chain's node
            return s if first is None else s.index_fill(1, first, float("inf"))

        idx, logp, q = children(g_last)                                       # [B, K]
        toks, scores = [d.draft_to_target(idx)], [keep_chain(logp)]
        parents = [torch.full((B, K), -1, device=dev)]
        qs = [q] if sampled else None                                         # q of each depth's chain node
        front = torch.arange(K, device=dev)[None].expand(B, K)               # global candidate index
        front_score, front_g = logp, g_last[:, None].expand(B, K, -1)
        front_anc = torch.zeros(B, K, 0, dtype=torch.bool, device=dev)       # fed ancestors
        eye = torch.eye(K, dtype=torch.bool, device=dev)[None].expand(B, K, K)
        n_cand = K
        front_tok = toks[0]
        for depth in range(2, D + 1):
            anc = torch.cat([front_anc, eye], -1)
            pos = (rows + depth - 2)[:, None].expand(B, K)
            g, logits = step(front_tok, front_g, pos, anc, (depth - 2) * K)
            idx, logp, q = children(g, logits)                                # [B, K, K]
            cum = (front_score[:, :, None] + logp).reshape(B, K * K)
            tok = d.draft_to_target(idx).reshape(B, K * K)
            toks.append(tok)
            scores.append(keep_chain(cum))
            parents.append(front[:, :, None].expand(B, K, K).reshape(B, K * K))
            if sampled:
                qs.append(q)
            if K == 1:  # a chain: its one child is the frontier (no top-k, no gathers: kernels of a graph)
                front, front_tok, front_score, front_g, front_anc = torch.full_like(front, n_cand), tok, cum, g, anc
            else:
                best = scores[-1].topk(K, dim=-1).indices                    # next frontier: the chain's child
                                                                              # (slot 0), then the best K - 1
                row = best // K                                               # which fed row is the parent
                front = n_cand + best
                front_tok = tok.gather(1, best)
                front_score = cum.gather(1, best)
                front_g = g.gather(1, row[:, :, None].expand(-1, -1, g.shape[-1]))
                front_anc = anc.gather(1, row[:, :, None].expand(-1, -1, anc.shape[-1]))  # parent's ancestors + parent
            n_cand += K * K
        q_all = torch.stack(qs, 1) if sampled else None                       # [B, D, V]
        return torch.cat(toks, 1), torch.cat(scores, 1), torch.cat(parents, 1), q_all

    def graph_step(self, start: torch.Tensor, end: torch.Tensor, past: torch.Tensor):
        """A `step` for `expand` on the static cache with no host values: the mask is built on the
        device from start/end/past (a 0-d tensor) and the rows are written at past + fed."""
        c, d = self.cache, self.drafter
        committed = committed_columns(c.cols, start, end)  # the same at every depth

        def step(tok, hidden, pos, anc, fed):
            c.write_at.copy_(past + fed)
            g = d(tok, hidden, pos, c, attn_mask=device_tree_mask(committed, past, anc))
            return g, d.logits(g)
        return step

    @torch.inference_mode()
    def propose(self, max_depth: list[int]) -> list[DraftTree]:
        B = len(max_depth)
        D = max(max_depth)
        if D <= 0:
            return [DraftTree() for _ in max_depth]
        sampled = self.temperature > 0
        K = self.topk
        past = self.cache.length
        if self.fast is not None and not sampled:  # the whole expansion: one graph per (batch, K, D)
            if past + (D - 1) * K >= self.cache.size:
                self.cache = self.fast.grow(self.cache, past + (D - 1) * K + 1)
            past_t = h2d(past, self.device)
            toks, scores, parents = self.fast.expansion(self, K, D)(self.g_last, self.rows, self.start_col,
                                                                    self.end_col, past_t)
            q_all = None
        else:
            def step(tok, hidden, pos, anc, fed):
                return self.step(tok, hidden, pos, anc, past)
            toks, scores, parents, q_all = self.expand(K, D, sampled, step, self.g_last, self.rows)
        self.cache.crop(past)  # drop the drafting rows
        depths = [1] + list(range(2, D + 1))
        n_cand = K + (D - 1) * K * K
        toks, scores, parents = (x.tolist() for x in (toks, scores, parents))
        depth_of = [dd for i, dd in enumerate(depths) for _ in range(K if i == 0 else K * K)]
        chain = {c: j for j, c in enumerate(chain_candidates(K, D))}  # sampled: the nodes drawn from q
        trees = []
        for b in range(B):
            ok = [i for i in range(n_cand) if depth_of[i] <= max_depth[b]]
            chosen = set(sorted(ok, key=lambda i: (-scores[b][i], i))[:self.budget])
            for i in list(chosen):  # ancestors first (only exact log-prob ties could leave one out)
                p = parents[b][i]
                while p >= 0 and p not in chosen:
                    chosen.add(p)
                    p = parents[b][p]
            order = sorted(chosen)
            at = {g: j for j, g in enumerate(order)}
            trees.append(DraftTree([toks[b][i] for i in order], [at[parents[b][i]] if parents[b][i] >= 0 else -1 for i in order],
                                   [q_all[b, chain[i]] if i in chain else None for i in order] if sampled else None))
        return trees


def chain_candidates(K: int, D: int) -> list[int]:
    """The candidate index of the chain's node at each depth 1..D in `expand`'s creation order: depth 1's
    first child of the root, then the first child of frontier slot 0 (the chain's node) at each depth."""
    return [0] + [K + (dd - 2) * K * K for dd in range(2, D + 1)]


# ----------------------------------------------------------------------------- the drafter's fast path


class FastDraft:
    """A drafter's static cache and its graphed step, reused across generations (re-made when
    the batch size changes or the sequence outgrows it)."""

    def __init__(self, drafter: Any, graphs: bool, max_rows: int = 64, compile: bool = False):
        self.drafter, self.graphs, self.max_rows = drafter, graphs, max_rows
        if compile:  # evaluate.fast: compile -- the drafter's pure regions too, as the target's (hfmodel.compile_regions)
            drafter.compile_regions()
        self.cache: Optional[StaticDraftCache] = None
        self.step = Graphed(self._step, graphs, max_rows)
        self.expansions: dict[tuple, Graphed] = {}
        self.resident: dict[tuple, Any] = {}  # resident.Resident per (batch, shape), holding its round's graph

    def reset(self, batch_size: int, needed: int) -> StaticDraftCache:
        """An empty cache for a new generation (the old buffers when they are big enough)."""
        c = self.cache
        if c is None or c.k.shape[0] != batch_size or c.size <= needed:
            self._new(batch_size, needed)
        self.cache.length = 0
        return self.cache

    def grow(self, cache: StaticDraftCache, needed: int) -> StaticDraftCache:
        """A bigger cache holding the same rows (graphs are re-captured for its new size)."""
        old = cache
        self._new(old.k.shape[0], max(needed, 2 * old.size))
        self.cache.k[:, :, :old.size] = old.k
        self.cache.v[:, :, :old.size] = old.v
        self.cache.length = old.length
        return self.cache

    def _new(self, batch_size: int, needed: int) -> None:
        cfg, w = self.drafter.cfg, self.drafter.fc.weight
        S = -(-(needed + 256) // 256) * 256
        self.cache = StaticDraftCache(batch_size, S, cfg.num_key_value_heads, cfg.head_dim, w.dtype, w.device,
                                      rope_table(cfg, S, w.dtype, w.device))
        self.step = Graphed(self._step, self.graphs, self.max_rows)
        self.expansions: dict[tuple, Graphed] = {}

    def expansion(self, proposer: Any, K: int, D: int) -> Graphed:
        """The proposer's whole top-K expansion to depth D (every drafter step, top-k and frontier
        choice) as one graphed call: (g_last, rows, start, end, past) -> (toks, scores, parents)."""
        if (K, D) not in self.expansions:
            def fn(g_last, rows, start, end, past):
                toks, scores, parents, _ = proposer.expand(K, D, False, proposer.graph_step(start, end, past),
                                                            g_last, rows)
                return toks, scores, parents
            self.expansions[(K, D)] = Graphed(fn, self.graphs)
        return self.expansions[(K, D)]

    def _step(self, ids, hidden, pos, mask, write_at):
        self.cache.write_at.copy_(write_at)
        g = self.drafter(ids, hidden, pos, self.cache, attn_mask=mask)
        return g, self.drafter.logits(g)
