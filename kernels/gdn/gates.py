"""The DeltaNet gates, shared by the decode and prefill kernels."""

import triton
import triton.language as tl


@triton.jit
def gates(a_ptrs, b_ptrs, A_log_ptr, dt_bias_ptr, h, mask):
    """Log decay g = -exp(A_log) softplus(a + dt_bias) and beta = sigmoid(b) of value head h, from the a and b
    at a_ptrs, b_ptrs; 0 where masked off (padded tokens then neither decay nor write the state)."""
    a = tl.load(a_ptrs, mask=mask, other=0.0).to(tl.float32) + tl.load(dt_bias_ptr + h).to(tl.float32)
    softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(a)))  # torch's softplus threshold
    g = -tl.exp(tl.load(A_log_ptr + h).to(tl.float32)) * softplus
    beta = tl.sigmoid(tl.load(b_ptrs, mask=mask, other=0.0).to(tl.float32))
    return tl.where(mask, g, 0.0), tl.where(mask, beta, 0.0)
