"""Greedy EAGLE-3 rounds that stay on the device: one CUDA graph per round, no host work between.

The engine's host loop (`engine.generate`) reads every round's drafts and the target's argmax back
to the host, builds the tree and the verify inputs there and walks the acceptance there: two
syncs and a few milliseconds of Python per round, during which the GPU idles (profile_rounds:
~40 % of every round on the H200). Here the same round is written in tensor ops only:

    expand     the proposer's EAGLE-2 expansion (its own graph-safe `expand`)
    select     the `budget` best candidates by cumulative log-prob, within each sequence's depth
               limit (stable sort: ties go to the earlier candidate, as the host's sort does, so
               the set is closed under ancestors), renumbered in creation order
    verify     [root, *nodes, padding] through the target over its static cache, ancestry masks
    accept     greedy: a node is accepted when its token is the target's argmax at its parent
               and its parent is accepted; the committed tokens are the argmax along that path
    commit     emitted tokens (cut at EOS) into an output buffer; per-round counts into stats
               buffers; the target's cache rows of the root and path moved behind each
               sequence's committed rows; the drafter fed those rows (as Eagle3Proposer._feed)

Sequences that finished only ride along (every update is masked). With CUDA graphs the host
replays one graph per round and reads one flag per round, a round late, so the GPU always has
the next round queued; the round after the last is a masked no-op. The host loop stays the path
for sampling, eager decoding and proposers other than EAGLE-3; outputs are the same (tests).
"""
from __future__ import annotations

import time
from typing import Sequence

import torch

from ..artifacts import log
from .cache import capture, copy_columns, h2d
from .eagle3 import Eagle3Proposer
from .fast import FastTarget
from .tree import SpecStats, device_tree_mask, left_pad
from .verify import rows_of


def eligible(fast, proposer, temperature: float) -> bool:
    """The resident path runs greedy EAGLE-3 proposals on a FastTarget with a FastDraft."""
    return (fast is not None and temperature <= 0 and isinstance(proposer, Eagle3Proposer)
            and proposer.fast is not None)


class Resident:
    """Device state and the round of one (batch, shape) configuration, reused across generations
    (kept on the FastDraft, so the captured graph is replayed by every later prompt of that shape)."""

    def __init__(self, ft: FastTarget, prop, B: int, depth: int, max_new: int, eos_ids: Sequence[int]):
        d, dev = prop.drafter, ft.device
        self.ft, self.prop, self.B, self.D, self.K = ft, prop, B, depth, prop.topk
        self.n_cand = self.K + (depth - 1) * self.K * self.K
        self.M = min(prop.budget, self.n_cand)        # nodes verified per sequence (padded)
        self.N = 1 + prop.budget                       # verify rows, as the host loop pads them
        self.T = min(depth, self.M) + 1                # committed tokens per round, at most
        self.max_new, self.eos_host = max_new, set(eos_ids)
        self.W = max_new + self.T + 1                  # output buffer; its last column is scratch
        self.R = max_new + 2                           # per-round stats; the last column is scratch
        L, Z = torch.long, lambda *s, dt=torch.long: torch.zeros(*s, dtype=dt, device=dev)
        self.state = {
            "t_start": Z(B), "t_end": Z(B), "last": Z(B), "n_gen": Z(B), "done": Z(B, dt=torch.bool),
            "buf": Z(B, self.W), "rounds": Z(B), "r_drafted": Z(B, self.R), "r_accepted": Z(B, self.R),
            "r_emitted": Z(B, self.R), "drafted": Z(B, depth), "reached": Z(B, depth), "accepted": Z(B, depth),
            "d_start": Z(B), "d_end": Z(B), "d_rows": Z(B),
            "g_last": torch.zeros(B, d.cfg.hidden_size, dtype=d.fc.weight.dtype, device=dev),
            "eos": h2d(list(eos_ids) or [-1], dev, L),
        }
        self.depth_c = h2d([1] * self.K + [dd for dd in range(2, depth + 1) for _ in range(self.K * self.K)], dev, L)
        self.ar_N, self.ar_T = torch.arange(self.N, device=dev), torch.arange(self.T, device=dev)
        self.eye = torch.eye(self.N, dtype=torch.bool, device=dev)
        self.tril = torch.ones(self.T, self.T, dtype=torch.bool, device=dev).tril()
        self.b_idx = torch.arange(B, device=dev).repeat_interleave(self.T)
        self.caches = self.current_caches()  # held: a graph replays into these very buffers
        self.graph = None

    def current_caches(self) -> tuple:
        return self.ft.cache, self.prop.cache

    def same_caches(self) -> bool:
        return all(a is b for a, b in zip(self.caches, self.current_caches()))

    # ------------------------------------------------------------------ one round, tensor ops only

    def round(self) -> None:
        st, ft, prop, d = self.state, self.ft, self.prop, self.prop.drafter
        B, D, K, N, M, T = self.B, self.D, self.K, self.N, self.M, self.T
        active = ~st["done"]
        max_depth = torch.where(active, (self.max_new - st["n_gen"] - 1).clamp(0, D), 0)

        # expand (drafting rows after the drafter's committed columns; dropped after the round)
        d_past = st["d_end"].max()
        toks, scores, parents, _ = prop.expand(K, D, False, prop.graph_step(st["d_start"], st["d_end"], d_past),
                                                st["g_last"], st["d_rows"])
        # select the best M candidates of allowed depth, then put them in creation order
        ok = self.depth_c[None] <= max_depth[:, None]
        best = torch.sort(torch.where(ok, scores, float("-inf")), dim=1, descending=True, stable=True).indices[:, :M]
        keep = ok.gather(1, best)
        cand = torch.where(keep, best, self.n_cand).sort(dim=1).values        # [B, M], n_cand = no node
        valid = cand < self.n_cand
        c = cand.clamp(max=self.n_cand - 1)
        node_of = torch.full((B, self.n_cand + 1), -1, dtype=torch.long, device=c.device)
        node_of.scatter_(1, cand, torch.arange(M, device=c.device).expand(B, M).contiguous())
        pc = parents.gather(1, c)
        parent_node = torch.where(pc >= 0, node_of.gather(1, pc.clamp(min=0)), -1)
        depth = torch.where(valid, self.depth_c[c], 0)

        # verify rows: 0 = root (last committed token), 1..M = nodes, then padding
        pad = N - 1 - M
        row_valid = torch.cat([torch.ones(B, 1, dtype=torch.bool, device=c.device), valid,
                               valid.new_zeros(B, pad)], 1)
        ids = torch.cat([st["last"][:, None], torch.where(valid, toks.gather(1, c), 0), c.new_zeros(B, pad)], 1)
        depth_r = torch.cat([depth.new_zeros(B, 1), depth, depth.new_zeros(B, pad)], 1)
        prow = torch.cat([c.new_zeros(B, 1), torch.where(valid, parent_node + 1, self.ar_N[1:1 + M]),
                          self.ar_N[1 + M:].expand(B, pad)], 1)               # parent's row; self for none
        anc = self.eye.expand(B, N, N)
        for _ in range(D):
            anc = self.eye | anc.gather(1, prow[:, :, None].expand(B, N, N))
        anc = anc & (row_valid[:, :, None] | self.eye)                       # padding rows see only themselves
        past = st["t_end"].max()
        pos = (st["t_end"] - st["t_start"])[:, None] + depth_r
        logits, aux, _ = ft.verify_rows(ids, pos, past, st["t_start"], st["t_end"], anc)

        # accept (greedy) along the tree
        greedy = logits.argmax(-1)                                             # [B, N]
        match = row_valid & (ids == greedy.gather(1, prow))
        root = self.ar_N[None] == 0
        acc = root.expand(B, N)
        for _ in range(D):
            acc = root | (match & acc.gather(1, prow))
        n_acc = acc.sum(1) - 1
        path = torch.where(acc, self.ar_N, N).sort(dim=1).values[:, :T]       # [0, path rows..., N...]
        in_path = self.ar_T[None] <= n_acc[:, None]
        path = torch.where(in_path, path, 0)
        committed = greedy.gather(1, path)                                     # tokens after each path row
        n_com = n_acc + 1
        is_eos = (committed[:, :, None] == st["eos"]).any(-1) & in_path
        hit = is_eos.any(1)
        n_emit = torch.where(hit, is_eos.int().argmax(1) + 1, n_com)

        # emitted tokens and per-round counts (active sequences only)
        put = in_path & (self.ar_T[None] < n_emit[:, None]) & active[:, None]
        st["buf"].scatter_(1, torch.where(put, st["n_gen"][:, None] + self.ar_T, self.W - 1), committed)
        st["n_gen"] += torch.where(active, n_emit, 0)
        at = torch.where(active, st["rounds"], self.R - 1)[:, None]
        st["r_drafted"].scatter_(1, at, valid.sum(1, keepdim=True))
        st["r_accepted"].scatter_(1, at, n_acc[:, None])
        st["r_emitted"].scatter_(1, at, n_emit[:, None])
        st["rounds"] += active.long()
        lvl = torch.arange(D, device=c.device)[None]
        reached_d = (lvl < depth.max(1).values[:, None]) & active[:, None]
        st["drafted"] += reached_d.long()
        st["reached"] += (reached_d & (lvl <= n_acc[:, None])).long()
        st["accepted"] += (reached_d & (lvl < n_acc[:, None])).long()
        now_done = st["done"] | (active & (hit | (st["n_gen"] >= self.max_new)))

        # the target's cache: root + path rows behind each sequence's committed rows
        mv = (in_path & active[:, None]).reshape(-1)
        spare = ft.S - 1
        src = torch.where(mv, (past + path).reshape(-1), spare)
        dst = torch.where(mv, (st["t_end"][:, None] + self.ar_T).reshape(-1), spare)
        ft.move_columns(self.b_idx, src, dst)
        st["t_end"] += torch.where(active, n_com, 0)
        st["last"].copy_(torch.where(active, committed.gather(1, n_acc[:, None])[:, 0], st["last"]))

        # the drafter: feed the committed rows of the sequences that go on (Eagle3Proposer._feed)
        n_b = torch.where(active & ~now_done, n_com, 0)
        fv = self.ar_T[None] < n_b[:, None]                                   # [B, T]
        f_ids = torch.where(fv, committed, 0)
        f_aux = aux.gather(1, path[:, :, None].expand(B, T, aux.shape[-1]))
        f_anc = (self.tril[None] & fv[:, None, :]) | self.eye[:T, :T]
        cache = prop.cache
        cache.write_at.copy_(d_past)
        cols = torch.arange(cache.size, device=c.device)
        g = d(f_ids, d.project(f_aux), st["d_rows"][:, None] + self.ar_T,
              cache, attn_mask=device_tree_mask(cols, st["d_start"], st["d_end"], d_past, f_anc))
        dmv = fv.reshape(-1)
        dsrc = torch.where(dmv, (d_past + self.ar_T).expand(B, T).reshape(-1), cache.size - 1)
        ddst = torch.where(dmv, (st["d_end"][:, None] + self.ar_T).reshape(-1), cache.size - 1)
        copy_columns((cache.k, cache.v), self.b_idx, dsrc, ddst)
        picked = g.gather(1, (n_b - 1).clamp(min=0)[:, None, None].expand(B, 1, g.shape[-1]))[:, 0]
        st["g_last"].copy_(torch.where((n_b > 0)[:, None], picked.to(st["g_last"].dtype), st["g_last"]))
        st["d_end"] += n_b
        st["d_rows"] += n_b
        st["done"].copy_(now_done)

    # ------------------------------------------------------------------ the host side

    def _replay(self):
        """The round as a callable: a CUDA graph's replay (captured on first use), or the eager round."""
        if not self.ft.graphs or self.graph is False:
            return self.round
        if self.graph is None:
            try:  # the warm-up round's advance of the state is undone (its cache writes are redone)
                self.graph, _ = capture(self.round, state=self.state)
            except Exception as e:  # cannot be captured: eager rounds from now on (a real error recurs there)
                torch.cuda.synchronize()
                log(f"[fast] CUDA graph capture of the resident round failed ({str(e).splitlines()[0][:160]}); "
                    "its rounds run eagerly")
                self.graph = False
                return self.round
        return self.graph.replay

    def run(self, first: list[int], pad: list[int], P: int) -> tuple[list[list[int]], list[dict]]:
        """Rounds until every sequence is done. `first` = the prefill's tokens; the proposer has
        been started (its committed rows hold the prompts). Returns (new tokens, stats) per sequence."""
        st, prop, dev = self.state, self.prop, self.ft.device
        for k in ("n_gen", "rounds", "r_drafted", "r_accepted", "r_emitted", "drafted", "reached", "accepted", "buf"):
            st[k].zero_()
        host = torch.tensor([[p, P, f, 1, int(f in self.eos_host or self.max_new <= 1)] for p, f in zip(pad, first)])
        init = h2d(host, dev)
        st["t_start"].copy_(init[:, 0])
        st["t_end"].copy_(init[:, 1])
        st["last"].copy_(init[:, 2])
        st["n_gen"].copy_(init[:, 3])
        st["done"].copy_(init[:, 4].bool())
        st["buf"][:, 0] = init[:, 2]
        st["d_start"].copy_(prop.start_col)
        st["d_end"].copy_(prop.end_col)
        st["d_rows"].copy_(prop.rows)
        st["g_last"].copy_(prop.g_last)
        step = None if bool(host[:, 4].all()) else self._replay()
        cuda = dev.type == "cuda"
        flags = [torch.zeros((), dtype=torch.bool, pin_memory=cuda) for _ in range(2)]
        events = [torch.cuda.Event() if cuda else None for _ in range(2)]
        r, pending = 0, None
        while step is not None:
            if r > self.max_new + 2:
                raise RuntimeError("resident rounds: a round emitted nothing (a bug); the sequences never finished")
            step()
            i = r % 2
            flags[i].copy_(st["done"].all(), non_blocking=cuda)
            if not cuda:
                if bool(flags[i]):
                    break
            else:
                events[i].record()
                if pending is not None:  # read the round before this one: the GPU has this round queued
                    events[pending].synchronize()
                    if bool(flags[pending]):
                        break
            pending, r = i, r + 1
        n_gen = st["n_gen"].tolist()
        buf, rounds = st["buf"].tolist(), st["rounds"].tolist()
        per = {k: st[k].tolist() for k in ("r_drafted", "r_accepted", "r_emitted", "drafted", "reached", "accepted")}
        self.ft.past = int(st["t_end"].max())
        new = [buf[b][:n_gen[b]] for b in range(self.B)]
        stats = [{"rounds": rounds[b], "drafted_per_round": per["r_drafted"][b][:rounds[b]],
                  "accepted_per_round": per["r_accepted"][b][:rounds[b]],
                  "emitted_per_round": per["r_emitted"][b][:rounds[b]],
                  "drafted": per["drafted"][b], "reached": per["reached"][b], "accepted": per["accepted"][b]}
                 for b in range(self.B)]
        return new, stats


def resident_generate(target, proposer, prompts: list[list[int]], max_new_tokens: int, depth: int,
                      eos_ids: Sequence[int], fast: FastTarget):
    """`engine.generate` for greedy EAGLE-3 on the fast path, every round on the device. Same
    returns: (new tokens, SpecStats) per sequence; target_s and draft_s are None (one graph does both)."""
    B, dev = len(prompts), target.device
    t_start = time.perf_counter()
    ids, pad, pos = left_pad(prompts, dev)
    P = ids.shape[1]
    out = fast.prefill(ids, pos, pad, max_new_tokens, 1 + proposer.max_nodes)
    first, pad_h = out.logits[:, -1].argmax(-1).tolist(), pad.tolist()
    tokens = [list(p) + [f] for p, f in zip(prompts, first)]
    proposer.start(tokens, [rows_of(out, b, torch.arange(pad_h[b], P, device=dev)) for b in range(B)])
    needed = P + max_new_tokens + depth * proposer.topk + depth + 2
    if proposer.cache.size <= needed:
        proposer.cache = proposer.fast.grow(proposer.cache, needed)
    store = proposer.fast.resident
    key = (B, proposer.topk, proposer.budget, depth, max_new_tokens, tuple(eos_ids))
    res = store.get(key)
    if res is not None:
        res.prop = proposer  # a new proposer over the same buffers: the graph stays valid
    if res is None or not res.same_caches():
        res = store[key] = Resident(fast, proposer, B, depth, max_new_tokens, eos_ids)
    new, per = res.run(first, pad_h, P)
    wall = time.perf_counter() - t_start
    stats = []
    for n, s in zip(new, per):
        stats.append(SpecStats(tokens=len(n), wall_s=wall, target_s=None, draft_s=None, **s))
    return new, stats
