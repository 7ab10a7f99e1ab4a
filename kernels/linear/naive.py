"""PyTorch reference for the dense projections: the model's `kernels.linear=torch` path and the kernels' oracle."""

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T -> [..., N] in x's dtype."""
    return F.linear(x, weight)


def linear_out(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """linear(x, weight) written into `out` [..., N] (contiguous, x's dtype): the out-variant an exported method
    uses to compute its output straight into the planned buffer."""
    return torch.matmul(x, weight.t(), out=out)
