"""What the decode loop talks to: proposers, for one sequence or a whole batch.

    Proposer       one sequence (n-gram, an independent draft model, test oracles)
    BatchProposer  the whole batch at once (Eagle3Proposer); what `engine.generate` calls
    PerSequence    a BatchProposer made of one Proposer per sequence
"""
from __future__ import annotations

from typing import Protocol

from ..target.model import TargetOutput
from .tree import DraftTree


class Proposer(Protocol):
    """Drafts tokens for one sequence (batch 1). All ids are target-vocab ids.

    start:  after the prefill; `tokens` = prompt + first token, `out` = the prefill forward
            (rows = prompt tokens).
    propose: up to k draft tokens continuing `tokens` (may return fewer, even none).
    commit: the round committed `new_tokens` (accepted drafts + bonus); `out` holds the verify
            forward's rows of [last_token, *accepted drafts], so rows 0..len(new_tokens)-1 are valid.
    A proposer may also define `propose_tree(depth) -> DraftTree` to draft trees."""

    def start(self, tokens: list[int], out: TargetOutput) -> None: ...
    def propose(self, k: int) -> list[int]: ...
    def commit(self, new_tokens: list[int], out: TargetOutput) -> None: ...


class BatchProposer(Protocol):
    """What `generate` talks to: the whole batch at once. `aux[b]` holds the target rows
    (aux hidden [n, A]) of sequence b's new committed tokens, as in `Proposer`."""

    def start(self, tokens: list[list[int]], outs: list[TargetOutput]) -> None: ...
    def propose(self, max_depth: list[int]) -> list[DraftTree]: ...
    def commit(self, new_tokens: list[list[int]], outs: list[TargetOutput]) -> None: ...


class PerSequence:
    """A BatchProposer made of one `Proposer` per sequence (n-gram, independent draft models)."""

    def __init__(self, proposers: list):
        self.proposers = proposers

    def start(self, tokens, outs):
        for p, t, o in zip(self.proposers, tokens, outs):
            p.start(t, o)

    def propose(self, max_depth):
        trees = []
        for p, d in zip(self.proposers, max_depth):
            if d <= 0:
                trees.append(DraftTree())
            elif hasattr(p, "propose_tree"):
                trees.append(p.propose_tree(d))
            else:
                trees.append(DraftTree.chain(list(p.propose(d))[:d]))
        return trees

    def commit(self, new_tokens, outs):
        for p, t, o in zip(self.proposers, new_tokens, outs):
            if t:
                p.commit(t, o)
