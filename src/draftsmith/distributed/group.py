"""The one process-group setup of every stage that runs on several ranks (capture, train, online
training), and FSDP2 applied from outside the model, for 1..N ranks.

`init_distributed()` reads torchrun's environment (distributed.ranks.torchrun_ranks: RANK, WORLD_SIZE,
LOCAL_RANK; MASTER_ADDR/PORT via env://); without it the world is one process and no process group
is created. `parallelize()` shards a module with FSDP2 (`fully_shard`) at world size > 1 and
returns it unchanged at world size 1: the training loop is the same code either way.
`process_group_scope()` owns the group's end: the CLI wraps each recipe command in it, so the
group lives from the first stage that needs it to the end of the command. See docs/distributed.md.
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import gc
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist

from ..messages import DraftsmithError
from .ranks import process_rank, torchrun_ranks


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise DraftsmithError(f"device {device!r} asked for but no CUDA GPU is visible; set device: cpu (or auto)")
    return torch.device(device)


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device: str = "auto") -> DistInfo:
    """(rank, world size, local rank, device). Under torchrun: env:// rendezvous, NCCL on GPU
    (one GPU per local rank), gloo on CPU. Idempotent: a second call reuses the group."""
    rank, world, local_rank = torchrun_ranks()
    dev = resolve_device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", local_rank if world > 1 else torch.cuda.current_device())
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world > 1 and not dist.is_initialized():
        if dev.type == "cuda":
            dist.init_process_group("nccl", init_method="env://", device_id=dev)
        else:
            dist.init_process_group("gloo", init_method="env://")
        _destroy_at_exit()
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    return DistInfo(rank, world, local_rank, dev)


def rank_device(device: str, info: DistInfo) -> str:
    """The device this rank loads the target on: under torchrun, `auto` and `cuda` mean the
    rank's own GPU (cuda:LOCAL_RANK); anything else (cpu, cuda:N) as given."""
    if info.world_size > 1 and device in ("auto", "cuda") and torch.cuda.is_available():
        return f"cuda:{info.local_rank}"
    return device


def parallelize(module: torch.nn.Module, info: DistInfo, param_dtype: torch.dtype) -> torch.nn.Module:
    """Shard `module`'s parameters over all ranks with FSDP2. Parameters stay float32 (master
    weights, so the optimizer state is float32); each forward all-gathers them in param_dtype
    and gradients are reduce-scattered in float32. World size 1: returned unchanged."""
    if info.world_size == 1:
        return module
    # why here: the FSDP modules take ~1.8 s to import, and one rank never needs them
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(info.device.type, (info.world_size,))
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    return fully_shard(module, mesh=mesh, mp_policy=mp)


def is_sharded(module: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule  # why here: ~1.8 s to import, needed only to ask

    return isinstance(module, FSDPModule)


def all_reduce_sum(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.world_size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def barrier(info: DistInfo) -> None:
    if info.world_size > 1:
        dist.barrier()


def from_rank0(obj: Any, info: DistInfo) -> Any:
    """Rank 0's `obj` on every rank (a collective: every rank must call it)."""
    if info.world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (a collective: every rank must call it), or t itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def destroy_distributed(sync: bool = True) -> None:
    """Tear the process group down; with `sync` (the ranks ended normally) after a barrier, so no rank
    closes its connections while another still works (a rank that returned first and tore gloo down
    was aborted now and then: "terminate called without an active exception"). After an error, no
    barrier: the other ranks may never reach it. The group goes even when the barrier fails."""
    if dist.is_initialized():
        try:
            if sync:
                dist.barrier()
        finally:
            gc.collect()  # work objects held by cycles (sharded modules, their hooks) go while the group is up
            dist.destroy_process_group()


@functools.lru_cache(maxsize=None)
def _destroy_at_exit() -> None:
    """Registered once, when init_distributed sets a group up: a group still up when the interpreter
    exits (a script or test that ran stages without process_group_scope) is destroyed while Python is
    whole. Left to the interpreter's finalization, gloo's worker threads free the tensors of their
    finished work after the interpreter is gone, and the rank aborts now and then ("terminate called
    without an active exception", exit -6; 1 in 3 two-rank runs of init, all_reduce, exit here;
    pytorch/pytorch#179291). No barrier: at exit this rank cannot tell an error from a normal end."""
    def at_exit() -> None:
        if dist.is_initialized():
            gc.collect()  # the work objects still referenced from cycles go before their group
            dist.destroy_process_group()

    atexit.register(at_exit)


@contextlib.contextmanager
def process_group_scope() -> Iterator[None]:
    """The lifetime of the process group that a command's stages set up (init_distributed is
    idempotent, so capture, train and online training share one group): torn down once when the
    command ends, after a barrier when it succeeded, without one after an error or an interrupt
    (the other ranks may never reach it). A group that was up before the scope is left alone:
    whoever created it owns it. World size 1 (no group): nothing to do."""
    owned = not dist.is_initialized()
    ok = False
    try:
        yield
        ok = True
    finally:
        if owned:
            try:
                destroy_distributed(sync=ok)
            except RuntimeError as e:  # torch's collective errors (a peer that died) are RuntimeErrors
                if ok:  # after an error, that error is the one to report
                    raise DraftsmithError(f"rank {process_rank()}: the command's work is done, but the barrier at its end "
                                          f"failed ({str(e).splitlines()[0][:160] if str(e) else type(e).__name__}): another "
                                          "rank ended with an error or died; see that rank's log") from e
