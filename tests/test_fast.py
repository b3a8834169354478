"""Fast paths (static KV caches, CUDA graphs): lossless against plain eager greedy decoding.

On a CPU the `static` mode runs (same caches and bookkeeping, no graphs) and `emulated`: the graphs
mode with CUDA-graph capture emulated (emulated_capture: every captured function runs as often as
under CUDA graphs, and once more); on a CUDA machine the same tests also run `graphs` and `compile`
(benchmarks/h200.sh runs this file there). In both graphed modes a test fails when a capture fell
back to eager (tests/conftest.py reads speculate.cache.CAPTURE_FALLBACKS): it would pass without a graph."""
from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from draftsmith.messages import DraftsmithError
from draftsmith.speculate.eagle3 import Eagle3Proposer
from draftsmith.speculate.engine import generate, plain_generate, plain_generate_batch
from draftsmith.speculate.proposer import PerSequence
from draftsmith.speculate.cache import CAPTURE_FALLBACKS, CAPTURES, Graphed
from draftsmith.speculate.eagle3 import FastDraft
from draftsmith.speculate.fast import FastTarget, in_stack, resolve_mode
from draftsmith.speculate.tree import pick_on_device
from draftsmith.speculate.ngram import NgramProposer
from draftsmith.target.model import load_target
from draftsmith.testing import make_model_dir

from test_engine import PROMPTS, OracleProposer, fitted_drafter, make_drafter

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
MODES = ["static", "emulated"] + (["graphs", "compile"] if CUDA else [])  # compile last: it patches the model in place
SPEC_MODES = MODES[:3]  # compile recompiles per row count: covered by the plain test, too slow here


class EmulatedGraph:
    """torch.cuda.CUDAGraph's replay on a CPU: the captured call runs again and its outputs are
    written into the captured call's output tensors (which callers hold, as they hold a graph's)."""

    def __init__(self, fn, args, out):
        self.fn, self.args, self.out = fn, args, out

    def replay(self):
        new = self.fn(*self.args)
        for o, n in zip(torch.utils._pytree.tree_leaves(self.out), torch.utils._pytree.tree_leaves(new)):
            if isinstance(o, torch.Tensor):
                o.copy_(n)


CAPTURING = [False]
"""[True] while emulated_capture runs its capture call (torch.cuda.is_current_stream_capturing's stand-in):
a test's function can fail only there, as one that cannot be captured does on a GPU."""


def emulated_capture(fn, args=(), state=None, generators=()):
    """speculate.cache.capture without a GPU: the warm-up call for real (its advance of `state`
    undone), then the capture, which a CUDA graph records without running: here it runs, and is
    undone in `state` too. A captured function thus runs once more than under CUDA graphs, so one
    that is not safe to run again (a warm-up moving cache columns twice) fails here as on a GPU."""
    saved = {k: v.clone() for k, v in (state or {}).items()}

    def call(capturing: bool):
        CAPTURING[0] = capturing
        try:
            return fn(*args)
        finally:
            CAPTURING[0] = False
            for k, v in saved.items():
                state[k].copy_(v)
    call(False)
    out = call(True)
    CAPTURES[0] += 1
    return EmulatedGraph(fn, args, out), out


def fast_mode(mode: str, monkeypatch) -> str:
    """The FastTarget mode a test parameter stands for: `emulated` is `graphs` with emulated_capture."""
    if mode != "emulated":
        return mode
    for module in ("cache", "resident"):
        monkeypatch.setattr(f"draftsmith.speculate.{module}.capture", emulated_capture)
    return "graphs"


@pytest.fixture(scope="module", params=["llama", "deepseek_v3"])
def target(request, tmp_path_factory):
    torch.manual_seed(0)
    path = make_model_dir(tmp_path_factory.mktemp(request.param), arch=request.param, num_layers=4)
    return load_target(path, device=DEVICE, dtype="float32")


@pytest.fixture(scope="module")
def plains(target):
    return [plain_generate(target, p, 24) for p in PROMPTS]


@pytest.fixture(scope="module")
def fitted(target):
    """A drafter whose head is fitted to these continuations: its drafts are accepted (test_engine.fitted_drafter)."""
    return fitted_drafter(target, seed=1)


@pytest.mark.parametrize("mode", MODES)
def test_fast_plain_equals_eager_plain(target, plains, mode, monkeypatch):
    mode = fast_mode(mode, monkeypatch)
    ft = FastTarget(target, mode, max_len=16)  # too small on purpose: prefill grows it
    for p, ref in zip(PROMPTS, plains):
        assert plain_generate_batch(target, [p], 24, fast=ft) == [ref]
    assert plain_generate_batch(target, PROMPTS, 24, fast=ft) == plains  # a left-padded batch, the same cache object re-sized
    eos = plains[0][5]
    assert plain_generate_batch(target, [PROMPTS[0]], 24, eos_ids=[eos], fast=ft) == [plains[0][:plains[0].index(eos) + 1]]  # stops at EOS


@pytest.mark.parametrize("mode", SPEC_MODES)
@pytest.mark.parametrize("method", ["chain", "tree", "ngram", "oracle"])
def test_fast_speculative_lossless(target, plains, fitted, mode, monkeypatch, method):
    mode = fast_mode(mode, monkeypatch)
    ft = FastTarget(target, mode)
    drafter = fitted
    fd = FastDraft(drafter, graphs=mode != "static")
    accepted = []
    for batch in ([0], [1], [2], [3], [0, 1, 2, 3]):
        prompts = [PROMPTS[i] for i in batch]
        if method == "chain":
            prop = Eagle3Proposer(drafter, topk=1, budget=4, fast=fd)
        elif method == "tree":
            prop = Eagle3Proposer(drafter, topk=3, budget=8, fast=fd)
        elif method == "ngram":
            prop = PerSequence([NgramProposer(3) for _ in prompts])
        else:
            prop = PerSequence([OracleProposer(PROMPTS[i] + plains[i], error_rate=0.3, seed=i) for i in batch])
        new, stats = generate(target, prop, prompts, 24, depth=4, fast=ft)
        assert new == [plains[i] for i in batch], (method, batch)
        assert all(s.rounds >= 1 for s in stats)
        accepted += [a for s in stats for a in s.accepted_per_round]
    if method != "ngram":  # drafts were accepted, deep ones too: cache moves and masks are exercised
        assert max(accepted) >= 2 and sum(accepted) >= len(accepted) // 2, (method, accepted)


@pytest.mark.parametrize("mode", SPEC_MODES)
def test_sampled_decoding_on_the_fast_path_is_seeded(target, fitted, mode, monkeypatch):
    """Plain decoding and resident rounds at temperature > 0 draw from generators of their own (the ones a
    CUDA graph registers), seeded per run from the caller's: the same seed gives the same tokens, another
    seed other ones."""
    mode = fast_mode(mode, monkeypatch)
    ft, fd = FastTarget(target, mode), FastDraft(fitted, graphs=mode != "static")

    def seeded(s: int):
        return torch.Generator(device=DEVICE).manual_seed(s)

    plain = [plain_generate_batch(target, PROMPTS[:2], 16, temperature=1.0, generator=seeded(s), fast=ft) for s in (1, 1, 2)]
    assert plain[0] == plain[1] != plain[2]
    spec = [generate(target, Eagle3Proposer(fitted, topk=k, budget=b, temperature=1.0, generator=seeded(s), fast=fd),
                     PROMPTS[:2], 16, depth=4, temperature=1.0, generator=seeded(s + 10), fast=ft, resident=True)[0]
            for k, b in ((1, 4), (3, 8)) for s in (1, 1, 2)]
    assert spec[0] == spec[1] != spec[2] and spec[3] == spec[4] != spec[5]


@pytest.mark.parametrize("mode", SPEC_MODES)
def test_attention_width_follows_the_context(target, plains, fitted, mode, monkeypatch):
    """The forwards attend over the cache's first W columns (FastTarget.attend: a power of two >= 256
    that holds the generation), not all S allocated: with every column past W poisoned (NaN: a masked
    column still enters the products, 0 x NaN), plain decoding, the host loop's rounds and the resident
    rounds still equal eager decoding. A longer generation on the same FastTarget attends wider (its own
    graphs) and is still lossless."""
    mode = fast_mode(mode, monkeypatch)
    ft, fd = FastTarget(target, mode, batch_size=2), FastDraft(fitted, graphs=mode != "static")  # 2,304 columns
    assert plain_generate_batch(target, PROMPTS[:2], 24, fast=ft) == plains[:2]  # batch 2 throughout: the cache poisoned below stays
    assert ft.W == 256 < ft.S
    with torch.inference_mode():  # the cache's tensors are inference tensors
        for layer in ft.cache.layers:
            for t in (layer.keys, layer.values):
                t[:, :, ft.W:] = float("nan")
    assert plain_generate_batch(target, PROMPTS[:2], 24, fast=ft) == plains[:2]
    for resident in (False, True):
        new, _ = generate(target, Eagle3Proposer(fitted, topk=3, budget=8, fast=fd), PROMPTS[:2], 24, depth=4,
                          fast=ft, resident=resident)
        assert new == plains[:2] and ft.W == 256
    with torch.inference_mode():  # a wider generation reads columns [256, 512): written ones or zeros, as allocated
        for layer in ft.cache.layers:
            for t in (layer.keys, layer.values):
                t[:, :, ft.W:] = 0
    long_ref = [plain_generate(target, p, 260) for p in PROMPTS[:2]]
    assert plain_generate_batch(target, PROMPTS[:2], 260, fast=ft) == long_ref and ft.W == 512
    new, _ = generate(target, Eagle3Proposer(fitted, topk=1, budget=4, fast=fd), PROMPTS[:2], 260, depth=4,
                      fast=ft, resident=True)
    assert new == long_ref


def test_evaluate_measures_again_a_run_that_captured(target, plains, fitted, monkeypatch):
    """evaluate's figures never hold a graph capture: a timed run (plain or a method) that captured one
    (its first call, or a longer generation that attends wider: FastTarget.attend) is run again and
    the second run is the one returned; a run that only replays is run once."""
    from draftsmith.config import EvaluateConfig
    from draftsmith.evaluate import measure
    from draftsmith.speculate import fast, methods

    monkeypatch.setattr(fast, "resolve_mode", lambda mode, device, key="": mode)
    fast_mode("emulated", monkeypatch)
    runners = methods.DecodeRunners(target, fitted, "graphs")
    calls = []
    real_plain, real_generate = methods.plain_generate_batch, methods.generate
    monkeypatch.setattr(methods, "plain_generate_batch", lambda *a, **k: calls.append("plain") or real_plain(*a, **k))
    monkeypatch.setattr(methods, "generate", lambda *a, **k: calls.append("chain") or real_generate(*a, **k))
    cfg = EvaluateConfig(max_new_tokens=24, draft_steps=4)
    for n, runs in ((24, 2), (24, 1), (260, 2), (260, 1)):  # new graphs, replays, a wider attention, replays
        calls.clear()
        [out], _ = measure.run_plain(target, [PROMPTS[0]], cfg, [], runners=runners, max_new_tokens=n)
        [new], _, _ = measure.run_method(target, fitted, "eagle3_chain", [PROMPTS[0]], cfg, [], max_new_tokens=n,
                                         runners=runners)
        assert calls == ["plain"] * runs + ["chain"] * runs, (n, calls)
        assert out == new == (plains[0] if n == 24 else out) and len(out) == n


def test_fast_oracle_accepts_everything(target, plains):
    ft = FastTarget(target, "static")
    prop = PerSequence([OracleProposer(PROMPTS[0] + plains[0])])
    new, [st] = generate(target, prop, [PROMPTS[0]], 24, depth=5, fast=ft)
    assert new == [plains[0]]
    assert st.tau == pytest.approx(6.0, abs=1.0)  # 5 drafts + bonus per round, the last round shorter


def test_drafter_cache_grows_without_losing_rows(target, plains):
    drafter = make_drafter(target, draft_vocab=200, seed=2).to(DEVICE)
    fd = FastDraft(drafter, graphs=False)
    fd._new(1, 0)
    fd.cache.k = fd.cache.k[:, :, :8].clone()  # force a growth in the middle of a generation
    fd.cache.v = fd.cache.v[:, :, :8].clone()
    fd.reset = lambda B, needed: fd.cache  # keep the tiny cache
    prop = Eagle3Proposer(drafter, topk=1, budget=4, fast=fd)
    eager = Eagle3Proposer(drafter, topk=1, budget=4)
    a = generate(target, prop, [PROMPTS[2]], 24, depth=4, fast=FastTarget(target, "static"))
    b = generate(target, eager, [PROMPTS[2]], 24, depth=4)
    assert a[0] == b[0] == [plains[2]]
    assert [s.accepted_per_round for s in a[1]] == [s.accepted_per_round for s in b[1]]
    assert fd.cache.size > 8


def test_pick_on_device_samples_softmax():
    torch.manual_seed(0)
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]]).repeat(20000, 1)
    got = torch.bincount(pick_on_device(logits, 1.0), minlength=4).float() / 20000
    want = torch.softmax(logits[0], -1)
    assert torch.allclose(got, want, atol=0.015)
    assert pick_on_device(logits[:2], 0.0).tolist() == [2, 2]


def test_resolve_mode():
    cpu = torch.device("cpu")
    assert resolve_mode("auto", cpu) == "off"
    assert resolve_mode("static", cpu) == "static"
    assert resolve_mode("auto", torch.device("cuda")) == "graphs"
    with pytest.raises(DraftsmithError, match="needs a CUDA device"):
        resolve_mode("graphs", cpu)
    with pytest.raises(DraftsmithError, match="unknown"):
        resolve_mode("fastest", cpu)


def test_graphed_disabled_and_row_limit_run_eagerly():
    calls = []
    g = Graphed(lambda x: calls.append(x.shape) or x * 2, enabled=False)
    assert g(torch.ones(2, 3)).sum() == 12
    g = Graphed(lambda x: calls.append(x.shape) or x * 2, enabled=True, max_rows=2)
    assert g(torch.ones(1, 3)).sum() == 6  # over max_rows: eager even when enabled (no CUDA needed)
    assert len(calls) == 2 and not g.graphs


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
def test_rotaries_rotate_q_and_k_together_bit_for_bit(tmp_path, arch, monkeypatch):
    """FastTarget replaces the modeling file's rotary functions by joint ones (q and k rotated as one
    tensor: about half the kernels): the logits keep every bit; a rotary function that does something
    else keeps its own; other call forms take the original."""
    import sys
    from draftsmith.speculate.hfmodel import ROTATIONS, join_rotaries

    target = load_target(make_model_dir(tmp_path, arch=arch, num_layers=2), device="cpu", dtype="float32")
    mod = sys.modules[type(target.model).__module__]
    for name in ROTATIONS:  # the originals, should an earlier test of this process have joined them
        f = getattr(mod, name, None)
        if f is not None:
            monkeypatch.setattr(mod, name, getattr(f, "__wrapped__", f))
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        before = target.forward(ids).logits
        assert join_rotaries(target.model) >= 1 and join_rotaries(target.model) == 0
        assert torch.equal(target.forward(ids).logits, before)
    used = "apply_rotary_pos_emb_interleave" if getattr(target.model.config, "rope_interleave", False) else "apply_rotary_pos_emb"
    joint = getattr(mod, used)
    assert joint.draftsmith_joint
    q, k, cos, sin = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 1, 8), torch.randn(1, 2, 8), torch.randn(1, 2, 8)  # [B, N, H, D]
    torch.testing.assert_close(joint(q, k, cos, sin, unsqueeze_dim=2), joint.__wrapped__(q, k, cos, sin, unsqueeze_dim=2))
    monkeypatch.setattr(mod, used, lambda q, k, cos, sin, unsqueeze_dim=1: (q * cos[:, None], k * sin[:, None]))
    assert join_rotaries(target.model) == 0  # not the rotation it claims to be: kept


def test_layers_live_in_two_stacks(target, plains, fitted):
    """The target's per-layer keys and values are views of two stacks from their allocation on (no copy,
    no cache held twice), and their lengths one tensor: a chain's column moves go through them and the
    output equals plain decoding.
    A layer of another shape (here one column more) gives the stacks up: every layer holds its own
    tensors, with what they held, and decoding stays lossless."""
    ft = FastTarget(target, "static")
    out, _ = generate(target, Eagle3Proposer(fitted, topk=1, budget=4), PROMPTS[:2], 24, depth=4, fast=ft)
    assert out == plains[:2]
    keys, values = ft.stacked
    assert all(in_stack(l.keys, keys) and in_stack(l.values, values) for l in ft.cache.layers)
    assert all(l.cumulative_length is ft.length for l in ft.cache.layers)  # one length, set once a forward
    assert 0 < int(ft.cache.get_seq_length()) == int(ft.length) < ft.S
    ft = FastTarget(target, "static", batch_size=2)  # the cache these prompts use (not re-made by the prefill)
    ft.cache.layers[-1].max_cache_len += 1  # the last: the layers before it were adopted already
    out, _ = generate(target, Eagle3Proposer(fitted, topk=1, budget=4), PROMPTS[:2], 24, depth=4, fast=ft)
    assert out == plains[:2] and ft.stacked == ()
    storages = {t.untyped_storage().data_ptr() for l in ft.cache.layers for t in (l.keys, l.values)}
    assert len(storages) == 2 * len(ft.cache.layers)


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
def test_standard_rms_norms_run_torchs_kernel(tmp_path, arch):
    """FastTarget switches the target's standard RMSNorms to torch's rms_norm (one kernel on CUDA):
    every one of them (MLA's q/kv norms too), once, the logits unchanged in float32; a variant whose
    forward is not the standard one (Gemma's 1 + weight) keeps its own."""
    from draftsmith.speculate.hfmodel import fuse_rms_norms

    target = load_target(make_model_dir(tmp_path, arch=arch, num_layers=2), device="cpu", dtype="float32")
    norms = [m for m in target.model.modules() if type(m).__name__.endswith("RMSNorm")]
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        for m in norms:  # weights away from 1, so that a wrong weight or eps would show
            m.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(1))
        before = target.forward(ids).logits

        class GemmaLikeRMSNorm(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.weight, self.eps = torch.nn.Parameter(torch.zeros(8)), 1e-6

            def forward(self, x):
                return (1 + self.weight) * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        gemma = GemmaLikeRMSNorm()
        target.model.add_module("gemma_like", gemma)
        assert fuse_rms_norms(target.model) == len(norms) > 2 * 2 and fuse_rms_norms(target.model) == 0
        assert all("forward" in vars(m) for m in norms) and "forward" not in vars(gemma)  # the variant kept its own
        torch.testing.assert_close(target.forward(ids).logits, before, rtol=1e-5, atol=1e-5)


def test_compiled_regions_keep_outputs(tmp_path, monkeypatch):
    """The compile mode's regional torch.compile (norms, MLPs, rotary) runs on a CPU too (without
    CUDA graphs): same greedy tokens as eager."""
    pytest.importorskip("torch._inductor")
    from draftsmith.speculate.hfmodel import compile_regions

    path = make_model_dir(tmp_path, num_layers=2)
    target = load_target(path, device="cpu", dtype="float32")
    ref = [plain_generate(target, p, 8) for p in PROMPTS[:2]]
    import transformers.models.llama.modeling_llama as llama  # compile_regions patches its rotary function

    monkeypatch.setattr(llama, "apply_rotary_pos_emb", llama.apply_rotary_pos_emb)
    assert compile_regions(target.model) > 0 and compile_regions(target.model) == 0
    assert plain_generate_batch(target, PROMPTS[:2], 8, fast=FastTarget(target, "static")) == ref


def test_compiled_drafter_regions_keep_drafts(target, plains):
    """FastDraft(compile=True) (evaluate.fast: compile) compiles the drafter's pure regions in place:
    the same drafts as the eager drafter, on a CPU too (the host loop and resident rounds), and the
    speculative output still equals plain decoding."""
    pytest.importorskip("torch._inductor")
    if target.model.config.model_type != "llama":
        pytest.skip("one target is enough: compiling dominates this test's time")
    from torch._dynamo.utils import counters

    runs, graphs_before = [], counters["stats"]["unique_graphs"]
    for compiled in (False, True):
        drafter = make_drafter(target, draft_vocab=200, seed=5).to(DEVICE)
        fd = FastDraft(drafter, graphs=False, compile=compiled)
        assert getattr(drafter, "_compiled_regions", False) is compiled
        if compiled:
            assert drafter.compile_regions() is False  # once: a second call does nothing
        ft = FastTarget(target, "static")
        runs.append([generate(target, Eagle3Proposer(drafter, topk=k, budget=b, fast=fd), PROMPTS[:2], 16, depth=3,
                              fast=ft, resident=r) for k, b in ((1, 3), (2, 6)) for r in (False, True)])
    assert counters["stats"]["unique_graphs"] > graphs_before  # the compiled regions ran
    for (eager, e_st), (comp, c_st) in zip(*runs):
        assert eager == comp == [plains[i][:16] for i in range(2)]
        assert [s.accepted_per_round for s in e_st] == [s.accepted_per_round for s in c_st]


def test_auto_falls_back_to_eager_where_the_fast_path_cannot_run(tmp_path, monkeypatch):
    """A target with sliding-window layers (gpt-oss) has no plain static cache: an explicit fast
    mode is a clear error; `auto` (graphs on a GPU, simulated here) falls back to eager decoding."""
    from draftsmith.speculate.methods import DecodeRunners
    from draftsmith.speculate import fast

    path = make_model_dir(tmp_path, arch="gpt_oss", num_layers=2)
    target = load_target(path, device="cpu", dtype="float32")
    with pytest.raises(DraftsmithError, match="sliding-window layers\\); set evaluate.fast: off"):
        DecodeRunners(target, None, "static").get(1)
    with pytest.raises(DraftsmithError, match="set regenerate.fast: off"):  # the field that chose it
        fast.fast_target_or_none(target, "static", "static", "regenerate.fast", "transformers generate")
    monkeypatch.setattr(fast, "resolve_mode", lambda mode, device, key="": "static" if mode == "auto" else mode)
    paths = DecodeRunners(target, None, "auto")
    assert paths.get(1) == (None, None) and paths.mode == "off"


def test_sampling_on_static_caches_matches_eager(target):
    """temperature > 0: the same generator seed gives the same sampled speculative output on the
    static path as on the eager one (same logits up to float rounding, same uniform draws)."""
    drafter = make_drafter(target, draft_vocab=200, seed=4).to(DEVICE)
    outs = []
    for fast in (None, FastTarget(target, "static")):
        g = torch.Generator(device=DEVICE).manual_seed(7)
        prop = Eagle3Proposer(drafter, topk=1, budget=3, temperature=0.8, generator=g,
                              fast=None if fast is None else FastDraft(drafter, graphs=False))
        outs.append(generate(target, prop, [PROMPTS[0], PROMPTS[2]], 20, depth=3, temperature=0.8, generator=g, fast=fast))
    (a, sa), (b, sb) = outs
    assert a == b and [s.accepted_per_round for s in sa] == [s.accepted_per_round for s in sb]


@pytest.mark.capture_fallback
def test_graphed_falls_back_to_eager_when_capture_fails(capsys):
    """A call whose capture fails (here: no CUDA at all) runs eagerly, now and later, with one log line;
    an error of fn itself still surfaces."""
    calls = []

    def fn(x):
        calls.append(1)
        if x.sum() < 0:
            raise ValueError("negative")
        return x * 2

    g = Graphed(fn, enabled=True)
    if CUDA:
        pytest.skip("capture works here")
    assert g(torch.ones(1, 3)).sum() == 6 and g(torch.ones(1, 3)).sum() == 6
    printed = capsys.readouterr()
    assert (printed.out + printed.err).count("CUDA graph capture") == 1
    assert list(g.graphs.values()) == [None]
    with pytest.raises(ValueError, match="negative"):
        g(-torch.ones(2, 3))


@pytest.mark.capture_fallback
@pytest.mark.parametrize("resident", [False, True])
def test_a_capture_that_falls_back_is_recorded(target, plains, fitted, monkeypatch, resident):
    """What the check behind every graphed test reads (tests/conftest.py fails a test on any entry of
    CAPTURE_FALLBACKS): a verify forward that cannot be captured (emulated: it raises only during the
    capture) still decodes losslessly, eagerly, and is recorded once per graph that was not made."""
    if target.model.config.model_type != "llama":
        pytest.skip("one target is enough")
    mode = fast_mode("emulated", monkeypatch)
    real = FastTarget.verify_rows

    @functools.wraps(real)
    def verify_rows(self, *args):
        if CAPTURING[0]:
            raise RuntimeError("operation not permitted when stream is capturing")
        return real(self, *args)

    monkeypatch.setattr(FastTarget, "verify_rows", verify_rows)
    ft, fd = FastTarget(target, mode), FastDraft(fitted, graphs=True)
    for _ in range(2):  # the second generation reuses the failed graph's eager fallback: no second entry
        new, _ = generate(target, Eagle3Proposer(fitted, topk=3, budget=8, fast=fd), PROMPTS[:2], 24, depth=4,
                          fast=ft, resident=resident)
        assert new == plains[:2]
    assert len(CAPTURE_FALLBACKS) == 1, CAPTURE_FALLBACKS
    what = "the resident round (batch 2, topk 3, budget 8, depth 4)" if resident else \
        "FastTarget.verify_rows on inputs [(2, 9), (2, 9), (), (2,), (2,), (2, 9, 9), (256,)]"
    assert CAPTURE_FALLBACKS[0] == f"{what}: RuntimeError: operation not permitted when stream is capturing"


@pytest.mark.capture_fallback  # its inner session's fallbacks land in this process's record too
def test_a_test_whose_capture_fell_back_fails(pytester):
    """The check itself (tests/conftest.py): under the emulated capture, a test whose graphed call fell
    back to eager FAILS although its result is right; the same test passes when the call is captured,
    and when it carries @pytest.mark.capture_fallback."""
    pytester.makeconftest((Path(__file__).parent / "conftest.py").read_text())
    pytester.makepyfile(test_inner="""
        import pytest, torch
        from draftsmith.speculate.cache import Graphed
        from test_fast import CAPTURING, emulated_capture

        def double(x):
            if CAPTURING[0]:
                raise RuntimeError("cannot be captured")
            return x * 2

        @pytest.fixture(autouse=True)
        def emulated(monkeypatch):
            monkeypatch.setattr("draftsmith.speculate.cache.capture", emulated_capture)

        def test_fell_back():
            assert Graphed(double, enabled=True)(torch.ones(2, 3)).sum() == 12

        def test_captured():
            assert Graphed(lambda x: x * 2, enabled=True)(torch.ones(2, 3)).sum() == 12

        @pytest.mark.capture_fallback
        def test_fell_back_on_purpose():
            assert Graphed(double, enabled=True)(torch.ones(2, 3)).sum() == 12
    """)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=1)
    out = result.stdout.str()
    assert "FAILED test_inner.py::test_fell_back - " in out
    assert ("1 CUDA-graph capture(s) fell back to eager, so the graphs were not tested: "
            "double on inputs [(2, 3)]: RuntimeError: cannot be captured") in out


@pytest.mark.skipif(not CUDA, reason="counts CUDA stream syncs")
@pytest.mark.parametrize("method,resident", [("chain", False), ("tree", False), ("tree", True)])
def test_graphed_round_waits_for_the_gpu_only_to_read_results(target, plains, method, resident):
    """A graphed round may wait for the GPU only where the host needs its results (the verify
    logits, the drafted tokens): host-to-device copies must not sync, or the host never runs ahead.
    Resident rounds (test_resident.py) replay one graph per round and read one flag per round."""
    import warnings

    ft = FastTarget(target, "graphs")
    drafter = make_drafter(target, draft_vocab=200, seed=1).to(DEVICE)
    fd = FastDraft(drafter, graphs=True)
    topk, budget = (1, 4) if method == "chain" else (3, 8)
    run = lambda: generate(target, Eagle3Proposer(drafter, topk=topk, budget=budget, fast=fd),  # noqa: E731
                           [PROMPTS[0]], 24, depth=4, fast=ft, resident=resident)
    assert run()[0] == [plains[0]]  # warm-up: captures every graph
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            new, [st] = run()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    print(f"{method}{' resident' if resident else ''}: {syncs} syncs in {st.rounds} rounds")
    assert new == [plains[0]]
    if resident:  # one flag read per round, plus the prefill's and the proposer's start reads, once
        assert syncs <= st.rounds + 12, (syncs, st.rounds)
        return
    # Per round: the timing sync and the logits read after verify, the timing sync and the three reads
    # (tokens, scores, parents) after propose. The H200 counted 118 in 23 rounds (5.1 per round).
    # A blocking host-to-device copy would count one more each (a round makes about 8 copies).
    assert syncs <= 6 * st.rounds + 4, (syncs, st.rounds)
