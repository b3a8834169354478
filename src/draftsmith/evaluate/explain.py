"""Why a turn's acceptance is what it is: the engine's rounds beside the drafter's teacher-forced predictions.

For a turn evaluate measured (its prompt and the target's plain answer, x = prompt + answer), the
target runs once over x for its aux states and the drafter's training path (Eagle3Drafter.ttt_step
unrolled k steps, as train/ttt.py does) predicts every position at every draft depth. A greedy chain
round rooted at x[c] (the last committed token) reads row c - 1 of step i, fed x[c + i], and accepts
the run of steps whose argmax is x[c + 1 + i], capped by the round's drafts.

In float32 these predictions are the engine's accepted counts round by round, on every decoding path
(tests/test_consistency.py), and a tree round never accepts less than its chain's prediction (the
chain is always in the tree). In bfloat16 a greedy speculative answer may leave the plain one at a
near-tie (the verify forward's rounding differs from one row's; evaluate records the first new token
where they differ): rounds from there on decode other tokens than x, so they are left unchecked, and
that turn's engine tau measures another answer. Up to its divergence a round that differs from its
prediction is the decoding path's doing; a turn whose teacher-forced tau is itself low is the
drafter's own blind spot. `benchmarks/explain_turns.py` runs this on a finished evaluate stage.
"""
from __future__ import annotations

from typing import Sequence

import torch


@torch.inference_mode()
def teacher_forced(target, drafter, x: list[int], k: int) -> list[torch.Tensor]:
    """The drafter's training path over the whole sequence x: [k] hidden states [n, H], step i's
    row t fed x[t + 1 + i] (zeros past the end)."""
    dev, n = target.device, len(x)
    ids = torch.tensor([x + [0] * (k + 1)], device=dev)
    hidden, cache, out = drafter.project(target.forward(ids[:, :n]).aux_hidden), [], []
    for i in range(k):
        hidden = drafter.ttt_step(ids[:, 1 + i:1 + i + n], hidden, torch.arange(n, device=dev)[None] + i, cache,
                                  attention="reference")
        out.append(hidden[0])
    return out


@torch.inference_mode()
def predictions(target, drafter, x: list[int], k: int) -> list[list[int]]:
    """[k][n] target-vocab ids: preds[i][t] is the drafter's argmax at draft step i on row t, its guess for x[t + 2 + i]."""
    return [drafter.draft_to_target(drafter.logits(h).argmax(-1)).tolist() for h in teacher_forced(target, drafter, x, k)]


def accepted_at(preds: list[list[int]], x: list[int], root: int, drafts: int) -> int:
    """Drafts a greedy chain round rooted at x[root] accepts: the run of steps i < drafts with
    preds[i][root - 1] == x[root + 1 + i], and short of x's last token (the round's own token ends it)."""
    run, cap = 0, min(drafts, len(x) - 2 - root)
    while run < cap and preds[run][root - 1] == x[root + 1 + run]:
        run += 1
    return run


def engine_roots(prompt_len: int, accepted: Sequence[int]) -> list[int]:
    """Each round's root index in x: the first round's is the token prefill gave (x[prompt_len]); a
    round emits its accepted drafts and the target's own token."""
    roots, c = [], prompt_len
    for a in accepted:
        roots.append(c)
        c += a + 1
    return roots


def chain_tau(preds: list[list[int]], x: list[int], prompt_len: int, depth: int) -> tuple[float, int]:
    """(tau, rounds) of a greedy chain of `depth` drafts decoding x's answer from its teacher-forced
    predictions alone: rounds from the first root until the answer's last token is emitted."""
    c, rounds, emitted = prompt_len, 0, 0
    while c < len(x) - 1:
        a = accepted_at(preds, x, c, min(depth, len(preds)))
        rounds, emitted, c = rounds + 1, emitted + a + 1, c + a + 1
    return (emitted / rounds if rounds else float("nan")), rounds


def explain_turn(preds: list[list[int]], x: list[int], prompt_len: int, methods: dict, depth: int) -> dict:
    """One turn: the chain's teacher-forced tau beside each EAGLE-3 method's engine tau, and its
    rounds checked against the predictions (`check`: a chain's accepted count equal to them, a tree's
    not below them; `bad_rounds` break it). A method whose answer left x's at new token f
    (`diverged_at`, evaluate's first_difference) has only the rounds that emitted tokens before it
    checked (`checked_rounds`)."""
    tau_tf, rounds_tf = chain_tau(preds, x, prompt_len, depth)
    row = {"new_tokens": len(x) - prompt_len, "tau_teacher_forced": tau_tf, "rounds_teacher_forced": rounds_tf}
    for m, r in methods.items():
        if not m.startswith("eagle3") or "accepted_per_round" not in r:
            continue
        accepted, drafted, f = r["accepted_per_round"], r["drafted_per_round"], r.get("first_difference")
        roots = engine_roots(prompt_len, accepted)
        checked = [j for j, (c, a) in enumerate(zip(roots, accepted)) if f is None or c + a + 1 < prompt_len + f]
        chain = m == "eagle3_chain"
        want = {j: accepted_at(preds, x, roots[j], min(drafted[j], len(preds))) for j in checked}
        bad = [j for j, w in want.items() if (accepted[j] != w if chain else accepted[j] < w)]
        row[m] = {"tau": r["emitted"] / r["rounds"] if r["rounds"] else None, "rounds": len(accepted),
                  "diverged_at": f, "checked_rounds": len(checked), "check": "equal" if chain else "not below",
                  "bad_rounds": len(bad), "first_bad_round": bad[0] if bad else None}
    return row
