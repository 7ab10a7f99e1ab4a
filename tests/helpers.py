"""Helpers for kernel tests: NaN-poisoned outputs and relative error against a reference."""

import torch


def poisoned(*shape, dtype=torch.float32, device="cpu") -> torch.Tensor:
    """An output buffer filled with NaN, so anything a kernel forgets to write fails the comparison."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere in out gives inf."""
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()
