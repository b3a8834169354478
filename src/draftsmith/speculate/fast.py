"""Fast paths: static KV caches and CUDA graphs around the target's and the drafter's forwards.

Eager transformers decoding on a GPU is bound by the CPU (Python and kernel launches), not by
memory bandwidth, so it flatters any drafter. The cure is the one serving engines use: every
tensor keeps its address (a static KV cache of `max_len` columns, inputs copied into static
buffers) and each forward is replayed as one CUDA graph.

    FastTarget        the target over a transformers StaticCache. `verify` runs [B, N] rows under
                      the engine's tree mask (one graph per N), `keep` moves the accepted rows
                      (one graph), `plain` is the whole plain decoding loop with the next token fed
                      back on the GPU (one graph; the host looks at the tokens every few steps).
    StaticDraftCache  the drafter's KV cache, preallocated (Eagle3Proposer graphs its steps).
    Graphed           fn(*tensors) replayed through one CUDA graph per input shape.

Modes (`evaluate.fast`): off = eager, transformers' DynamicCache; static = static caches without
graphs (what a CPU runs; the tests); graphs = static + CUDA graphs; compile = graphs around a
torch.compile'd target forward. Column bookkeeping is the engine's: sequence b owns the columns
[start_b, end_b); a forward writes its N rows at [past, past + N) with past = max_b end_b, and
the mask hides every other column, so the cache is never cropped or re-allocated.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from ..artifacts import DraftsmithError, log
from ..target.model import Target, TargetOutput

MODES = ("off", "static", "graphs", "compile")


def resolve_mode(mode: str, device: torch.device, key: str = "evaluate.fast") -> str:
    """auto -> graphs on CUDA, off elsewhere; graphs/compile on a CPU is a config error. `key`
    names the recipe field in messages."""
    if mode == "auto":
        return "graphs" if device.type == "cuda" else "off"
    if mode not in MODES:
        raise DraftsmithError(f"{key} {mode!r}: unknown; use one of auto, {', '.join(MODES)}")
    if mode in ("graphs", "compile") and device.type != "cuda":
        raise DraftsmithError(f"{key} {mode!r} needs a CUDA device (the target is on {device}); "
                              f"use {key}: static or auto on a CPU")
    return mode


def choose_mode(requested: str, target: Target, key: str = "evaluate.fast") -> str:
    """resolve_mode for this target: CUDA graphs need the target on one device, so `auto` on a
    target spread over several GPUs (target.device_map) becomes static; an explicit graphs/compile errs."""
    mode = resolve_mode(requested, target.device, key)
    n_devices = len({p.device for p in target.model.parameters()})
    if mode in ("graphs", "compile") and n_devices > 1:
        if requested != "auto":
            raise DraftsmithError(f"{key} {requested!r}: the target is spread over {n_devices} devices "
                                  f"(target.device_map) and CUDA graphs need one; use {key}: static or off")
        log(f"[{key.split('.')[0]}] fast path: the target spans several GPUs; static caches without CUDA graphs")
        mode = "static"
    return mode


def fast_target_or_none(target: Target, mode: str, requested: str, key: str, fallback: str,
                        **kw) -> Optional["FastTarget"]:
    """FastTarget(target, mode, **kw); where the target cannot run it (e.g. sliding-window layers)
    an explicit `requested` mode errs and `auto` gets None, logged with `fallback` (what runs instead)."""
    try:
        return FastTarget(target, mode, key=key, **kw)
    except DraftsmithError as e:
        if requested != "auto":
            raise
        log(f"[{key.split('.')[0]}] fast path unavailable ({e}); {fallback}")
        return None


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


def pick_on_device(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """[B, V] -> [B] next tokens without leaving the GPU: argmax, or a sample from softmax(l / T)
    by the exponential race (argmax p / E, E ~ Exp(1)), which needs no host sync."""
    if temperature <= 0:
        return logits.argmax(-1)
    p = torch.softmax(logits.float() / temperature, -1)
    return (p / torch.empty_like(p).exponential_()).argmax(-1)


def capture(fn: Callable, args: Sequence[torch.Tensor] = (), state: Optional[dict[str, torch.Tensor]] = None):
    """Run fn(*args) once for real on a side stream (lazy allocations, kernel selection,
    compilation), then capture one call into a CUDA graph. `state`: tensors fn advances in place
    (a decoding step's counters); the warm-up's changes to them are undone, also when it fails.
    Returns (graph, the captured call's outputs); replay the graph to compute."""
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
    with torch.cuda.graph(graph):
        out = fn(*args)
    return graph, out


def copy_columns(tensors: Sequence[torch.Tensor], b, src, dst) -> None:
    """KV-cache columns src -> dst of batch rows b (index tensors of one length), in every [B, heads,
    S, d] tensor; all sources are read before any is written. Graph-safe with device indices."""
    for t in tensors:
        t[b, :, dst] = t[b, :, src]


def device_tree_mask(cols: torch.Tensor, start: torch.Tensor, end: torch.Tensor, past: torch.Tensor,
                     anc: torch.Tensor) -> torch.Tensor:
    """engine.tree_mask built on the device from device values only (graph-safe): bool [B, N, S]
    over a static cache's columns `cols` (arange(S)); `past` is a 0-d tensor."""
    B, N, M = anc.shape
    committed = (cols >= start[:, None]) & (cols < end[:, None])
    mask = committed[:, None, :].expand(B, N, cols.shape[0]).clone()
    mask.index_copy_(2, past + torch.arange(M, device=anc.device), anc)
    return mask


class Graphed:
    """Call fn(*tensors) -> tensors, through a CUDA graph captured on the first call per input
    shape (inputs are copied into the graph's static buffers, outputs are the graph's own and
    are overwritten by the next call of that shape). fn must be idempotent for equal inputs: the
    capture runs it once for real first. Calls whose row count (dim 1 of the first input)
    exceeds `max_rows`, and every call when disabled, run fn eagerly."""

    def __init__(self, fn: Callable, enabled: bool, max_rows: int = 1 << 30):
        self.fn, self.enabled, self.max_rows = fn, enabled, max_rows
        self.graphs: dict[tuple, tuple] = {}

    def __call__(self, *xs: torch.Tensor):
        if not self.enabled or (xs[0].dim() > 1 and xs[0].shape[1] > self.max_rows):
            return self.fn(*xs)
        key = tuple((tuple(x.shape), x.dtype) for x in xs)
        entry = self.graphs.get(key, False)
        if entry is False:
            try:
                return self._capture(key, xs)
            except Exception as e:  # fn cannot be captured: run it eagerly from now on (a real error recurs there)
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                log(f"[fast] CUDA graph capture of {getattr(self.fn, '__qualname__', self.fn)} failed "
                    f"({str(e).splitlines()[0][:160]}); that call runs eagerly")
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


# ----------------------------------------------------------------------------- target


def graph_safe_experts(model: torch.nn.Module) -> bool:
    """MoE targets: CUDA graphs need an expert kernel without host syncs. transformers' eager
    experts loop over the experts that got tokens, and grouped_mm outside bf16 takes a fallback,
    both syncing the host; such a target is switched to grouped_mm (bf16) or batched_mm. False
    (and a log line) when none can be set: the run uses static caches without graphs."""
    impl = getattr(model.config, "_experts_implementation", None)
    can_set = getattr(model, "_can_set_experts_implementation", lambda: False)
    if impl not in ("eager", "grouped_mm") or not can_set():
        return True
    # torch's grouped_mm kernel is bf16; other dtypes take a fallback that syncs the host
    bf16 = next(model.parameters()).dtype == torch.bfloat16
    if impl == "grouped_mm" and bf16:
        return True
    for cand in (("grouped_mm", "batched_mm") if bf16 else ("batched_mm",)):
        try:
            model.set_experts_implementation(cand)
            log(f"[fast] MoE experts: {impl} -> {cand} (CUDA graphs need an expert kernel without host syncs)")
            return True
        except (ValueError, ImportError, RuntimeError):
            continue
    log("[fast] MoE experts: no graph-safe expert kernel in this transformers; static caches without CUDA graphs")
    return False


def compile_regions(model: torch.nn.Module) -> int:
    """torch.compile the model's pure regions in place: every *RMSNorm and dense *MLP module and
    the attention's rotary function (the many small kernels of a decode step; fused, they leave the
    weight-reading matmuls). The KV-cache writes, the MoE routing and the hooks stay eager, so
    nothing that mutates state is traced. Affects every later forward of this model in this
    process. Returns the number of compiled modules (0 the second time)."""
    import sys

    if getattr(model, "_draftsmith_compiled", False):
        return 0
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    n, patched = 0, set()
    for m in model.modules():
        cls = type(m).__name__
        if cls.endswith(("RMSNorm", "MLP")):
            m.forward = torch.compile(m.forward)
            n += 1
        mod = sys.modules.get(type(m).__module__)
        if "Attention" in cls and mod is not None and hasattr(mod, "apply_rotary_pos_emb") and mod not in patched:
            mod.apply_rotary_pos_emb = torch.compile(mod.apply_rotary_pos_emb)
            patched.add(mod)
    model._draftsmith_compiled = True
    return n


class FastTarget:
    """The target over a static KV cache, optionally CUDA-graphed. Same interface as the
    engine's EagerVerifier: prefill, verify, keep, past."""

    def __init__(self, target: Target, mode: str = "graphs", batch_size: int = 1, max_len: int = 2048,
                 key: str = "evaluate.fast"):
        if mode not in MODES[1:]:
            raise ValueError(f"FastTarget mode {mode!r}: one of {MODES[1:]}")
        self.target, self.mode, self.device, self.key = target, mode, target.device, key  # key: the recipe field, for messages
        self.graphs = mode in ("graphs", "compile") and graph_safe_experts(target.model)
        self.fn = self._forward
        if mode == "compile":
            compile_regions(target.model)
        self.B = self.S = 0
        self.reallocations = 0
        self.ensure(batch_size, max_len)

    # -- allocation ---------------------------------------------------------------------

    def ensure(self, batch_size: int, needed: int) -> None:
        """A cache of batch_size rows and at least `needed` columns (+1 spare); new graphs if it grows."""
        if batch_size == self.B and needed < self.S:
            return
        from transformers import StaticCache

        S = max(needed + 1, self.S if batch_size == self.B else 0)
        S = -(-S // 256) * 256
        self.cache = StaticCache(config=self.target.model.config, max_cache_len=S)
        for layer in self.cache.layers:
            if getattr(layer, "is_sliding", False) or not hasattr(layer, "cumulative_length"):
                raise DraftsmithError(f"{type(self.target.model).__name__}: the fast path needs a plain static KV cache "
                                      f"(transformers >= 5 StaticLayer, no sliding-window layers); set {self.key}: off")
        self.B, self.S = batch_size, S
        self.reallocations += 1
        self.cols = torch.arange(S, device=self.device)
        self.verify_g = Graphed(self._verify, self.graphs)
        self.keep_g = Graphed(self._keep, self.graphs)
        self.plain_graph = None
        self.past = 0

    # -- the forwards -------------------------------------------------------------------

    def _forward(self, ids, pos, past, mask):
        """ids/pos [B, N], past a 0-d tensor (where the N rows are written), mask bool [B, N, S]."""
        for layer in self.cache.layers:
            layer.cumulative_length.copy_(past)
        out = self.target.forward(ids, attention_mask=additive(mask, self.target.dtype), past_key_values=self.cache,
                                  position_ids=pos, use_cache=True)
        return out.logits, out.aux_hidden, out.final_hidden

    def _verify(self, ids, pos, past, start, end, anc):
        anc = anc.bool()  # sent as int64 with the other inputs
        return self.fn(ids, pos, past, device_tree_mask(self.cols, start, end, past, anc))

    def _keep(self, b, src, dst):
        copy_columns([t for layer in self.cache.layers for t in (layer.keys, layer.values)], b, src, dst)
        return ()

    # -- the engine's interface ---------------------------------------------------------

    def prefill(self, ids: torch.Tensor, pos: torch.Tensor, pad: torch.Tensor, max_new_tokens: int,
                max_rows: int = 1) -> TargetOutput:
        """Left-padded prompts [B, P] into columns [0, P) (eager: prompt lengths vary)."""
        from .engine import prefill_mask

        B, P = ids.shape
        self.ensure(B, P + max_new_tokens + max_rows)
        mask = torch.zeros(B, P, self.S, dtype=torch.bool, device=ids.device)
        mask[:, :, :P] = prefill_mask(pad, P)
        logits, aux, final = self._forward(ids, pos, h2d(0, ids.device), mask)
        self.past = P
        return TargetOutput(logits=logits, aux_hidden=aux, final_hidden=final)

    def verify(self, ids: torch.Tensor, pos: torch.Tensor, start: torch.Tensor, end: torch.Tensor,
               anc: torch.Tensor, n_rows: int = 0) -> TargetOutput:
        """[B, N] rows at [past, past + N): row i of b sees b's committed columns and the rows j
        with anc[b, i, j]. Rows are padded to n_rows (one graph per padded size). The inputs are
        host tensors: padded on the host and sent in one copy that does not wait for the GPU."""
        B, N = ids.shape
        if n_rows > N:  # padding rows: token 0, seeing only themselves
            pad = n_rows - N
            ids = torch.cat([ids, ids.new_zeros(B, pad)], 1)
            pos = torch.cat([pos, pos[:, -1:].expand(B, pad)], 1)
            a = torch.eye(n_rows, dtype=torch.bool).repeat(B, 1, 1)
            a[:, :N, :N] = anc
            anc = a
        M = ids.shape[1]
        if self.past + M >= self.S:
            raise DraftsmithError(f"fast path: {self.past + M} cache columns needed, {self.S} allocated "
                                  "(prefill's max_new_tokens/max_rows too small)")
        parts = (ids, pos, start, end, torch.tensor([self.past]), anc)
        buf = h2d(torch.cat([x.reshape(-1).long() for x in parts]), self.device)
        ids, pos, start, end, past, anc = (v.view(x.shape) for v, x in zip(buf.split([x.numel() for x in parts]), parts))
        logits, aux, final = self.verify_g(ids, pos, past.reshape(()), start, end, anc)
        return TargetOutput(logits=logits[:, :N], aux_hidden=aux[:, :N], final_hidden=final[:, :N])

    def keep(self, b: list[int], src: list[int], dst: list[int], length: int, n_moves: int = 0) -> None:
        """Copy the rows src -> dst of sequences b (one graph: padded with no-op copies of the
        spare last column to n_moves), then past = length."""
        if b:
            pad = max(n_moves - len(b), 0)
            spare = self.S - 1
            idx = h2d([b + [0] * pad, src + [spare] * pad, dst + [spare] * pad], self.device)
            self.keep_g(idx[0], idx[1], idx[2])
        self.past = length

    # -- plain decoding: the baseline -----------------------------------------------------

    @torch.inference_mode()
    def plain(self, prompts: list[list[int]], max_new_tokens: int, eos_ids: Sequence[int] = (),
              temperature: float = 0.0, check_every: int = 8) -> list[list[int]]:
        """Plain decoding of a (left-padded) batch, one target forward per token, the token fed
        back on the device; the host reads the tokens every `check_every` steps to stop at EOS."""
        from .engine import _first_eos, left_pad

        ids, pad, pos = left_pad(prompts, self.device)
        B, P = ids.shape
        out = self.prefill(ids, pos, pad, max_new_tokens)
        first = pick_on_device(out.logits[:, -1], temperature)
        st = self._plain_state()
        st["tok"].copy_(first[:, None])
        st["pos"].copy_(pos[:, -1:] + 1)
        st["past"].fill_(P)
        st["start"].copy_(pad)
        st["buf"][:, 0] = first
        st["i"].fill_(1)
        step = self._plain_step(temperature)
        n, got = 1, None
        while n < max_new_tokens:
            todo = min(check_every, max_new_tokens - n)
            for _ in range(todo):
                step()
            n += todo
            got = st["buf"][:, :n].tolist()  # the one device read per check
            if eos_ids and all(any(t in eos_ids for t in g) for g in got):
                break
        if got is None:  # a single new token: no step ran
            got = st["buf"][:, :1].tolist()
        self.past = P + n
        return [g[:_first_eos(g, eos_ids)][:max_new_tokens] for g in got]

    def _plain_state(self) -> dict:
        if getattr(self, "_state_for", None) != (self.B, self.S):
            dev, B = self.device, self.B
            self._state = {"tok": torch.zeros(B, 1, dtype=torch.long, device=dev),
                           "pos": torch.zeros(B, 1, dtype=torch.long, device=dev),
                           "past": torch.zeros((), dtype=torch.long, device=dev),
                           "start": torch.zeros(B, dtype=torch.long, device=dev),
                           "buf": torch.zeros(B, self.S, dtype=torch.long, device=dev),
                           "i": torch.zeros(1, dtype=torch.long, device=dev)}
            self._state_for = (self.B, self.S)
            self.plain_graph = None
        return self._state

    def _plain_step(self, temperature: float) -> Callable[[], None]:
        st = self._state

        def step():
            mask = ((self.cols >= st["start"][:, None]) & (self.cols <= st["past"]))[:, None, :]
            logits, _, _ = self.fn(st["tok"], st["pos"], st["past"], mask)
            nxt = pick_on_device(logits[:, -1], temperature)
            st["tok"].copy_(nxt[:, None])
            st["pos"].add_(1)
            st["past"].add_(1)
            st["buf"].index_copy_(1, st["i"], nxt[:, None])
            st["i"].add_(1)

        if not self.graphs:
            return step
        key = (temperature,)
        if self.plain_graph is None or self.plain_graph[0] != key:
            graph, _ = capture(step, state=st)  # the warm-up step's advance is undone
            self.plain_graph = (key, graph)
        return self.plain_graph[1].replay


# ----------------------------------------------------------------------------- drafter


class StaticDraftCache:
    """The drafter's KV cache, preallocated [B, nkv, S, hd]; `append` writes the new rows at
    column `write_at` (a device scalar, so a graph can replay it) and returns the whole buffers;
    the caller's mask hides the columns it must not see. `length` is the host's bookkeeping."""

    static = True

    def __init__(self, batch_size: int, max_len: int, num_kv_heads: int, head_dim: int, dtype, device):
        shape = (batch_size, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.write_at = torch.zeros((), dtype=torch.long, device=device)
        self.length = 0

    @property
    def size(self) -> int:
        return self.k.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor):
        idx = self.write_at + torch.arange(k.shape[2], device=k.device)
        self.k.index_copy_(2, idx, k)
        self.v.index_copy_(2, idx, v)
        return self.k, self.v

    def crop(self, n: int) -> None:
        self.length = n


class FastDraft:
    """A drafter's static cache and its graphed step, reused across generations (re-made when
    the batch size changes or the sequence outgrows it)."""

    def __init__(self, drafter: Any, graphs: bool, max_rows: int = 64):
        self.drafter, self.graphs, self.max_rows = drafter, graphs, max_rows
        self.cache: Optional[StaticDraftCache] = None
        self.step = Graphed(self._step, graphs, max_rows)
        self.expansions: dict[tuple, Graphed] = {}
        self.resident: dict[tuple, Any] = {}  # resident.Resident per (batch, shape), holding its round's graph

    def reset(self, batch_size: int, needed: int) -> StaticDraftCache:
        """An empty cache for a new generation (the old buffers when they are big enough)."""
        c = self.cache
        if c is None or c.k.shape[0] != batch_size or c.size <= needed:
            self._new(batch_size, needed)
        self.cache.length = 0
        return self.cache

    def grow(self, cache: StaticDraftCache, needed: int) -> StaticDraftCache:
        """A bigger cache holding the same rows (graphs are re-captured for its new size)."""
        old = cache
        self._new(old.k.shape[0], max(needed, 2 * old.size))
        self.cache.k[:, :, :old.size] = old.k
        self.cache.v[:, :, :old.size] = old.v
        self.cache.length = old.length
        return self.cache

    def _new(self, batch_size: int, needed: int) -> None:
        cfg, w = self.drafter.cfg, self.drafter.fc.weight
        S = -(-(needed + 256) // 256) * 256
        self.cache = StaticDraftCache(batch_size, S, cfg.num_key_value_heads, cfg.head_dim, w.dtype, w.device)
        self.step = Graphed(self._step, self.graphs, self.max_rows)
        self.expansions: dict[tuple, Graphed] = {}

    def expansion(self, proposer: Any, K: int, D: int) -> Graphed:
        """The proposer's whole top-K expansion to depth D (every drafter step, top-k and frontier
        choice) as one graphed call: (g_last, rows, start, end, past) -> (toks, scores, parents)."""
        if (K, D) not in self.expansions:
            def fn(g_last, rows, start, end, past):
                toks, scores, parents, _ = proposer._expand(K, D, False, proposer.graph_step(start, end, past),
                                                            g_last, rows)
                return toks, scores, parents
            self.expansions[(K, D)] = Graphed(fn, self.graphs)
        return self.expansions[(K, D)]

    def _step(self, ids, hidden, pos, mask, write_at):
        self.cache.write_at.copy_(write_at)
        g = self.drafter(ids, hidden, pos, self.cache, attn_mask=mask)
        return g, self.drafter.logits(g)
