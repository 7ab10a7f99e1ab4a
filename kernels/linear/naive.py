"""PyTorch reference for the dense projections: the model's `kernels.linear=torch` path and the kernels' oracle."""

import torch
import torch.nn.functional as F

from kernels.norm import naive as norm_naive


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T -> [..., N] in x's dtype."""
    return F.linear(x, weight)


def linear_out(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """linear(x, weight) written into `out` [..., N] (contiguous, x's dtype): the out-variant an exported method
    uses to compute its output straight into the planned buffer."""
    return torch.matmul(x, weight.t(), out=out)


def add_rms_norm_linear(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The add + RMSNorm before a projection, and the projection -> (linear(normed, weight), normed, hidden):
    hidden = x + residual (the new residual stream), normed = rms_norm(hidden, norm_weight, eps)."""
    normed, hidden = norm_naive.add_rms_norm(x, residual, norm_weight, eps)
    return F.linear(normed, weight), normed, hidden
