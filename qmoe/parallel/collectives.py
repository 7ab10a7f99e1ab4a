"""Collectives as custom ops (`qmoe::all_reduce`, `qmoe::all_gather`) over torch.distributed process groups.

As custom ops with fakes they export: an exported method holds one opaque call per collective, and a CUDA graph
captures the NCCL kernel it launches. Groups are passed by name ("tp": the mixer's row of ranks, "world": every
rank), registered once by `set_groups`. Every call is recorded in one place (`record`) into the active
collective ledger, if any (`recording`), as (kind, bytes) under the method that runs it: all_reduce counts the
reduced tensor's bytes, all_gather the gathered output's.
"""

import contextlib

import torch
import torch.distributed as dist

import kernels

GROUPS: dict[str, object] = {}  # name -> ProcessGroup (None = the default group)
SIZES: dict[str, int] = {}
REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
KINDS = ("all_reduce", "all_gather", "all_to_all")


class _Active:
    ledger = None  # a TransferLedger (or anything with record_collective(kind, nbytes, method, group))
    method = "forward"
    captured: list | None = None  # while a CUDA graph captures: the collectives its replays will run


ACTIVE = _Active()


def set_groups(groups: dict[str, object]) -> None:
    """Register the process groups by name (every rank calls this with the same names)."""
    GROUPS.clear()
    SIZES.clear()
    for name, group in groups.items():
        GROUPS[name] = group
        SIZES[name] = dist.get_world_size(group)


def size(group: str) -> int:
    return SIZES.get(group, 1)


def record(kind: str, nbytes: int, group: str) -> None:
    """The one site that records a collective: into the active ledger, and into the capture being made."""
    if ACTIVE.captured is not None:
        ACTIVE.captured.append((kind, nbytes, group))
        return  # a capture runs nothing: each replay records it (replayed)
    if ACTIVE.ledger is not None:
        ACTIVE.ledger.record_collective(kind, nbytes, ACTIVE.method, group)


@contextlib.contextmanager
def recording(ledger, method: str):
    """Collectives run inside the block are recorded in `ledger` under `method`."""
    saved = ACTIVE.ledger, ACTIVE.method
    ACTIVE.ledger, ACTIVE.method = ledger, method
    try:
        yield
    finally:
        ACTIVE.ledger, ACTIVE.method = saved


@contextlib.contextmanager
def capturing():
    """Yields the list of collectives a CUDA-graph capture records, so each replay can record them again."""
    saved, ACTIVE.captured = ACTIVE.captured, []
    try:
        yield ACTIVE.captured
    finally:
        ACTIVE.captured = saved


def replayed(captured: list) -> None:
    """Record the collectives of one replay of a captured graph (its NCCL kernels run without Python)."""
    if ACTIVE.ledger is not None:
        for kind, nbytes, group in captured:
            ACTIVE.ledger.record_collective(kind, nbytes, ACTIVE.method, group)


def all_reduce_consumed(x: torch.Tensor, group: str, op: str = "sum") -> torch.Tensor:
    """x reduced over `group` in its own memory (a contiguous copy of it if it is not contiguous): for a tensor
    nothing else reads, a module's partial sums. What qmoe::all_reduce does after a copy of x; without that copy a
    TP2 step of the 35B runs 80 fewer kernels (the exported delegate calls this where the graph allows it:
    qmoe.export.program.eager_custom_ops)."""
    x = x.contiguous()
    dist.all_reduce(x, op=REDUCE_OPS[op], group=GROUPS[group])
    record("all_reduce", x.nbytes, group)
    return x


@torch.library.custom_op("qmoe::all_reduce", mutates_args=())
def _all_reduce_op(x: torch.Tensor, group: str, op: str) -> torch.Tensor:
    return all_reduce_consumed(x.clone(memory_format=torch.contiguous_format), group, op)  # one copy, contiguous


@_all_reduce_op.register_fake
def _(x, group, op):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("qmoe::all_gather", mutates_args=())
def _all_gather_op(x: torch.Tensor, group: str) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty(SIZES[group], *x.shape)
    if dist.get_backend(GROUPS[group]) == "nccl":
        dist.all_gather_into_tensor(out, x, group=GROUPS[group])
    else:  # gloo has no all_gather_into_tensor
        dist.all_gather(list(out.unbind(0)), x, group=GROUPS[group])
    record("all_gather", out.nbytes, group)
    return out


@_all_gather_op.register_fake
def _(x, group):
    return x.new_empty(SIZES[group], *x.shape)


def all_reduce(x: torch.Tensor, group: str, op: str = "sum") -> torch.Tensor:
    """x reduced over `group` (a new tensor); x itself when the group is one rank."""
    return x if size(group) == 1 else _all_reduce_op(x, group, op)


def reduced(x: torch.Tensor, group: str | None) -> torch.Tensor:
    """The sum of x over `group` (a module's partial sums, which nobody reads after: summed in place outside a
    tracer); x itself for None (the module is not sharded)."""
    if group is None:
        return x
    return _all_reduce_op(x, group, "sum") if kernels.tracing() else all_reduce_consumed(x, group)


def all_gather(x: torch.Tensor, group: str) -> torch.Tensor:
    """[group size, *x.shape]: every rank's x, in rank order."""
    return x[None] if size(group) == 1 else _all_gather_op(x, group)
