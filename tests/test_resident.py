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
