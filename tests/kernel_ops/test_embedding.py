"""The forward's prologue (kernels/embedding/triton.py) against the PyTorch reference (kernels/embedding/naive.py):
rows are copied, so every output must equal the reference exactly."""

import pytest
import torch

from kernels.embedding import naive
from kernels.embedding import triton as tri
from tests.helpers import poisoned

# (B, T, V, H, reason)
CASES = [
    (1, 1, 50, 72, "one decode token, H not a power of 2 (masked tail of the block)"),
    (3, 1, 50, 200, "batch 3 decode at three positions"),
    (2, 5, 37, 64, "prefill rows, H a power of 2 (no tail)"),
    (1, 3, 20, tri.MAX_BLOCK_H + 40, "H over one block: two column blocks, positions written once"),
    (2, 1, 30, 48, "strided views: a batch's last column of tokens, every other input position"),
]


def make(B, T, V, H, dtype, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    table = torch.randn(V, H, generator=gen).to(dtype).to(device)
    tokens = torch.randint(0, V, (B, T), generator=gen).to(device)
    tokens[0, 0] = V - 1  # the last row: an off-by-one in the row offset reads past the table
    input_pos = torch.tensor([5 + 17 * b for b in range(B)], device=device)
    if (B, T) == (2, 1):  # views, as the runner passes them: the prompt's last tokens, a strided position
        tokens = torch.cat([tokens, tokens.flip(0)], 1)[:, 1:]
        input_pos = torch.stack([input_pos, input_pos + 100], 1)[:, 0]
        assert not tokens.is_contiguous() and input_pos.stride(0) == 2
    return tokens, input_pos, table


def check(B, T, V, H, dtype, device):
    tokens, input_pos, table = make(B, T, V, H, dtype, device, seed=B + T + H)
    want = naive.embed(tokens, input_pos, table)
    h, residual = poisoned(B, T, H, dtype=dtype, device=device), poisoned(B, T, H, dtype=dtype, device=device)
    positions = torch.full((B, T), -7, dtype=torch.int64, device=device)
    tri.embed_into(tokens, input_pos, table, h, residual, positions)
    for got, ref in zip((h, residual, positions), want, strict=True):
        assert got.dtype == ref.dtype and torch.equal(got, ref)
    for got, ref in zip(tri.embed(tokens, input_pos, table), want, strict=True):
        assert got.shape == ref.shape and torch.equal(got, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,T,V,H,reason", CASES, ids=[c[-1].split(":")[0] for c in CASES])
def test_embed(B, T, V, H, reason, dtype):
    check(B, T, V, H, dtype, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,T,V,H,reason", CASES, ids=[c[-1].split(":")[0] for c in CASES])
def test_embed_gpu(B, T, V, H, reason, dtype):
    check(B, T, V, H, dtype, "cuda")


def test_embed_reference():
    """The reference's contract: table rows, zeros of h's dtype, positions input_pos[b] + t."""
    tokens, input_pos, table = make(2, 3, 10, 8, torch.float32)
    h, residual, positions = naive.embed(tokens, input_pos, table)
    assert torch.equal(h[1, 2], table[tokens[1, 2]]) and torch.equal(residual, torch.zeros(2, 3, 8))
    assert positions.tolist() == [[5, 6, 7], [22, 23, 24]]


def test_embed_refuses_a_strided_table():
    tokens, input_pos, table = make(1, 1, 10, 8, torch.float32)
    with pytest.raises(ValueError, match="rows must be contiguous"):
        tri.embed(tokens, input_pos, table.t().contiguous().t())
