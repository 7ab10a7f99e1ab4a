"""Depthwise causal conv1d + SiLU over a prompt, continuing from and leaving the conv state (prefill)."""

import torch
import triton
import triton.language as tl

from kernels.launch import cdiv, fast_launch, next_power_of_2

# launch config at prefill: time block x channel block (experiments/tune_prefill.py on the 35B shape, H200:
# 32 x 128 on 4 warps 104.8 µs, the 16-token blocks before 117.5)
CONFIG = dict(BT=32, BC=128, num_warps=4)


@fast_launch
@triton.jit
def _causal_conv1d_kernel(
    x_ptr,  # [B, T, C], rows (b, t) at b * stride_xb + t * stride_xt
    w_ptr,  # [C, KW]
    state_ptr,  # [B, C, KW-1], read (first block) then overwritten with the last KW-1 inputs
    out_ptr,  # [B, T, C]
    T,
    C,
    stride_xb,
    stride_xt,
    KW: tl.constexpr,
    KP: tl.constexpr,  # next power of two >= KW-1: the state slots as one tile
    BT: tl.constexpr,
    BC: tl.constexpr,
):
    pid_t, pid_c, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t = pid_t * BT + tl.arange(0, BT)  # [BT]
    c = pid_c * BC + tl.arange(0, BC)  # [BC]
    mc = c < C
    x_base = x_ptr + b * stride_xb
    s_base = state_ptr + b * C * (KW - 1)

    acc = tl.zeros([BT, BC], dtype=tl.float32)
    # the input is cast to the state's dtype first, as the reference concatenates it onto the state
    if pid_t > 0:  # BT >= KW - 1: every tap of this block reads the prompt (no state loads, no selects)
        for j in tl.static_range(KW):
            src = t - (KW - 1) + j  # [BT]
            xv = tl.load(x_base + src[:, None] * stride_xt + c[None, :], mask=(t < T)[:, None] & mc[None, :],
                         other=0.0)  # fmt: skip
            wj = tl.load(w_ptr + c * KW + j, mask=mc, other=0.0).to(tl.float32)  # [BC]
            acc += xv.to(state_ptr.dtype.element_ty).to(tl.float32) * wj[None, :]
    else:
        for j in tl.static_range(KW):
            # tap j reads sequence position t - (KW-1) + j: the prompt when >= 0, else the conv state
            src = t - (KW - 1) + j  # [BT]
            from_x = (src >= 0) & (t < T)
            xv = tl.load(x_base + src[:, None] * stride_xt + c[None, :], mask=from_x[:, None] & mc[None, :],
                         other=0.0)  # fmt: skip
            from_s = (src < 0) & (t < T)
            sv = tl.load(
                s_base + c[None, :] * (KW - 1) + (src + KW - 1)[:, None], mask=from_s[:, None] & mc[None, :],
                other=0.0,
            )  # fmt: skip
            wj = tl.load(w_ptr + c * KW + j, mask=mc, other=0.0).to(tl.float32)  # [BC]
            acc += tl.where(from_x[:, None], xv.to(state_ptr.dtype.element_ty), sv).to(tl.float32) * wj[None, :]
    y = acc * tl.sigmoid(acc)
    tl.store(
        out_ptr + b * T * C + t[:, None] * C + c[None, :],
        y.to(out_ptr.dtype.element_ty),
        mask=(t < T)[:, None] & mc[None, :],
    )

    if pid_t == 0:
        # new state slot i holds sequence position T + i of [old state | x] (length KW-1+T)
        i = tl.arange(0, KP)  # [KP]
        mi = i < KW - 1
        pos = T + i - (KW - 1)  # position in x
        x_tail = tl.load(
            x_base + pos[None, :] * stride_xt + c[:, None], mask=mc[:, None] & (mi & (pos >= 0))[None, :], other=0.0
        )
        s_tail = tl.load(
            s_base + c[:, None] * (KW - 1) + (T + i)[None, :], mask=mc[:, None] & (mi & (pos < 0))[None, :], other=0.0
        )
        new = tl.where((pos >= 0)[None, :], x_tail.to(state_ptr.dtype.element_ty), s_tail)  # [BC, KP]
        # every thread's reads of the old state above happen before any write below
        tl.debug_barrier()
        tl.store(s_base + c[:, None] * (KW - 1) + i[None, :], new, mask=mc[:, None] & mi[None, :])


def causal_conv1d(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """SiLU(depthwise causal conv) of x [B, T, C] continuing from conv_state [B, C, KW-1] (updated in place)
    with weight [C, 1, KW] -> [B, T, C] in x.dtype (contiguous). x may be a (b, t)-strided view (a slice of the
    fused in_proj output): it is read in place."""
    B, T, C = x.shape
    KW = weight.shape[-1]
    assert x.stride(-1) == 1 and conv_state.is_contiguous() and weight.is_contiguous()
    out = torch.empty(B, T, C, dtype=x.dtype, device=x.device)
    BT, BC = CONFIG["BT"], CONFIG["BC"]
    assert BT >= KW - 1, "only the first time block reads the conv state"
    grid = (cdiv(T, BT), cdiv(C, BC), B)
    _causal_conv1d_kernel[grid](
        x,
        weight,
        conv_state,
        out,
        T,
        C,
        x.stride(0),
        x.stride(1),
        KW=KW,
        KP=next_power_of_2(KW - 1),
        BT=BT,
        BC=BC,
        num_warps=CONFIG["num_warps"],
    )
    return out
