"""Triton Gated DeltaNet: the model's `kernels.gdn=triton` path, same function and signature as naive.py.

T == 1 (decode) is one fused kernel (fused_recurrent.py); T > 1 (prefill) is the causal conv, the chunked
WY/UT delta rule and the gated norm (conv.py, chunk.py). The projections' outputs are read in place as the
fused in_proj's strided slices. Under `kernels.tracing()` the call goes through a custom op that declares its
in-place state updates (torch.export; the decode step captures in a CUDA graph); in eager it launches directly.
"""

import torch

import kernels
from kernels.gdn.chunk import gated_delta_net_prefill
from kernels.gdn.fused_recurrent import gated_delta_net_decode


@torch.library.custom_op("qmoe_gdn::gated_delta_net", mutates_args=("conv_state", "recurrent_state"))
def _gated_delta_net(
    mixed_qkv: torch.Tensor,
    z: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    conv_weight: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    conv_state: torch.Tensor,
    recurrent_state: torch.Tensor,
    num_k_heads: int,
    eps: float,
) -> torch.Tensor:
    return _launch(
        mixed_qkv, z, a, b, conv_weight, A_log, dt_bias, norm_weight, conv_state, recurrent_state, num_k_heads, eps
    )


def _launch(mixed_qkv, z, a, b, conv_weight, A_log, dt_bias, norm_weight, conv_state, recurrent_state, nk, eps):
    impl = gated_delta_net_decode if mixed_qkv.shape[1] == 1 else gated_delta_net_prefill
    return impl(mixed_qkv, z, a, b, conv_weight, A_log, dt_bias, norm_weight, conv_state, recurrent_state, nk, eps)


@_gated_delta_net.register_fake
def _(mixed_qkv, z, a, b, conv_weight, A_log, dt_bias, norm_weight, conv_state, recurrent_state, num_k_heads, eps):
    B, T, _ = mixed_qkv.shape
    return mixed_qkv.new_empty(B, T, recurrent_state.shape[1] * recurrent_state.shape[3])


def gated_delta_net(
    mixed_qkv: torch.Tensor,  # [B, T, C] output of in_proj_qkv
    z: torch.Tensor,  # [B, T, nv * dv] output of in_proj_z
    a: torch.Tensor,  # [B, T, nv] output of in_proj_a
    b: torch.Tensor,  # [B, T, nv] output of in_proj_b
    conv_weight: torch.Tensor,  # [C, 1, K]
    A_log: torch.Tensor,  # [nv]
    dt_bias: torch.Tensor,  # [nv]
    norm_weight: torch.Tensor,  # [dv]
    conv_state: torch.Tensor,  # [B, C, K-1], updated in place
    recurrent_state: torch.Tensor,  # [B, nv, dk, dv] fp32, updated in place
    num_k_heads: int,
    eps: float,
) -> torch.Tensor:
    """DeltaNet core between in_proj and out_proj -> [B, T, nv * dv], as naive.gated_delta_net."""
    op = _gated_delta_net if kernels.tracing() else _launch
    return op(
        mixed_qkv, z, a, b, conv_weight, A_log, dt_bias, norm_weight, conv_state, recurrent_state, num_k_heads, eps
    )
