"""The verifier on the eager target (plain decoding's steps too: the reference every speculative output equals).

    EagerVerifier          the target over transformers' own (dynamic) KV cache: prefill, verify, keep, past
                           (fast.FastTarget is the same interface over a static cache, graphed)
    verify_forward         THE eager verify forward: [B, N] tokens under a bool tree mask
    rows_of                a sequence's rows of a forward's output (what proposers are fed)

Plain decoding is engine.generate with no proposer (EagerVerifier.prefill_plain, then one `step` per token).
"""
from __future__ import annotations

from typing import Any

import torch

from ..target.model import Target, TargetOutput
from .cache import additive, h2d, move_rows
from .tree import prefill_mask, tree_mask


def verify_forward(target: Target, cache: Any, input_ids: torch.Tensor, position_ids: torch.Tensor,
                   mask: torch.Tensor) -> TargetOutput:
    """[B, N] tokens over the cache with a bool mask [B, N, S + N] (True = attend)."""
    return target.forward(input_ids, attention_mask=additive(mask, target.dtype), past_key_values=cache,
                          position_ids=position_ids, use_cache=True)


class EagerVerifier:
    """The target over transformers' own (dynamic) KV cache: the eager path. Same interface as
    fast.FastTarget (prefill, verify, keep, past), which the loop uses instead when given."""

    def __init__(self, target: Target):
        self.target, self.cache = target, None
        self.mask = self.pos = None  # plain decoding's 2D padding mask and next positions (prefill_plain, step)

    @property
    def past(self) -> int:
        return int(self.cache.get_seq_length())

    def prefill(self, ids, pos, pad, max_new_tokens: int, max_rows: int = 1) -> TargetOutput:
        out = self.target.forward(ids, attention_mask=additive(prefill_mask(pad, ids.shape[1]), self.target.dtype),
                                  position_ids=pos, use_cache=True)
        self.cache = out.past_key_values
        return out

    def prefill_plain(self, ids, pos, pad, max_new_tokens: int = 0, max_rows: int = 1) -> TargetOutput:
        """Plain decoding's prefill (engine.generate with no proposer): transformers' own 2D padding mask,
        or none at batch 1 (nothing to hide: the model's causal attention alone)."""
        self.mask = (torch.arange(ids.shape[1], device=ids.device)[None] >= pad[:, None]).long() if len(ids) > 1 else None
        out = self.target.forward(ids, attention_mask=self.mask, position_ids=pos, use_cache=True)
        self.cache, self.pos = out.past_key_values, pos[:, -1:]
        return out

    def step(self, tokens: list[int]) -> TargetOutput:
        """Plain decoding's step: one row per sequence (its last token) after the cache."""
        if self.mask is not None:
            self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1)
        self.pos = self.pos + 1
        return self.target.forward(torch.tensor(tokens, device=self.pos.device)[:, None], attention_mask=self.mask,
                                   position_ids=self.pos, past_key_values=self.cache, use_cache=True)

    def verify(self, ids, pos, start, end, anc, n_rows: int = 0) -> TargetOutput:
        """Host tensors in (as FastTarget.verify): [B, N] rows after the cache's `past` columns."""
        ids, pos, start, end, anc = (h2d(x, self.target.device) for x in (ids, pos, start, end, anc))
        return verify_forward(self.target, self.cache, ids, pos, tree_mask(start, end, self.past, anc))

    def keep(self, b: list[int], src: list[int], dst: list[int], length: int, n_moves: int = 0) -> None:
        move_rows(self.cache, b, src, dst, length)


def rows_of(out: TargetOutput, b: int, rows: torch.Tensor) -> TargetOutput:
    """Sequence b's rows `rows` of a forward's output, as a batch-1 TargetOutput."""
    return TargetOutput(logits=None if out.logits is None else out.logits[b:b + 1, rows],
                        aux_hidden=out.aux_hidden[b:b + 1, rows],
                        final_hidden=None if out.final_hidden is None else out.final_hidden[b:b + 1, rows])
