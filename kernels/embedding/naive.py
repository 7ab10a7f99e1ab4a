"""PyTorch reference for the forward's prologue: the model's `kernels.embedding=torch` path and the kernel's oracle."""

import torch
import torch.nn.functional as F


def embed(
    tokens: torch.Tensor, input_pos: torch.Tensor, table: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tokens [B, T] at positions input_pos [B] + t -> (h = table[tokens] [B, T, H], the residual stream before the
    first layer (zeros like h), positions [B, T] int64)."""
    h = F.embedding(tokens, table)
    positions = input_pos[:, None] + torch.arange(tokens.shape[1], device=tokens.device)
    return h, torch.zeros_like(h), positions
