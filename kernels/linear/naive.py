"""PyTorch reference for the dense projections: the model's `kernels.linear=torch` path and the kernels' oracle."""

import torch
import torch.nn.functional as F

from kernels.fp8 import dequantize
from kernels.norm import naive as norm_naive


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T -> [..., N] in x's dtype. With `scale` ([N, ceil(K / 128)], kernels/fp8.py)
    the weight is fp8, dequantized to x's dtype first."""
    return F.linear(x, weight if scale is None else dequantize(weight, scale, x.dtype))


def linear_out(x: torch.Tensor, weight: torch.Tensor, *scale_out: torch.Tensor) -> torch.Tensor:
    """linear(x, weight[, scale]) written into `out` [..., N] (the last argument; contiguous, x's dtype): the
    out-variant an exported method uses to compute its output straight into the planned buffer."""
    *scale, out = scale_out
    weight = weight if not scale else dequantize(weight, scale[0], x.dtype)
    return torch.matmul(x, weight.t(), out=out)


def logits(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """The model's logits: linear(x, weight[, scale]) in x's dtype, then fp32 [..., N]."""
    return linear(x, weight, scale).float()


def add_rms_norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The add + RMSNorm before a projection, and the projection -> (linear(normed, weight[, scale]), normed,
    hidden): hidden = x + residual (the new residual stream), normed = rms_norm(hidden, norm_weight, eps)."""
    normed, hidden = norm_naive.add_rms_norm(x, residual, norm_weight, eps)
    return linear(normed, weight, scale), normed, hidden
