"""Chunked gated delta rule for prefill (T > 1), chunk 64 in the WY/UT form, in three launches:

1. `_wy_kernel`, parallel over (chunk, batch * value head): per chunk, A = strictly-lower beta k k^T decay,
   T = (I + A)^-1 (16x16 diagonal blocks by forward substitution, off-diagonal blocks by block
   substitution with tl.dot), u = T (beta v) and w = T (beta exp(gc) k); stores u, w and the in-chunk
   cumulative log decay gc.
2. `_chunk_state_kernel`, per (value block, batch * value head), sequential over chunks with the fp32
   state [dk, BV] in registers: v_new = u - w S, o = (q exp(gc)) S + (q k^T decay, causal) v_new,
   S <- exp(gc_last) S + (k exp(gc_last - gc))^T v_new. Starts from and leaves the recurrent state.
3. `_gated_norm_kernel`: RMSNorm of each value-head row of o, * weight * silu(z).

q and k are L2-normed (q scaled) where they are loaded, from the conv output, and the gates g and beta are
computed from a and b in the WY kernel, so no normalised copies are written.
"""

import torch
import triton
import triton.language as tl

from kernels.gdn.conv import causal_conv1d
from kernels.gdn.gates import gates

CHUNK = 64  # the kernels hard-code it (and its 16-token diagonal blocks) as literals


@triton.jit
def _load_rows(ptr, rows, row_mask, col0, D: tl.constexpr, BD: tl.constexpr, NORM: tl.constexpr):
    """[len(rows), BD] fp32 tile of columns col0 .. col0+D of row-major rows; L2-normed per row if NORM."""
    i = tl.arange(0, BD)
    x = tl.load(ptr + rows[:, None] + col0 + i[None, :], mask=row_mask[:, None] & (i < D)[None, :], other=0.0)
    x = x.to(tl.float32)
    if NORM:
        x = x * tl.rsqrt(tl.sum(x * x, axis=1) + 1e-6)[:, None]
    return x


@triton.jit
def _wy_block(qkv_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, bt0,
        t0, h, hk, carry,
        T, C,
              NK: tl.constexpr, NV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
              BK: tl.constexpr, BV: tl.constexpr):  # fmt: skip
    """Normed k [16, BK], v [16, BV], beta and cumulative log decay gc [16] of tokens t0 .. t0+16."""
    t = t0 + tl.arange(0, 16)
    mt = t < T
    rows = (bt0 + t) * C  # bt0 = b * T
    k = _load_rows(qkv_ptr, rows, mt, (NK + hk) * DK, DK, BK, True)
    v = _load_rows(qkv_ptr, rows, mt, 2 * NK * DK + h * DV, DV, BV, False)
    g, beta = gates(a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, (bt0 + t) * NV + h, h, mt)
    return k, v, beta, tl.cumsum(g, axis=0) + carry, carry + tl.sum(g, axis=0)


@triton.jit
def _kkt(k_i, beta_i, gc_i, k_j, gc_j, DIAG: tl.constexpr):
    """Block (i, j) of A: beta_i (k_i . k_j) exp(gc_i - gc_j), strictly lower on the diagonal block."""
    a = tl.dot(k_i * beta_i[:, None], tl.trans(k_j))  # [16, 16]
    diff = gc_i[:, None] - gc_j[None, :]
    if DIAG:
        lower = tl.arange(0, 16)[:, None] > tl.arange(0, 16)[None, :]
        return tl.where(lower, a * tl.exp(tl.where(lower, diff, 0.0)), 0.0)  # no exp of the positive upper half
    return a * tl.exp(diff)


@triton.jit
def _inv_unit_lower(a):
    """(I + a)^-1 for a strictly lower [16, 16], by forward substitution one row at a time."""
    rows, cols = tl.arange(0, 16)[:, None], tl.arange(0, 16)[None, :]
    inv = tl.where(rows == cols, 1.0, 0.0)
    for i in range(1, 16):
        a_i = tl.sum(tl.where(rows == i, a, 0.0), axis=0)  # [16] row i of a; zero from column i on
        inv -= tl.where(rows == i, tl.sum(a_i[:, None] * inv, axis=0)[None, :], 0.0)  # rows < i are final
    return inv


@triton.jit
def _dot(a, b):
    # the small block products of the inverse stay in full fp32 (no tf32 on the GPU)
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _store_rows(ptr, row0, x, D: tl.constexpr, BD: tl.constexpr):
    i, r = tl.arange(0, BD), tl.arange(0, 16)
    tl.store(ptr + (row0 + r)[:, None] * D + i[None, :], x.to(ptr.dtype.element_ty), mask=(i < D)[None, :])


@triton.jit
def _wy_kernel(qkv_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, u_ptr, w_ptr, gc_ptr, T, Tp, C,
               NK: tl.constexpr, G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
               BK: tl.constexpr, BV: tl.constexpr):  # fmt: skip
    chunk, bh = tl.program_id(0), tl.program_id(1)
    NV: tl.constexpr = NK * G
    b, h = bh // NV, bh % NV
    hk = h // G
    t0, bt0 = chunk * 64, b * T
    k0, v0, beta0, gc0, carry = _wy_block(
        qkv_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, bt0, t0, h, hk, 0.0, T, C, NK, NV, DK, DV, BK, BV
    )
    k1, v1, beta1, gc1, carry = _wy_block(
        qkv_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, bt0, t0 + 16, h, hk, carry, T, C, NK, NV, DK, DV, BK, BV
    )
    k2, v2, beta2, gc2, carry = _wy_block(
        qkv_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, bt0, t0 + 32, h, hk, carry, T, C, NK, NV, DK, DV, BK, BV
    )
    k3, v3, beta3, gc3, carry = _wy_block(
        qkv_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, bt0, t0 + 48, h, hk, carry, T, C, NK, NV, DK, DV, BK, BV
    )

    # T = (I + A)^-1 block by block: T_ii = (I + A_ii)^-1, T_ij = -T_ii sum_{j <= m < i} A_im T_mj
    d0 = _inv_unit_lower(_kkt(k0, beta0, gc0, k0, gc0, True))
    d1 = _inv_unit_lower(_kkt(k1, beta1, gc1, k1, gc1, True))
    d2 = _inv_unit_lower(_kkt(k2, beta2, gc2, k2, gc2, True))
    d3 = _inv_unit_lower(_kkt(k3, beta3, gc3, k3, gc3, True))
    a10 = _kkt(k1, beta1, gc1, k0, gc0, False)
    a20 = _kkt(k2, beta2, gc2, k0, gc0, False)
    a21 = _kkt(k2, beta2, gc2, k1, gc1, False)
    a30 = _kkt(k3, beta3, gc3, k0, gc0, False)
    a31 = _kkt(k3, beta3, gc3, k1, gc1, False)
    a32 = _kkt(k3, beta3, gc3, k2, gc2, False)
    t10 = -_dot(d1, _dot(a10, d0))
    t21 = -_dot(d2, _dot(a21, d1))
    t32 = -_dot(d3, _dot(a32, d2))
    t20 = -_dot(d2, _dot(a20, d0) + _dot(a21, t10))
    t31 = -_dot(d3, _dot(a31, d1) + _dot(a32, t21))
    t30 = -_dot(d3, _dot(a30, d0) + _dot(a31, t10) + _dot(a32, t20))

    # u = T (beta v), w = T (beta exp(gc) k)
    vb0, vb1, vb2, vb3 = v0 * beta0[:, None], v1 * beta1[:, None], v2 * beta2[:, None], v3 * beta3[:, None]
    kb0 = k0 * (beta0 * tl.exp(gc0))[:, None]
    kb1 = k1 * (beta1 * tl.exp(gc1))[:, None]
    kb2 = k2 * (beta2 * tl.exp(gc2))[:, None]
    kb3 = k3 * (beta3 * tl.exp(gc3))[:, None]
    row0 = bh * Tp + t0
    _store_rows(u_ptr, row0, tl.dot(d0, vb0), DV, BV)
    _store_rows(u_ptr, row0 + 16, tl.dot(t10, vb0) + tl.dot(d1, vb1), DV, BV)
    _store_rows(u_ptr, row0 + 32, tl.dot(t20, vb0) + tl.dot(t21, vb1) + tl.dot(d2, vb2), DV, BV)
    _store_rows(u_ptr, row0 + 48, tl.dot(t30, vb0) + tl.dot(t31, vb1) + tl.dot(t32, vb2) + tl.dot(d3, vb3), DV, BV)
    _store_rows(w_ptr, row0, tl.dot(d0, kb0), DK, BK)
    _store_rows(w_ptr, row0 + 16, tl.dot(t10, kb0) + tl.dot(d1, kb1), DK, BK)
    _store_rows(w_ptr, row0 + 32, tl.dot(t20, kb0) + tl.dot(t21, kb1) + tl.dot(d2, kb2), DK, BK)
    _store_rows(w_ptr, row0 + 48, tl.dot(t30, kb0) + tl.dot(t31, kb1) + tl.dot(t32, kb2) + tl.dot(d3, kb3), DK, BK)
    r = tl.arange(0, 16)
    tl.store(gc_ptr + row0 + r, gc0)
    tl.store(gc_ptr + row0 + 16 + r, gc1)
    tl.store(gc_ptr + row0 + 32 + r, gc2)
    tl.store(gc_ptr + row0 + 48 + r, gc3)


@triton.jit
def _chunk_state_kernel(qkv_ptr, u_ptr, w_ptr, gc_ptr, state_ptr, o_ptr, T, Tp, C, scale,
                        NK: tl.constexpr, G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                        BK: tl.constexpr, BV: tl.constexpr):  # fmt: skip
    pid_v, bh = tl.program_id(0), tl.program_id(1)
    NV: tl.constexpr = NK * G
    b, h = bh // NV, bh % NV
    hk = h // G
    ik, iv = tl.arange(0, BK), pid_v * BV + tl.arange(0, BV)
    mk, mv = ik < DK, iv < DV
    s_ptrs = state_ptr + (bh * DK + ik[:, None]) * DV + iv[None, :]
    s = tl.load(s_ptrs, mask=mk[:, None] & mv[None, :], other=0.0)  # [BK, BV] fp32
    r = tl.arange(0, 64)
    causal = r[:, None] >= r[None, :]
    for chunk in range(tl.cdiv(T, 64)):
        t = chunk * 64 + r
        mt = t < T
        rows = (b * T + t) * C
        q = _load_rows(qkv_ptr, rows, mt, hk * DK, DK, BK, True) * scale  # [64, BK]
        k = _load_rows(qkv_ptr, rows, mt, (NK + hk) * DK, DK, BK, True)  # [64, BK]
        scratch = bh * Tp + t  # padded scratch rows: always in bounds
        w = _load_rows(w_ptr, scratch * DK, r >= 0, 0, DK, BK, False)  # [64, BK]
        u = tl.load(u_ptr + scratch[:, None] * DV + iv[None, :], mask=mv[None, :], other=0.0).to(tl.float32)
        gc = tl.load(gc_ptr + scratch)  # [64]
        gc_last = tl.load(gc_ptr + bh * Tp + chunk * 64 + 63)

        v_new = u - tl.dot(w, s)  # [64, BV]
        diff = tl.where(causal, gc[:, None] - gc[None, :], 0.0)
        attn = tl.where(causal, tl.dot(q, tl.trans(k)) * tl.exp(diff), 0.0)  # [64, 64]
        o = tl.dot(q * tl.exp(gc)[:, None], s) + tl.dot(attn, v_new)
        o_ptrs = o_ptr + ((b * T + t) * NV + h)[:, None] * DV + iv[None, :]
        tl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=mt[:, None] & mv[None, :])
        s = s * tl.exp(gc_last) + tl.dot(tl.trans(k * tl.exp(gc_last - gc)[:, None]), v_new)
    tl.store(s_ptrs, s, mask=mk[:, None] & mv[None, :])


@triton.jit
def _gated_norm_kernel(o_ptr, z_ptr, w_ptr, out_ptr, n_rows, eps, D: tl.constexpr, BR: tl.constexpr,
                       BD: tl.constexpr):  # fmt: skip
    """Rows [n_rows, D]: w * rmsnorm(o) * silu(z), rounding like kernels.norm.naive.gated_rms_norm."""
    row = tl.program_id(0) * BR + tl.arange(0, BR)
    i = tl.arange(0, BD)
    mask = (row < n_rows)[:, None] & (i < D)[None, :]
    offs = row[:, None] * D + i[None, :]
    dtype = out_ptr.dtype.element_ty
    o = tl.load(o_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = (o * tl.rsqrt(tl.sum(o * o, axis=1) / D + eps)[:, None]).to(dtype)
    z = tl.load(z_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + i, mask=i < D, other=0.0)
    tl.store(out_ptr + offs, ((w[None, :] * y).to(tl.float32) * z * tl.sigmoid(z)).to(dtype), mask=mask)


def gated_delta_net_prefill(
    mixed_qkv, z, a, b, conv_weight, A_log, dt_bias, norm_weight, conv_state, recurrent_state, num_k_heads, eps
) -> torch.Tensor:
    """naive.gated_delta_net for any T (meant for T > 1); same arguments, same in-place state updates."""
    B, T, C = mixed_qkv.shape
    nv, dk, dv = recurrent_state.shape[1:]
    nk = num_k_heads
    for t in (mixed_qkv, z, a, b, recurrent_state):
        assert t.is_contiguous()
    dtype, device = mixed_qkv.dtype, mixed_qkv.device
    BK, BV = max(16, triton.next_power_of_2(dk)), max(16, triton.next_power_of_2(dv))  # tl.dot needs >= 16
    qkv = causal_conv1d(mixed_qkv, conv_state, conv_weight)  # [B, T, C]

    n_chunks = triton.cdiv(T, CHUNK)
    Tp = n_chunks * CHUNK
    u = torch.empty(B, nv, Tp, dv, dtype=dtype, device=device)
    w = torch.empty(B, nv, Tp, dk, dtype=dtype, device=device)
    gc = torch.empty(B, nv, Tp, dtype=torch.float32, device=device)
    consts = dict(NK=nk, G=nv // nk, DK=dk, DV=dv, BK=BK)
    _wy_kernel[(n_chunks, B * nv)](qkv, a, b, A_log, dt_bias, u, w, gc, T, Tp, C, **consts, BV=BV, num_warps=4)

    o = torch.empty(B, T, nv, dv, dtype=dtype, device=device)
    BVS = min(BV, 64)  # state tile [dk, 64]: more programs, fewer registers
    _chunk_state_kernel[(triton.cdiv(dv, BVS), B * nv)](
        qkv, u, w, gc, recurrent_state, o, T, Tp, C, dk**-0.5, **consts, BV=BVS, num_warps=4
    )

    out = torch.empty(B, T, nv * dv, dtype=dtype, device=device)
    n_rows, BR = B * T * nv, 16
    _gated_norm_kernel[(triton.cdiv(n_rows, BR),)](o, z, norm_weight, out, n_rows, eps, D=dv, BR=BR, BD=BV)
    return out
