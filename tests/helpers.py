"""Test helpers: the tiny model's architecture, NaN-poisoned outputs, relative error against a reference."""

from pathlib import Path

import torch
import yaml

from qmoe.model import ModelConfig

# The default model (configs/model/qwen35_moe_tiny.yaml): every structural feature at CPU-test size.
TINY_ARCH = yaml.safe_load((Path(__file__).parents[1] / "configs/model/qwen35_moe_tiny.yaml").read_text())["arch"]


def tiny_config(**changes) -> ModelConfig:
    return ModelConfig.from_dict({**TINY_ARCH, **changes})


def poisoned(*shape, dtype=torch.float32, device="cpu") -> torch.Tensor:
    """An output buffer filled with NaN, so anything a kernel forgets to write fails the comparison."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere in out gives inf."""
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def captured(fn):
    """(CUDA graph, its static output) of fn(), captured after one warm-up call on a side stream (compilation and
    first-call allocations stay out of the capture); replay the graph after writing new inputs in place."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out
