"""Triton norms: zero-centred RMSNorm, the residual add fused into it, and DeltaNet's gated RMSNorm.

One program per row; every reduction in fp32. Under `kernels.tracing()` each op goes through its
`torch.library.custom_op` (with a fake) so the model exports with torch.export; in eager it launches directly.
The `*_into` launchers write into a caller-given output (tests poison it).
Rounding mirrors naive.py: where the reference rounds an intermediate to the input dtype, so do we.
"""

import torch
import triton
import triton.language as tl

import kernels
from kernels.launch import fast_launch, next_power_of_2
from kernels.pdl import allow_dependents, pdl, wait_for_producers


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[..., N] -> [M, N] with unit stride on the last dim (a view when possible)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _launch_config(n: int) -> tuple[int, int]:
    block = next_power_of_2(n)
    return block, min(max(block // 256, 1), 16)  # ~8 elements per thread for wide rows


@fast_launch
@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    hidden_ptr,
    stride_x,
    stride_res,
    eps,
    N,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    allow_dependents(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # a weight: safe before the wait
    wait_for_producers(PDL)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(x.dtype)  # the residual stream stays in the model dtype
        tl.store(hidden_ptr + row * N + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
    tl.store(out_ptr + row * N + cols, (xf * rstd * (1.0 + w)).to(out_ptr.dtype.element_ty), mask=mask)


@fast_launch
@triton.jit
def _gated_rms_norm_kernel(x_ptr, z_ptr, w_ptr, out_ptr, stride_x, stride_z, eps, N, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
    y = (xf * rstd).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    wy = (w.to(tl.float32) * y.to(tl.float32)).to(x.dtype)  # naive multiplies in the model dtype
    z = tl.load(z_ptr + row * stride_z + cols, mask=mask, other=0.0).to(tl.float32)
    out = wy.to(tl.float32) * z * tl.sigmoid(z)
    tl.store(out_ptr + row * N + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_into(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor) -> None:
    """out (contiguous, x's shape) = rms_norm(x, weight, eps)."""
    x2 = _rows(x)
    block, warps = _launch_config(x2.shape[1])
    on = pdl(x2)
    _rms_norm_kernel[(x2.shape[0],)](
        x2, x2, weight, out, out, x2.stride(0), 0, eps, x2.shape[1],
        HAS_RESIDUAL=False, BLOCK=block, PDL=on, launch_pdl=on, num_warps=warps,
    )  # fmt: skip


def add_rms_norm_into(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor, hidden: torch.Tensor
) -> None:
    """hidden = x + residual; out = rms_norm(hidden): one read of x and residual, one write of each output."""
    x2, res2 = _rows(x), _rows(residual)
    block, warps = _launch_config(x2.shape[1])
    on = pdl(x2)
    _rms_norm_kernel[(x2.shape[0],)](
        x2,
        res2,
        weight,
        out,
        hidden,
        x2.stride(0),
        res2.stride(0),
        eps,
        x2.shape[1],
        HAS_RESIDUAL=True,
        BLOCK=block,
        PDL=on,
        launch_pdl=on,
        num_warps=warps,
    )


def gated_rms_norm_into(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor) -> None:
    """out = weight * rmsnorm(x) * silu(z) per row of the last dim (DeltaNet's plain-weight norm)."""
    x2, z2 = _rows(x), _rows(z)
    block, warps = _launch_config(x2.shape[1])
    _gated_rms_norm_kernel[(x2.shape[0],)](
        x2, z2, weight, out, x2.stride(0), z2.stride(0), eps, x2.shape[1], BLOCK=block, num_warps=warps
    )


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rms_norm_into(x, weight, eps, out)
    return out


def _add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    hidden = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    add_rms_norm_into(x, residual, weight, eps, out, hidden)
    return out, hidden


def _gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    gated_rms_norm_into(x, z, weight, eps, out)
    return out


_rms_norm_op = torch.library.custom_op("qmoe_norm::rms_norm", _rms_norm, mutates_args=())
_add_rms_norm_op = torch.library.custom_op("qmoe_norm::add_rms_norm", _add_rms_norm, mutates_args=())
_gated_rms_norm_op = torch.library.custom_op("qmoe_norm::gated_rms_norm", _gated_rms_norm, mutates_args=())


@_rms_norm_op.register_fake
def _(x, weight, eps):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@_add_rms_norm_op.register_fake
def _(x, residual, weight, eps):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device), torch.empty(x.shape, dtype=x.dtype, device=x.device)


@_gated_rms_norm_op.register_fake
def _(x, z, weight, eps):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm over the last dim: x * rsqrt(mean(x^2) + eps) * (1 + w), in fp32, cast back."""
    return (_rms_norm_op if kernels.tracing() else _rms_norm)(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one pass."""
    return (_add_rms_norm_op if kernels.tracing() else _add_rms_norm)(x, residual, weight, eps)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """DeltaNet's output norm per value head: w * rmsnorm(x) (plain weight), then * silu(z)."""
    return (_gated_rms_norm_op if kernels.tracing() else _gated_rms_norm)(x, z, weight, eps)
