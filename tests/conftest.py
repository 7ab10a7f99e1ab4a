"""Shared test setup: Triton runs in its interpreter without CUDA; `gpu` tests skip without it."""

import os
import sys

import torch

if not torch.cuda.is_available():
    # Must be set before any @triton.jit runs: the kernels are then executed by Triton's CPU interpreter.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
# Under pytest-xdist (the README's `-n logical`) each worker takes its share of the cores: torch's intra-op threads
# would otherwise oversubscribe them (2 workers x 2 threads on the 2-core CI machine).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1 and not HAS_CUDA:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


@pytest.fixture
def device() -> str:
    return "cuda" if HAS_CUDA else "cpu"


@pytest.fixture(autouse=True)
def poisoned_workspaces(monkeypatch):
    """Every kernels.counters.Workspaces buffer is handed out NaN-filled (integers: 12345) in every test, so a
    kernel that reads scratch it did not write in the same call fails instead of reading the last call's values."""
    from torch.utils._python_dispatch import _disable_current_modes

    from kernels.counters import Workspaces

    hand_out = Workspaces.__call__

    def poisoned(self, shape, dtype, device):
        buf = hand_out(self, shape, dtype, device)
        with _disable_current_modes():  # a test's dispatch mode counts the op's torch calls, not this fill
            return buf.fill_(float("nan") if buf.is_floating_point() else 12345)

    monkeypatch.setattr(Workspaces, "__call__", poisoned)


@pytest.fixture(autouse=True)
def release_gpu_memory(request):
    """GPU tests run in parallel processes on one device: each test hands the memory it cached back when it ends
    (else one test's peak stays reserved in its worker and the others run out), and a test whose peak passes
    20 GiB is named (on stderr, and appended to the file QMOE_GPU_MEMLOG names), so a memory-hungry test is
    found, not guessed."""
    if not HAS_CUDA or "gpu" not in request.keywords:
        yield
        return
    torch.cuda.reset_peak_memory_stats()
    yield
    peak = torch.cuda.max_memory_allocated() / 2**30
    if peak > 20:
        line = f"[gpu memory] {request.node.nodeid}: peak {peak:.1f} GiB"
        print(line, file=sys.stderr)
        if os.environ.get("QMOE_GPU_MEMLOG"):
            with open(os.environ["QMOE_GPU_MEMLOG"], "a") as f:
                f.write(line + "\n")
    torch.cuda.empty_cache()
