"""Speculative decoding engine: lossless against plain greedy, accounting, EOS, drafter cache."""
from __future__ import annotations

import random

import pytest
import torch

from draftsmith.config import DraftConfig
from draftsmith.draft.build import drafter_config, init_drafter
from draftsmith.draft.model import Eagle3Drafter
from draftsmith.speculate.engine import Eagle3Proposer, plain_generate, speculative_generate
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


@pytest.mark.parametrize("k", [1, 3, 5])
def test_lossless_random_drafter(target, k):
    drafter = make_drafter(target, draft_vocab=200, seed=k)
    for prompt in PROMPTS:
        plain = plain_generate(target, prompt, 24)
        spec, st = speculative_generate(target, drafter, prompt, 24, draft_steps=k)
        assert spec == plain, f"prompt {prompt}"
        assert st.tokens == len(spec) == 24
        assert sum(st.emitted_per_round) == len(spec) - 1
        assert all(0 <= a <= k for a in st.accepted_per_round)


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
    drafter = make_drafter(target)
    spec2, _ = speculative_generate(target, drafter, prompt, 30, draft_steps=k, eos_ids=[eos])
    assert spec2 == plain


def test_one_token_budget(target):
    spec, st = speculative_generate(target, make_drafter(target), PROMPTS[1], 1, draft_steps=3)
    assert spec == plain_generate(target, PROMPTS[1], 1) and st.rounds == 0 and st.tau is None


class RecordingProposer(Eagle3Proposer):
    """Records, per round, the committed tokens, the drafts and the drafter's logits."""

    def start(self, tokens, out):
        self.tokens, self.log = list(tokens), []
        logits = self.drafter.logits
        self.seen = []
        self.drafter.logits = lambda g: self.seen.append(logits(g)) or self.seen[-1]
        super().start(tokens, out)

    def propose(self, k):
        self.seen.clear()
        drafts = super().propose(k)
        if drafts:
            self.log.append((list(self.tokens), drafts, torch.cat(self.seen)))
        return drafts

    def commit(self, new_tokens, out):
        self.tokens += new_tokens
        super().commit(new_tokens, out)


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
    prop = RecordingProposer(drafter)
    speculative_generate(target, prop, PROMPTS[2], 20, draft_steps=3)
    assert len(prop.log) >= 3
    del drafter.logits
    for tokens, drafts, logits in prop.log:
        ref = ttt_reference_logits(target, drafter, tokens, drafts)
        torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
