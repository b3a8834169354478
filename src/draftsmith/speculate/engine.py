"""Speculative decoding with the target's own KV cache; batch >= 1, chain or tree: the top of speculate/.

    generate               a proposer drafts a tree per sequence (a chain is a tree with one
                           child per node), ONE target forward verifies every tree of the batch
    speculative_generate   batch 1 wrapper: an Eagle3Drafter or any `Proposer`

The layers of speculate/ import one way, top first (tests/test_layering.py checks it):

    engine.py     the loop: `generate` on the host, or on the device (resident.py) for EAGLE-3 (greedy or sampled)
    resident.py   the same round as tensor ops, one CUDA graph per round
    eagle3.py     proposers: EAGLE-3 chains and trees (+ FastDraft, its static cache and graphed steps);
    ngram.py,     prompt lookup; an independent draft model; the Proposer protocols and PerSequence
    independent.py, proposer.py
    verify.py     the verifier: EagerVerifier (transformers' cache) and plain decoding;
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

__all__ = ["generate", "speculative_generate"]  # the rest lives where it is defined: tree, verify, proposer, cache


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
    `compile_round` compiles the round's pure parts there); this host loop runs everything else."""
    if resident and eligible(fast, proposer, temperature):
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
    out = timed("target_s", runner.prefill, ids, pos, pad, max_new_tokens, n_rows)
    tokens = [list(p) + [pick(out.logits[b, -1], temperature, generator)] for b, p in enumerate(prompts)]
    new = [[t[-1]] for t in tokens]
    done = [len(n) >= max_new_tokens or n[-1] in eos_ids for n in new]
    start, end = pad.cpu(), torch.full((B,), P)  # host bookkeeping: no device reads per sequence
    if proposer is not None and not all(done):
        timed("draft_s", proposer.start, tokens,
              [rows_of(out, b, torch.arange(int(pad[b]), P, device=dev)) for b in range(B)])

    while not all(done):
        # Never draft past the token budget: the bonus token always fits.
        max_depth = [0 if done[b] else min(depth, max_new_tokens - len(new[b]) - 1) for b in range(B)]
        trees = [DraftTree() for _ in range(B)]
        if proposer is not None and any(max_depth):
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
            committed = [t.tokens[i] for i in path] + [bonus]
            emitted = committed[:first_eos(committed, eos_ids)]
            st = stats[b]
            st.rounds += 1
            st.drafted_per_round.append(len(t))
            st.accepted_per_round.append(len(path))
            st.emitted_per_round.append(len(emitted))
            tree_depth = max(t.depths(), default=0)
            for j in range(tree_depth):
                st.drafted[j] += 1
                st.reached[j] += int(j <= len(path))
                st.accepted[j] += int(j < len(path))
            tokens[b] += emitted
            new[b] += emitted
            done[b] = len(new[b]) >= max_new_tokens or emitted[-1] in eos_ids
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
        if proposer is not None and not all(done):
            # No sync: the drafter's feed runs on the GPU while the host starts the next round
            # (propose reads its tokens back, so its wait counts in draft_s too).
            timed("draft_s", proposer.commit, commits, outs, sync=False)

    wall = time.perf_counter() - t_start
    for st, n in zip(stats, new):
        st.tokens, st.target_s, st.draft_s, st.wall_s = len(n), clock["target_s"], clock["draft_s"], wall
    return new, stats


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
