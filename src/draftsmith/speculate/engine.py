"""Decoding, plain and speculative, with the target's own KV cache; batch >= 1, chain or tree.

    plain_generate         one target forward per token, batch 1 (the reference)
    plain_generate_batch   the same for a left-padded batch (HF 2D padding mask)
    generate               a proposer drafts a tree per sequence (a chain is a tree with one
                           child per node), ONE target forward verifies every tree of the batch
    speculative_generate   batch 1 wrapper: an Eagle3Drafter or any `Proposer`

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
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol, Sequence

import torch

from ..artifacts import DraftsmithError
from ..draft.model import DraftKVCache, Eagle3Drafter
from ..target.model import Target, TargetOutput
from .fast import FastTarget, additive, copy_columns, h2d


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


def _cache_tensors(cache: Any) -> list[tuple[Any, str]]:
    """(holder, attribute) of every key/value tensor [B, heads, S, d] of a cache."""
    if isinstance(cache, DraftKVCache) or getattr(cache, "static", False):
        return [(cache, "k"), (cache, "v")]
    layers = getattr(cache, "layers", None)
    if layers is None or any(getattr(layer, "sliding_window", None) for layer in layers):
        raise DraftsmithError(f"{type(cache).__name__}: speculative decoding needs a plain per-layer KV cache "
                              "(no sliding-window layers); this target's cache is not supported yet")
    return [(layer, name) for layer in layers for name in ("keys", "values")]


def move_rows(cache: Any, batch: list[int], src: list[int], dst: list[int], length: int) -> None:
    """Copy cache columns src -> dst of the given batch rows, then keep the first `length` columns
    (a static cache keeps its buffers: only its `length` changes)."""
    static = getattr(cache, "static", False)
    index: dict[torch.device, list[torch.Tensor]] = {}  # built once per device, not per tensor
    for holder, name in _cache_tensors(cache):
        t = getattr(holder, name)
        if t is None or t.numel() == 0:
            continue
        if batch:
            if t.device not in index:
                index[t.device] = list(h2d([batch, src, dst], t.device))
            copy_columns((t,), *index[t.device])
        if not static:
            setattr(holder, name, t[:, :, :length])
    if static:
        cache.length = length


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


def _tree_ancestry(trees: list[DraftTree], n: int) -> torch.Tensor:
    """anc [B, n, n] (host) over [root, *nodes, padding]: each real row sees the root, its ancestors and
    itself; padding rows see only themselves (a row seeing nothing would turn NaN)."""
    anc = torch.eye(n, dtype=torch.bool).repeat(len(trees), 1, 1)
    for b, t in enumerate(trees):
        for i, p in enumerate(t.parents):
            anc[b, i + 1] |= anc[b, p + 1]
    return anc


def _sample(probs: torch.Tensor, generator: Optional[torch.Generator]) -> int:
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
            return path, _sample(p, generator)
        path.append(nxt)
        row = nxt + 1


def _first_eos(tokens: list[int], eos_ids: Sequence[int]) -> int:
    """Number of tokens to keep: up to and including the first EOS."""
    for i, t in enumerate(tokens):
        if t in eos_ids:
            return i + 1
    return len(tokens)


def _pick(logits: torch.Tensor, temperature: float, generator: Optional[torch.Generator]) -> int:
    if temperature <= 0:
        return int(logits.argmax())
    return _sample(torch.softmax(logits.float() / temperature, -1), generator)


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


# ----------------------------------------------------------------------------- plain


@torch.inference_mode()
def plain_generate(target: Target, input_ids: Any, max_new_tokens: int, eos_ids: Sequence[int] = (),
                   temperature: float = 0.0, generator: Optional[torch.Generator] = None) -> list[int]:
    """Decoding at batch 1, one target forward per token. Returns the new tokens (EOS included)."""
    ids = _as_prompt(input_ids, target.device)
    out = target.forward(ids, use_cache=True)
    cache, new = out.past_key_values, []
    while True:
        tok = _pick(out.logits[0, -1], temperature, generator)
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
        step = [_pick(out.logits[b, -1], temperature, generator) for b in range(len(prompts))]
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


# ----------------------------------------------------------------------------- speculative


def verify_forward(target: Target, cache: Any, input_ids: torch.Tensor, position_ids: torch.Tensor,
                   mask: torch.Tensor) -> TargetOutput:
    """THE verify forward: [B, N] tokens over the cache with a bool mask [B, N, S + N]. The one
    place a compiled / CUDA-graph fast path would hook in."""
    return target.forward(input_ids, attention_mask=additive(mask, target.dtype), past_key_values=cache,
                          position_ids=position_ids, use_cache=True)


def prefill_mask(pad: torch.Tensor, P: int) -> torch.Tensor:
    """Bool [B, P, P]: causal over each left-padded prompt (padding rows see themselves)."""
    dev = pad.device
    causal = torch.ones(P, P, dtype=torch.bool, device=dev).tril()[None]
    return (causal & (torch.arange(P, device=dev)[None, None] >= pad[:, None, None])) | torch.eye(
        P, dtype=torch.bool, device=dev)[None]


class EagerVerifier:
    """The target over transformers' own (dynamic) KV cache: the eager path. Same interface as
    fast.FastTarget (prefill, verify, keep, past), which `generate` uses instead when given."""

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


def _rows(out: TargetOutput, b: int, rows: torch.Tensor) -> TargetOutput:
    return TargetOutput(logits=None if out.logits is None else out.logits[b:b + 1, rows],
                        aux_hidden=out.aux_hidden[b:b + 1, rows],
                        final_hidden=None if out.final_hidden is None else out.final_hidden[b:b + 1, rows])


@torch.inference_mode()
def generate(target: Target, proposer: Optional[BatchProposer], prompts: list[list[int]], max_new_tokens: int,
             depth: int = 5, eos_ids: Sequence[int] = (), temperature: float = 0.0,
             generator: Optional[torch.Generator] = None,
             fast: Optional[FastTarget] = None, resident: bool = False) -> tuple[list[list[int]], list[SpecStats]]:
    """Speculative decoding of a batch. Trees deeper than `depth` are cut. Greedy output equals
    plain greedy decoding; sampled output has the target's distribution. Returns per sequence
    the new tokens (EOS included) and its SpecStats (target_s/draft_s/wall_s are batch-wide).
    `fast` (a FastTarget) replaces the eager target forwards with static-cache / CUDA-graph
    ones; every verify then feeds the same number of rows (1 + the proposer's `max_nodes`).
    With `resident`, greedy EAGLE-3 on the fast path runs its rounds on the device (resident.py);
    this host loop runs everything else."""
    from .resident import eligible, resident_generate

    if resident and eligible(fast, proposer, temperature):
        return resident_generate(target, proposer, prompts, max_new_tokens, depth, eos_ids, fast)
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
            _sync(dev)
        clock[attr] += time.perf_counter() - t0
        return r

    ids, pad, pos = left_pad(prompts, dev)
    P = ids.shape[1]
    out = timed("target_s", runner.prefill, ids, pos, pad, max_new_tokens, n_rows)
    tokens = [list(p) + [_pick(out.logits[b, -1], temperature, generator)] for b, p in enumerate(prompts)]
    new = [[t[-1]] for t in tokens]
    done = [len(n) >= max_new_tokens or n[-1] in eos_ids for n in new]
    start, end = pad.cpu(), torch.full((B,), P)  # host bookkeeping: no device reads per sequence
    if proposer is not None and not all(done):
        timed("draft_s", proposer.start, tokens,
              [_rows(out, b, torch.arange(int(pad[b]), P, device=dev)) for b in range(B)])

    while not all(done):
        # Never draft past the token budget: the bonus token always fits.
        max_depth = [0 if done[b] else min(depth, max_new_tokens - len(new[b]) - 1) for b in range(B)]
        trees = [DraftTree() for _ in range(B)]
        if proposer is not None and any(max_depth):
            trees = timed("draft_s", proposer.propose, max_depth)
        trees = [_cut(t, d) for t, d in zip(trees, max_depth)]
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
                    _tree_ancestry(trees, N), n_rows)  # host tensors: the runner sends them without a sync

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
            emitted = committed[:_first_eos(committed, eos_ids)]
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
            outs.append(None if done[b] else _rows(out, b, h2d(rows, dev)))
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


def _cut(tree: DraftTree, max_depth: int) -> DraftTree:
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


@torch.inference_mode()
def speculative_generate(target: Target, drafter: Eagle3Drafter | Proposer, input_ids: Any,
                         max_new_tokens: int, draft_steps: int = 5, eos_ids: Sequence[int] = (),
                         temperature: float = 0.0, generator: Optional[torch.Generator] = None,
                         tree: Optional[tuple[int, int]] = None) -> tuple[list[int], SpecStats]:
    """Speculative decoding at batch 1; greedy output equals `plain_generate` token for token.

    `drafter` is an Eagle3Drafter (chain of `draft_steps`, or an EAGLE-2 tree when
    tree=(topk, budget)) or any Proposer."""
    from .eagle3 import Eagle3Proposer

    if isinstance(drafter, Eagle3Drafter):
        topk, budget = tree or (1, draft_steps)
        proposer = Eagle3Proposer(drafter, topk=topk, budget=budget, temperature=temperature, generator=generator)
    else:
        proposer = PerSequence([drafter])
    new, stats = generate(target, proposer, [list(_as_prompt(input_ids, "cpu")[0].tolist())], max_new_tokens,
                          draft_steps, eos_ids, temperature, generator)
    return new[0], stats[0]
