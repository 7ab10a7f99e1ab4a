"""The whole DeltaNet decode step (T == 1) in one kernel: conv state update + SiLU, q/k L2 norm, gates,
fp32 delta-rule state update (state read once, written once), output and gated RMSNorm * silu(z).

One program per (batch row, key head) owns the conv channels of its q/k head and of the value heads that
read it, so the in-place conv state update has no readers in other programs; it walks those value heads,
each a full [dk, dv] state tile, which also puts a whole value-head row in one program for the norm."""

import torch
import triton
import triton.language as tl

from kernels.gdn.gates import gates


@triton.jit
def _conv_step(x_ptr, conv_ptr, w_ptr, ch, mask, KW: tl.constexpr, KP: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """SiLU(conv) of one new token for channels ch [N]; shifts the token into the conv state [C, KW-1]
    (KP = next power of two >= KW-1: the state slots as one tile)."""
    j = tl.arange(0, KP)
    slots = conv_ptr + ch[:, None] * (KW - 1) + j[None, :]  # [N, KP]
    old = tl.load(slots, mask=mask[:, None] & (j < KW - 1)[None, :], other=0.0)
    shifted = tl.load(slots + 1, mask=mask[:, None] & (j < KW - 2)[None, :], other=0.0)  # old slot j + 1
    x = tl.load(x_ptr + ch, mask=mask, other=0.0).to(conv_ptr.dtype.element_ty)  # [N]
    w_old = tl.load(w_ptr + ch[:, None] * KW + j[None, :], mask=mask[:, None] & (j < KW - 1)[None, :], other=0.0)
    acc = tl.sum(old.to(tl.float32) * w_old.to(tl.float32), axis=1)
    acc += x.to(tl.float32) * tl.load(w_ptr + ch * KW + KW - 1, mask=mask, other=0.0).to(tl.float32)
    # replicated lanes may still be reading the old state: every read happens before the first write
    tl.debug_barrier()
    new = tl.where((j == KW - 2)[None, :], x[:, None], shifted)
    tl.store(slots, new, mask=mask[:, None] & (j < KW - 1)[None, :])
    y = acc * tl.sigmoid(acc)
    return y.to(OUT_DTYPE).to(tl.float32)  # the reference rounds the conv output to the activation dtype


@triton.jit
def _l2norm(x):
    return x * tl.rsqrt(tl.sum(x * x, axis=0) + 1e-6)


@triton.jit
def _decode_kernel(
    x_ptr,  # [B, C] mixed q|k|v of the new token
    z_ptr,  # [B, NV*DV]
    a_ptr,  # [B, NV]
    b_ptr,  # [B, NV]
    conv_w_ptr,  # [C, KW]
    A_log_ptr,  # [NV]
    dt_bias_ptr,  # [NV]
    norm_w_ptr,  # [DV]
    conv_ptr,  # [B, C, KW-1], updated in place
    state_ptr,  # [B, NV, DK, DV] fp32, updated in place
    out_ptr,  # [B, NV*DV]
    C,
    eps,
    scale,
    NK: tl.constexpr,
    G: tl.constexpr,  # value heads per key head
    DK: tl.constexpr,
    DV: tl.constexpr,
    KW: tl.constexpr,
    KP: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
):
    b, hk = tl.program_id(0), tl.program_id(1)
    NV = NK * G
    dtype = out_ptr.dtype.element_ty
    x_row, conv_row = x_ptr + b * C, conv_ptr + b * C * (KW - 1)
    ik, iv = tl.arange(0, BK), tl.arange(0, BV)
    mk, mv = ik < DK, iv < DV

    q = _l2norm(_conv_step(x_row, conv_row, conv_w_ptr, hk * DK + ik, mk, KW, KP, dtype)) * scale  # [BK]
    k = _l2norm(_conv_step(x_row, conv_row, conv_w_ptr, (NK + hk) * DK + ik, mk, KW, KP, dtype))  # [BK]
    norm_w = tl.load(norm_w_ptr + iv, mask=mv, other=0.0)
    for r in tl.static_range(G):
        h = hk * G + r
        s_ptrs = state_ptr + ((b * NV + h) * DK + ik[:, None]) * DV + iv[None, :]
        s = tl.load(s_ptrs, mask=mk[:, None] & mv[None, :], other=0.0)  # [BK, BV], issued first: the long wait
        v = _conv_step(x_row, conv_row, conv_w_ptr, 2 * NK * DK + h * DV + iv, mv, KW, KP, dtype)  # [BV]
        g, beta = gates(a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, b * NV + h, h, h < NV)
        s *= tl.exp(g)
        delta = (v - tl.sum(s * k[:, None], axis=0)) * beta  # [BV]
        s += k[:, None] * delta[None, :]
        o = tl.sum(s * q[:, None], axis=0)  # [BV]
        tl.store(s_ptrs, s, mask=mk[:, None] & mv[None, :])

        # gated RMSNorm over the value-head row, with the reference's roundings to the activation dtype
        o = o.to(dtype).to(tl.float32)
        y = (o * tl.rsqrt(tl.sum(o * o, axis=0) / DV + eps)).to(dtype)
        z = tl.load(z_ptr + b * NV * DV + h * DV + iv, mask=mv, other=0.0).to(tl.float32)
        out = (norm_w * y).to(tl.float32) * z * tl.sigmoid(z)
        tl.store(out_ptr + b * NV * DV + h * DV + iv, out.to(dtype), mask=mv)


def gated_delta_net_decode(
    mixed_qkv, z, a, b, conv_weight, A_log, dt_bias, norm_weight, conv_state, recurrent_state, num_k_heads, eps
) -> torch.Tensor:
    """naive.gated_delta_net for T == 1 as one kernel launch; same arguments, same in-place state updates."""
    B, T, C = mixed_qkv.shape
    assert T == 1
    nv, dk, dv = recurrent_state.shape[1:]
    nk = num_k_heads
    for t in (mixed_qkv, z, a, b, conv_weight, conv_state, recurrent_state):
        assert t.is_contiguous()
    out = torch.empty(B, T, nv * dv, dtype=mixed_qkv.dtype, device=mixed_qkv.device)
    BK, BV = triton.next_power_of_2(dk), triton.next_power_of_2(dv)
    kw = conv_weight.shape[-1]
    _decode_kernel[(B, nk)](
        mixed_qkv, z, a, b, conv_weight, A_log, dt_bias, norm_weight, conv_state, recurrent_state, out,
        C, eps, dk**-0.5,
        NK=nk, G=nv // nk, DK=dk, DV=dv, KW=kw, KP=triton.next_power_of_2(kw - 1), BK=BK, BV=BV,
        num_warps=8 if BK * BV >= 128 * 64 else 4,
    )  # fmt: skip
    return out
