"""Speculative and plain decoding with the target's own KV cache; batch >= 1, chain or tree: the top of speculate/.

    generate               a proposer drafts a tree per sequence (a chain is a tree with one
                           child per node), ONE target forward verifies every tree of the batch;
                           with no proposer it is plain decoding, one row per sequence per step
    plain_generate(_batch) plain decoding (batch 1, a batch): `generate` with no proposer
    speculative_generate   batch 1 wrapper: an Eagle3Drafter or any `Proposer`

Two loops decode, and only two: this host loop (`generate`: eager targets, every proposer; eager plain
decoding) and the device-resident loop (resident.py: plain decoding on the fast path, always; EAGLE-3
rounds there with `resident`). Plain decoding, the speedup's denominator, is each loop with no proposer:
over the same cache, with no draft, tree or cache-move work per token.

The layers of speculate/ import one way, top first (tests/test_layering.py checks it):

    engine.py     the loop: `generate` on the host, or on the device (resident.py): plain decoding on the fast path,
                  EAGLE-3 (greedy or sampled) with `resident`
    resident.py   the same round as tensor ops, one CUDA graph per round (a plain step with no proposer)
    eagle3.py     proposers: EAGLE-3 chains and trees (+ FastDraft, its static cache and graphed steps);
    ngram.py,     prompt lookup; an independent draft model; the Proposer protocols and PerSequence
    independent.py, proposer.py
    verify.py     the verifier: EagerVerifier (transformers' cache; plain decoding's steps too);
    fast.py       FastTarget (static cache, CUDA graphs), the same interface plus graph-safe pieces
    tree.py       trees, masks, acceptance, accounting (SpecStats)
    cache.py      KV-cache moves, host-to-device copies, CUDA-graph capture, the drafter's static cache

One verify loop (`generate`), written once, knows nothing about how drafts are made. Each round,
sequence b feeds [root = last committed token, *tree nodes] at rotary positions L_b + depth with
a 4D attention mask over [committed cache columns of b, root, ancestors, self]; the target's
rows are then walked from the root: greedy follows the target's argmax, temperature > 0 uses
speculative rejection sampling (see `accept_sampled`). The cache rows of the root and of the
accepted path are gathered into place behind b's committed rows and the cache is cropped.

Cache layout (target and drafter alike): a physical [B, heads, S, d] tensor; sequence b owns the
columns [start_b, end_b) (left padding sits before start_b, stale rows of shorter sequences after
end_b), so sequences of a batch accept different numbers of tokens without re-padding.

Lossless: under greedy every emitted token is the target's own argmax given the committed prefix;
spec and plain can differ only where a verify forward rounds differently from single-row
forwards (a near-tie). Under sampling every emitted token has the target's distribution.

Accounting (per round = one verification forward after the prefill, per sequence):
    accepted  drafts on the accepted path (greedy: longest matching path)
    emitted   accepted + 1 (the target's own "bonus" token), fewer only at EOS
    tau       sum(emitted) / rounds   (the prefill token and forward are left out)
"""
from __future__ import annotations

import time
from typing import Any, Optional, Sequence

import torch

from ..draft.model import Eagle3Drafter
from ..target.model import Target
from .cache import h2d
from .cache import sync as sync_device
from .eagle3 import Eagle3Proposer
from .fast import FastTarget
from .proposer import BatchProposer, PerSequence, Proposer
from .resident import eligible, resident_generate
from .tree import DraftTree, SpecStats, accept_greedy, accept_sampled, as_prompt, cut_tree, first_eos, left_pad, pick, tree_ancestry
from .verify import EagerVerifier, rows_of

__all__ = ["generate", "plain_generate", "plain_generate_batch", "speculative_generate"]  # the rest lives where it is defined: tree, verify, proposer, cache


@torch.inference_mode()
def generate(target: Target, proposer: Optional[BatchProposer], prompts: list[list[int]], max_new_tokens: int,
             depth: int = 5, eos_ids: Sequence[int] = (), temperature: float = 0.0,
             generator: Optional[torch.Generator] = None,
             fast: Optional[FastTarget] = None, resident: bool = False,
             compile_round: bool = False) -> tuple[list[list[int]], list[SpecStats]]:
    """Speculative decoding of a batch. Trees deeper than `depth` are cut. Greedy output equals
    plain greedy decoding; sampled output has the target's distribution. Returns per sequence
    the new tokens (EOS included) and its SpecStats (target_s/draft_s/wall_s are batch-wide).
    `fast` (a FastTarget) replaces the eager target forwards with static-cache / CUDA-graph
    ones; every verify then feeds the same number of rows (1 + the proposer's `max_nodes`).
    With `resident`, EAGLE-3 on the fast path runs its rounds on the device (resident.py;
    `compile_round` compiles the round's pure parts there); this host loop runs everything else.
    No proposer: plain decoding, the baseline. Eager, one row per sequence per step over the same
    transformers cache (EagerVerifier.prefill_plain / step: its 2D padding mask, none at batch 1), no tree
    and no cache moves; on the fast path always the resident loop's plain steps (resident.Plain: the token
    fed back on the device, one CUDA graph per step), whatever `resident` says."""
    if eligible(fast, proposer, resident):
        return resident_generate(target, proposer, prompts, max_new_tokens, depth, eos_ids, fast, compile_round,
                                 temperature, generator)
    B, dev = len(prompts), target.device
    runner = fast if fast is not None else EagerVerifier(target)
    n_rows = 1 + (getattr(proposer, "max_nodes", depth) if proposer is not None else 0)
    stats = [SpecStats(drafted=[0] * depth, reached=[0] * depth, accepted=[0] * depth) for _ in prompts]
    clock = {"target_s": 0.0, "draft_s": 0.0}
    t_start = time.perf_counter()

    def timed(attr: str, fn, *args, sync: bool = True):
        t0 = time.perf_counter()
        r = fn(*args)
        if sync:
            sync_device(dev)
        clock[attr] += time.perf_counter() - t0
        return r

    ids, pad, pos = left_pad(prompts, dev)
    P = ids.shape[1]
    prefill = runner.prefill if proposer is not None else runner.prefill_plain  # (eager only: fast is resident)
    out = timed("target_s", prefill, ids, pos, pad, max_new_tokens, n_rows)
    tokens = [list(p) + [pick(out.logits[b, -1], temperature, generator)] for b, p in enumerate(prompts)]
    new = [[t[-1]] for t in tokens]

    def finished(n: list[int]) -> bool:  # a sequence's new tokens fill the budget or end in an EOS
        return len(n) >= max_new_tokens or n[-1] in eos_ids

    done = [finished(n) for n in new]
    start, end = pad.cpu(), torch.full((B,), P)  # host bookkeeping: no device reads per sequence
    if proposer is not None and not all(done):
        timed("draft_s", proposer.start, tokens,
              [rows_of(out, b, torch.arange(int(pad[b]), P, device=dev)) for b in range(B)])
    empty = DraftTree()

    while not all(done):
        if proposer is None:
            # Plain decoding: one row per sequence (its last token, the finished ones riding along) after the
            # cache, no tree, no cache moves; every sequence draws, as one forward per token at batch 1 does.
            out = timed("target_s", runner.step, [t[-1] for t in tokens])
            picked = (out.logits[:, -1].argmax(-1).tolist() if temperature <= 0 else
                      [pick(out.logits[b, -1], temperature, generator) for b in range(B)])
            for b in range(B):
                if not done[b]:
                    commit_round(stats[b], empty, [], picked[b], tokens[b], new[b])
                    done[b] = finished(new[b])
            continue
        # Never draft past the token budget: the bonus token always fits.
        max_depth = [0 if done[b] else min(depth, max_new_tokens - len(new[b]) - 1) for b in range(B)]
        trees = [DraftTree() for _ in range(B)]
        if any(max_depth):
            trees = timed("draft_s", proposer.propose, max_depth)
        trees = [cut_tree(t, d) for t, d in zip(trees, max_depth)]
        N = 1 + max(len(t) for t in trees)
        verify_in = torch.zeros(B, N, dtype=torch.long)
        depth_of = torch.zeros(B, N, dtype=torch.long)
        for b, t in enumerate(trees):
            verify_in[b, 0] = tokens[b][-1]
            verify_in[b, 1:1 + len(t)] = torch.tensor(t.tokens, dtype=torch.long)
            depth_of[b, 1:1 + len(t)] = torch.tensor(t.depths(), dtype=torch.long)
        past = runner.past
        committed_len = end - start
        out = timed("target_s", runner.verify, verify_in, committed_len[:, None] + depth_of, start, end,
                    tree_ancestry(trees, N), n_rows)  # host tensors: the runner sends them without a sync

        if temperature <= 0:
            greedy = out.logits.argmax(-1).tolist()
        else:
            probs = torch.softmax(out.logits.float() / temperature, -1)
        move_b, move_src, move_dst, commits, outs = [], [], [], [], []
        for b, t in enumerate(trees):
            if done[b]:
                commits.append([])
                outs.append(None)
                continue
            path, bonus = accept_greedy(t, greedy[b]) if temperature <= 0 else accept_sampled(t, probs[b], generator)
            committed = commit_round(stats[b], t, path, bonus, tokens[b], new[b], eos_ids)
            done[b] = finished(new[b])
            rows = [0] + [i + 1 for i in path]
            e = int(end[b])
            move_b += [b] * len(rows)
            move_src += [past + r for r in rows]
            move_dst += list(range(e, e + len(rows)))
            end[b] = e + len(rows)
            commits.append([] if done[b] else committed)
            outs.append(None if done[b] else rows_of(out, b, h2d(rows, dev)))
        # Keep the root and the accepted path of every sequence, behind its committed rows.
        runner.keep(move_b, move_src, move_dst, int(end.max()), B * n_rows)  # end is on the host
        if not all(done):
            # No sync: the drafter's feed runs on the GPU while the host starts the next round
            # (propose reads its tokens back, so its wait counts in draft_s too).
            timed("draft_s", proposer.commit, commits, outs, sync=False)

    wall = time.perf_counter() - t_start
    for st, n in zip(stats, new):
        st.tokens, st.target_s, st.draft_s, st.wall_s = len(n), clock["target_s"], clock["draft_s"], wall
    return new, stats


def commit_round(st: SpecStats, tree: DraftTree, path: list[int], bonus: int, tokens: list[int], new: list[int],
                 eos_ids: Sequence[int] = ()) -> list[int]:
    """One sequence's round: the accepted path's tokens and the bonus token, emitted up to the first EOS
    (onto `tokens` and `new`) and counted in its stats. Returns the committed tokens (path + bonus)."""
    committed = [tree.tokens[i] for i in path] + [bonus]
    emitted = committed[:first_eos(committed, eos_ids)]
    st.rounds += 1
    st.drafted_per_round.append(len(tree))
    st.accepted_per_round.append(len(path))
    st.emitted_per_round.append(len(emitted))
    for j in range(max(tree.depths(), default=0)):
        st.drafted[j] += 1
        st.reached[j] += int(j <= len(path))
        st.accepted[j] += int(j < len(path))
    tokens += emitted
    new += emitted
    return committed


@torch.inference_mode()
def plain_generate(target: Target, input_ids: Any, max_new_tokens: int, eos_ids: Sequence[int] = (),
                   temperature: float = 0.0, generator: Optional[torch.Generator] = None,
                   fast: Optional[FastTarget] = None) -> list[int]:
    """Plain decoding at batch 1 (`generate` with no proposer). Returns the new tokens (EOS included)."""
    return plain_generate_batch(target, [as_prompt(input_ids, "cpu")[0].tolist()], max_new_tokens, eos_ids, temperature,
                                generator, fast)[0]


@torch.inference_mode()
def plain_generate_batch(target: Target, prompts: list[list[int]], max_new_tokens: int, eos_ids: Sequence[int] = (),
                         temperature: float = 0.0, generator: Optional[torch.Generator] = None,
                         fast: Optional[FastTarget] = None) -> list[list[int]]:
    """Plain decoding of a batch (`generate` with no proposer): the new tokens per prompt, EOS included."""
    return generate(target, None, prompts, max_new_tokens, 0, eos_ids, temperature, generator, fast=fast)[0]


@torch.inference_mode()
def speculative_generate(target: Target, drafter: Eagle3Drafter | Proposer, input_ids: Any,
                         max_new_tokens: int, draft_steps: int = 5, eos_ids: Sequence[int] = (),
                         temperature: float = 0.0, generator: Optional[torch.Generator] = None,
                         tree: Optional[tuple[int, int]] = None) -> tuple[list[int], SpecStats]:
    """Speculative decoding at batch 1; greedy output equals `plain_generate` token for token.

    `drafter` is an Eagle3Drafter (chain of `draft_steps`, or an EAGLE-2 tree when
    tree=(topk, budget)) or any Proposer."""
    if isinstance(drafter, Eagle3Drafter):
        topk, budget = tree or (1, draft_steps)
        proposer = Eagle3Proposer(drafter, topk=topk, budget=budget, temperature=temperature, generator=generator)
    else:
        proposer = PerSequence([drafter])
    new, stats = generate(target, proposer, [list(as_prompt(input_ids, "cpu")[0].tolist())], max_new_tokens,
                          draft_steps, eos_ids, temperature, generator)
    return new[0], stats[0]
