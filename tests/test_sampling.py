"""Speculative rejection sampling keeps the target's distribution: chi-square tests, seeded.

Unit level: `accept_sampled` on synthetic target/draft distributions over 6 tokens (chains with a
sampled draft, trees of point-mass siblings). End to end: a tiny 8-token Llama target, a batch
of identical prompts decoded 3 tokens deep by EAGLE-3 chain (sampled drafts), EAGLE-3 tree and
n-gram, against the exact joint distribution of the target's 3 tokens.
"""
from __future__ import annotations

import math

import pytest
import torch

from draftsmith.config import DraftConfig
from draftsmith.draft.build import drafter_config, init_drafter
from draftsmith.speculate.eagle3 import Eagle3Proposer
from draftsmith.speculate.engine import generate
from draftsmith.speculate.hybrid import HybridProposer
from draftsmith.speculate.ngram import NgramProposer
from draftsmith.speculate.proposer import PerSequence
from draftsmith.speculate.tree import DraftTree, accept_sampled
from draftsmith.target.model import Target
from draftsmith.testing import tiny_config


def chi_square_p(counts: dict, expected: dict, min_expected: float = 5.0) -> float:
    """p-value of Pearson's chi-square; bins expected below min_expected are pooled."""
    n = sum(counts.values())
    stat, df, pool_o, pool_e = 0.0, -1, 0.0, 0.0
    for key, p in expected.items():
        e, o = p * n, counts.get(key, 0)
        if e < min_expected:
            pool_o, pool_e = pool_o + o, pool_e + e
        else:
            stat, df = stat + (o - e) ** 2 / e, df + 1
    if pool_e > 0:
        stat, df = stat + (pool_o - pool_e) ** 2 / pool_e, df + 1
    assert sum(counts.get(k, 0) for k in expected) == n, "a sample fell outside the support"
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))


def test_chi_square_p_matches_known_values():
    # chi-square(df=1) of 3.841 has p = 0.05; df=4 of 9.488 has p = 0.05
    assert math.isclose(float(torch.special.gammaincc(torch.tensor(0.5, dtype=torch.float64), torch.tensor(3.841 / 2, dtype=torch.float64))), 0.05, abs_tol=1e-3)
    assert math.isclose(float(torch.special.gammaincc(torch.tensor(2.0, dtype=torch.float64), torch.tensor(9.488 / 2, dtype=torch.float64))), 0.05, abs_tol=1e-3)


V = 6


def _dists(seed: int, rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(2 * torch.randn(rows, V, generator=g, dtype=torch.float64), -1).float()


P0 = _dists(1, 1)[0]      # target law of token 1
P2 = _dists(2, V)          # P2[x1]: target law of token 2 after token 1 = x1
Q0, Q1 = _dists(3, 2)      # a drafter's (rough) laws


def _rows(tree: DraftTree) -> torch.Tensor:
    """Target rows for [root, *nodes]: p0 at the root, P2[token] below a depth-1 node, uniform deeper."""
    depths = tree.depths()
    return torch.stack([P0] + [P2[t] if d == 1 else torch.full((V,), 1 / V) for t, d in zip(tree.tokens, depths)])


def _two_tokens(make_tree, trials: int, seed: int, verify=accept_sampled) -> dict:
    """Law of the first two emitted tokens; a round that emits one is followed by a plain sample."""
    g = torch.Generator().manual_seed(seed)
    counts: dict = {}
    for _ in range(trials):
        tree = make_tree(g)
        path, bonus = verify(tree, _rows(tree), g)
        emitted = [tree.tokens[i] for i in path] + [bonus]
        if len(emitted) < 2:
            emitted.append(int(torch.multinomial(P2[emitted[0]], 1, generator=g)))
        counts[tuple(emitted[:2])] = counts.get(tuple(emitted[:2]), 0) + 1
    return counts


EXPECTED_TWO = {(a, b): float(P0[a] * P2[a, b]) for a in range(V) for b in range(V)}


def sampled_chain(g):  # drafts drawn from q, q handed to the verifier
    return DraftTree.chain([int(torch.multinomial(Q0, 1, generator=g)), int(torch.multinomial(Q1, 1, generator=g))], [Q0, Q1])


def point_mass_tree(g):  # top-3 siblings under the root, two grandchildren: deterministic nodes
    order = P0.argsort(descending=True).tolist()
    return DraftTree([order[0], order[1], order[2], 4, 1], [-1, -1, -1, 0, 0])


def _mixed(x1: int, y: int) -> tuple[list[int], list[int]]:
    """A sampled tree's shape (Eagle3Proposer at temperature > 0): under the root x1 ~ Q0 first, then
    the top-2 of Q0 without x1 as fixed siblings; under x1 its chain child y ~ Q1."""
    rest = [t for t in Q0.argsort(descending=True).tolist() if t != x1][:2]
    return [x1, *rest, y], [-1, -1, -1, 0]


def mixed_tree(g):
    tokens, parents = _mixed(int(torch.multinomial(Q0, 1, generator=g)), int(torch.multinomial(Q1, 1, generator=g)))
    return DraftTree(tokens, parents, [Q0, None, None, Q1])


@pytest.mark.parametrize("make_tree", [sampled_chain, point_mass_tree, mixed_tree])
def test_accept_sampled_preserves_the_target_distribution(make_tree):
    counts = _two_tokens(make_tree, 6000, seed=7)
    assert chi_square_p(counts, EXPECTED_TWO) > 1e-3


def test_chi_square_catches_a_biased_verifier():
    """The test has teeth: accepting every draft (greedy-style) is detected."""
    def accept_all(t, p, g):
        return list(range(len(t))), int(torch.multinomial(p[len(t)], 1, generator=g))

    counts = _two_tokens(sampled_chain, 3000, seed=7, verify=accept_all)
    assert chi_square_p(counts, EXPECTED_TWO) < 1e-6


def _chain_rounds(n: int, seed: int, accept_all: bool = False, cut: bool = False) -> dict:
    """Law of the first two tokens emitted by resident.accept_sampled_chain over n chains at once: drafts
    x1 ~ Q0, x2 ~ Q1, the target's laws P0 at the root and P2[x1] below x1 (as _rows). `cut`: the second
    draft is past the depth limit (an invalid row). A round emitting one token is followed by a plain sample."""
    from draftsmith.speculate.resident import accept_sampled_chain

    g = torch.Generator().manual_seed(seed)
    x1, x2 = torch.multinomial(Q0, n, replacement=True, generator=g), torch.multinomial(Q1, n, replacement=True, generator=g)
    ids = torch.stack([torch.zeros(n, dtype=torch.long), x1, x2], 1)
    logits = torch.stack([P0.log().expand(n, V), P2[x1].log(), torch.zeros(n, V)], 1)
    q_all = torch.stack([Q0, Q1])[None].expand(n, 2, V)
    valid = torch.ones(n, 3, dtype=torch.bool)
    valid[:, 2] = not cut
    u = torch.zeros(n, 3) if accept_all else torch.rand(n, 3, generator=g)
    e = torch.empty(n, V).exponential_(generator=g)
    n_acc, path, committed, n_emit, hit = accept_sampled_chain(logits, ids, valid, q_all, u, e, torch.tensor([-1]), 1.0, 3)
    assert not hit.any() and (n_emit == n_acc + 1).all() and (n_acc <= (1 if cut else 2)).all()
    return _first_two(committed, n_emit, g)


def _first_two(committed: torch.Tensor, n_emit: torch.Tensor, g: torch.Generator) -> dict:
    """Counts of the first two tokens of rounds run at once; a round that emitted one is followed by a plain sample."""
    second = torch.where(n_emit >= 2, committed[:, 1], torch.multinomial(P2[committed[:, 0]], 1, generator=g)[:, 0])
    counts: dict = {}
    for a, b in zip(committed[:, 0].tolist(), second.tolist()):
        counts[(a, b)] = counts.get((a, b), 0) + 1
    return counts


def _tree_rounds(n: int, seed: int) -> dict:
    """As _chain_rounds for point_mass_tree's fixed nodes (top-3 siblings, two grandchildren under the first),
    verified by tree.sample_race and resident.accept: one draw per row, the path follows the drawn tokens."""
    from draftsmith.speculate.resident import accept, ancestry
    from draftsmith.speculate.tree import sample_race

    g = torch.Generator().manual_seed(seed)
    tree = point_mass_tree(g)
    ids = torch.tensor([[0] + tree.tokens]).expand(n, -1)
    logits = _rows(tree).log()[None].expand(n, -1, -1)
    prow = torch.tensor([[0] + [p + 1 if p >= 0 else 0 for p in tree.parents]]).expand(n, -1)
    valid = torch.ones(n, len(tree) + 1, dtype=torch.bool)
    picked = sample_race(logits, 1.0, torch.empty(logits.shape).exponential_(generator=g))
    n_acc, path, committed, n_emit, hit = accept(picked, ids, prow, valid, ancestry(prow, valid, 2), torch.tensor([-1]), 3)
    return _first_two(committed, n_emit, g)


def test_resident_tree_acceptance_preserves_the_target_distribution():
    """A tree of fixed (top-k) nodes verified on the device against one draw per row keeps the target's law."""
    assert chi_square_p(_tree_rounds(20000, seed=9), EXPECTED_TWO) > 1e-3


def _mixed_rounds(n: int, seed: int, accept_all: bool = False) -> dict:
    """As _tree_rounds for mixed_tree (chain nodes drawn from Q0 and Q1, fixed siblings), n trees at once,
    picked by resident.pick_sampled_tree; accept_all: u = 0, every drawn node taken."""
    from draftsmith.speculate.resident import accept, ancestry, pick_sampled_tree

    g = torch.Generator().manual_seed(seed)
    x1, y = torch.multinomial(Q0, n, replacement=True, generator=g), torch.multinomial(Q1, n, replacement=True, generator=g)
    trees = [_mixed(a, b) for a, b in zip(x1.tolist(), y.tolist())]
    ids = torch.tensor([[0] + t for t, _ in trees])
    logits = torch.stack([_rows(DraftTree(t, par)) for t, par in trees]).log()
    prow = torch.tensor([[0, 0, 0, 0, 1]]).expand(n, -1)
    depth = torch.tensor([[0, 1, 1, 1, 2]]).expand(n, -1)
    chain = torch.tensor([[False, True, False, False, True]]).expand(n, -1)
    valid = torch.ones(n, 5, dtype=torch.bool)
    u = torch.zeros(n, 5) if accept_all else torch.rand(n, 5, generator=g)
    e = torch.empty(n, 5, V).exponential_(generator=g)
    picked = pick_sampled_tree(logits, ids, prow, depth, chain, torch.stack([Q0, Q1])[None].expand(n, 2, V), u, e, 1.0)
    n_acc, path, committed, n_emit, hit = accept(picked, ids, prow, valid, ancestry(prow, valid, 2), torch.tensor([-1]), 3)
    return _first_two(committed, n_emit, g)


def test_resident_sampled_tree_acceptance_preserves_the_target_distribution():
    """A tree whose chain nodes were drawn from the drafter's law and whose siblings are fixed, verified on
    the device (pick_sampled_tree, then accept), keeps the target's law; taking every drawn node is caught."""
    assert chi_square_p(_mixed_rounds(20000, seed=4), EXPECTED_TWO) > 1e-3
    assert chi_square_p(_mixed_rounds(20000, seed=4, accept_all=True), EXPECTED_TWO) < 1e-6


@pytest.mark.parametrize("cut", [False, True])
def test_resident_chain_acceptance_preserves_the_target_distribution(cut):
    """The resident rounds' sampled chain acceptance (tensor ops, every chain at once) keeps the target's law,
    also with the chain cut by the depth limit; accepting every draft instead is caught."""
    assert chi_square_p(_chain_rounds(20000, seed=5, cut=cut), EXPECTED_TWO) > 1e-3
    assert chi_square_p(_chain_rounds(20000, seed=5, accept_all=True, cut=cut), EXPECTED_TWO) < 1e-6


# ----------------------------------------------------------------------------- end to end


def tiny_pair(device: str = "cpu"):
    """A tiny 8-token Llama target with broad next-token laws, and a random EAGLE-3 drafter for it."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(vocab_size=8, hidden_size=32, num_layers=4)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    target = Target(model.to(device), None)
    target._install_final_hook()
    cfg = drafter_config(target.config, DraftConfig(), 8, target.aux_layer_ids)
    drafter = init_drafter(cfg, target.input_embeddings(), torch.zeros(8, dtype=torch.long, device=device),
                           torch.ones(8, dtype=torch.bool, device=device), 0, std=0.3).eval()
    return target, drafter.to(device)


@pytest.fixture(scope="module")
def tiny():
    return tiny_pair()


PROMPT = [1, 3, 5, 3, 5, 3]


@torch.inference_mode()
def exact_three(target, temperature: float = 1.0) -> dict:
    """P(x1, x2, x3 | PROMPT) at a sampling temperature, from one forward over all 64 two-token continuations."""
    seqs = torch.tensor([PROMPT + [a, b] for a in range(8) for b in range(8)], device=target.device)
    p = torch.softmax(target.forward(seqs).logits.double() / temperature, -1)
    P = len(PROMPT)
    return {(a, b, c): float(p[a * 8 + b, P - 1, a] * p[a * 8 + b, P, b] * p[a * 8 + b, P + 1, c])
            for a in range(8) for b in range(8) for c in range(8)}


@pytest.mark.parametrize("method,temperature", [("eagle3_chain", 1.0), ("eagle3_tree", 1.0), ("ngram", 1.0),
                                                ("hybrid", 1.0), ("eagle3_chain", 0.3), ("eagle3_tree", 0.3)])
def test_sampled_decoding_matches_target_distribution(tiny, method, temperature):
    """The joint law of 3 sampled tokens is the target's at the sampling temperature: 1, and 0.3 (sharper than
    any recipe serves). N-gram only at 1: at 0.3 this target never accepts the prompt's n-gram, so that case
    would check plain sampling only."""
    target, drafter = tiny
    g = torch.Generator().manual_seed(11)
    batch, rounds = 250, 8
    counts: dict = {}
    for _ in range(rounds):
        if method == "eagle3_chain":
            prop = Eagle3Proposer(drafter, topk=1, budget=2, temperature=temperature, generator=g)
        elif method == "eagle3_tree":
            prop = Eagle3Proposer(drafter, topk=3, budget=6, temperature=temperature, generator=g)
        elif method == "hybrid":  # the sampled tree with the prompt's n-gram grafted on (point masses)
            prop = HybridProposer(Eagle3Proposer(drafter, topk=3, budget=6, temperature=temperature, generator=g),
                                  PerSequence([NgramProposer() for _ in range(batch)]), 2, 2)
        else:
            prop = PerSequence([NgramProposer() for _ in range(batch)])
        new, stats = generate(target, prop, [PROMPT] * batch, 3, depth=2, temperature=temperature, generator=g)
        for n in new:
            counts[tuple(n)] = counts.get(tuple(n), 0) + 1
    assert sum(s.accepted_per_round.count(0) < len(s.accepted_per_round) for s in stats) >= 5  # drafts were accepted
    assert chi_square_p(counts, exact_three(target, temperature)) > 1e-3


@pytest.mark.parametrize("method,temperature", [("chain", 1.0), ("tree", 1.0), ("chain_top1", 1.0),
                                                ("chain", 0.3), ("tree", 0.3)])
@pytest.mark.parametrize("mode", ["static", "emulated", pytest.param("graphs", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_resident_sampled_decoding_matches_target_distribution(tiny, mode, monkeypatch, method, temperature):
    """Sampled EAGLE-3 on the device (resident rounds over static caches, eager or as an emulated CUDA
    graph; draws from the round's own generator seeded from the proposer's) keeps the target's joint law
    of 3 tokens at the sampling temperature: a chain of drafts drawn from q, a tree of top-k drafts, a chain
    of top-1 drafts (at 1 only: at 0.3 this random drafter's top-1 is never accepted)."""
    import test_fast
    from draftsmith.speculate.eagle3 import FastDraft
    from draftsmith.speculate.fast import FastTarget

    target, drafter = tiny_pair("cuda") if mode == "graphs" else tiny  # graphs: real CUDA graphs (-m gpu)
    mode = test_fast.fast_mode(mode, monkeypatch)
    ft, fd = FastTarget(target, mode), FastDraft(drafter, graphs=mode != "static")
    g = torch.Generator(device=target.device).manual_seed(12)
    counts: dict = {}
    accepted = 0
    for _ in range(8):
        topk, budget, t_draft = {"chain": (1, 2, temperature), "tree": (3, 6, temperature), "chain_top1": (1, 2, 0.0)}[method]
        prop = Eagle3Proposer(drafter, topk=topk, budget=budget, temperature=t_draft, generator=g, fast=fd)
        new, stats = generate(target, prop, [PROMPT] * 250, 3, depth=2, temperature=temperature, generator=g, fast=ft,
                              resident=True)
        assert all(s.target_s is None for s in stats) and prop.generator is g  # the resident path ran
        accepted += sum(sum(s.accepted_per_round) for s in stats)
        for n in new:
            counts[tuple(n)] = counts.get(tuple(n), 0) + 1
    assert accepted >= 20  # drafts were accepted (top-1 drafts of this random drafter: ~30 of 2,000 rounds)
    assert chi_square_p(counts, exact_three(target, temperature)) > 1e-3


@pytest.mark.parametrize("method", ["chain", "tree"])
def test_resident_sampled_decoding_stops_at_eos(tiny, method):
    """Sampled resident rounds cut each sequence after its first EOS, as the host loop does: no EOS before the
    last token, and a sequence shorter than max_new_tokens ends with one."""
    from draftsmith.speculate.eagle3 import FastDraft
    from draftsmith.speculate.fast import FastTarget

    target, drafter = tiny
    ft, fd = FastTarget(target, "static"), FastDraft(drafter, graphs=False)
    g = torch.Generator().manual_seed(3)
    topk, budget = (1, 3) if method == "chain" else (3, 6)
    prop = Eagle3Proposer(drafter, topk=topk, budget=budget, temperature=1.0, generator=g, fast=fd)
    new, stats = generate(target, prop, [PROMPT] * 64, 8, depth=3, eos_ids=(3,), temperature=1.0, generator=g,
                          fast=ft, resident=True)
    assert all(s.target_s is None for s in stats)
    assert all(3 not in n[:-1] and (n[-1] == 3 or len(n) == 8) for n in new)
    assert sum(n[-1] == 3 and len(n) < 8 for n in new) >= 10  # EOS did stop sequences early
    assert all(s.tokens == len(n) == sum(s.emitted_per_round) + 1 for s, n in zip(stats, new))
