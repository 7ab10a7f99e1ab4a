"""Shared test setup: Triton runs in its interpreter without CUDA; `gpu` tests skip without it."""

import os

import torch

if not torch.cuda.is_available():
    # Must be set before any @triton.jit runs: the kernels are then executed by Triton's CPU interpreter.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


@pytest.fixture
def device() -> str:
    return "cuda" if HAS_CUDA else "cpu"
