"""Speculative decoding engine: lossless against plain greedy, accounting, EOS, drafter cache."""
from __future__ import annotations

import random

import pytest
import torch

from draftsmith.config import DraftConfig
from draftsmith.draft.build import drafter_config, init_drafter
from draftsmith.draft.model import Eagle3Drafter
from draftsmith.evaluate.explain import teacher_forced
from draftsmith.speculate.eagle3 import Eagle3Proposer
from draftsmith.speculate.engine import generate, speculative_generate
from draftsmith.speculate.ngram import NgramProposer
from draftsmith.speculate.proposer import PerSequence
from draftsmith.speculate.engine import plain_generate, plain_generate_batch
from draftsmith.target.model import load_target
from draftsmith.testing import make_model_dir

PROMPTS = [[1, 5, 17, 33, 8], [1, 44, 9], [1, 100, 101, 102, 103, 104, 105, 3, 60], [1, 250]]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    torch.manual_seed(0)
    path = make_model_dir(tmp_path_factory.mktemp("target"), num_layers=6)
    return load_target(path, device="cpu", dtype="float32")


def make_drafter(target, draft_vocab: int | None = None, seed: int = 0) -> Eagle3Drafter:
    """A random drafter shaped for `target`; a draft vocab subset gets real d2t offsets."""
    V = target.vocab_size
    Vd = draft_vocab or V
    cfg = drafter_config(target.config, DraftConfig(), Vd, target.aux_layer_ids)
    chosen = torch.sort(torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:Vd]).values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[chosen] = True
    return init_drafter(cfg, target.input_embeddings(), chosen - torch.arange(Vd), t2d, seed, std=0.2).eval()


K_FIT = 4  # drafting steps the fitted head is fitted for


@torch.inference_mode()
def fit_head(target, drafter, seqs: list[list[int]], k: int = K_FIT) -> None:
    """lm_head := a least-squares fit of one-hot next tokens (x[t + 2 + i], in draft ids) on the
    normed teacher-forced states of steps 0..k-1 over `seqs`, scaled for decisive logits. The drafter
    then predicts these sequences well but not perfectly: rounds accept 0..k drafts."""
    t2d = drafter.t2d.cpu()
    draft_id = torch.cumsum(t2d.long(), 0) - 1  # target id -> draft id (where t2d)
    feats, labels = [], []
    for x in seqs:
        xt = torch.tensor(x)
        for i, h in enumerate(teacher_forced(target, drafter, x, k)):
            rows = torch.arange(0, len(x) - 2 - i)
            rows = rows[t2d[xt[rows + 2 + i]]]
            feats.append(drafter.norm(h[rows.to(h.device)]).cpu())
            labels.append(draft_id[xt[rows + 2 + i]])
    X = torch.cat(feats).double()
    Y = torch.nn.functional.one_hot(torch.cat(labels), drafter.cfg.draft_vocab_size).double()
    W = torch.linalg.solve(X.T @ X + 1e-3 * torch.eye(X.shape[1], dtype=X.dtype), X.T @ Y)  # [H, Vd]
    drafter.lm_head.weight.copy_(20.0 * W.T.to(drafter.lm_head.weight))


def fitted_drafter(target, draft_vocab: int | None = None, seed: int = 7, prompts=None, new_tokens: int = 24):
    """A drafter that accepts: random linears, the head fitted (fit_head) to the target's greedy
    continuations of `prompts` (default PROMPTS). Lossless tests need drafts that are accepted: with
    none accepted, a broken tree mask or cache move never shows (only the root row is ever used)."""
    drafter = make_drafter(target, draft_vocab, seed).to(target.device)
    fit_head(target, drafter, [p + plain_generate(target, p, new_tokens) for p in (prompts or PROMPTS)])
    return drafter


class OracleProposer:
    """Proposes the reference continuation, optionally corrupting drafts at random."""

    def __init__(self, reference: list[int], error_rate: float = 0.0, seed: int = 0):
        self.ref, self.error_rate, self.rng = reference, error_rate, random.Random(seed)

    def start(self, tokens, out):
        self.pos = len(tokens)

    def propose(self, k):
        drafts = list(self.ref[self.pos:self.pos + k])
        return [(t + 1) % 400 if self.rng.random() < self.error_rate else t for t in drafts]  # a wrong id, in range

    def commit(self, new_tokens, out):
        self.pos += len(new_tokens)


@pytest.fixture(scope="module")
def fitted(target):
    return fitted_drafter(target)


@pytest.mark.parametrize("k", [2, 5])
def test_lossless_chain(target, fitted, k):
    accepted = []
    for prompt in PROMPTS:
        plain = plain_generate(target, prompt, 20)
        spec, st = speculative_generate(target, fitted, prompt, 20, draft_steps=k)
        assert spec == plain, f"prompt {prompt}"
        assert st.tokens == len(spec) == 20
        assert sum(st.emitted_per_round) == len(spec) - 1
        assert all(0 <= a <= k for a in st.accepted_per_round)
        accepted += st.accepted_per_round
    assert sum(accepted) >= len(accepted) and max(accepted) >= min(k, K_FIT)  # drafts were accepted, deep ones too


def test_lossless_draft_vocab_subset(target):
    """A draft vocab of 300 of the target's tokens (real d2t offsets): still lossless, still accepting."""
    drafter = fitted_drafter(target, draft_vocab=300, seed=3)
    accepted = []
    for prompt in PROMPTS:
        spec, st = speculative_generate(target, drafter, prompt, 20, draft_steps=4)
        assert spec == plain_generate(target, prompt, 20), f"prompt {prompt}"
        accepted += st.accepted_per_round
    assert max(accepted) >= 2


@pytest.mark.parametrize("k", [1, 3, 5])
def test_oracle_accepts_everything(target, k):
    prompt = PROMPTS[0]
    rounds = 4
    n = 1 + rounds * (k + 1)
    plain = plain_generate(target, prompt, n)
    spec, st = speculative_generate(target, OracleProposer(prompt + plain), prompt, n, draft_steps=k)
    assert spec == plain
    assert st.rounds == rounds and st.tau == k + 1
    assert st.accepted_per_round == [k] * rounds
    assert st.drafted == st.reached == st.accepted == [rounds] * k


def test_noisy_oracle_partial_acceptance(target):
    prompt, k, n = PROMPTS[2], 4, 40
    plain = plain_generate(target, prompt, n)
    spec, st = speculative_generate(target, OracleProposer(prompt + plain, 0.3, seed=1), prompt, n, draft_steps=k)
    assert spec == plain
    assert len(set(st.accepted_per_round)) > 1  # several acceptance lengths were exercised
    assert st.tau == pytest.approx((n - 1) / st.rounds)
    rounds = list(zip(st.drafted_per_round, st.accepted_per_round))
    assert st.drafted_per_round[-1] < k  # the last round drafts only what the budget can take
    for j in range(k):  # reached[j] = rounds that drafted position j and accepted the j before it
        assert st.drafted[j] == sum(d > j for d, _ in rounds)
        assert st.reached[j] == sum(d > j and a >= j for d, a in rounds)
        assert st.accepted[j] == sum(a > j for _, a in rounds)
        assert st.accepted[j] <= st.reached[j] <= st.drafted[j]


def test_eos_stops_inside_accepted_drafts(target):
    prompt, k = PROMPTS[0], 5
    ref = plain_generate(target, prompt, 30)
    eos = ref[7]
    stop = ref.index(eos) + 1
    plain = plain_generate(target, prompt, 30, eos_ids=[eos])
    assert plain == ref[:stop]
    # The oracle's drafts run past the EOS: the round must cut at it, bonus token included.
    spec, st = speculative_generate(target, OracleProposer(prompt + ref), prompt, 30, draft_steps=k, eos_ids=[eos])
    assert spec == plain and st.tokens == stop
    drafter = fitted_drafter(target, prompts=[prompt], new_tokens=30)
    spec2, st2 = speculative_generate(target, drafter, prompt, 30, draft_steps=k, eos_ids=[eos])
    assert spec2 == plain and sum(st2.accepted_per_round) > 0


def test_one_token_budget(target):
    spec, st = speculative_generate(target, make_drafter(target), PROMPTS[1], 1, draft_steps=3)
    assert spec == plain_generate(target, PROMPTS[1], 1) and st.rounds == 0 and st.tau is None


class RecordingProposer(Eagle3Proposer):
    """Records, per round, the committed tokens, the drafts and the drafter's logits (batch 1)."""

    def start(self, tokens, outs):
        self.tokens, self.log = list(tokens[0]), []
        logits = self.drafter.logits
        self.seen = []
        self.drafter.logits = lambda g: self.seen.append(logits(g)) or self.seen[-1]
        super().start(tokens, outs)

    def propose(self, max_depth):
        self.seen.clear()
        trees = super().propose(max_depth)
        if len(trees[0]):
            self.log.append((list(self.tokens), trees[0].tokens, torch.cat([x.reshape(-1, x.shape[-1]) for x in self.seen])))
        return trees

    def commit(self, new_tokens, outs):
        self.tokens += new_tokens[0]
        super().commit(new_tokens, outs)


@torch.inference_mode()
def ttt_reference_logits(target, drafter, tokens, drafts):
    """Draft logits of the last committed row through the TRAINING path (Eagle3Drafter.ttt_step,
    as train/ttt.py unrolls it): rows 0..R-1 over one uncached target forward, step i feeding
    token x[t+1+i] at rotary position t+i, teacher-forced with the drafts."""
    R = len(tokens) - 1
    aux = target.forward(torch.tensor([tokens[:-1]])).aux_hidden
    x = torch.tensor([tokens + drafts])
    hidden, cache, logits = drafter.project(aux), [], []
    for i in range(len(drafts)):
        hidden = drafter.ttt_step(x[:, 1 + i:1 + i + R], hidden, torch.arange(R)[None] + i, cache)
        logits.append(drafter.logits(hidden[:, -1]))
    return torch.cat(logits)


def test_drafter_cache_matches_recompute(target):
    """Inference drafting (incremental cache: prefill, crop, commit from the verify forward's
    aux states) gives the logits that training's TTT unroll gives over the committed sequence."""
    drafter = make_drafter(target, draft_vocab=300, seed=3)
    prop = RecordingProposer(drafter, topk=1, budget=3)
    generate(target, prop, [PROMPTS[2]], 20, depth=3)
    assert len(prop.log) >= 3
    del drafter.logits
    for tokens, drafts, logits in prop.log:
        ref = ttt_reference_logits(target, drafter, tokens, drafts)
        torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------- tree, batch, n-gram


class TreeRecorder(Eagle3Proposer):
    """Eagle3Proposer that keeps every round's trees (batch 1)."""

    def propose(self, max_depth):
        trees = super().propose(max_depth)
        self.trees = getattr(self, "trees", []) + [trees[0]]
        return trees


@pytest.mark.parametrize("topk,budget,depth", [(3, 10, 4)])
def test_lossless_tree(target, fitted, topk, budget, depth):
    behind_others = 0  # accepted nodes with a non-ancestor before them in the verify rows
    accepted = []
    for prompt in PROMPTS:
        plain = plain_generate(target, prompt, 20)
        prop = TreeRecorder(fitted, topk=topk, budget=budget)
        spec, [st] = generate(target, prop, [prompt], 20, depth=depth)
        assert spec == [plain], f"prompt {prompt}"
        assert sum(st.emitted_per_round) == len(plain) - 1
        assert max(st.drafted_per_round) <= budget and max(st.accepted_per_round) <= depth
        assert any(d > depth for d in st.drafted_per_round)  # really a tree, not a chain
        accepted += st.accepted_per_round
        x, c = prompt + plain, len(prompt)
        for tree, a, e in zip(prop.trees, st.accepted_per_round, st.emitted_per_round):
            node = -1
            for j in range(1, a + 1):  # walk the accepted path: the child carrying the next token
                node = next(i for i, (t, p) in enumerate(zip(tree.tokens, tree.parents)) if p == node and t == x[c + j])
                anc, p = set(), tree.parents[node]
                while p >= 0:
                    anc.add(p)
                    p = tree.parents[p]
                behind_others += any(i not in anc for i in range(node))
            c += e
    # drafts were accepted, at depth >= 2, and on nodes whose rows come after non-ancestors (only the
    # tree-ancestry mask hides those from them): a broken mask cannot stay green
    assert max(accepted) >= 2 and sum(accepted) >= len(accepted)
    assert behind_others > 0


class ChainAndTree(Eagle3Proposer):
    """Each round drafts the chain (top-1, depth deep) from the same state, then the tree it returns,
    and keeps both (batch 1; propose crops the drafting rows, so the two see the same cache)."""

    def propose(self, max_depth):
        topk, budget = self.topk, self.budget
        self.topk, self.budget = 1, max(max_depth)
        chain = super().propose(max_depth)[0]
        self.topk, self.budget = topk, budget
        trees = super().propose(max_depth)
        self.rounds = getattr(self, "rounds", []) + [(chain, trees[0])]
        return trees


@pytest.mark.parametrize("fit", [False, True])
def test_tree_holds_the_chain(target, fitted, fit):
    """Every round's tree holds the chain the drafter drafts from the same state as a root path, at
    full depth, even with a budget of one node beyond it: under greedy verification a tree never
    accepts less than the chain. A random drafter (flat draft probabilities) is the case where EAGLE-2's
    ranking by cumulative log-prob alone leaves the deep chain nodes out; the fitted one accepts."""
    drafter = fitted if fit else make_drafter(target, seed=3)
    depth, n_rounds = 5, 0
    for prompt in PROMPTS:
        prop = ChainAndTree(drafter, topk=4, budget=depth + 1)
        spec, [st] = generate(target, prop, [prompt], 16, depth=depth)
        assert spec == [plain_generate(target, prompt, 16)]
        for chain, tree in prop.rounds:
            node = -1
            for tok in chain.tokens:
                node = next((i for i, (t, p) in enumerate(zip(tree.tokens, tree.parents)) if p == node and t == tok), None)
                assert node is not None, f"prompt {prompt}: chain {chain.tokens} is not a root path of {tree.tokens}"
            n_rounds += len(chain) == depth
    assert n_rounds > 0


def test_tree_of_oracle_and_noise_accepts_the_right_branch(target):
    """A tree whose root has a wrong first child and the right one second: the path is found."""
    from draftsmith.speculate.tree import DraftTree
    prompt, n = PROMPTS[0], 25
    ref = prompt + plain_generate(target, prompt, n)

    class Forked(OracleProposer):
        def propose_tree(self, depth):
            good = self.ref[self.pos:self.pos + depth]
            bad = [(good[0] + 7) % 300] if good else []
            return DraftTree(bad + good, [-1] + [-1] + list(range(1, len(good))) if good else [])

    spec, st = speculative_generate(target, Forked(ref), prompt, n, draft_steps=4)
    assert spec == ref[len(prompt):]
    assert st.accepted_per_round[:-1] == [4] * (len(st.accepted_per_round) - 1)


@pytest.mark.parametrize("tree", [None, (3, 8)])
def test_batch_lossless_per_sequence(target, tree):
    """Batch of prompts of different lengths (left padding, per-sequence acceptance and cache
    lengths, EOS in one sequence): each equals its own batch-1 plain greedy decoding."""
    drafter = fitted_drafter(target, draft_vocab=300, seed=5)
    eos = plain_generate(target, PROMPTS[1], 20)[9]
    plains = [plain_generate(target, p, 20, eos_ids=[eos]) for p in PROMPTS]
    assert len({len(p) for p in plains}) > 1  # some sequence stops early
    topk, budget = tree or (1, 4)
    new, stats = generate(target, Eagle3Proposer(drafter, topk=topk, budget=budget), PROMPTS, 20, depth=4, eos_ids=[eos])
    assert new == plains
    assert [s.tokens for s in stats] == [len(p) for p in plains]
    assert all(max(s.accepted_per_round) >= 1 for s in stats)  # every sequence of the batch accepted drafts
    if tree is None:
        assert plain_generate_batch(target, PROMPTS, 20, eos_ids=[eos]) == plains
        ngram = PerSequence([NgramProposer() for _ in PROMPTS])
        assert generate(target, ngram, PROMPTS, 20, depth=4, eos_ids=[eos])[0] == plains


def test_batch_oracle_per_sequence_acceptance(target):
    """Sequences of one batch accept different lengths in the same round."""
    n = 21
    refs = [p + plain_generate(target, p, n) for p in PROMPTS]
    props = PerSequence([OracleProposer(r, error_rate=e, seed=i) for i, (r, e) in enumerate(zip(refs, [0, .5, .2, 1]))])
    new, stats = generate(target, props, PROMPTS, n, depth=4)
    assert new == [r[len(p):] for r, p in zip(refs, PROMPTS)]
    assert stats[0].tau == 5 and stats[3].tau == 1
    assert len({s.rounds for s in stats}) > 2


def test_ngram_proposer():
    p = NgramProposer(max_ngram=3)
    p.start([5, 6, 7, 8, 9, 5, 6, 7], None)
    assert p.propose(3) == [8, 9, 5]            # trigram 5 6 7 seen before
    p.commit([1], None)
    assert p.propose(2) == []                   # 1 never seen
    p.commit([9], None)
    assert p.propose(4) == [5, 6, 7, 1]         # unigram 9 -> what followed it
    assert NgramProposer().propose(2) == []


def test_ngram_lossless(target):
    prompt = PROMPTS[2] * 3  # repeated text: the n-gram proposer drafts (a random target rarely agrees)
    plain = plain_generate(target, prompt, 30)
    spec, st = speculative_generate(target, NgramProposer(), prompt, 30, draft_steps=4)
    assert spec == plain and sum(st.drafted_per_round) > 0


# ----------------------------------------------------------------------------- hybrid


def test_graft_merges_shared_prefixes_and_keeps_the_tree():
    from draftsmith.speculate.hybrid import graft
    from draftsmith.speculate.tree import DraftTree
    tree = DraftTree([5, 6, 7, 8], [-1, -1, 0, 2])          # 5 -> 7 -> 8, and 6
    g = graft(tree, [5, 7, 9, 4])                          # shares 5 -> 7, then branches
    assert g.tokens[:4] == tree.tokens and g.parents[:4] == tree.parents
    assert g.tokens[4:] == [9, 4] and g.parents[4:] == [2, 4]
    assert graft(tree, []) is tree
    g = graft(DraftTree(), [3, 3])                         # no drafter tree: the chain alone
    assert g.tokens == [3, 3] and g.parents == [-1, 0]
    q = torch.ones(10)
    g = graft(DraftTree([5], [-1], [q]), [6])              # a sampled tree: the n-gram node is a point mass
    assert g.q[0] is q and g.q[1] is None and g.parents == [-1, -1]


@pytest.mark.parametrize("batch", [1, 4])
def test_hybrid_lossless_and_both_branches_accept(target, fitted, batch):
    """One tree holding the drafter's nodes and a second proposer's chain: greedy output equals plain
    decoding, with prompt lookup there and with a noisy oracle there, whose right drafts are accepted
    past the drafter's depth (only the grafted chain reaches depth 4)."""
    from draftsmith.speculate.hybrid import HybridProposer
    prompts = [PROMPTS[2] * 3, PROMPTS[0], PROMPTS[1] * 4, PROMPTS[3]][:batch]
    plains = [plain_generate(target, p, 24) for p in prompts]

    def hybrid(second):
        return HybridProposer(Eagle3Proposer(fitted, topk=3, budget=8), PerSequence(second), drafter_depth=3, ngram_depth=4)

    new, _ = generate(target, hybrid([NgramProposer() for _ in prompts]), prompts, 24, depth=4)
    assert new == plains
    oracle = hybrid([OracleProposer(p + r, error_rate=0.3, seed=i) for i, (p, r) in enumerate(zip(prompts, plains))])
    assert oracle.max_nodes == 12
    new, stats = generate(target, oracle, prompts, 24, depth=4)
    assert new == plains
    assert any(4 in s.accepted_per_round for s in stats)


@pytest.mark.parametrize("batch", [1, 3])
def test_hybrid_trusting_a_long_lookup_match_skips_the_drafter_and_stays_lossless(target, fitted, batch):
    """evaluate.hybrid_trust_ngram: a round whose lookup matched that many tokens and filled its
    length verifies the lookup alone (no drafter nodes in that sequence's tree); the other rounds hold
    both; greedy output equals plain decoding either way, and trusting drafts fewer nodes in all."""
    from draftsmith.speculate.hybrid import HybridProposer
    prompts = [PROMPTS[2] * 3, PROMPTS[0], PROMPTS[1] * 4][:batch]
    plains = [plain_generate(target, p, 24) for p in prompts]

    def run(trust):
        h = HybridProposer(Eagle3Proposer(fitted, topk=3, budget=8), PerSequence([NgramProposer() for _ in prompts]),
                           drafter_depth=3, ngram_depth=4, trust_ngram=trust)
        return generate(target, h, prompts, 24, depth=4)

    (both, s_both), (trusted, s_trusted) = run(0), run(1)  # this target seldom repeats: trust any match
    assert both == plains and trusted == plains
    lookup_only = [d for s in s_trusted for d in s.drafted_per_round if 0 < d <= 4]
    assert lookup_only, "some rounds verify the lookup alone"
    assert sum(map(sum, (s.drafted_per_round for s in s_trusted))) < sum(map(sum, (s.drafted_per_round for s in s_both)))
