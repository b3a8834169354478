"""The verifier on the eager target, and plain decoding (the reference every speculative output equals).

    EagerVerifier          the target over transformers' own (dynamic) KV cache: prefill, verify, keep, past
                           (fast.FastTarget is the same interface over a static cache, graphed)
    verify_forward         THE eager verify forward: [B, N] tokens under a bool tree mask
    rows_of                a sequence's rows of a forward's output (what proposers are fed)
    plain_generate         one target forward per token, batch 1
    plain_generate_batch   the same for a left-padded batch (HF 2D padding mask)
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from ..target.model import Target, TargetOutput
from .cache import additive, h2d, move_rows
from .tree import as_prompt, left_pad, pick, prefill_mask, tree_mask


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

    @property
    def past(self) -> int:
        return int(self.cache.get_seq_length())

    def prefill(self, ids, pos, pad, max_new_tokens: int, max_rows: int = 1) -> TargetOutput:
        out = self.target.forward(ids, attention_mask=additive(prefill_mask(pad, ids.shape[1]), self.target.dtype),
                                  position_ids=pos, use_cache=True)
        self.cache = out.past_key_values
        return out

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


@torch.inference_mode()
def plain_generate(target: Target, input_ids: Any, max_new_tokens: int, eos_ids: Sequence[int] = (),
                   temperature: float = 0.0, generator: Optional[torch.Generator] = None) -> list[int]:
    """Decoding at batch 1, one target forward per token. Returns the new tokens (EOS included)."""
    ids = as_prompt(input_ids, target.device)
    out = target.forward(ids, use_cache=True)
    cache, new = out.past_key_values, []
    while True:
        tok = pick(out.logits[0, -1], temperature, generator)
        new.append(tok)
        if len(new) >= max_new_tokens or tok in eos_ids:
            return new
        out = target.forward(torch.tensor([[tok]], device=ids.device), past_key_values=cache, use_cache=True)


@torch.inference_mode()
def plain_generate_batch(target: Target, prompts: list[list[int]], max_new_tokens: int, eos_ids: Sequence[int] = (),
                         temperature: float = 0.0, generator: Optional[torch.Generator] = None) -> list[list[int]]:
    """Plain decoding of a left-padded batch (HF's own 2D padding mask); finished sequences ride along."""
    dev = target.device
    ids, pad, pos = left_pad(prompts, dev)
    mask = (torch.arange(ids.shape[1], device=dev)[None] >= pad[:, None]).long()
    out = target.forward(ids, attention_mask=mask, position_ids=pos, use_cache=True)
    cache, new = out.past_key_values, [[] for _ in prompts]
    done = [False] * len(prompts)
    last_pos = pos[:, -1:]
    while True:
        step = [pick(out.logits[b, -1], temperature, generator) for b in range(len(prompts))]
        for b, tok in enumerate(step):
            if not done[b]:
                new[b].append(tok)
                done[b] = len(new[b]) >= max_new_tokens or tok in eos_ids
        if all(done):
            return new
        last_pos = last_pos + 1
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        out = target.forward(torch.tensor(step, device=dev)[:, None], attention_mask=mask, position_ids=last_pos,
                             past_key_values=cache, use_cache=True)
