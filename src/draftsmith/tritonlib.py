"""Triton where it is installed: the fast path's kernels (speculate/skinny.py, draft/flash_decode.py) import
it from here. CPU builds of torch ship no Triton and CI must pass without it, so the import is guarded:
`triton` and `tl` are None where it fails. INTERPRET: TRITON_INTERPRET=1 at start, Triton's interpreter,
under which the kernels also run on a CPU (the tests)."""
from __future__ import annotations

import os

try:
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 (any import failure: no kernel)
    triton = tl = None

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
