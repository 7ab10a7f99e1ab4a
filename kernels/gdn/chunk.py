"""Chunked gated delta rule for prefill (T > 1), chunk 64 in the WY/UT form: after the causal conv
(conv.py), three launches:

1. `_wy_kernel`, parallel over (chunk, batch * value head): per chunk, A = strictly-lower beta k k^T decay,
   T = (I + A)^-1 (16x16 diagonal blocks by forward substitution, all four at once; off-diagonal
   blocks by block substitution with tl.dot), u = T (beta v) and w = T (beta exp(gc) k); also everything
   of the output that does not depend on the state: the intra-chunk attention (q k^T decay, causal) and
   the row scales (norms, q's scale, decays) of the state kernel's dots.
2. `_chunk_state_kernel`, per (value block, batch * value head), sequential over chunks with the fp32
   state [dk, BV] in registers, four dots per chunk: v_new = u - w S, o = (q exp(gc)) S + attn v_new,
   S <- exp(gc_last) S + (k exp(gc_last - gc))^T v_new. Starts from and leaves the recurrent state.
3. `_gated_norm_kernel`: RMSNorm of each value-head row of o, * weight * silu(z).

q and k are read raw from the conv output; their L2 norms (and q's scale) scale the rows and columns of the
dot results, and g and beta are computed from a and b in the WY kernel, so no normalised copies are written.
Dot operands are in the activation dtype (bf16 tensor cores on the GPU; fp32/TF32 for fp32), accumulating in
fp32; the recurrent state stays fp32.
"""

import torch
import triton
import triton.language as tl

from kernels.gdn.conv import causal_conv1d
from kernels.gdn.gates import gates
from kernels.launch import cdiv, fast_launch, next_power_of_2

CHUNK = 64  # the kernels hard-code it (and its 16-token blocks) as literals
# launch configs (experiments/tune_prefill.py on the 35B shape at 4096 tokens, H200): the WY kernel's warps
# (4: 240 µs, 8: 365), the state kernel's value columns per program and warps (32 on 4: 111 µs, on 8: 140), the
# gated norm's rows per program and warps (within 1 µs of the best)
WY_CONFIG = dict(num_warps=4)
STATE_CONFIG = dict(BV=32, num_warps=4)
NORM_CONFIG = dict(BR=16, num_warps=4)


@triton.jit
def _dot(a, b):
    # the small block products of the inverse stay in full fp32 (no tf32 on the GPU)
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _inv_unit_lower4(a0, a1, a2, a3):
    """(I + a)^-1 of four strictly lower [16, 16] blocks, by forward substitution one row at a time (exact
    up to rounding even when the powers of a grow large). The four are stacked in two trailing dims of size 2
    so that each step is one reduction for all of them."""
    a = tl.join(tl.join(a0, a1), tl.join(a2, a3))  # [16, 16, 2, 2]
    rows = tl.arange(0, 16)[:, None, None, None]
    cols = tl.arange(0, 16)[None, :, None, None]
    inv = tl.where(rows == cols, 1.0, 0.0) + tl.zeros_like(a)
    for i in range(1, 16):
        a_i = tl.sum(tl.where(rows == i, a, 0.0), axis=0)  # [16, 2, 2] row i of each block, zero from column i
        inv -= tl.where(rows == i, tl.sum(a_i[:, None] * inv, axis=0)[None], 0.0)  # rows < i are final
    inv01, inv23 = tl.split(inv)
    inv0, inv1 = tl.split(inv01)
    inv2, inv3 = tl.split(inv23)
    return inv0, inv1, inv2, inv3


@triton.jit
def _block(t_ptr, i: tl.constexpr, j: tl.constexpr):
    """Block (i, j) [16, 16] of a row-major [64, 64] matrix."""
    r = tl.arange(0, 16)
    return tl.load(t_ptr + (16 * i + r)[:, None] * 64 + 16 * j + r[None, :])


@triton.jit
def _store_block(t_ptr, i: tl.constexpr, j: tl.constexpr, x):
    r = tl.arange(0, 16)
    tl.store(t_ptr + (16 * i + r)[:, None] * 64 + 16 * j + r[None, :], x)


@fast_launch
@triton.jit
def _wy_kernel(qkv_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, u_ptr, w_ptr, gc_ptr, qs_ptr, ks_ptr, attn_ptr,
               t_ptr, T, Tp, C, stride_ab, stride_at, stride_bb, stride_bt, scale,
               NK: tl.constexpr, G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
               BK: tl.constexpr, BV: tl.constexpr):  # fmt: skip
    chunk, bh = tl.program_id(0), tl.program_id(1)
    NV = NK * G
    b, h = bh // NV, bh % NV
    hk = h // G
    r = tl.arange(0, 64)
    t = chunk * 64 + r
    mt = t < T
    ik, iv = tl.arange(0, BK), tl.arange(0, BV)
    rows = qkv_ptr + ((b * T + t) * C)[:, None]
    k_ptrs, k_mask = rows + (NK + hk) * DK + ik[None, :], mt[:, None] & (ik < DK)[None, :]
    k = tl.load(k_ptrs, mask=k_mask, other=0.0)  # [64, BK]
    k_norm = tl.rsqrt(tl.sum(k.to(tl.float32) * k.to(tl.float32), axis=1) + 1e-6)  # [64]
    a_ptrs, b_ptrs = a_ptr + b * stride_ab + t * stride_at + h, b_ptr + b * stride_bb + t * stride_bt + h
    g, beta = gates(a_ptrs, b_ptrs, A_log_ptr, dt_bias_ptr, h, mt)
    gc = tl.cumsum(g, axis=0)  # [64] log decay from the chunk start

    q = tl.load(k_ptrs - NK * DK, mask=k_mask, other=0.0)  # [64, BK]
    q_norm = scale * tl.rsqrt(tl.sum(q.to(tl.float32) * q.to(tl.float32), axis=1) + 1e-6)
    causal, lower = r[:, None] >= r[None, :], r[:, None] > r[None, :]
    decay = tl.exp(tl.where(causal, gc[:, None] - gc[None, :], 0.0))  # [64, 64], no exp of the upper half

    # for the sequential kernel, so that it only does the four state-dependent dots: the output's intra-chunk
    # attention q_i . k_j exp(gc_i - gc_j) (i >= j) of scaled queries and normed keys, and the row scales of
    # its q S and k^T v_new dots (stored at the end)
    attn = tl.where(causal, tl.dot(q, tl.trans(k)) * q_norm[:, None] * k_norm[None, :] * decay, 0.0)
    scratch = bh * Tp + t  # padded rows: always in bounds
    tl.store(attn_ptr + scratch[:, None] * 64 + r[None, :], attn)

    # A = beta_i (k_i . k_j) exp(gc_i - gc_j) of normed keys, strictly lower, through this chunk's scratch
    a = tl.where(lower, tl.dot(k, tl.trans(k)) * (beta * k_norm)[:, None] * k_norm[None, :] * decay, 0.0)
    t_ptr += (bh * Tp + chunk * 64) * 64
    tl.store(t_ptr + r[:, None] * 64 + r[None, :], a)
    tl.debug_barrier()  # A in scratch for every thread's block loads

    # T = (I + A)^-1 by 16-blocks: T_ii = (I + A_ii)^-1, T_ij = -T_ii sum_{j <= m < i} A_im T_mj
    d0, d1, d2, d3 = _inv_unit_lower4(
        _block(t_ptr, 0, 0), _block(t_ptr, 1, 1), _block(t_ptr, 2, 2), _block(t_ptr, 3, 3)
    )
    a10, a20, a30 = _block(t_ptr, 1, 0), _block(t_ptr, 2, 0), _block(t_ptr, 3, 0)
    a21, a31, a32 = _block(t_ptr, 2, 1), _block(t_ptr, 3, 1), _block(t_ptr, 3, 2)
    t10 = -_dot(d1, _dot(a10, d0))
    t21 = -_dot(d2, _dot(a21, d1))
    t32 = -_dot(d3, _dot(a32, d2))
    t20 = -_dot(d2, _dot(a20, d0) + _dot(a21, t10))
    t31 = -_dot(d3, _dot(a31, d1) + _dot(a32, t21))
    t30 = -_dot(d3, _dot(a30, d0) + _dot(a31, t10) + _dot(a32, t20))
    tl.debug_barrier()  # every read of A before T overwrites it (the upper blocks stay zero)
    _store_block(t_ptr, 0, 0, d0)
    _store_block(t_ptr, 1, 1, d1)
    _store_block(t_ptr, 2, 2, d2)
    _store_block(t_ptr, 3, 3, d3)
    _store_block(t_ptr, 1, 0, t10)
    _store_block(t_ptr, 2, 0, t20)
    _store_block(t_ptr, 3, 0, t30)
    _store_block(t_ptr, 2, 1, t21)
    _store_block(t_ptr, 3, 1, t31)
    _store_block(t_ptr, 3, 2, t32)
    tl.debug_barrier()
    tt = tl.load(t_ptr + r[:, None] * 64 + r[None, :])  # [64, 64]

    # u = T (beta v), w = T (beta exp(gc) k / |k|): dot operands in the activation dtype; k is read again
    # (from cache) rather than held in registers through the inverse
    dt = qkv_ptr.dtype.element_ty
    k = tl.load(k_ptrs, mask=k_mask, other=0.0)
    v = tl.load(rows + 2 * NK * DK + h * DV + iv[None, :], mask=mt[:, None] & (iv < DV)[None, :], other=0.0)
    tt = tt.to(dt)
    u = tl.dot(tt, (v * beta[:, None]).to(dt))  # [64, BV]
    w = tl.dot(tt, (k * (beta * k_norm * tl.exp(gc))[:, None]).to(dt))  # [64, BK]
    tl.store(u_ptr + scratch[:, None] * DV + iv[None, :], u.to(u_ptr.dtype.element_ty), mask=(iv < DV)[None, :])
    tl.store(w_ptr + scratch[:, None] * DK + ik[None, :], w.to(w_ptr.dtype.element_ty), mask=(ik < DK)[None, :])
    tl.store(gc_ptr + scratch, gc)

    tl.store(qs_ptr + scratch, q_norm * tl.exp(gc))
    # the cumsum's own last element: gc reaches -1e3, where sum vs cumsum rounding would show through exp
    gc_last = tl.sum(tl.where(r == 63, gc, 0.0), axis=0)
    tl.store(ks_ptr + scratch, k_norm * tl.exp(gc_last - gc))


@fast_launch
@triton.jit
def _chunk_state_kernel(qkv_ptr, u_ptr, w_ptr, gc_ptr, qs_ptr, ks_ptr, attn_ptr, state_ptr, o_ptr, T, Tp, C,
                        NK: tl.constexpr, G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                        BK: tl.constexpr, BV: tl.constexpr):  # fmt: skip
    pid_v, bh = tl.program_id(0), tl.program_id(1)
    NV = NK * G
    b, h = bh // NV, bh % NV
    hk = h // G
    ik, iv = tl.arange(0, BK), pid_v * BV + tl.arange(0, BV)
    mk, mv = ik < DK, iv < DV
    s_ptrs = state_ptr + (bh * DK + ik[:, None]) * DV + iv[None, :]
    s = tl.load(s_ptrs, mask=mk[:, None] & mv[None, :], other=0.0)  # [BK, BV] fp32
    r = tl.arange(0, 64)
    dt = qkv_ptr.dtype.element_ty  # dot operands in the activation dtype (bf16 tensor cores), fp32 accumulation
    for chunk in range(tl.cdiv(T, 64)):
        t = chunk * 64 + r
        mt = t < T
        scratch = bh * Tp + t  # padded scratch rows: always in bounds
        w = tl.load(w_ptr + scratch[:, None] * DK + ik[None, :], mask=mk[None, :], other=0.0)
        u = tl.load(u_ptr + scratch[:, None] * DV + iv[None, :], mask=mv[None, :], other=0.0).to(tl.float32)
        v_new = u - tl.dot(w.to(dt), s.to(dt))  # [64, BV]

        # q and k stay raw in the dots; their norms, scale and decays are the precomputed row scales
        qk_rows = qkv_ptr + ((b * T + t) * C)[:, None] + hk * DK + ik[None, :]
        q = tl.load(qk_rows, mask=mt[:, None] & mk[None, :], other=0.0)  # [64, BK]
        k = tl.load(qk_rows + NK * DK, mask=mt[:, None] & mk[None, :], other=0.0)  # [64, BK]
        attn = tl.load(attn_ptr + scratch[:, None] * 64 + r[None, :])  # [64, 64]
        q_scale, k_scale = tl.load(qs_ptr + scratch), tl.load(ks_ptr + scratch)  # [64]
        chunk_decay = tl.exp(tl.load(gc_ptr + bh * Tp + chunk * 64 + 63))
        o = tl.dot(q.to(dt), s.to(dt)) * q_scale[:, None] + tl.dot(attn.to(dt), v_new.to(dt))
        o_ptrs = o_ptr + ((b * T + t) * NV + h)[:, None] * DV + iv[None, :]
        tl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=mt[:, None] & mv[None, :])
        s = s * chunk_decay + tl.dot(tl.trans(k.to(dt)), (v_new * k_scale[:, None]).to(dt))
    tl.store(s_ptrs, s, mask=mk[:, None] & mv[None, :])


@fast_launch
@triton.jit
def _gated_norm_kernel(o_ptr, z_ptr, w_ptr, out_ptr, n_rows, T, stride_zb, stride_zt, eps, NV: tl.constexpr,
                       D: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):  # fmt: skip
    """Rows [n_rows = B * T * NV, D]: w * rmsnorm(o) * silu(z), rounding like kernels.norm.naive.gated_rms_norm;
    z's value-head row (b, t, h) at b * stride_zb + t * stride_zt + h * D."""
    row = tl.program_id(0) * BR + tl.arange(0, BR)
    i = tl.arange(0, BD)
    mask = (row < n_rows)[:, None] & (i < D)[None, :]
    offs = row[:, None] * D + i[None, :]
    token, h = row // NV, row % NV
    z_row = (token // T) * stride_zb + (token % T) * stride_zt + h * D
    dtype = out_ptr.dtype.element_ty
    o = tl.load(o_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = (o * tl.rsqrt(tl.sum(o * o, axis=1) / D + eps)[:, None]).to(dtype)
    z = tl.load(z_ptr + z_row[:, None] + i[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + i, mask=i < D, other=0.0)
    tl.store(out_ptr + offs, ((w[None, :] * y).to(tl.float32) * z * tl.sigmoid(z)).to(dtype), mask=mask)


def _blocks(dk: int, dv: int) -> tuple[int, int]:
    return max(16, next_power_of_2(dk)), max(16, next_power_of_2(dv))  # tl.dot needs >= 16


def wy_transform(qkv, a, b, A_log, dt_bias, num_k_heads: int, dk: int, dv: int) -> dict:
    """Per chunk of conv output qkv [B, T, C] (contiguous; a, b [B, T, nv] may be (b, t)-strided views), with
    Tp = T rounded up to the chunk: u [B, nv, Tp, dv] and
    w [B, nv, Tp, dk] (activation dtype); fp32 gc (in-chunk log decay), q_scale, k_scale [B, nv, Tp] and
    attn [B, nv, Tp, 64] (the output's intra-chunk attention, activation dtype)."""
    B, T, C = qkv.shape
    nv, nk = a.shape[-1], num_k_heads
    BK, BV = _blocks(dk, dv)
    n_chunks = cdiv(T, CHUNK)
    Tp = n_chunks * CHUNK
    u = torch.empty(B, nv, Tp, dv, dtype=qkv.dtype, device=qkv.device)
    w = torch.empty(B, nv, Tp, dk, dtype=qkv.dtype, device=qkv.device)
    gc = torch.empty(B, nv, Tp, dtype=torch.float32, device=qkv.device)
    q_scale, k_scale = torch.empty_like(gc), torch.empty_like(gc)
    attn = torch.empty(B, nv, Tp, CHUNK, dtype=qkv.dtype, device=qkv.device)
    t_scratch = torch.empty(B, nv, Tp, CHUNK, dtype=torch.float32, device=qkv.device)  # A, then (I + A)^-1
    _wy_kernel[(n_chunks, B * nv)](
        qkv, a, b, A_log, dt_bias, u, w, gc, q_scale, k_scale, attn, t_scratch, T, Tp, C,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), dk**-0.5,
        NK=nk, G=nv // nk, DK=dk, DV=dv, BK=BK, BV=BV, num_warps=WY_CONFIG["num_warps"],
    )  # fmt: skip
    return dict(u=u, w=w, gc=gc, q_scale=q_scale, k_scale=k_scale, attn=attn)


def chunk_delta_rule(qkv, wy: dict, recurrent_state, num_k_heads: int) -> torch.Tensor:
    """o [B, T, nv, dv] (activation dtype) of the delta rule over the chunks, from and into recurrent_state."""
    B, T, C = qkv.shape
    nv, dk, dv = recurrent_state.shape[1:]
    nk = num_k_heads
    BK, BV = _blocks(dk, dv)
    BV = min(BV, STATE_CONFIG["BV"])  # state tile [dk, 32]: 4 programs per 128-wide head
    # 16-bit operands: the chunk loads are pipelined 3 deep (32.5 KiB of shared memory at dk = dv = 128).
    # fp32 (TF32) operands get no pipelining: 3 stages take 376.5 KiB there, 2 take 256 KiB (the H100/H200
    # limit is 227 KiB), 1 takes 72 KiB
    num_stages = 3 if qkv.element_size() <= 2 else 1
    o = torch.empty(B, T, nv, dv, dtype=qkv.dtype, device=qkv.device)
    _chunk_state_kernel[(cdiv(dv, BV), B * nv)](
        qkv, wy["u"], wy["w"], wy["gc"], wy["q_scale"], wy["k_scale"], wy["attn"], recurrent_state, o,
        T, wy["u"].shape[2], C,
        NK=nk, G=nv // nk, DK=dk, DV=dv, BK=BK, BV=BV, num_warps=STATE_CONFIG["num_warps"], num_stages=num_stages,
    )  # fmt: skip
    return o


def gated_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """kernels.norm.naive.gated_rms_norm of o [B, T, nv, dv] (contiguous) with z [B, T, nv * dv] (a (b, t)-strided
    view is read in place) -> [B, T, nv * dv]."""
    B, T, nv, dv = o.shape
    assert o.is_contiguous() and z.stride(-1) == 1
    out = torch.empty(B, T, nv * dv, dtype=o.dtype, device=o.device)
    n_rows, BR = B * T * nv, NORM_CONFIG["BR"]
    BD = _blocks(dv, dv)[1]
    _gated_norm_kernel[(cdiv(n_rows, BR),)](
        o, z, weight, out, n_rows, T, z.stride(0), z.stride(1), eps, NV=nv, D=dv, BR=BR, BD=BD,
        num_warps=NORM_CONFIG["num_warps"],
    )  # fmt: skip
    return out


def gated_delta_net_prefill(
    mixed_qkv, z, a, b, conv_weight, A_log, dt_bias, norm_weight, conv_state, recurrent_state, num_k_heads, eps
) -> torch.Tensor:
    """naive.gated_delta_net for any T (meant for T > 1); same arguments, same in-place state updates.
    mixed_qkv, z, a and b may be (b, t)-strided views (the fused in_proj's slices): read in place, never copied."""
    assert recurrent_state.is_contiguous() and a.stride(-1) == 1 and b.stride(-1) == 1
    dk, dv = recurrent_state.shape[2:]
    qkv = causal_conv1d(mixed_qkv, conv_state, conv_weight)  # [B, T, C]
    wy = wy_transform(qkv, a, b, A_log, dt_bias, num_k_heads, dk, dv)
    o = chunk_delta_rule(qkv, wy, recurrent_state, num_k_heads)
    return gated_norm(o, z, norm_weight, eps)
