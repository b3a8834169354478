"""Greedy decoding, plain and speculative, at batch 1 with the target's own KV cache.

    plain_generate        one target forward per token (the reference)
    speculative_generate  a proposer drafts k tokens, ONE target forward verifies them all

The verify loop is written once and knows nothing about how drafts are made: a *proposer*
(`Eagle3Proposer` here; later a tree drafter or an n-gram matcher) is told the prompt, asked
for up to k draft tokens, and told what the target committed. Lossless by construction:
every emitted token is the target's own argmax given the committed prefix; drafts only
decide how many of those argmaxes one forward yields. The first token comes from the same
prefill forward in both functions, so spec and plain can differ only where a verify forward
over k+1 rows rounds differently from k+1 single-row forwards (a near-tie; fp32 has none in
our tests).

Accounting (per round = one verification forward after the prefill):
    accepted  drafts that matched the target's argmax, longest prefix
    emitted   accepted + 1 (the target's own "bonus" token), fewer only at EOS
    tau       sum(emitted) / rounds   (the prefill token and forward are left out)
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol, Sequence

import torch

from ..draft.model import DraftKVCache, Eagle3Drafter
from ..target.model import Target, TargetOutput


@dataclass
class SpecStats:
    rounds: int = 0                       # target verification forwards (prefill not counted)
    tokens: int = 0                       # tokens emitted, including the prefill token
    drafted_per_round: list[int] = field(default_factory=list)
    accepted_per_round: list[int] = field(default_factory=list)
    emitted_per_round: list[int] = field(default_factory=list)
    drafted: list[int] = field(default_factory=list)   # [k] rounds in which position j was proposed
    reached: list[int] = field(default_factory=list)   # [k] ... and drafts 0..j-1 were all accepted
    accepted: list[int] = field(default_factory=list)  # [k] ... and draft j was accepted too
    target_s: float = 0.0
    draft_s: float = 0.0
    wall_s: float = 0.0

    @property
    def tau(self) -> Optional[float]:
        return sum(self.emitted_per_round) / self.rounds if self.rounds else None

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["tau"] = self.tau
        return d


class Proposer(Protocol):
    """Drafts tokens for the verify loop. All ids are target-vocab ids.

    start:  after the prefill; `tokens` = prompt + first token, `out` = the prefill forward.
    propose: up to k draft tokens continuing `tokens` (may return fewer, even none).
    commit: the round committed `new_tokens` (accepted drafts + bonus); `out` is the verify
            forward over [last_token, *drafts], so its rows 0..len(new_tokens)-1 are valid."""

    def start(self, tokens: list[int], out: TargetOutput) -> None: ...
    def propose(self, k: int) -> list[int]: ...
    def commit(self, new_tokens: list[int], out: TargetOutput) -> None: ...


# ----------------------------------------------------------------------------- helpers


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _as_prompt(input_ids: Any, device: torch.device) -> torch.Tensor:
    ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(1, -1).to(device)
    if ids.shape[1] == 0:
        raise ValueError("empty prompt: give at least one input token")
    return ids


def crop_cache(cache: Any, length: int) -> None:
    """Keep the first `length` positions of a transformers cache. A negative argument means
    'remove this many' in every transformers 5 release (positive changed meaning in 5.17)."""
    remove = cache.get_seq_length() - length
    if remove > 0:
        cache.crop(-remove)


def _first_eos(tokens: list[int], eos_ids: Sequence[int]) -> int:
    """Number of tokens to keep: up to and including the first EOS."""
    for i, t in enumerate(tokens):
        if t in eos_ids:
            return i + 1
    return len(tokens)


# ----------------------------------------------------------------------------- plain


@torch.inference_mode()
def plain_generate(target: Target, input_ids: Any, max_new_tokens: int,
                   eos_ids: Sequence[int] = ()) -> list[int]:
    """Greedy decoding, one target forward per token. Returns the new tokens (EOS included)."""
    ids = _as_prompt(input_ids, target.device)
    out = target.forward(ids, use_cache=True)
    cache, new = out.past_key_values, []
    while True:
        tok = int(out.logits[0, -1].argmax())
        new.append(tok)
        if len(new) >= max_new_tokens or tok in eos_ids:
            return new
        out = target.forward(torch.tensor([[tok]], device=ids.device), past_key_values=cache, use_cache=True)


# ----------------------------------------------------------------------------- proposers


class Eagle3Proposer:
    """Chain drafting with an EAGLE-3 drafter and its own KV cache.

    Drafter row t pairs the target's aux state at position t with token t+1 (rotary
    position t) and predicts token t+2. Committed rows always come from the target's real
    aux states; the rows made while drafting (fed the drafter's own g) are dropped after
    each round."""

    def __init__(self, drafter: Eagle3Drafter):
        self.drafter = drafter
        self.cache = DraftKVCache()
        self.rows = 0                       # committed rows = committed tokens - 1
        self.g_last: Optional[torch.Tensor] = None  # [1, 1, H] output of the last committed row

    def _feed(self, tokens: list[int], aux: torch.Tensor) -> None:
        d = self.drafter
        dev = d.fc.weight.device
        n = len(tokens)
        pos = torch.arange(self.rows, self.rows + n, device=dev)[None]
        hidden = d.project(aux.to(dev))
        g = d(torch.tensor([tokens], device=dev), hidden, pos, self.cache)
        self.rows += n
        self.g_last = g[:, -1:]

    def start(self, tokens: list[int], out: TargetOutput) -> None:
        self.cache, self.rows = DraftKVCache(), 0
        self._feed(tokens[1:], out.aux_hidden)

    def propose(self, k: int) -> list[int]:
        d = self.drafter
        dev = d.fc.weight.device
        drafts, g = [], self.g_last
        for j in range(k):
            if j > 0:  # feed (g of the previous row, the token just drafted) at the next position
                pos = torch.tensor([[self.rows + j - 1]], device=dev)
                g = d(torch.tensor([[drafts[-1]]], device=dev), g, pos, self.cache)
            draft_id = d.logits(g[:, -1]).argmax(-1)
            drafts.append(int(d.draft_to_target(draft_id)))
        self.cache.crop(self.rows)
        return drafts

    def commit(self, new_tokens: list[int], out: TargetOutput) -> None:
        self._feed(new_tokens, out.aux_hidden[:, :len(new_tokens)])


# ----------------------------------------------------------------------------- speculative


@torch.inference_mode()
def speculative_generate(target: Target, drafter: Eagle3Drafter | Proposer, input_ids: Any,
                         max_new_tokens: int, draft_steps: int = 5,
                         eos_ids: Sequence[int] = ()) -> tuple[list[int], SpecStats]:
    """Greedy speculative decoding; the output equals `plain_generate` token for token.

    `drafter` is an Eagle3Drafter (chain drafting) or any Proposer."""
    proposer = Eagle3Proposer(drafter) if isinstance(drafter, Eagle3Drafter) else drafter
    k = draft_steps
    st = SpecStats(drafted=[0] * k, reached=[0] * k, accepted=[0] * k)
    dev = target.device
    ids = _as_prompt(input_ids, dev)
    t_start = time.perf_counter()

    def timed(fn, *args, attr: str):
        t0 = time.perf_counter()
        r = fn(*args)
        _sync(dev)
        setattr(st, attr, getattr(st, attr) + time.perf_counter() - t0)
        return r

    out = timed(lambda: target.forward(ids, use_cache=True), attr="target_s")
    cache = out.past_key_values
    tokens = ids[0].tolist() + [int(out.logits[0, -1].argmax())]
    new = [tokens[-1]]
    done = len(new) >= max_new_tokens or new[-1] in eos_ids
    if not done:
        timed(proposer.start, tokens, out, attr="draft_s")

    while not done:
        # Never draft past the token budget: the bonus token always fits.
        drafts = timed(proposer.propose, min(k, max_new_tokens - len(new) - 1), attr="draft_s")[:k]
        verify_in = torch.tensor([[tokens[-1], *drafts]], device=dev)
        out = timed(lambda: target.forward(verify_in, past_key_values=cache, use_cache=True), attr="target_s")
        greedy = out.logits[0].argmax(-1).tolist()  # greedy[i] follows verify_in[i]
        n = 0
        while n < len(drafts) and drafts[n] == greedy[n]:
            n += 1
        committed = drafts[:n] + [greedy[n]]
        emitted = committed[:_first_eos(committed, eos_ids)]

        st.rounds += 1
        st.drafted_per_round.append(len(drafts))
        st.accepted_per_round.append(n)
        st.emitted_per_round.append(len(emitted))
        for j in range(len(drafts)):
            st.drafted[j] += 1
            st.reached[j] += int(j <= n)
            st.accepted[j] += int(j < n)

        tokens += emitted
        new += emitted
        done = len(new) >= max_new_tokens or emitted[-1] in eos_ids
        if not done:
            # The target cache holds every verified row; keep the committed ones (the
            # bonus token is not in it yet: it is the next round's first input).
            crop_cache(cache, len(tokens) - 1)
            timed(proposer.commit, committed, out, attr="draft_s")

    st.tokens = len(new)
    st.wall_s = time.perf_counter() - t_start
    return new, st
