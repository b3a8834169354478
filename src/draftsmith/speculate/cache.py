"""KV-cache and device helpers: the bottom layer of speculate/ with tree.py (it imports no other file of it).

    h2d                    a host value on the device without a stream sync
    additive               bool mask -> HF's additive 4D float mask
    copy_columns           KV columns src -> dst of given batch rows (graph-safe)
    crop_cache, move_rows  keep/move columns of a transformers cache, a drafter cache or a static one
    capture, Graphed       CUDA-graph capture of a function, and replay per input shape
    CAPTURE_FALLBACKS      every capture that failed in this process (its call then runs eagerly)
    CAPTURES               how many graphs this process captured (a timed run that moved it paid for one)
    StaticDraftCache       the drafter's preallocated KV cache (graphed drafting steps write into it)
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from ..messages import DraftsmithError, log
from ..draft.model import DraftKVCache


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def h2d(x: Any, device: torch.device, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """A host value (tensor, list or number) on `device` without a stream sync: a blocking
    host-to-device copy waits for every kernel queued before it, so the host could never run
    ahead of the GPU. From pageable memory the data is staged before the call returns, so the
    host tensor may be freed at once."""
    t = torch.as_tensor(x, dtype=dtype)
    return t.to(device, non_blocking=True) if torch.device(device).type == "cuda" else t.to(device)


def additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool [B, N, S] -> HF 4D additive float mask [B, 1, N, S] (works for eager and sdpa)."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)[:, None]


CAPTURES = [0]
"""CUDA graphs captured in this process (capture's calls): evaluate measures a run again when it moved."""


def capture(fn: Callable, args: Sequence[torch.Tensor] = (), state: Optional[dict[str, torch.Tensor]] = None,
            generators: Sequence[torch.Generator] = ()):
    """Run fn(*args) once for real on a side stream (lazy allocations, kernel selection,
    compilation), then capture one call into a CUDA graph. `state`: tensors fn advances in place
    (a decoding step's counters); the warm-up's changes to them are undone, also when it fails.
    `generators`: CUDA generators fn draws from besides the default one (registered with the graph,
    so that every replay draws afresh). Returns (graph, the captured call's outputs); replay the
    graph to compute."""
    CAPTURES[0] += 1
    saved = {k: v.clone() for k, v in (state or {}).items()}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(side):
            fn(*args)
    finally:
        torch.cuda.current_stream().wait_stream(side)
        for k, v in saved.items():
            state[k].copy_(v)
    graph = torch.cuda.CUDAGraph()
    for g in generators:
        graph.register_generator_state(g)
    with torch.cuda.graph(graph):
        out = fn(*args)
    return graph, out


def seeded_generator(device, temperature: float, seed: int, salt: int) -> Optional[torch.Generator]:
    """A sampling run's generator, seeded by (seed, salt), e.g. evaluate's prompt or regenerate's chunk;
    None when greedy (temperature <= 0)."""
    if temperature <= 0:
        return None
    return torch.Generator(device=device).manual_seed(seed * 1_000_003 + salt)


def reseed(own: torch.Generator, source: Optional[torch.Generator]) -> None:
    """Seed `own` from one draw of `source` (torch's default generator when None). A CUDA graph holds the
    generator it registered at capture, so a caller's new generator per run could never reach it: a
    graphed loop draws from its own, seeded per run from the caller's -- after any capture of that run,
    whose warm-up draws too, so that a run that captured draws what one that did not."""
    own.manual_seed(int(torch.randint(1 << 62, (1,), generator=source, device=source.device if source is not None else "cpu")))


def copy_columns(tensors: Sequence[torch.Tensor], b, src, dst) -> None:
    """KV-cache columns src -> dst of batch rows b (index tensors of one length), in every [..., B,
    heads, S, d] tensor (leading dims: layers stacked into one tensor move in one gather and one
    scatter); all sources are read before any is written. Graph-safe with device indices."""
    for t in tensors:
        t[..., b, :, dst, :] = t[..., b, :, src, :]


CAPTURE_FALLBACKS: list[str] = []
"""One line per CUDA-graph capture that failed in this process, whose call then runs eagerly
(capture_failed). Production goes on with a log line; the tests fail on any entry (tests/conftest.py)
and the benchmarks write the list into their JSON, so a run that silently went eager shows."""


def capture_failed(what: str, e: Exception, then: str) -> None:
    """Record and log that capturing `what` raised `e`; the caller runs it eagerly (`then` says how)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    why = (str(e).splitlines() or [""])[0][:160]
    CAPTURE_FALLBACKS.append(f"{what}: {type(e).__name__}: {why}")
    log(f"[fast] CUDA graph capture of {what} failed ({type(e).__name__}: {why}); {then}")


class Graphed:
    """Call fn(*tensors) -> tensors, through a CUDA graph captured on the first call per input
    shape (inputs are copied into the graph's static buffers, outputs are the graph's own and
    are overwritten by the next call of that shape). fn must be idempotent for equal inputs: the
    capture runs it once for real first. Calls whose row count (dim 1 of the first input)
    exceeds `max_rows`, and every call when disabled, run fn eagerly."""

    def __init__(self, fn: Callable, enabled: bool, max_rows: int = 1 << 30):
        self.fn, self.enabled, self.max_rows = fn, enabled, max_rows
        self.graphs: dict[tuple, tuple] = {}

    def key(self, xs: Sequence[torch.Tensor]) -> tuple:
        return tuple((tuple(x.shape), x.dtype) for x in xs)

    def captured(self, *xs: torch.Tensor) -> bool:
        """Whether a call of these shapes replays (or runs eagerly) without a capture first."""
        return not self.enabled or self.key(xs) in self.graphs

    def __call__(self, *xs: torch.Tensor):
        if not self.enabled or (xs[0].dim() > 1 and xs[0].shape[1] > self.max_rows):
            return self.fn(*xs)
        key = self.key(xs)
        entry = self.graphs.get(key, False)
        if entry is False:
            try:
                return self._capture(key, xs)
            except Exception as e:  # fn cannot be captured: run it eagerly from now on (a real error recurs there)
                capture_failed(f"{getattr(self.fn, '__qualname__', self.fn)} on inputs {[tuple(x.shape) for x in xs]}",
                               e, "that call runs eagerly")
                self.graphs[key] = None
                return self.fn(*xs)
        if entry is None:  # capture failed before
            return self.fn(*xs)
        static_in, graph, out = entry
        for s, x in zip(static_in, xs):
            s.copy_(x, non_blocking=True)
        graph.replay()
        return out

    def _capture(self, key: tuple, xs: Sequence[torch.Tensor]):
        static_in = [x.clone() for x in xs]
        graph, out = capture(self.fn, static_in)
        graph.replay()
        self.graphs[key] = (static_in, graph, out)
        return out



# ----------------------------------------------------------------------------- caches


def crop_cache(cache: Any, length: int) -> None:
    """Keep the first `length` positions of a transformers cache. A negative argument means
    'remove this many' in every transformers 5 release (positive changed meaning in 5.17)."""
    remove = cache.get_seq_length() - length
    if remove > 0:
        cache.crop(-remove)


def cache_tensors(cache: Any) -> list[tuple[Any, str]]:
    """(holder, attribute) of every key/value tensor [..., B, heads, S, d] of a cache."""
    if isinstance(cache, StaticDraftCache):
        return [(cache, "kv")]
    if isinstance(cache, DraftKVCache):
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
    for holder, name in cache_tensors(cache):
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


class StaticDraftCache:
    """The drafter's KV cache, preallocated [B, nkv, S, hd]; `append` writes the new rows at
    column `write_at` (a device scalar, so a graph can replay it) and returns the whole buffers;
    the caller's mask hides the columns it must not see. `length` is the host's bookkeeping.
    `rope` (draft.rope.rope_table, or None) is the rotation of positions 0..S-1: a row's position is
    at most its column, so the drafter looks its rows up there. `cols` = arange(S), made once: the
    columns a write offsets from and a device mask is built over."""

    static = True

    def __init__(self, batch_size: int, max_len: int, num_kv_heads: int, head_dim: int, dtype, device,
                 rope: Optional[torch.Tensor] = None):
        self.kv = torch.zeros((2, batch_size, num_kv_heads, max_len, head_dim), dtype=dtype, device=device)
        self.rope = rope
        self.k, self.v = self.kv[0], self.kv[1]  # views of one buffer: a column move is one copy of both
        self.write_at = torch.zeros((), dtype=torch.long, device=device)
        self.cols = torch.arange(max_len, device=device)
        self.length = 0

    @property
    def size(self) -> int:
        return self.k.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor):
        idx = self.write_at + self.cols[:k.shape[2]]
        self.k.index_copy_(2, idx, k)
        self.v.index_copy_(2, idx, v)
        return self.k, self.v

    def crop(self, n: int) -> None:
        self.length = n
