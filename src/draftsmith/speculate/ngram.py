"""Prompt-lookup / n-gram drafting (Saxena 2023): the baseline every evaluation reports.

The last n tokens (n = max_ngram down to min_ngram) are looked up in everything committed so
far, prompt included; the tokens that followed their most recent earlier occurrence are the
drafts. No model, no training: what speculation gives for free on repetitive text.
"""
from __future__ import annotations


class NgramProposer:
    """A `Proposer` (batch 1; wrap several in proposer.PerSequence for a batch)."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"ngram sizes: need 1 <= min_ngram ({min_ngram}) <= max_ngram ({max_ngram})")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.tokens: list[int] = []
        self.matched = 0  # the n of the last proposal's match (0: none)

    def start(self, tokens, out) -> None:
        self.tokens = list(tokens)

    def commit(self, new_tokens, out) -> None:
        self.tokens += new_tokens

    def propose(self, k: int) -> list[int]:
        t = self.tokens
        for n in range(min(self.max_ngram, len(t) - 1), self.min_ngram - 1, -1):
            tail = t[-n:]
            for i in range(len(t) - n - 1, -1, -1):  # most recent earlier occurrence first
                if t[i:i + n] == tail:
                    self.matched = n
                    return t[i + n:i + n + k]
        self.matched = 0
        return []
