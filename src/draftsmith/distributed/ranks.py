"""Which rank this process is, without importing torch.distributed (status, plan and the run
directory's bookkeeping ask it in processes that never start a process group)."""
from __future__ import annotations

import os
import sys


def torchrun_ranks() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's environment; (0, 1, 0) in a plain process.
    The one reader of these variables (group.init_distributed, process_rank)."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_RANK", "0"))


def process_rank() -> int:
    """This process's global rank: torch.distributed's when a process group is up, else
    torchrun's RANK variable, else 0. torch.distributed is not imported for this: a process
    that never imported it has no process group."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    try:
        return torchrun_ranks()[0]
    except ValueError:
        return 0


def is_main_rank() -> bool:
    """True on rank 0 (and in a single process). Under torchrun only rank 0 writes the run
    directory's bookkeeping (stage manifests, the ledger); the other ranks only read it."""
    return process_rank() == 0
