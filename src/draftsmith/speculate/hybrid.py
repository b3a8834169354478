"""Hybrid drafting: the drafter's tree and prompt lookup's continuation in ONE verification tree.

EAGLE-3 and n-gram lookup win on different text: the drafter on what the target writes anew,
n-gram on what it copies (the prompt, its own earlier lines). Run as separate methods, a server
must pick one. Here each round's n-gram continuation is grafted onto the drafter's tree: it
follows the tree's nodes while its tokens equal theirs and hangs its own nodes from the first
token that differs, so the one target forward verifies both and the round keeps whichever
path the target accepts further. The n-gram nodes are chosen, not sampled (q = None), and come
after the drafter's siblings: greedy acceptance follows the target's argmax into either branch;
rejection sampling (tree.accept_sampled) tries the drafter's children first, then the n-gram
node as a point mass against the residual, so every emitted token keeps the target's law.
A merged node (same token as the drafter's) keeps only the drafter's test: fewer candidates,
still exact.
"""
from __future__ import annotations

from .proposer import BatchProposer, PerSequence
from .tree import DraftTree


def graft(tree: DraftTree, chain: list[int]) -> DraftTree:
    """`tree` with the chain `chain` (from the root) grafted on: shared prefixes are merged and the
    rest appended as new nodes, parents before children, after every node of `tree`."""
    if not chain:
        return tree
    tokens, parents = list(tree.tokens), list(tree.parents)
    q = None if tree.q is None else list(tree.q)
    children: dict[int, dict[int, int]] = {}
    for i, (t, p) in enumerate(zip(tokens, parents)):
        children.setdefault(p, {}).setdefault(t, i)  # the first child with a token is the one tried first
    node = -1
    for t in chain:
        nxt = children.get(node, {}).get(t)
        if nxt is None:
            nxt = len(tokens)
            tokens.append(t)
            parents.append(node)
            if q is not None:
                q.append(None)
            children.setdefault(node, {})[t] = nxt
        node = nxt
    return DraftTree(tokens, parents, q)


class HybridProposer:
    """A BatchProposer: `drafter` (an Eagle3Proposer, trees or chains) to `drafter_depth`, and one
    n-gram lookup per sequence to `ngram_depth`, grafted into one tree per sequence per round."""

    def __init__(self, drafter: BatchProposer, ngram: PerSequence, drafter_depth: int, ngram_depth: int,
                 trust_ngram: int = 0):
        self.drafter, self.ngram = drafter, ngram
        self.drafter_depth, self.ngram_depth = drafter_depth, ngram_depth
        self.trust_ngram = trust_ngram  # > 0: a sequence whose lookup matched that many tokens and filled its depth drafts no tree

    @property
    def max_nodes(self) -> int:
        """Most nodes a round proposes: the drafter's budget and a whole n-gram chain beside it."""
        return getattr(self.drafter, "max_nodes", self.drafter_depth) + self.ngram_depth

    def start(self, tokens, outs) -> None:
        self.drafter.start(tokens, outs)
        self.ngram.start(tokens, outs)

    def propose(self, max_depth: list[int]) -> list[DraftTree]:
        chains = self.ngram.propose([min(d, self.ngram_depth) for d in max_depth])
        trusted = [self.trust_ngram > 0 and len(c.tokens) >= min(d, self.ngram_depth) > 0 and p.matched >= self.trust_ngram
                   for c, d, p in zip(chains, max_depth, self.ngram.proposers)]
        trees = self.drafter.propose([0 if t else min(d, self.drafter_depth) for t, d in zip(trusted, max_depth)])
        return [graft(t, c.tokens) for t, c in zip(trees, chains)]

    def commit(self, new_tokens, outs) -> None:
        self.drafter.commit(new_tokens, outs)
        self.ngram.commit(new_tokens, outs)
