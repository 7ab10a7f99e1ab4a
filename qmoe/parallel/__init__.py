"""Tensor and expert parallelism over torch.distributed: NCCL on GPUs, gloo on the CPU.

`torchrun --nproc-per-node N run.py ... parallel.tp=N`: torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK)
says how many processes run; `parallel.tp` x `parallel.ep` must equal it. Without torchrun nothing here runs.
"""

import os

from qmoe.parallel.layout import Layout, fp8_layout_errors, layout_errors

__all__ = ["Layout", "fp8_layout_errors", "layout_errors", "env_rank", "env_world_size", "init", "current"]

_CURRENT = {"layout": Layout()}


def env_world_size() -> int:
    """Processes torchrun started (1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def env_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def env_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def current() -> Layout:
    """The layout of this process (tp = ep = 1 until `init`)."""
    return _CURRENT["layout"]


def init(tp: int, ep: int, device_type: str) -> Layout:
    """Join the process group torchrun set up (once per process), register the "tp" and "world" groups, and
    return this rank's layout. On CUDA the rank's device is cuda:LOCAL_RANK."""
    import torch
    import torch.distributed as dist

    from qmoe.parallel import collectives

    layout = Layout(tp, ep, env_rank())
    if current() == layout and dist.is_initialized():
        return layout
    if device_type == "cuda":
        torch.cuda.set_device(env_local_rank())
    if not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        kwargs = {"device_id": torch.device("cuda", env_local_rank())} if device_type == "cuda" else {}
        dist.init_process_group(backend, **kwargs)
    rows = [dist.new_group(list(range(e * tp, (e + 1) * tp))) for e in range(ep)]  # every rank makes every group
    collectives.set_groups({"tp": rows[layout.ep_rank], "world": None})
    _CURRENT["layout"] = layout
    return layout


def shutdown() -> None:
    """Leave the process group (at the end of a run that joined one), every rank together, and drop this module's
    references to the groups first, so that destroy_process_group frees them (joining gloo's threads) now. A group
    still referenced was freed at interpreter exit instead, where a gloo rank could die in "terminate called
    without an active exception" (SIGABRT) after every result had been handed over: 3 of ~80 two-process test runs
    on the CPU machine."""
    import torch.distributed as dist

    from qmoe.parallel import collectives

    if dist.is_initialized():
        dist.barrier()
        collectives.set_groups({})
        _CURRENT["layout"] = Layout()
        dist.destroy_process_group()


def report_failure() -> bool:
    """Tell the other ranks this one failed (through the store torchrun's rendezvous made); False if another
    rank already had (then this rank's error is the echo of that one: its peer vanished mid-collective)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return True
    try:
        store = dist.distributed_c10d._get_default_store()
        return store.add("qmoe_failed", 1) == 1
    except Exception:  # noqa: BLE001 - the store went with a failed peer: report, do not hide the error
        return True
