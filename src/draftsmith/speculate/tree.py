"""Draft trees, masks and acceptance: the bottom layer of speculate/ (it imports no other file of it).

    DraftTree              draft tokens continuing one sequence, each node below a parent (a chain: one child each)
    SpecStats              per-sequence accounting of a generation (rounds, drafted/accepted/emitted per round)
    tree_ancestry          [B, n, n] host bool: each verify row sees the root, its ancestors and itself
    tree_mask              host-side bool mask over [committed columns, new rows] (engine, eager drafter)
    committed_columns, device_tree_mask   the same from device values only (graph-safe: static caches, resident rounds)
    prefill_mask           causal over left-padded prompts
    accept_greedy          follow the target's argmax down a tree
    accept_sampled         speculative rejection sampling down a tree
    cut_tree, first_eos, left_pad, pick, pick_on_device, as_prompt   small helpers of the loops
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch


@dataclass
class SpecStats:
    rounds: int = 0                       # target verification forwards (prefill not counted)
    tokens: int = 0                       # tokens emitted, including the prefill token
    drafted_per_round: list[int] = field(default_factory=list)   # tree nodes (chain: drafts)
    accepted_per_round: list[int] = field(default_factory=list)
    emitted_per_round: list[int] = field(default_factory=list)
    drafted: list[int] = field(default_factory=list)   # [k] rounds whose drafts reached depth j+1
    reached: list[int] = field(default_factory=list)   # [k] ... and depths 1..j were all accepted
    accepted: list[int] = field(default_factory=list)  # [k] ... and depth j+1 was accepted too
    target_s: Optional[float] = 0.0       # batch-wide times (shared by every sequence of a batch);
    draft_s: Optional[float] = 0.0        # None on resident rounds (one graph does both)
    wall_s: float = 0.0

    @property
    def tau(self) -> Optional[float]:
        return sum(self.emitted_per_round) / self.rounds if self.rounds else None

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["tau"] = self.tau
        return d


@dataclass
class DraftTree:
    """Draft tokens (target ids) continuing one sequence. Node i hangs below `parents[i]`
    (-1 = the root, i.e. the last committed token); parents come before their children.
    `q[i]` is the draft distribution [V] node i was *sampled* from, or None when it was chosen
    deterministically (greedy, top-k, n-gram); siblings with a q must be i.i.d. samples of it."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    q: Optional[list[Optional[torch.Tensor]]] = None

    @classmethod
    def chain(cls, tokens: list[int], q: Optional[list[Optional[torch.Tensor]]] = None) -> "DraftTree":
        return cls(list(tokens), list(range(-1, len(tokens) - 1)), q)

    def __len__(self) -> int:
        return len(self.tokens)

    def depths(self) -> list[int]:
        d: list[int] = []
        for p in self.parents:
            d.append(1 if p < 0 else d[p] + 1)
        return d


def cut_tree(tree: DraftTree, max_depth: int) -> DraftTree:
    """Drop nodes deeper than max_depth (proposers may overshoot; the token budget must hold)."""
    if not len(tree):
        return tree
    keep, remap = [], {}
    for i, (d, p) in enumerate(zip(tree.depths(), tree.parents)):
        if d <= max_depth and (p < 0 or p in remap):
            remap[i] = len(keep)
            keep.append(i)
    if len(keep) == len(tree):
        return tree
    return DraftTree([tree.tokens[i] for i in keep], [remap.get(tree.parents[i], -1) for i in keep],
                     None if tree.q is None else [tree.q[i] for i in keep])


# ----------------------------------------------------------------------------- masks


def tree_ancestry(trees: list[DraftTree], n: int) -> torch.Tensor:
    """anc [B, n, n] (host) over [root, *nodes, padding]: each real row sees the root, its ancestors and
    itself; padding rows see only themselves (a row seeing nothing would turn NaN)."""
    anc = torch.eye(n, dtype=torch.bool).repeat(len(trees), 1, 1)
    for b, t in enumerate(trees):
        for i, p in enumerate(t.parents):
            anc[b, i + 1] |= anc[b, p + 1]
    return anc


def tree_mask(start: torch.Tensor, end: torch.Tensor, past: int, anc: torch.Tensor,
              width: Optional[int] = None) -> torch.Tensor:
    """Bool mask [B, N, past + M] (True = attend), anc [B, N, M]: row i of sequence b sees b's
    committed columns [start_b, end_b) and the new columns past + j with anc[b, i, j] (its
    ancestors and itself). `width` pads the mask with unseen columns (a static cache's size)."""
    cols = torch.arange(past, device=anc.device)
    committed = (cols >= start[:, None]) & (cols < end[:, None])
    parts = [committed[:, None, :].expand(-1, anc.shape[1], -1), anc]
    if width is not None and width > past + anc.shape[-1]:
        parts.append(anc.new_zeros(anc.shape[0], anc.shape[1], width - past - anc.shape[-1]))
    return torch.cat(parts, dim=-1)


def committed_columns(cols: torch.Tensor, start: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
    """Bool [B, S]: the committed columns [start_b, end_b) of each sequence among a static cache's
    columns `cols` (arange(S)); device_tree_mask's first input, made once for the steps that share it."""
    return (cols >= start[:, None]) & (cols < end[:, None])


def device_tree_mask(committed: torch.Tensor, past: torch.Tensor, anc: torch.Tensor) -> torch.Tensor:
    """tree_mask built on the device from device values only (graph-safe): bool [B, N, S], the
    committed columns (committed_columns) and the new ones at past + j where anc says; `past` is a
    0-d tensor."""
    B, N, M = anc.shape
    mask = committed[:, None, :].expand(B, N, committed.shape[1]).clone()
    mask.index_copy_(2, past + torch.arange(M, device=anc.device), anc)
    return mask


def prefill_mask(pad: torch.Tensor, P: int) -> torch.Tensor:
    """Bool [B, P, P]: causal over each left-padded prompt (padding rows see themselves)."""
    dev = pad.device
    causal = torch.ones(P, P, dtype=torch.bool, device=dev).tril()[None]
    return (causal & (torch.arange(P, device=dev)[None, None] >= pad[:, None, None])) | torch.eye(
        P, dtype=torch.bool, device=dev)[None]


# ----------------------------------------------------------------------------- acceptance and picking


def sample(probs: torch.Tensor, generator: Optional[torch.Generator]) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def accept_greedy(tree: DraftTree, greedy: list[int]) -> tuple[list[int], int]:
    """Follow the target's argmax (greedy[r] = argmax after row r; row 0 = root, row i+1 = node i)
    down the tree. Returns (accepted node indices, bonus token)."""
    children = [[] for _ in range(len(tree) + 1)]
    for i, p in enumerate(tree.parents):
        children[p + 1].append(i)
    path, row = [], 0
    while True:
        nxt = next((c for c in children[row] if tree.tokens[c] == greedy[row]), None)
        if nxt is None:
            return path, greedy[row]
        path.append(nxt)
        row = nxt + 1


def accept_sampled(tree: DraftTree, probs: torch.Tensor, generator: Optional[torch.Generator] = None,
                   uniform=None) -> tuple[list[int], int]:
    """Speculative rejection sampling down a tree; probs [rows, V] are the target's distributions
    (row 0 = root). At a node, children are tried in order against the residual p:
        sampled child x ~ q:   accept with min(1, p(x)/q(x)); on reject p <- norm(max(p - q, 0))
        chosen child x:        accept with p(x) (q is a point mass);  on reject p <- norm(p with x removed)
    and when none is accepted the bonus token is drawn from the residual. Each emitted token then
    has exactly the target's distribution (Leviathan et al. 2023; SpecInfer's multi-candidate form)."""
    uniform = uniform or (lambda: float(torch.rand((), generator=generator, device=probs.device)))
    children = [[] for _ in range(len(tree) + 1)]
    for i, p in enumerate(tree.parents):
        children[p + 1].append(i)
    path, row = [], 0
    while True:
        p = probs[row].float()
        nxt = None
        for c in children[row]:
            x = tree.tokens[c]
            q = tree.q[c] if tree.q is not None else None
            if q is None:
                if uniform() < float(p[x]):
                    nxt = c
                    break
                p = p.clone()
                p[x] = 0
            else:
                q = q.to(p.device, torch.float32)
                if uniform() * float(q[x]) < float(p[x]):
                    nxt = c
                    break
                p = (p - q).clamp_min(0)
            s = p.sum()
            if s <= 0:  # numerically empty residual: only possible if p was (almost) all on x
                p = probs[row].float()
                break
            p = p / s
        if nxt is None:
            return path, sample(p, generator)
        path.append(nxt)
        row = nxt + 1


def first_eos(tokens: list[int], eos_ids: Sequence[int]) -> int:
    """Number of tokens to keep: up to and including the first EOS."""
    for i, t in enumerate(tokens):
        if t in eos_ids:
            return i + 1
    return len(tokens)


def pick(logits: torch.Tensor, temperature: float, generator: Optional[torch.Generator]) -> int:
    """The next token on the host: argmax, or a sample of softmax(logits / T)."""
    if temperature <= 0:
        return int(logits.argmax())
    return sample(torch.softmax(logits.float() / temperature, -1), generator)


def sample_race(logits: torch.Tensor, temperature: float, e: torch.Tensor) -> torch.Tensor:
    """[..., V] -> [...]: one draw per row from softmax(logits / temperature) by the exponential race,
    argmax p / e with e ~ Exp(1) of logits' shape: no host sync, and e comes in, so that a compiled
    or graphed caller draws it where it likes."""
    return (torch.softmax(logits.float() / temperature, -1) / e).argmax(-1)


def pick_on_device(logits: torch.Tensor, temperature: float, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """[..., V] -> [...] next tokens without leaving the GPU: argmax, or a draw from softmax(l / T)
    (sample_race, e from `generator`)."""
    if temperature <= 0:
        return logits.argmax(-1)
    return sample_race(logits, temperature, torch.empty(logits.shape, device=logits.device).exponential_(generator=generator))


def as_prompt(input_ids: Any, device: torch.device) -> torch.Tensor:
    ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(1, -1).to(device)
    if ids.shape[1] == 0:
        raise ValueError("empty prompt: give at least one input token")
    return ids


def left_pad(prompts: list[list[int]], device, pad_id: int = 0):
    """ids [B, P] left-padded, pad [B] (number of pad columns), position_ids [B, P]."""
    P = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), P), pad_id, dtype=torch.long)
    for b, p in enumerate(prompts):
        if not p:
            raise ValueError("empty prompt: give at least one input token")
        ids[b, P - len(p):] = torch.as_tensor(p, dtype=torch.long)
    pad = torch.tensor([P - len(p) for p in prompts])
    pos = (torch.arange(P)[None] - pad[:, None]).clamp_min(0)
    return ids.to(device), pad.to(device), pos.to(device)
