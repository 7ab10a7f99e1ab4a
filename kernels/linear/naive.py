"""PyTorch reference for the dense projections: the model's `kernels.linear=torch` path and the kernels' oracle."""

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T -> [..., N] in x's dtype."""
    return F.linear(x, weight)
