"""Resident rounds (speculate/resident.py): greedy EAGLE-3 rounds done on the device give the same
tokens and the same per-round statistics as the engine's host loop, and both equal plain decoding.

The drafts come from an oracle `expand` (tensor ops over the plain continuation, with planted
misses and a tree whose true child is not always the first), so rounds accept 0..depth drafts,
trees are cut by the budget and by the token budget, and sequences of a batch finish apart.
On a CPU the `static` and `emulated` modes run (emulated: graphs with CUDA-graph capture emulated, test_fast.fast_mode);
on a CUDA machine `graphs` too (one CUDA graph per round)."""
from __future__ import annotations

import pytest
import torch

from draftsmith.speculate.eagle3 import Eagle3Proposer
from draftsmith.speculate.engine import generate
from draftsmith.speculate.eagle3 import FastDraft
from draftsmith.speculate.fast import FastTarget
from draftsmith.speculate.resident import PARTS
from draftsmith.speculate.tree import DraftTree

from test_engine import PROMPTS, make_drafter
from test_fast import fast_mode, fitted, plains, target  # noqa: F401  (the Llama and DeepSeek-V3 tiny targets, their plain outputs)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
MODES = ["static", "emulated"] + (["graphs"] if CUDA else [])  # emulated: test_fast.fast_mode


class OracleEagle(Eagle3Proposer):
    """Eagle3Proposer whose expansion knows the answer: at each depth the frontier's first node has
    the true next token as its first child (its second child on some rounds, a wrong token on
    others), every other node a wrong one; cumulative scores fall with depth and sibling rank."""

    TABLE = torch.zeros(4, 128, dtype=torch.long, device=DEVICE)  # shared: captured graphs read it in place

    def __init__(self, drafter, seqs: list[list[int]], vocab: int, **kw):
        super().__init__(drafter, **kw)
        self.TABLE.zero_()
        for b, s in enumerate(seqs):
            self.TABLE[b, :len(s)] = torch.tensor(s)
        self.oracle = self.TABLE[:len(seqs)]
        self.V = vocab

    def expand(self, K, D, sampled, step, g_last, rows):
        B, dev = rows.shape[0], rows.device
        ks = torch.arange(K, device=dev)
        toks, scores, parents, n_prev, front, s = [], [], [], 0, None, None
        for depth in range(1, D + 1):
            true = self.oracle.gather(1, (rows + depth)[:, None])[:, 0]          # [B]
            r = rows + torch.arange(B, device=dev)                             # planted pattern:
            wrong = (true + self.V // 2) % self.V
            first = torch.where(r % 5 == depth, wrong, true)                   # a miss at depth r % 5
            width = 1 if depth == 1 else K
            kid = (true[:, None, None] + 1 + torch.arange(width, device=dev)[None, :, None] * K + ks) % self.V
            kid = kid.expand(B, width, K).clone()
            if K > 1:  # on some rounds the true token is the second child of the first node
                second = r % 7 == depth
                kid[:, 0, 1] = torch.where(second, true, kid[:, 0, 1])
                first = torch.where(second, wrong, first)
            kid[:, 0, 0] = first
            base = torch.zeros(1, device=dev) if depth == 1 else s[0]          # parent's cumulative score
            s = base[:, None] - 0.1 - 0.5 * ks[None].float()                    # [width, K], falls along a path
            par = (torch.full((B, width, K), -1, device=dev) if depth == 1
                   else front[:, :, None].expand(B, width, K))
            toks.append(kid.reshape(B, -1))
            scores.append(s[None].expand(B, width, K).reshape(B, -1))
            parents.append(par.reshape(B, -1))
            front = (n_prev + ks)[None].expand(B, K)                           # the first node's children
            n_prev += width * K
        return torch.cat(toks, 1), torch.cat(scores, 1), torch.cat(parents, 1), None


def _times_off(st) -> dict:
    return {k: v for k, v in st.as_dict().items() if not k.endswith("_s")}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("topk,budget,depth", [(1, 4, 4), (3, 8, 4), (2, 12, 3), (2, 3, 5), (8, 64, 4)])
def test_resident_equals_host_loop_and_plain(target, plains, mode, monkeypatch, topk, budget, depth):
    mode = fast_mode(mode, monkeypatch)
    ft = FastTarget(target, mode)
    drafter = make_drafter(target, draft_vocab=200, seed=1).to(DEVICE)
    fd = FastDraft(drafter, graphs=mode != "static")
    V = target.vocab_size
    eos = plains[2][7]
    accepted = []
    for batch, max_new, eos_ids in (([0], 24, ()), ([0, 1, 2, 3], 24, ()), ([3, 1], 9, ()), ([2, 0], 24, (eos,))):
        prompts = [PROMPTS[i] for i in batch]
        seqs = [PROMPTS[i] + plains[i] for i in batch]
        runs = [generate(target, OracleEagle(drafter, seqs, V, topk=topk, budget=budget, fast=fd), prompts, max_new,
                         depth=depth, eos_ids=eos_ids, fast=ft, resident=r) for r in (False, True)]
        (host, host_st), (res, res_st) = runs
        cut = [plains[i][:max_new] for i in batch]
        want = [c[:c.index(eos) + 1] if eos_ids and eos in c else c for c in cut]
        assert host == want and res == want, (batch, max_new)
        assert [_times_off(s) for s in res_st] == [_times_off(s) for s in host_st], (batch, max_new)
        accepted += [a for s in res_st for a in s.accepted_per_round]
    assert set(accepted) == set(range(min(depth, budget) + 1))  # the oracle makes every outcome happen
    # the captured round is reused: one per (batch, shape) configuration
    assert len(fd.resident) == 4


@pytest.mark.parametrize("mode", MODES)
def test_resident_with_a_real_drafter_equals_plain(target, plains, fitted, mode, monkeypatch):
    """A real drafter through the real expansion: random linears, a head fitted to these continuations
    (test_engine.fitted_drafter), so its drafts are accepted at several depths."""
    mode = fast_mode(mode, monkeypatch)
    ft = FastTarget(target, mode)
    drafter = fitted
    accepted = []
    fd = FastDraft(drafter, graphs=mode != "static")
    for topk, budget in ((1, 4), (3, 8)):
        for batch in ([1], [0, 1, 2, 3]):
            prompts = [PROMPTS[i] for i in batch]
            a = generate(target, Eagle3Proposer(drafter, topk=topk, budget=budget, fast=fd), prompts, 24, depth=4,
                         fast=ft, resident=False)
            b = generate(target, Eagle3Proposer(drafter, topk=topk, budget=budget, fast=fd), prompts, 24, depth=4,
                         fast=ft, resident=True)
            assert a[0] == b[0] == [plains[i] for i in batch]
            assert [_times_off(s) for s in a[1]] == [_times_off(s) for s in b[1]]
            accepted += [x for s in b[1] for x in s.accepted_per_round]
    assert max(accepted) >= 2 and sum(accepted) >= len(accepted) // 2, accepted


@pytest.mark.parametrize("mode", MODES)
def test_compiled_round_equals_host_loop(target, plains, mode, monkeypatch):
    """compile_round: the round's pure parts compiled by inductor (on a CPU too) give the host loop's
    tokens and every per-round statistic, bit for bit. One shape (compiling takes tens of seconds on
    a CPU), the DeepSeek-V3 target: a batch whose sequences finish apart, one at EOS."""
    if target.model.config.model_type != "deepseek_v3":
        pytest.skip("one target is enough here: compiling the round's parts dominates this test's time")
    mode = fast_mode(mode, monkeypatch)
    ft = FastTarget(target, mode)
    drafter = make_drafter(target, draft_vocab=200, seed=1).to(DEVICE)
    fd = FastDraft(drafter, graphs=mode != "static")
    batch, topk, budget, depth = [0, 1, 2, 3], 2, 6, 3
    eos = plains[2][7]
    prompts, seqs = [PROMPTS[i] for i in batch], [PROMPTS[i] + plains[i] for i in batch]
    runs = [generate(target, OracleEagle(drafter, seqs, target.vocab_size, topk=topk, budget=budget, fast=fd), prompts,
                     24, depth=depth, eos_ids=(eos,), fast=ft, resident=r, compile_round=r) for r in (False, True)]
    (host, host_st), (res, res_st) = runs
    cut = [plains[i][:24] for i in batch]
    assert res == host == [c[:c.index(eos) + 1] if eos in c else c for c in cut]
    assert [_times_off(s) for s in res_st] == [_times_off(s) for s in host_st]
    assert set(a for s in res_st for a in s.accepted_per_round) == set(range(depth + 1))
    assert len({s.rounds for s in res_st}) > 1  # the sequences finished apart
    (res_state,) = fd.resident.values()
    assert all(hasattr(getattr(res_state.parts, f.__name__), "_torchdynamo_orig_callable") for f in PARTS)  # compiled
    assert mode == "static" or res_state.graph not in (None, False)  # graphs: the compiled round was captured


# ----------------------------------------------------------------------------- acceptance, round by round


def _random_tree(gen, V: int, D: int, K: int, M: int, q_of=None) -> tuple[DraftTree, list[bool]]:
    """A draft tree as Eagle3Proposer builds one: nodes in creation order depth by depth, at most M, distinct
    tokens among siblings, the root with K children and every other node 0..K. With `q_of` (depth -> the
    drafter's law [V]) each depth's chain node (the root's first child, then each chain node's first child)
    is drawn from q and kept out of its siblings, as expand's keep_chain does. Returns (tree, chain flags)."""
    tokens, parents, chain, q, frontier = [], [], [], [], [-1]
    for d in range(1, D + 1):
        nxt = []
        for par in frontier:
            n = K if par < 0 else int(torch.randint(0, K + 1, (1,), generator=gen))
            drawn = q_of is not None and (par < 0 or chain[par]) and n > 0
            first = int(torch.multinomial(q_of(d), 1, generator=gen)) if drawn else None
            rest = [t for t in torch.randperm(V, generator=gen).tolist() if t != first][:n - int(drawn)]
            for i, t in enumerate(([first] if drawn else []) + rest):
                if len(tokens) < M:
                    tokens.append(t)
                    parents.append(par)
                    chain.append(drawn and i == 0)
                    q.append(q_of(d) if drawn and i == 0 else None)
                    nxt.append(len(tokens) - 1)
        frontier = nxt
    return DraftTree(tokens, parents, q if q_of is not None else None), chain


def _rows(trees, chains, N: int, roots):
    """The resident round's verify rows of these trees (what resident.choose makes): ids, depth, parent row
    (self for padding), row valid, chain [B, N]."""
    B = len(trees)
    ids, depth = torch.zeros(B, N, dtype=torch.long), torch.zeros(B, N, dtype=torch.long)
    prow = torch.arange(N).repeat(B, 1)
    valid, chain = torch.zeros(B, N, dtype=torch.bool), torch.zeros(B, N, dtype=torch.bool)
    valid[:, 0] = True
    for b, (t, c) in enumerate(zip(trees, chains)):
        ids[b, 0] = roots[b]
        for i, (tok, par, d) in enumerate(zip(t.tokens, t.parents, t.depths())):
            ids[b, i + 1], prow[b, i + 1], depth[b, i + 1] = tok, par + 1, d
            valid[b, i + 1], chain[b, i + 1] = True, c[i]
    return ids, depth, prow, valid, chain


class _Coupled:
    """tree.accept_sampled's draws tied to the resident round's (u, e) for one sequence, so that both
    acceptances must make the same decisions: a drawn (chain) node at row r is tried with u[r] (its parent's
    row, as pick_sampled_tree; a chain's draft row, as accept_sampled_chain: `chain_u`); a fixed child y at
    row r is accepted exactly when y is the exponential race's draw z_r = argmax(res_r / e_r) from that row's
    residual (uniform 0, else 1: the coupling under which trying fixed children one by one is one draw
    from the residual, as the round does); the bonus token is the race over tree.py's own residual with
    e of the row the walk stopped at (one e per sequence for a chain). Follows the walk to know the row."""

    def __init__(self, tree, probs, u, e, chain_u: bool):
        self.tree, self.probs, self.u, self.e, self.chain_u = tree, probs, u, e, chain_u
        self.children = [[] for _ in range(len(tree) + 1)]
        for i, p in enumerate(tree.parents):
            self.children[p + 1].append(i)
        self.row, self.k = 0, 0

    def _e(self):
        return self.e if self.e.dim() == 1 else self.e[self.row]

    def _race(self, w):
        return int((w / self._e()).argmax())

    def uniform(self) -> float:
        c = self.children[self.row][self.k]
        x, p = self.tree.tokens[c], self.probs[self.row].float()
        q = self.tree.q[c] if self.tree.q is not None else None
        if q is not None:
            v = float(self.u[c + 1] if self.chain_u else self.u[self.row])
            took = v * float(q[x]) < float(p[x])
        else:
            drawn = [d for d in self.children[self.row] if self.tree.q is not None and self.tree.q[d] is not None]
            res = (p - self.tree.q[drawn[0]]).clamp_min(0) if drawn else p  # a fixed child is tried after the drawn one
            took = x == self._race(torch.where(res.sum() > 0, res, p))
            v = 0.0 if took else 1.0
        self.row, self.k = (c + 1, 0) if took else (self.row, self.k + 1)
        return v

    def sample(self, p, generator=None) -> int:
        return self._race(p)


@pytest.mark.parametrize("kind", ["greedy", "sampled_fixed", "sampled_chain", "sampled_tree"])
def test_resident_acceptance_matches_tree_round_by_round(kind, monkeypatch):
    """The resident round's acceptance (resident.accept on the argmax, on sample_race's draws, on
    pick_sampled_tree's; resident.accept_sampled_chain) and tree.py's (accept_greedy, accept_sampled) on the
    same random trees and logits, round after round: the same ancestry masks, accepted path, accepted count,
    committed tokens, tokens emitted up to EOS and EOS flag. Sampled rounds share their draws (_Coupled)."""
    from draftsmith.speculate import resident, tree as tree_mod
    from draftsmith.speculate.tree import accept_greedy, accept_sampled, first_eos, tree_ancestry

    gen = torch.Generator().manual_seed({"greedy": 0, "sampled_fixed": 1, "sampled_chain": 2, "sampled_tree": 3}[kind])
    B, V, D, K, temp = 3, 12, 4, 2, 0.7
    M = D if kind == "sampled_chain" else 10
    N, T = M + 2, min(D, M) + 1  # a padding row past the largest tree
    eos_ids = [5, 9]
    eos = torch.tensor(eos_ids)
    seen = {"accepted": set(), "hit": 0, "fixed_after_drawn": 0, "drawn_rejected": 0}
    for _ in range(150):
        q_all = torch.softmax(2 * torch.randn(B, D, V, generator=gen), -1)
        trees, chains = [], []
        for b in range(B):
            if kind == "sampled_chain":  # drafts drawn from q, cut at a random depth limit
                n = int(torch.randint(0, D + 1, (1,), generator=gen))
                toks = [int(torch.multinomial(q_all[b, d], 1, generator=gen)) for d in range(n)]
                trees.append(DraftTree.chain(toks, [q_all[b, d] for d in range(n)]))
                chains.append([True] * n)
            else:
                m = M if bool(torch.rand((), generator=gen) < 0.6) else int(torch.randint(0, M + 1, (1,), generator=gen))
                t, c = _random_tree(gen, V, D, K, m,
                                    (lambda d, b=b: q_all[b, d - 1]) if kind == "sampled_tree" else None)
                trees.append(t)
                chains.append(c)
        ids, depth, prow, valid, chain = _rows(trees, chains, N, torch.randint(0, V, (B,), generator=gen).tolist())
        # logits that often favour a child's token (or, at a drawn node's parent, follow q), so paths go deep
        logits = torch.randn(B, N, V, generator=gen)
        for b, t in enumerate(trees):
            for i, (tok, par) in enumerate(zip(t.tokens, t.parents)):
                if t.q is not None and t.q[i] is not None and bool(torch.rand((), generator=gen) < 0.8):
                    logits[b, par + 1] = temp * t.q[i].log() + 0.3 * torch.randn(V, generator=gen)
                elif bool(torch.rand((), generator=gen) < 0.75):
                    logits[b, par + 1, tok] = logits[b, par + 1].max() + 1.0
        anc = resident.ancestry(prow, valid, D)
        assert torch.equal(anc, tree_ancestry(trees, N))
        u = torch.rand(B, N, generator=gen)
        e = torch.empty(B, V if kind == "sampled_chain" else N * V).exponential_(generator=gen).view(B, -1, V).squeeze(1)
        if kind == "greedy":
            got = resident.accept(logits.argmax(-1), ids, prow, valid, anc, eos, T)
        elif kind == "sampled_fixed":
            got = resident.accept(resident.sample_race(logits, temp, e), ids, prow, valid, anc, eos, T)
        elif kind == "sampled_chain":
            got = resident.accept_sampled_chain(logits, ids, valid, q_all, u, e, eos, temp, T)
        else:
            picked = resident.pick_sampled_tree(logits, ids, prow, depth, chain, q_all, u, e, temp)
            got = resident.accept(picked, ids, prow, valid, anc, eos, T)
        n_acc, path_rows, committed, n_emit, hit = (x.tolist() for x in got)
        probs = torch.softmax(logits / temp, -1)
        for b, t in enumerate(trees):
            if kind == "greedy":
                path, bonus = accept_greedy(t, logits[b].argmax(-1).tolist())
            else:
                c = _Coupled(t, probs[b], u[b], e[b], chain_u=kind == "sampled_chain")
                monkeypatch.setattr(tree_mod, "sample", c.sample)
                path, bonus = accept_sampled(t, probs[b], uniform=c.uniform)
            want = [t.tokens[i] for i in path] + [bonus]
            where = (kind, b, t)
            assert n_acc[b] == len(path), where
            assert path_rows[b][:len(path) + 1] == [0] + [i + 1 for i in path], where
            assert committed[b][:len(path) + 1] == want, where
            assert n_emit[b] == first_eos(want, eos_ids) and hit[b] == any(x in eos_ids for x in want), where
            seen["accepted"].add(len(path))
            seen["hit"] += hit[b]
            drawn = [i for i in range(len(t)) if t.q is not None and t.q[i] is not None]
            seen["drawn_rejected"] += sum(1 for i in drawn if t.parents[i] + 1 in [0] + [j + 1 for j in path]
                                          and i not in path)
            seen["fixed_after_drawn"] += sum(1 for i in path if i not in drawn and any(
                t.parents[d] == t.parents[i] for d in drawn))
    assert seen["accepted"] == set(range(D + 1)), seen  # every depth was reached, none too
    assert seen["hit"] > 0, seen
    if kind in ("sampled_chain", "sampled_tree"):
        assert seen["drawn_rejected"] > 0, seen
    if kind == "sampled_tree":  # a fixed sibling taken after its drawn sibling was rejected
        assert seen["fixed_after_drawn"] > 0, seen
