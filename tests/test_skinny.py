"""speculate/skinny.py: the skinny matmul (evaluate.verify_gemm: skinny). On a CPU without the kernel it
is F.linear exactly, and `switched` puts each module's forward back; an explicit skinny that cannot run
is a config error. With Triton installed, the kernel itself runs under Triton's interpreter
(TRITON_INTERPRET=1, in a child process): its numbers against F.linear, every config and
split-K, and batch invariance (row r of an M-row call equals the one-row call bit for bit); and a
tiny target on the fast path with every linear through the kernel decodes as F.linear does, its
verify rows lossless. The GPU tests (marker gpu) run the compiled kernel and its tuning in bf16."""
from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from draftsmith.messages import DraftsmithError
from draftsmith.speculate import skinny
from draftsmith.speculate.engine import generate
from draftsmith.speculate.fast import FastTarget
from draftsmith.speculate.proposer import PerSequence
from draftsmith.speculate.engine import plain_generate
from draftsmith.target.model import load_target
from draftsmith.testing import interpreted_or_skip, make_model_dir, run_interpreted

from test_engine import PROMPTS, OracleProposer

HAS_TRITON = importlib.util.find_spec("triton") is not None
CUDA = torch.cuda.is_available()


@pytest.fixture
def no_kernel(monkeypatch):
    """This process as a CPU machine sees it: no interpreter (whatever the environment says)."""
    monkeypatch.setattr(skinny, "INTERPRET", False)


@pytest.mark.parametrize("rows", [(1,), (3,), (2, 8), (17,), (4, 5)])
def test_falls_back_to_f_linear_on_a_cpu(no_kernel, rows):
    torch.manual_seed(0)
    w, b = torch.randn(24, 40), torch.randn(24)
    x = torch.randn(*rows, 40)
    assert not skinny.applies(x, w, b)
    for bias in (None, b):
        assert torch.equal(skinny.skinny_linear(x, w, bias), F.linear(x, w, bias))


def test_applies_only_where_the_kernel_can_run(monkeypatch):
    monkeypatch.setattr(skinny, "INTERPRET", True)  # as if the kernel could run on this CPU
    if not HAS_TRITON:
        monkeypatch.setattr(skinny, "triton", object())
    w = torch.randn(24, 40)
    assert skinny.applies(torch.randn(16, 40), w, None) and skinny.applies(torch.randn(2, 3, 40), w, None)
    assert not skinny.applies(torch.randn(17, 40), w, None)                    # more rows than the kernel takes
    assert not skinny.applies(torch.randn(0, 40), w, None)
    assert not skinny.applies(torch.randn(4, 40), w.t().contiguous().t(), None)  # a strided weight
    assert not skinny.applies(torch.randn(4, 36), torch.randn(24, 36), None)     # K not a multiple of 8
    assert not skinny.applies(torch.randn(4, 40, dtype=torch.float64), w.double(), None)
    assert not skinny.applies(torch.randn(4, 40, requires_grad=True), w, None)   # autograd: F.linear's backward
    with torch.no_grad():
        assert skinny.applies(torch.randn(4, 40, requires_grad=True), w, torch.randn(24))
    assert not skinny.applies(torch.randn(4, 40), w, torch.randn(23))


def test_resolve_verify_gemm(no_kernel):
    model = torch.nn.Linear(8, 8)
    assert skinny.resolve_verify_gemm("cublas", model) == "cublas"
    assert skinny.resolve_verify_gemm("auto", model) == "cublas"   # the kernel cannot run here
    with pytest.raises(DraftsmithError, match="evaluate.verify_gemm skinny: .*use evaluate.verify_gemm: cublas"):
        skinny.resolve_verify_gemm("skinny", model)
    with pytest.raises(DraftsmithError, match="'fast': unknown"):
        skinny.resolve_verify_gemm("fast", model)


def test_switched_puts_each_forward_back():
    a, b = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)
    own = b.forward = lambda x: x  # e.g. a hook's wrapper
    x = torch.randn(2, 8)
    with skinny.switched([a, b]):
        assert "forward" in a.__dict__ and b.forward is not own
        assert torch.equal(a(x), F.linear(x, a.weight, a.bias))
    assert "forward" not in a.__dict__ and b.forward is own


def test_fast_target_with_skinny_on_a_cpu_is_a_config_error(tmp_path, no_kernel):
    target = load_target(make_model_dir(tmp_path, num_layers=2), device="cpu", dtype="float32")
    with pytest.raises(DraftsmithError, match="evaluate.verify_gemm skinny"):
        FastTarget(target, "static", verify_gemm="skinny")
    assert FastTarget(target, "static", verify_gemm="auto").linears == []


# ----------------------------------------------------------------------------- the kernel, interpreted


@pytest.fixture
def interpreted(monkeypatch):
    """The skinny module with its kernels under Triton's interpreter (untuned)."""
    interpreted_or_skip(skinny, "test_kernel_under_the_interpreter_in_a_child_process")
    monkeypatch.setattr(skinny, "TUNED", {})
    return skinny


def test_kernel_under_the_interpreter_in_a_child_process(tmp_path):
    """The interpreted tests below, in a pytest process started with TRITON_INTERPRET=1."""
    run_interpreted(__file__, "interpreted_", tmp_path / "child")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", [skinny.DEFAULT_CONFIG, (16, 32, 1, 4, 1), (16, 32, 2, 4, 1), (32, 16, 4, 4, 1)])
def test_interpreted_kernel_matches_f_linear_and_is_batch_invariant(interpreted, dtype, config):
    torch.manual_seed(0)
    N, K = 40, 104  # neither a multiple of the blocks: the masks
    w, b = torch.randn(N, K).to(dtype), torch.randn(N).to(dtype)
    x = torch.randn(16, K).to(dtype)
    tol = 1e-4 if dtype == torch.float32 else 0.0
    for bias in (None, b):
        full = interpreted.launch(x, w, bias, config)
        ref = F.linear(x.float(), w.float(), None if bias is None else bias.float())
        # float32: the same sum in another order; bf16: rounded once from a float32 sum (within one ulp: the
        # interpreter's float32 -> bf16 cast truncates where the GPU's rounds to nearest)
        bound = tol * ref.abs().max() if dtype == torch.float32 else (ref.abs() * 2 ** -7 + 1e-6)
        assert ((full.float() - ref).abs() <= bound).all(), (config, (full.float() - ref).abs().max())
        for M in (1, 2, 5, 15):
            part = interpreted.launch(x[:M].contiguous(), w, bias, config)
            assert torch.equal(part, full[:M]), (config, M)  # bit for bit, whatever the row count


def test_interpreted_skinny_linear_runs_the_kernel_for_few_rows_only(interpreted, monkeypatch):
    calls = []
    launch = interpreted.launch
    monkeypatch.setattr(interpreted, "launch", lambda *a: calls.append(a[0].shape) or launch(*a))
    w = torch.randn(24, 32)
    y = interpreted.skinny_linear(torch.randn(2, 3, 32), w)
    assert y.shape == (2, 3, 24) and calls == [(6, 32)]
    interpreted.skinny_linear(torch.randn(20, 32), w)  # a prefill: F.linear
    assert calls == [(6, 32)]


def test_interpreted_fast_path_decodes_through_the_kernel(interpreted, tmp_path, monkeypatch):
    """A tiny Llama on static caches with every linear through the interpreted kernel: plain decoding
    equals eager plain decoding (F.linear), and speculative rounds over 5 verify rows equal it too."""
    torch.manual_seed(0)
    target = load_target(make_model_dir(tmp_path, num_layers=2), device="cpu", dtype="float32")
    prompts = PROMPTS[:2]
    plains = [plain_generate(target, p, 10) for p in prompts]
    ft = FastTarget(target, "static", verify_gemm="skinny")
    assert ft.verify_gemm == "skinny" and len(ft.linears) == 2 * 7 + 1  # q k v o gate up down per layer, lm_head
    rows = []
    launch = interpreted.launch
    monkeypatch.setattr(interpreted, "launch", lambda *a: rows.append(a[0].shape[0]) or launch(*a))
    assert [plain_generate(target, p, 10, fast=ft) for p in prompts] == plains
    assert 1 in rows and max(rows) <= 16  # the one-row steps ran the kernel (and these short prompts' prefills)
    prop = PerSequence([OracleProposer(p + r, error_rate=0.3, seed=i) for i, (p, r) in enumerate(zip(prompts, plains))])
    new, _ = generate(target, prop, prompts, 10, depth=4, fast=ft)
    assert new == plains
    assert 10 in rows  # two sequences' 5 verify rows in one call
    assert all("forward" not in m.__dict__ for m in ft.linears)  # switched for FastTarget's forwards only


# ----------------------------------------------------------------------------- on a GPU


@pytest.mark.gpu
@pytest.mark.skipif(not (CUDA and HAS_TRITON), reason="needs CUDA and Triton")
@pytest.mark.parametrize("N,K", [(1024, 4096), (4096, 14336), (6000, 512)])
def test_kernel_on_the_gpu(N, K):
    torch.manual_seed(0)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(16, K, device="cuda", dtype=torch.bfloat16)
    full = skinny.skinny_linear(x, w)
    ref = F.linear(x.float(), w.float())
    assert skinny.TUNED[(N, K, torch.bfloat16, w.device)] is not None
    assert ((full.float() - ref).abs() <= ref.abs() * 2 ** -7 + 1e-3).all()
    for M in (1, 2, 4, 8, 15):
        assert torch.equal(skinny.skinny_linear(x[:M], w), full[:M])
    for config in skinny.CONFIGS:  # every config, not only the tuned one
        try:
            y = skinny.launch(x, w, None, config)
        except Exception:  # noqa: BLE001 (one that does not fit this GPU's shared memory: the tuner skips it too)
            continue
        assert ((y.float() - ref).abs() <= ref.abs() * 2 ** -7 + 1e-3).all(), config
        assert torch.equal(skinny.launch(x[:3].contiguous(), w, None, config), y[:3]), config
