"""The forward's prologue in one launch: the embedding rows, the empty residual stream, the positions.

As torch ops these are four launches before the first layer (arange, add, the embedding gather, zeros: 5.3 us of a
graphed 35B decode step before its first projection, results/profile_decode_loop.json at d2a60d7), none with PDL.
One program per (token, H block) copies its slice of the token's row, zeroes the residual's, and the first H
block writes the position. Launched without PDL, like the torch ops it replaces: it starts once every kernel before
it has completed, and no kernel after it starts before it has completed. The decode kernels' loads before their
PDL wait rely on that: attention's position (written here) and DeltaNet's states (written in the step before).
"""

import torch
import triton
import triton.language as tl

import kernels
from kernels.launch import cdiv, fast_launch, next_power_of_2

__all__ = ["embed", "embed_into"]

MAX_BLOCK_H = 2048  # columns per program: the 35B's hidden size in one (4 KB of bf16), wider ones in blocks


@fast_launch
@triton.jit
def _embed_kernel(
    tokens_ptr, input_pos_ptr, table_ptr, h_ptr, residual_ptr, positions_ptr, T, H, stride_v, stride_tb, stride_tt,
    stride_p, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """Program (row b * T + t, H block): h[row] = table[tokens[row]] and residual[row] = 0 over the block's
    columns; H block 0 writes positions[row] = input_pos[b] + t."""
    row = tl.program_id(0)
    b, t = row // T, row % T
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    token = tl.load(tokens_ptr + b * stride_tb + t * stride_tt)  # any view: a batch's last column, say
    h = tl.load(table_ptr + token * stride_v + cols, mask=mask)
    offs = row.to(tl.int64) * H + cols
    tl.store(h_ptr + offs, h, mask=mask)
    tl.store(residual_ptr + offs, tl.zeros_like(h), mask=mask)
    if tl.program_id(1) == 0:
        tl.store(positions_ptr + row, tl.load(input_pos_ptr + b * stride_p) + t)


def embed_into(tokens, input_pos, table, h, residual, positions) -> None:
    """naive.embed into caller-given h, residual [B, T, H] (contiguous, table's dtype) and positions [B, T]
    (contiguous int64); tokens and input_pos may be any views."""
    B, T = tokens.shape
    H = table.shape[1]
    if table.stride(1) != 1:
        raise ValueError(f"embed: the table's rows must be contiguous, got strides {table.stride()}")
    if B * T == 0:
        return
    block = min(next_power_of_2(H), MAX_BLOCK_H)
    _embed_kernel[(B * T, cdiv(H, block))](
        tokens, input_pos, table, h, residual, positions, T, H, table.stride(0), *tokens.stride(), input_pos.stride(0),
        BLOCK_H=block, num_warps=4,
    )  # fmt: skip


def _embed(
    tokens: torch.Tensor, input_pos: torch.Tensor, table: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, T = tokens.shape
    h = torch.empty((B, T, table.shape[1]), dtype=table.dtype, device=tokens.device)
    residual = torch.empty_like(h)
    positions = torch.empty((B, T), dtype=torch.int64, device=tokens.device)
    embed_into(tokens, input_pos, table, h, residual, positions)
    return h, residual, positions


_embed_op = torch.library.custom_op("qmoe_embedding::embed", _embed, mutates_args=())


@_embed_op.register_fake
def _(tokens, input_pos, table):
    B, T = tokens.shape
    h = tokens.new_empty((B, T, table.shape[1]), dtype=table.dtype)
    return h, torch.empty_like(h), tokens.new_empty((B, T), dtype=torch.int64)


def embed(
    tokens: torch.Tensor, input_pos: torch.Tensor, table: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """naive.embed in one launch."""
    return (_embed_op if kernels.tracing() else _embed)(tokens, input_pos, table)
