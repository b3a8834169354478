"""The engine and the trainer agree round by round (issue 19 item 4): in float32 and greedy, every
speculative round's accepted count equals what the drafter's TEACHER-FORCED predictions on the final
sequence say it must be. The predictions come from the training path (Eagle3Drafter.ttt_step unrolled
over the whole sequence, as train/ttt.py does): at a round whose root (last committed token) is x[c],
drafting step i of the chain reads row c - 1 of TTT step i, fed x[c + i]; the round accepts the first
i where that row's argmax is not x[c + 1 + i], capped by the drafts of that round.

The drafter has a closed-form head: its linears are random, its lm_head is fitted by least squares
to the teacher-forced states of the sequences the test decodes (test_engine.fit_head), so rounds accept 0..k drafts (a
random head accepts nearly none and would make the equality trivial). Paths: the eager host loop,
static caches (host loop and resident rounds) on the CPU, in CI; CUDA graphs (host loop and
resident rounds) on a GPU, marked `gpu` (benchmarks/h200.sh step `consistency`)."""
from __future__ import annotations

import pytest
import torch

from draftsmith.evaluate.explain import accepted_at, predictions
from draftsmith.speculate.eagle3 import Eagle3Proposer
from draftsmith.speculate.engine import generate
from draftsmith.speculate.engine import plain_generate
from draftsmith.speculate.eagle3 import FastDraft
from draftsmith.speculate.fast import FastTarget
from draftsmith.target.model import load_target
from draftsmith.testing import make_model_dir

from test_engine import K_FIT, PROMPTS, fit_head, make_drafter
from test_fast import fast_mode

K = 4          # chain length
NEW = 24       # new tokens per prompt


def build(device: str, tmp_path_factory):
    torch.manual_seed(0)
    path = make_model_dir(tmp_path_factory.mktemp(f"consistency_{device}"), num_layers=6)
    target = load_target(path, device=device, dtype="float32")
    drafter = make_drafter(target, seed=7).to(device)  # full draft vocab: every target token can be drafted
    seqs = [p + plain_generate(target, p, NEW) for p in PROMPTS]
    fit_head(target, drafter, seqs)
    return target, drafter, seqs


def expected_accepted(target, drafter, x: list[int], roots: list[int], drafted: list[int]) -> list[int]:
    """Per round (root index c, drafts d): the length of the run of correct teacher-forced predictions."""
    preds = predictions(target, drafter, x, K_FIT)
    return [accepted_at(preds, x, c, d) for c, d in zip(roots, drafted)]


def check(target, drafter, seqs, fast=None, fd=None, resident=False) -> list[int]:
    """Decode all prompts as one batch (chain of K), then check every round of every sequence."""
    new, stats = generate(target, Eagle3Proposer(drafter, topk=1, budget=K, fast=fd), PROMPTS, NEW, depth=K,
                          fast=fast, resident=resident)
    seen = []
    for p, x, out, st in zip(PROMPTS, seqs, new, stats):
        assert p + out == x  # lossless
        roots = [len(p) + sum(st.emitted_per_round[:r]) for r in range(st.rounds)]
        want = expected_accepted(target, drafter, x, roots, st.drafted_per_round)
        assert st.accepted_per_round == want, (p, st.accepted_per_round, want)
        seen += st.accepted_per_round
    assert set(seen) >= {0, 1, 2}, seen  # the fitted head accepts: the equality is not 0 == 0
    assert sum(seen) >= len(seen)        # on average at least one draft a round
    return seen


@pytest.fixture(scope="module")
def cpu_pair(tmp_path_factory):
    return build("cpu", tmp_path_factory)


@pytest.mark.parametrize("path", ["eager", "static", "static-resident", "emulated", "emulated-resident"])
def test_rounds_match_teacher_forcing_cpu(cpu_pair, path, monkeypatch):
    """emulated: the graphs mode with CUDA-graph capture emulated on the CPU (test_fast.fast_mode)."""
    target, drafter, seqs = cpu_pair
    if path == "eager":
        check(target, drafter, seqs)
    else:
        mode = fast_mode(path.split("-")[0], monkeypatch)
        ft, fd = FastTarget(target, mode), FastDraft(drafter, graphs=mode == "graphs")
        for _ in range(2):  # the second time replays what the first captured
            check(target, drafter, seqs, ft, fd, resident=path.endswith("resident"))


def test_a_wrong_teacher_forcing_is_caught(cpu_pair):
    """The check itself: an off-by-one in the predictions' row (row c instead of c - 1) fails it."""
    target, drafter, seqs = cpu_pair
    global expected_accepted
    real = expected_accepted

    def shifted(target, drafter, x, roots, drafted):
        return real(target, drafter, x, [r + 1 for r in roots], drafted)
    expected_accepted = shifted
    try:
        with pytest.raises(AssertionError):
            check(target, drafter, seqs)
    finally:
        expected_accepted = real


@pytest.fixture(scope="module")
def gpu_pair(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32 here
    torch.backends.cudnn.allow_tf32 = False
    return build("cuda", tmp_path_factory)


@pytest.mark.gpu
@pytest.mark.parametrize("resident", [False, True])
def test_rounds_match_teacher_forcing_gpu_graphs(gpu_pair, resident):
    target, drafter, seqs = gpu_pair
    ft = FastTarget(target, "graphs")
    fd = FastDraft(drafter, graphs=True)
    assert ft.graphs
    check(target, drafter, seqs, ft, fd, resident=resident)
    check(target, drafter, seqs, ft, fd, resident=resident)  # replayed graphs, not only the captures
