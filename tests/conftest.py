"""Fixtures and checks shared by every test module."""
from __future__ import annotations

import pytest
import torch

from draftsmith.speculate.cache import CAPTURE_FALLBACKS
from draftsmith.testing import TinyDrafter, make_tiny_drafter

pytest_plugins = ["pytester"]  # tests/test_fast.py runs a test session of its own to prove the check below fails


def pytest_configure(config):
    config.addinivalue_line("markers", "capture_fallback: the test makes a CUDA-graph capture fail on purpose "
                                       "(exempt from the fallback check below)")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    CAPTURE_FALLBACKS.clear()  # before the fixtures: what they capture counts for this test
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """A test FAILS when a CUDA-graph capture fell back to eager while it ran (speculate.cache.
    CAPTURE_FALLBACKS): a graphs or emulated-graphs test would otherwise pass on the eager path,
    testing no graph (on the H200 a benchmark once ran everything eagerly and no test noticed).
    Tests that make a capture fail on purpose carry @pytest.mark.capture_fallback."""
    result = yield
    fell_back = list(CAPTURE_FALLBACKS)
    if fell_back and item.get_closest_marker("capture_fallback") is None:
        pytest.fail(f"{len(fell_back)} CUDA-graph capture(s) fell back to eager, so the graphs were not tested: "
                    + "; ".join(fell_back), pytrace=False)
    return result


@pytest.fixture(scope="module")
def tiny_drafter(tmp_path_factory) -> TinyDrafter:
    """A tiny 8-layer llama target (internal aux layers [1, 3, 4]) and a drafter for it with a
    100-token draft vocab, saved in `root/target` and `root/drafter`; built once per module
    (tests/test_export.py, test_export_vllm.py, test_interop.py). See testing.make_tiny_drafter."""
    return make_tiny_drafter(tmp_path_factory.mktemp("tiny_drafter"))


@pytest.fixture
def one_thread():
    """Tiny matmuls on a shared 2-core machine: thread handoffs cost more than they give. Modules of
    many small stage runs take it for every test: `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
