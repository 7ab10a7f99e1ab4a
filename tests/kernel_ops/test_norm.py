"""Triton norms (kernels/norm/triton.py) against the PyTorch reference (kernels/norm/naive.py)."""

import pytest
import torch

from kernels.norm import naive
from kernels.norm import triton as tri
from tests.helpers import poisoned, rel_err

EPS = 1e-6
# rel_err bounds: both sides round once to the output dtype, so they differ by a few ulps at most
TOL = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}

SHAPES = [
    (1, 1, 72),  # one decode row, hidden not a power of 2 (masked tail of the block)
    (3, 1, 200),  # batch 3 decode, odd hidden
    (2, 5, 64),  # prefill rows, power-of-2 hidden (no tail)
    (1, 7, 2048),  # 35B-A3B hidden
]


def _inputs(shape, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen).to(dtype).to(device)
    residual = (3 * torch.randn(*shape, generator=gen)).to(dtype).to(device)  # residual stream is larger
    weight = (0.1 * torch.randn(shape[-1], generator=gen)).to(dtype).to(device)  # zero-centred scale
    return x, residual, weight


def check_rms_norm(shape, dtype, device):
    x, _, weight = _inputs(shape, dtype, device)
    out = poisoned(*shape, dtype=dtype, device=device)
    tri.rms_norm_into(x, weight, EPS, out)
    ref = naive.rms_norm(x.float(), weight.float(), EPS)
    assert rel_err(out, ref) < TOL[dtype]
    assert rel_err(tri.rms_norm(x, weight, EPS), ref) < TOL[dtype]


def check_add_rms_norm(shape, dtype, device):
    x, residual, weight = _inputs(shape, dtype, device)
    out, hidden = poisoned(*shape, dtype=dtype, device=device), poisoned(*shape, dtype=dtype, device=device)
    tri.add_rms_norm_into(x, residual, weight, EPS, out, hidden)
    ref_out, ref_hidden = naive.add_rms_norm(x, residual, weight, EPS)
    assert torch.equal(hidden, ref_hidden)  # the residual stream: same single rounding of the sum
    assert rel_err(out, naive.rms_norm(ref_hidden.float(), weight.float(), EPS)) < TOL[dtype]
    assert rel_err(out, ref_out) < TOL[dtype]
    fused_out, fused_hidden = tri.add_rms_norm(x, residual, weight, EPS)
    assert torch.equal(fused_hidden, ref_hidden) and rel_err(fused_out, ref_out) < TOL[dtype]


def check_gated_rms_norm(shape, dtype, device):
    x, z, _ = _inputs(shape, dtype, device, seed=1)
    weight = (1 + 0.1 * torch.randn(shape[-1], generator=torch.Generator().manual_seed(2))).to(dtype).to(device)
    out = poisoned(*shape, dtype=dtype, device=device)
    tri.gated_rms_norm_into(x, z, weight, EPS, out)
    ref = naive.gated_rms_norm(x, z, weight, EPS)
    assert rel_err(out, ref) < TOL[dtype]
    assert rel_err(tri.gated_rms_norm(x, z, weight, EPS), ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm(shape, dtype):
    check_rms_norm(shape, dtype, "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_add_rms_norm(shape, dtype):
    check_add_rms_norm(shape, dtype, "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "shape",
    [
        (1, 1, 4, 16),  # tiny model: 4 value heads of 16
        (3, 5, 6, 12),  # batch 3, prefill, odd head dim
        (1, 1, 32, 128),  # 35B-A3B decode: 32 value heads of 128
    ],
)
def test_gated_rms_norm(shape, dtype):
    check_gated_rms_norm(shape, dtype, "cpu")


def test_strided_rows():
    """A row-strided view (a slice of a wider tensor) is read in place, as naive reads it."""
    wide = torch.randn(5, 300)
    x, weight = wide[:, :200], 0.1 * torch.randn(200)
    out = poisoned(5, 200)
    tri.rms_norm_into(x, weight, EPS, out)
    assert rel_err(out, naive.rms_norm(x, weight, EPS)) < TOL[torch.float32]


def test_exports():
    """The ops are custom ops with fakes: torch.export traces them and the exported program runs them."""

    class Block(torch.nn.Module):
        def forward(self, x, residual, weight):
            normed, hidden = tri.add_rms_norm(x, residual, weight, EPS)
            return tri.rms_norm(normed, weight, EPS), hidden

    x, residual, weight = _inputs((2, 3, 72), torch.float32, "cpu")
    program = torch.export.export(Block(), (x, residual, weight))
    assert "qmoe_norm.add_rms_norm" in str(program.graph)
    out, hidden = program.module()(x, residual, weight)
    ref_normed, ref_hidden = naive.add_rms_norm(x, residual, weight, EPS)
    assert torch.equal(hidden, ref_hidden)
    assert rel_err(out, naive.rms_norm(ref_normed, weight, EPS)) < TOL[torch.float32]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 3, 64, 4096])  # decode batches and a 4096-token prefill
def test_norms_gpu_35b(rows, dtype):
    check_rms_norm((1, rows, 2048), dtype, "cuda")
    check_add_rms_norm((1, rows, 2048), dtype, "cuda")
    check_gated_rms_norm((1, rows, 32, 128), dtype, "cuda")
