"""Fixtures shared by several test modules."""
from __future__ import annotations

import pytest

from draftsmith.testing import TinyDrafter, make_tiny_drafter


@pytest.fixture(scope="module")
def tiny_drafter(tmp_path_factory) -> TinyDrafter:
    """A tiny 8-layer llama target (internal aux layers [1, 3, 4]) and a drafter for it with a
    100-token draft vocab, saved in `root/target` and `root/drafter`; built once per module
    (tests/test_export.py, test_export_vllm.py, test_interop.py). See testing.make_tiny_drafter."""
    return make_tiny_drafter(tmp_path_factory.mktemp("tiny_drafter"))
