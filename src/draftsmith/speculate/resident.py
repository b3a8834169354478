"""The device-resident decode loop: EAGLE-3 rounds, or plain decoding's steps, one CUDA graph each, no host
work between (the engine's other loop, `engine.generate`, is the host's).

The engine's host loop (`engine.generate`) reads every round's drafts and the target's argmax back
to the host, builds the tree and the verify inputs there and walks the acceptance there: two
syncs and a few milliseconds of Python per round, during which the GPU idles (profile_rounds:
~40 % of every round on the H200). Here the same round is written in tensor ops only:

    expand     the proposer's EAGLE-2 expansion (its own graph-safe `expand`)
    select     the chain, then the `budget` best candidates by cumulative log-prob (expand scores
               the chain +inf), within each sequence's depth
               limit (stable sort: ties go to the earlier candidate, as the host's sort does, so
               the set is closed under ancestors), renumbered in creation order
    verify     [root, *nodes, padding] through the target over its static cache, ancestry masks
    accept     greedy: a node is accepted when its token is the target's argmax at its parent
               and its parent is accepted; the committed tokens are the argmax along that path.
               Sampled (temperature > 0): the same with one pick per row instead of the argmax:
               a draw from p (sample_race) where the drafts are fixed (top-k), and at the parent
               of a chain node drawn from the drafter's law q, that node when speculative sampling
               accepts it, else a draw from the residual (pick_sampled_tree); a chain of drawn
               drafts: accept_sampled_chain; draws from the round's own generator, the target's law kept
    commit     emitted tokens (cut at EOS) into an output buffer; per-round counts into stats
               buffers; the target's cache rows of the root and path moved behind each
               sequence's committed rows; the drafter fed those rows (as Eagle3Proposer._feed)

Each step but expand and verify is a pure tensor function below (choose, ancestry, sample_race, pick_sampled_tree, accept,
accept_sampled_chain, commit, feed_inputs, feed_finish), labelled with its phase for torch.profiler (benchmarks/count_round_ops.py
counts the ops of each); with `compile_round` inductor compiles each of them, so their small
kernels (167 in a 12-layer reference-shaped chain round on a CPU) become a few fused ones (24).

Sequences that finished only ride along (every update is masked). With CUDA graphs the host
replays one graph per round and reads one flag per round, a round late, so the GPU always has
the next round queued; the round after the last is a masked no-op. The host loop stays the path
for eager decoding and proposers other than EAGLE-3; greedy outputs are the same, sampled ones have
the same law (tests; tests/test_resident.py::test_resident_acceptance_matches_tree_round_by_round holds
accept, accept_sampled_chain and pick_sampled_tree to tree.py's acceptance on the same trees and draws).

With no proposer the loop is plain decoding on the fast path (Plain, resident_plain): one row per sequence
per step over the FastTarget's cache, the next token picked on the device and fed back; the same host
side (`drive`) replays it, reading one "every sequence hit EOS" flag a step late (none without EOS ids).
"""
from __future__ import annotations

import math
import time
from types import SimpleNamespace
from typing import Sequence

import torch

from .cache import capture, capture_failed, copy_columns, h2d, reseed
from .eagle3 import Eagle3Proposer
from .fast import FastTarget
from .tree import SpecStats, committed_columns, device_tree_mask, first_eos, left_pad, pick, pick_on_device, sample_race
from .verify import rows_of

phase = torch.profiler.record_function  # labels a round's phases for benchmarks/count_round_ops.py (no-op unprofiled)


def eligible(fast, proposer, resident: bool) -> bool:
    """Whether engine.generate runs on the device here: plain decoding (no proposer) on a FastTarget always
    (nothing of it needs the host); with `resident`, EAGLE-3 proposals on a FastTarget with a FastDraft,
    greedy or sampled (chains whose drafts are drawn from q: accept_sampled_chain; trees: pick_sampled_tree,
    or sample_race where every draft is fixed, and accept), as the host loop does with tree.accept_sampled."""
    if fast is None:
        return False
    return proposer is None or resident and isinstance(proposer, Eagle3Proposer) and proposer.fast is not None


# ----------------------------------------------------------------------------- the round's parts
# Pure tensor functions of the round (no model, no cache): eager by default, each compiled by
# inductor under `compile_round` (torch.compile fuses their many tiny kernels; inside the round's CUDA
# graph each kernel still costs a few microseconds). Python ints among the arguments are constants
# (a compiled part is specialized to them); what varies between runs of one shape (max_new, the
# spare cache column) comes in as 0-d tensors.


def choose(scores, parents, toks, last, n_gen, active, depth_c, max_new, D: int, M: int, N: int):
    """select: each sequence's M best candidates by cumulative log-prob within its depth limit (stable
    sort: ties go to the earlier candidate, as the host's sort does, so the set is closed under
    ancestors), in creation order, as verify rows: 0 = root (the last committed token), 1..M = the
    nodes, then padding. Returns (ids, depth, parent row (self where none), row valid, chain) [B, N];
    chain: the row holds a chain node (score +inf: Eagle3Proposer.expand's keep_chain, trees only)."""
    B, n_cand = scores.shape
    max_depth = torch.where(active, (max_new - n_gen - 1).clamp(0, D), 0)  # max_new: a 0-d tensor
    ok = depth_c[None] <= max_depth[:, None]
    best = torch.sort(torch.where(ok, scores, float("-inf")), dim=1, descending=True, stable=True).indices[:, :M]
    cand = torch.where(ok.gather(1, best), best, n_cand).sort(dim=1).values      # [B, M], n_cand = no node
    valid = cand < n_cand
    c = cand.clamp(max=n_cand - 1)
    rows = torch.arange(N, device=c.device)
    node_row = c.new_zeros(B, n_cand + 1).scatter(1, cand, rows[1:1 + M].expand(B, M))    # candidate -> its row
    pc = parents.gather(1, c)
    parent_row = torch.where(pc >= 0, node_row.gather(1, pc.clamp(min=0)), 0)    # the root's children: 0
    pad = N - 1 - M
    zeros = c.new_zeros(B, pad)
    ids = torch.cat([last[:, None], torch.where(valid, toks.gather(1, c), 0), zeros], 1)
    depth = torch.cat([c.new_zeros(B, 1), torch.where(valid, depth_c[c], 0), zeros], 1)
    prow = torch.cat([c.new_zeros(B, 1), torch.where(valid, parent_row, rows[1:1 + M]), rows[1 + M:].expand(B, pad)], 1)
    row_valid = torch.cat([valid.new_ones(B, 1), valid, valid.new_zeros(B, pad)], 1)
    chain = torch.cat([valid.new_zeros(B, 1), valid & (scores.gather(1, c) == float("inf")), valid.new_zeros(B, pad)], 1)
    return ids, depth, prow, row_valid, chain


def ancestry(prow, row_valid, D: int):
    """masks: anc[b, i, j] = row j is row i or one of its ancestors; padding rows see only themselves.
    Pointer doubling: after s steps `anc` holds the ancestors fewer than 2^s levels up and `jump` the
    2^s-th one, so ceil(log2(D + 1)) steps (D = 5: 3) reach the root from depth D."""
    B, N = prow.shape
    eye = torch.eye(N, dtype=torch.bool, device=prow.device).expand(B, N, N)
    anc, jump = eye, prow
    for _ in range(math.ceil(math.log2(D + 1))):
        anc = anc | anc.gather(1, jump[:, :, None].expand(B, N, N))
        jump = jump.gather(1, jump)
    return anc & (row_valid[:, :, None] | eye)


def pick_sampled_tree(logits, ids, prow, depth, chain, q_all, u, e, temperature: float):
    """The token each row's children are checked against (accept's `picked`) in a tree whose chain node
    at each depth was drawn from q (q_all [B, D, V]) and whose other nodes are fixed: at the parent row of
    a drawn node x, x is picked when u q(x) < p(x) (speculative sampling), else a draw from norm(max(p - q,
    0)), the residual after rejecting x; elsewhere a draw from p (as sample_race). Moving to the child that
    holds the picked token then tries x first and the fixed siblings after it against the residual, as
    tree.accept_sampled does on the host: every emitted token keeps the target's law. x is not among its
    siblings (expand leaves it out), and a rejected x has p(x) < q(x): no mass in the residual. u [B, N]
    uniform, e [B, N, V] Exp(1) draws."""
    B, N, V = logits.shape
    D = q_all.shape[1]
    p = torch.softmax(logits.float() / temperature, -1)
    to = torch.where(chain, prow, N)                                            # a drawn node's parent row (N: spare)
    x = ids.new_full((B, N + 1), -1).scatter_(1, to, torch.where(chain, ids, -1))[:, :N]  # at most one per parent
    k = ids.new_full((B, N + 1), D).scatter_(1, to, torch.where(chain, depth - 1, D))[:, :N]  # its q's index (D: none)
    q = torch.cat([q_all, q_all.new_zeros(B, 1, V)], 1).gather(1, k[..., None].expand(B, N, V))
    has = x >= 0
    xc = x.clamp(min=0)[..., None]
    take = has & (u * q.gather(2, xc)[..., 0] < p.gather(2, xc)[..., 0])
    res = (p - q).clamp_min(0)                                                   # p itself where none was drawn (q 0)
    res = torch.where(res.sum(-1, keepdim=True) > 0, res, p)                      # empty residual: p was all on x
    return torch.where(take, x, (res / e).argmax(-1))


def cut_at_eos(committed, in_path, n_acc, eos):
    """(tokens emitted per sequence: its n_acc + 1 committed ones, cut after the first EOS among them;
    whether it hit EOS), the tail of both acceptances."""
    is_eos = (committed[:, :, None] == eos).any(-1) & in_path
    hit = is_eos.any(1)
    return torch.where(hit, is_eos.int().argmax(1) + 1, n_acc + 1), hit


def accept(picked, ids, prow, row_valid, anc, eos, T: int):
    """Acceptance against the target's token at every row, `picked` [B, N]: its argmax (greedy), or one
    draw per row (tree.sample_race). A row is accepted when it and every ancestor below the root hold the
    picked token of their parent. With draws this is speculative sampling of a tree whose nodes are
    fixed (top-k children, distinct tokens: q a point mass), as tree.accept_sampled does by trying the
    children one after another: a child x is accepted with p(x), the residual after rejecting the
    children is p without them -- the same law as one draw y ~ p, moving to the child that holds y, else
    emitting y. Returns (accepted count, path rows [B, T] (0 past the path), the committed tokens after
    them [B, T], tokens emitted (cut after the first EOS), EOS hit)."""
    B, N = ids.shape
    rows = torch.arange(N, device=ids.device)
    good = (row_valid & (ids == picked.gather(1, prow))) | (rows == 0)
    acc = ~(anc & ~good[:, None, :]).any(-1)
    n_acc = acc.sum(1) - 1
    path = torch.where(acc, rows, N).sort(dim=1).values[:, :T]                  # [0, path rows..., N...]
    in_path = torch.arange(T, device=ids.device)[None] <= n_acc[:, None]
    path = torch.where(in_path, path, 0)
    committed = picked.gather(1, path)                                           # the token after each path row
    return (n_acc, path, committed) + cut_at_eos(committed, in_path, n_acc, eos)


def accept_sampled_chain(logits, ids, row_valid, q_all, u, e, eos, temperature: float, T: int):
    """Speculative sampling down a chain (Leviathan et al. 2023), as tree.accept_sampled does on the
    host: draft row i (token x_i drawn from q_i, the drafter's law over the target vocab) is accepted
    when u_i q_i(x_i) < p_{i-1}(x_i) and every draft before it was, p_{i-1} = softmax(logits / temperature)
    at its parent row; the token after the last accepted row is drawn from norm(max(p - q, 0)) when the
    next draft was rejected, else from p (every draft accepted, or the chain cut by the depth limit), so
    every emitted token has the target's law. The draws come in: u [B, N] uniform, e [B, V] Exp(1)
    (argmax w / e draws w / sum w: the exponential race). Returns what `accept` returns."""
    B, N = ids.shape
    M = min(q_all.shape[1], N - 1)                                               # draft rows 1..M
    p = torch.softmax(logits.float() / temperature, -1)                          # [B, N, V]
    x = ids[:, 1:1 + M, None]
    ok = row_valid[:, 1:1 + M] & (u[:, 1:1 + M] * q_all[:, :M].gather(2, x)[..., 0] < p[:, :M].gather(2, x)[..., 0])
    n_acc = ok.long().cumprod(1).sum(1)                                          # [B]
    V = p.shape[-1]
    p_r = p.gather(1, n_acc[:, None, None].expand(B, 1, V))[:, 0]                # the target's law after the path
    q_r = q_all.gather(1, n_acc.clamp(max=M - 1)[:, None, None].expand(B, 1, V))[:, 0]
    rejected = (n_acc < M) & row_valid.gather(1, (n_acc + 1).clamp(max=N - 1)[:, None])[:, 0]
    res = torch.where(rejected[:, None], (p_r - q_r).clamp_min(0), p_r)
    res = torch.where(res.sum(-1, keepdim=True) > 0, res, p_r)                    # empty residual: p was all on x
    bonus = (res / e).argmax(-1)
    steps = torch.arange(T, device=ids.device)
    in_path = steps[None] <= n_acc[:, None]
    path = torch.where(in_path, steps[None], 0)                                  # a chain's path: rows 0..n_acc
    committed = torch.where(steps[None] < n_acc[:, None], ids.gather(1, (path + 1).clamp(max=N - 1)), bonus[:, None])
    return (n_acc, path, committed) + cut_at_eos(committed, in_path, n_acc, eos)


def commit(st: dict, active, n_acc, path, committed, n_emit, hit, row_valid, depth, past, spare):
    """Emitted tokens into the output buffer, per-round counts into the stats buffers, the committed
    length and last token, `done` (active sequences only; scratch columns take the rest). Returns the
    target cache's column moves (src, dst: root + path rows behind each sequence's committed rows,
    spare -> spare for none) and the rows to feed the drafter per sequence (0 for one that stopped)."""
    B, T = path.shape
    W, R, D = st["buf"].shape[1], st["r_drafted"].shape[1], st["drafted"].shape[1]
    steps = torch.arange(T, device=path.device)[None]
    in_path = (steps <= n_acc[:, None]) & active[:, None]
    put = in_path & (steps < n_emit[:, None])
    st["buf"].scatter_(1, torch.where(put, st["n_gen"][:, None] + steps, W - 1), committed)
    st["n_gen"] += torch.where(active, n_emit, 0)
    at = torch.where(active, st["rounds"], R - 1)[:, None]
    st["r_drafted"].scatter_(1, at, row_valid.sum(1, keepdim=True) - 1)
    st["r_accepted"].scatter_(1, at, n_acc[:, None])
    st["r_emitted"].scatter_(1, at, n_emit[:, None])
    st["rounds"] += active.long()
    lvl = torch.arange(D, device=path.device)[None]
    reached = (lvl < depth.max(1).values[:, None]) & active[:, None]
    st["drafted"] += reached.long()
    st["reached"] += (reached & (lvl <= n_acc[:, None])).long()
    st["accepted"] += (reached & (lvl < n_acc[:, None])).long()
    now_done = st["done"] | (active & (hit | (st["n_gen"] >= st["max_new"])))
    src = torch.where(in_path, past + path, spare).reshape(-1)
    dst = torch.where(in_path, st["t_end"][:, None] + steps, spare).reshape(-1)
    n_com = n_acc + 1
    st["t_end"] += torch.where(active, n_com, 0)
    st["last"].copy_(torch.where(active, committed.gather(1, n_acc[:, None])[:, 0], st["last"]))
    n_feed = torch.where(active & ~now_done, n_com, 0)
    st["done"].copy_(now_done)
    return src, dst, n_feed


def feed_inputs(committed, aux, path, n_feed, d_start, d_end, d_rows, d_past, d_cols):
    """The drafter's feed of the committed rows (as Eagle3Proposer's), written at d_past: (ids, target
    aux states, positions, mask [B, T, S_d]) and the moves of the rows fed behind each sequence's
    drafter columns (src, dst; the spare last column for none)."""
    B, T = committed.shape
    steps = torch.arange(T, device=committed.device)
    fed = steps[None] < n_feed[:, None]                                          # [B, T]
    ids = torch.where(fed, committed, 0)
    f_aux = aux.gather(1, path[:, :, None].expand(B, T, aux.shape[-1]))
    eye = torch.eye(T, dtype=torch.bool, device=committed.device)
    anc = (torch.ones(T, T, dtype=torch.bool, device=fed.device).tril()[None] & fed[:, None, :]) | eye  # causal, fed rows
    mask = device_tree_mask(committed_columns(d_cols, d_start, d_end), d_past, anc)
    spare = d_cols.shape[0] - 1
    src = torch.where(fed, d_past + steps, spare).reshape(-1)
    dst = torch.where(fed, d_end[:, None] + steps, spare).reshape(-1)
    return ids, f_aux, d_rows[:, None] + steps, mask, src, dst


def feed_finish(st: dict, g, n_feed) -> None:
    """After the feed: each sequence's last fed drafter state, its drafter columns and rows advanced."""
    B, _, H = g.shape
    picked = g.gather(1, (n_feed - 1).clamp(min=0)[:, None, None].expand(B, 1, H))[:, 0]
    st["g_last"].copy_(torch.where((n_feed > 0)[:, None], picked.to(st["g_last"].dtype), st["g_last"]))
    st["d_end"] += n_feed
    st["d_rows"] += n_feed


PARTS = (choose, ancestry, sample_race, pick_sampled_tree, accept, accept_sampled_chain, commit, feed_inputs, feed_finish)


def round_parts(compiled: bool) -> SimpleNamespace:
    """The round's pure parts by name: the functions themselves, or each torch.compile'd (inductor,
    fullgraph, static shapes; one compilation per round shape, done by the round's first call)."""
    if not compiled:
        return SimpleNamespace(**{f.__name__: f for f in PARTS})
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)  # one per round shape
    return SimpleNamespace(**{f.__name__: torch.compile(f, fullgraph=True, dynamic=False) for f in PARTS})


class Resident:
    """Device state and the round of one (batch, shape) configuration, reused across generations
    (kept on the FastDraft, so the captured graph is replayed by every later prompt of that shape)."""

    def __init__(self, ft: FastTarget, prop, B: int, depth: int, max_new: int, eos_ids: Sequence[int],
                 compile_round: bool = False, temperature: float = 0.0):
        d, dev = prop.drafter, ft.device
        self.temperature = temperature  # > 0: sampled (drawn drafts: accept_sampled_chain, pick_sampled_tree; else sample_race)
        self.sampled_drafts = temperature > 0 and prop.temperature > 0  # as Eagle3Proposer.propose
        # a sampled round draws from its own generator (the one its graph registers), seeded per run (cache.reseed)
        self.gen = torch.Generator(device=dev) if temperature > 0 else None
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
            "eos": h2d(list(eos_ids) or [-1], dev, L), "max_new": h2d(max_new, dev, L),
        }
        self.depth_c = h2d([1] * self.K + [dd for dd in range(2, depth + 1) for _ in range(self.K * self.K)], dev, L)
        self.d_cols = prop.cache.cols
        self.spare = h2d(ft.S - 1, dev, L)  # the target cache's scratch column
        self.t_cols = ft.cols[:ft.W]        # the columns the target's forwards attend over (FastTarget.attend)
        self.parts = round_parts(compile_round)
        self.b_idx = torch.arange(B, device=dev).repeat_interleave(self.T)
        self.caches = self.current_caches()  # held: a graph replays into these very buffers
        self.graph = None

    def current_caches(self) -> tuple:
        return self.ft.cache, self.prop.cache

    def same_caches(self) -> bool:
        return all(a is b for a, b in zip(self.caches, self.current_caches()))

    # ------------------------------------------------------------------ one round, tensor ops only

    def round(self) -> None:
        st, ft, prop, d, f = self.state, self.ft, self.prop, self.prop.drafter, self.parts
        active = ~st["done"]
        with phase("expand"):  # drafting rows go after the drafter's committed columns; dropped after the round
            d_past = st["d_end"].max()
            toks, scores, parents, q_all = prop.expand(self.K, self.D, self.sampled_drafts,
                                                        prop.graph_step(st["d_start"], st["d_end"], d_past),
                                                        st["g_last"], st["d_rows"])
        with phase("select"):
            ids, depth_r, prow, row_valid, chain = f.choose(scores, parents, toks, st["last"], st["n_gen"], active,
                                                     self.depth_c, st["max_new"], self.D, self.M, self.N)
        with phase("masks"):
            anc = f.ancestry(prow, row_valid, self.D)
        with phase("verify"):
            past = st["t_end"].max()
            logits, aux, _ = ft.verify_rows(ids, (st["t_end"] - st["t_start"])[:, None] + depth_r, past,
                                            st["t_start"], st["t_end"], anc, self.t_cols)
        with phase("accept"):
            g = prop.generator  # sampled: self.gen, which is prop.generator during a run (resident_generate)
            if self.sampled_drafts and self.K == 1:  # drafts drawn from q: speculative sampling down the chain
                u = torch.rand(ids.shape, generator=g, device=ids.device)
                e = torch.empty(logits.shape[0], logits.shape[-1], device=ids.device).exponential_(generator=g)
                n_acc, path, committed, n_emit, hit = f.accept_sampled_chain(logits, ids, row_valid, q_all, u, e, st["eos"],
                                                                             self.temperature, self.T)
            else:  # greedy, or a tree: its drawn chain nodes and fixed siblings verified by one pick per row
                if self.sampled_drafts:
                    u = torch.rand(ids.shape, generator=g, device=ids.device)
                    e = torch.empty(logits.shape, device=ids.device).exponential_(generator=g)
                    picked = f.pick_sampled_tree(logits, ids, prow, depth_r, chain, q_all, u, e, self.temperature)
                else:
                    picked = logits.argmax(-1) if self.temperature <= 0 else f.sample_race(
                        logits, self.temperature, torch.empty(logits.shape, device=ids.device).exponential_(generator=g))
                n_acc, path, committed, n_emit, hit = f.accept(picked, ids, prow, row_valid, anc, st["eos"], self.T)
        with phase("commit"):
            src, dst, n_feed = f.commit(st, active, n_acc, path, committed, n_emit, hit, row_valid, depth_r, past,
                                        self.spare)
        with phase("cache_moves"):
            ft.move_columns(self.b_idx, src, dst)
        with phase("drafter_feed"):
            cache = prop.cache
            f_ids, f_aux, f_pos, f_mask, dsrc, ddst = f.feed_inputs(committed, aux, path, n_feed, st["d_start"],
                                                                    st["d_end"], st["d_rows"], d_past, self.d_cols)
            with phase("feed_forward"):
                cache.write_at.copy_(d_past)
                g = d(f_ids, d.project(f_aux), f_pos, cache, attn_mask=f_mask)
            copy_columns((cache.kv,), self.b_idx, dsrc, ddst)
            f.feed_finish(st, g, n_feed)

    # ------------------------------------------------------------------ the host side

    def _replay(self):
        """The round as a callable: a CUDA graph's replay (captured on first use), or the eager round."""
        if not self.ft.graphs or self.graph is False:
            return self.round
        if self.graph is None:
            try:  # the warm-up round's advance of the state is undone (its cache writes are redone)
                gens = (self.gen,) if self.temperature > 0 and self.gen.device.type == "cuda" else ()
                self.graph, _ = capture(self.round, state=self.state, generators=gens)
            except Exception as e:  # cannot be captured: eager rounds from now on (a real error recurs there)
                what = f"the resident round (batch {self.B}, topk {self.K}, budget {self.M}, depth {self.D})"
                capture_failed(what, e, "its rounds run eagerly")
                self.graph = False
                return self.round
        return self.graph.replay

    def run(self, first: list[int], pad: list[int], P: int, seed_from=None) -> tuple[list[list[int]], list[dict]]:
        """Rounds until every sequence is done. `first` = the prefill's tokens; the proposer has
        been started (its committed rows hold the prompts). Sampled: self.gen seeded from `seed_from`
        once the round is captured. Returns (new tokens, stats) per sequence."""
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
        if self.temperature > 0:
            reseed(self.gen, seed_from)
        if step is not None and not drive(step, lambda: st["done"].all(), self.max_new + 3, dev.type == "cuda")[1]:
            raise RuntimeError("resident rounds: a round emitted nothing (a bug); the sequences never finished")
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


def drive(step, done, limit: int, cuda: bool) -> tuple[int, bool]:
    """The resident loop's host side, the same for speculative rounds and plain steps: replay `step` until
    `done()` (a 0-d bool device tensor; None: no flag, `limit` steps) holds or `limit` steps ran. On CUDA the
    flag is read a step late, so the GPU always has the next step queued (the step after the last is a
    no-op: a round's updates are masked, a plain step's token is cut on the host). Returns (steps run,
    whether done was seen)."""
    if done is None:
        for _ in range(limit):
            step()
        return limit, False
    flags = [torch.zeros((), dtype=torch.bool, pin_memory=cuda) for _ in range(2)]
    events = [torch.cuda.Event() if cuda else None for _ in range(2)]
    pending = None
    for r in range(limit):
        step()
        i = r % 2
        flags[i].copy_(done(), non_blocking=cuda)
        if not cuda:
            if bool(flags[i]):
                return r + 1, True
            continue
        events[i].record()
        if pending is not None:  # read the step before this one: the GPU has this step queued
            events[pending].synchronize()
            if bool(flags[pending]):
                return r + 1, True
        pending = i
    if pending is not None:
        events[pending].synchronize()
        return limit, bool(flags[pending])
    return limit, False


class Plain:
    """Plain decoding on the device: the resident loop with no proposer. One row per sequence per step
    over the FastTarget's static cache, the next token picked and fed back on the device (argmax, or the
    exponential race for sampling: tree.pick_on_device), one CUDA graph per step; no draft, no tree, no
    column moves. With EOS ids the step also marks the sequences that emitted one (3 small kernels), and
    the host stops a step after every sequence has (drive); without, it runs max_new_tokens - 1 steps
    and reads nothing in between. Kept on the FastTarget per (width, temperature, EOS ids) and dropped
    with its cache, so its graph is replayed by every later generation of that shape."""

    def __init__(self, ft: FastTarget, temperature: float, eos_ids: Sequence[int]):
        dev, B = ft.device, ft.B
        Z = lambda *s, dt=torch.long: torch.zeros(s, dtype=dt, device=dev)  # noqa: E731
        self.ft, self.temperature = ft, temperature
        # a sampled step draws from its own generator (the one its graph registers), seeded per run (cache.reseed)
        self.gen = torch.Generator(device=dev) if temperature > 0 else None
        self.eos_ids = tuple(eos_ids)
        self.eos = h2d(list(eos_ids), dev, torch.long) if eos_ids else None
        self.state = {"tok": Z(B, 1), "pos": Z(B, 1), "past": Z(), "start": Z(B), "buf": Z(B, ft.S), "i": Z(1),
                      "hit": Z(B, dt=torch.bool)}
        self.cols = ft.cols[:ft.W]  # the columns the forwards attend over (FastTarget.attend)
        self.graph = None

    def step(self) -> None:
        st = self.state
        mask = ((self.cols >= st["start"][:, None]) & (self.cols <= st["past"]))[:, None, :]
        logits, _, _ = self.ft.fn(st["tok"], st["pos"], st["past"], mask)
        nxt = pick_on_device(logits[:, -1], self.temperature, self.gen)
        st["tok"].copy_(nxt[:, None])
        st["pos"].add_(1)
        st["past"].add_(1)
        st["buf"].index_copy_(1, st["i"], nxt[:, None])
        st["i"].add_(1)
        if self.eos is not None:
            st["hit"] |= (nxt[:, None] == self.eos).any(-1)

    def _replay(self):
        """The step as a callable: its CUDA graph's replay (captured on first use; no fallback: a failed
        capture raises), or the eager step."""
        if not self.ft.graphs:
            return self.step
        if self.graph is None:  # the warm-up step's advance of the state is undone (its cache write is redone)
            gens = (self.gen,) if self.temperature > 0 and self.ft.device.type == "cuda" else ()
            self.graph, _ = capture(self.step, state=self.state, generators=gens)
        return self.graph.replay

    def run(self, last_logits, pos, pad, P: int, max_new: int, generator=None) -> list[list[int]]:
        """Steps after the prefill (`last_logits` [B, V]: its last row) until max_new tokens or every
        sequence's EOS; the new tokens per sequence, cut after the first EOS. Sampled: self.gen seeded
        from `generator` after any capture, then the prefill's token drawn from it too."""
        st = self.state
        st["pos"].copy_(pos[:, -1:] + 1)
        st["past"].fill_(P)
        st["start"].copy_(pad)
        st["i"].fill_(1)
        step = self._replay()  # may capture: after the state is this run's (its warm-up writes column P)
        if self.temperature > 0:
            reseed(self.gen, generator)
        first = pick_on_device(last_logits, self.temperature, self.gen)
        st["tok"].copy_(first[:, None])
        st["buf"][:, 0] = first
        if self.eos is not None:
            st["hit"].copy_((first[:, None] == self.eos).any(-1))
        done = None if self.eos is None else (lambda: st["hit"].all())
        steps, _ = drive(step, done, max_new - 1, self.ft.device.type == "cuda")
        n = 1 + steps
        got = st["buf"][:, :n].tolist()  # the one device read of the generation
        self.ft.past = P + n
        return [g[:first_eos(g, self.eos_ids)][:max_new] for g in got]


def resident_plain(prompts: list[list[int]], max_new_tokens: int, eos_ids: Sequence[int], fast: FastTarget,
                   temperature: float = 0.0, generator=None) -> tuple[list[list[int]], list[SpecStats]]:
    """`engine.generate` with no proposer on the fast path: plain decoding, every step on the device
    (Plain). Same returns: (new tokens, SpecStats) per sequence (one token per round; target_s and
    draft_s None). Sampled: the draws, the prefill's too, come from the step's own generator, seeded
    from `generator`: the same seed, the same tokens."""
    t_start = time.perf_counter()
    ids, pad, pos = left_pad(prompts, fast.device)
    out = fast.prefill(ids, pos, pad, max_new_tokens)
    key = (fast.W, temperature, tuple(eos_ids))  # the step's graph: one per attention width and sampling setting
    plain = fast.resident.get(key)
    if plain is None:  # also after prefill re-allocated the cache (FastTarget.ensure empties fast.resident)
        plain = fast.resident[key] = Plain(fast, temperature, eos_ids)
    new = plain.run(out.logits[:, -1], pos, pad, ids.shape[1], max_new_tokens, generator)
    wall = time.perf_counter() - t_start
    return new, [SpecStats(rounds=len(n) - 1, tokens=len(n), drafted_per_round=[0] * (len(n) - 1),
                           accepted_per_round=[0] * (len(n) - 1), emitted_per_round=[1] * (len(n) - 1),
                           target_s=None, draft_s=None, wall_s=wall) for n in new]


def resident_generate(target, proposer, prompts: list[list[int]], max_new_tokens: int, depth: int,
                      eos_ids: Sequence[int], fast: FastTarget, compile_round: bool = False, temperature: float = 0.0,
                      generator=None):
    """`engine.generate` for EAGLE-3 on the fast path (greedy or sampled: eligible), every round
    on the device. Same returns: (new tokens, SpecStats) per sequence; target_s and draft_s are None (one
    graph does both). `compile_round`: the round's pure parts compiled by inductor (round_parts); the same
    outputs. Sampled: the prefill's token is drawn on the host as engine.generate does (`generator`), the
    rounds from the round's own generator, seeded from the proposer's. No proposer: plain decoding
    (resident_plain)."""
    if proposer is None:
        return resident_plain(prompts, max_new_tokens, eos_ids, fast, temperature, generator)
    B, dev = len(prompts), target.device
    t_start = time.perf_counter()
    ids, pad, pos = left_pad(prompts, dev)
    P = ids.shape[1]
    out = fast.prefill(ids, pos, pad, max_new_tokens, 1 + proposer.max_nodes)
    first = (out.logits[:, -1].argmax(-1).tolist() if temperature <= 0 else
             [pick(out.logits[b, -1], temperature, generator) for b in range(B)])  # as engine.generate draws it
    pad_h = pad.tolist()
    tokens = [list(p) + [f] for p, f in zip(prompts, first)]
    proposer.start(tokens, [rows_of(out, b, torch.arange(pad_h[b], P, device=dev)) for b in range(B)])
    needed = P + max_new_tokens + depth * proposer.topk + depth + 2
    if proposer.cache.size <= needed:
        proposer.cache = proposer.fast.grow(proposer.cache, needed)
    store = proposer.fast.resident
    key = (B, proposer.topk, proposer.budget, depth, max_new_tokens, tuple(eos_ids), compile_round, fast.W, temperature,
           proposer.temperature)  # temperatures are constants of the round's graph
    res = store.get(key)
    if res is not None:
        res.prop = proposer  # a new proposer over the same buffers: the graph stays valid
    if res is None or not res.same_caches():
        res = store[key] = Resident(fast, proposer, B, depth, max_new_tokens, eos_ids, compile_round, temperature)
    own = proposer.generator
    if temperature > 0:  # this run draws from the round's own generator, seeded from the proposer's (run)
        proposer.generator = res.gen
    try:
        new, per = res.run(first, pad_h, P, seed_from=own)
    finally:
        proposer.generator = own
    wall = time.perf_counter() - t_start
    stats = []
    for n, s in zip(new, per):
        stats.append(SpecStats(tokens=len(n), wall_s=wall, target_s=None, draft_s=None, **s))
    return new, stats
