"""Triton gated attention: the whole layer between the q|k|v projection and o_proj, q/k RMSNorm + partial RoPE,
the static KV cache write, causal GQA attention and the sigmoid output gate, reading q, gate, k and v in place as
strided views of the fused projection's output.

Decode (T == 1) is ONE launch. A split-K program owns (row, kv head, split) and computes all the q heads of its
group against one load of each K/V tile (GQA), reading only keys 0..pos of its row; it norms and ropes its q
heads and the new key itself (a few hundred bytes, recomputed by each split). The split grid is sized from the
static cache length (CUDA-graph safe); each split finds its own key range from the row's position. The program
that owns `pos` writes the new K/V into the cache and takes key `pos` from registers, so no launch orders the
write. Every split (empty ones too) then counts itself in on the (row, kv head) arrival counter; the last one to
arrive merges the splits' partial outputs by log-sum-exp, multiplies by sigmoid(gate) and writes the output
(`split_arrivals`, kernels/counters.py: the counters' invariants).
Prefill (T > 1) is two launches: q/k norm + RoPE that also writes k and v into the cache, then a causal flash-
attention kernel per (query block, q head) whose key loop stops at the block's last position and whose epilogue
applies the gate. (The torch path's masked GQA SDPA falls back to the math backend over all S cache slots;
experiments/bench_attention.py times both.)

Under `kernels.tracing()` the op is a `torch.library.custom_op` with a fake (torch.export) that declares the
cache mutation; in eager it launches directly. The `*_into` launchers write into caller-given outputs (tests
poison them).
"""

import functools

import torch
import triton
import triton.language as tl

import kernels
from kernels.counters import ArrivalCounters, Workspaces
from kernels.launch import cdiv, fast_launch, next_power_of_2
from kernels.pdl import allow_dependents, pdl, wait_for_producers

BLOCK_N = 64  # keys per decode tile, also the unit a decode split's key range is counted in
MAX_SPLITS = 64  # experiments/tune_attention.py: 64 splits of 8 warps beat 128 of 4 at every context, 256 to 32k
# A K or V tile row (head block x element size) above this many bytes halves the prefill tile: fp32 at head
# dim 256 would need 208 KiB of shared memory with the 16-bit config, near the H200's 227 KiB.
WIDE_ROW_BYTES = 512
REDUCE_TILE = 8192  # elements of the [heads, splits, head dim] partial tile the last split merges per step
# prefill q/k norm + RoPE: one head row per program on one warp (experiments/tune_prefill.py, 35B at 4096 tokens on
# the H200: 80 µs; 16 rows on 4 warps 187 µs)
NORM_ROPE_CONFIG = dict(BLOCK_T=1, num_warps=1)


@triton.jit
def _cos_sin(angle):
    """cos, sin of fp32 angles up to ~4e5 rad: Cody-Waite reduction to [-pi, pi] first, so the result does
    not depend on how the backend reduces large arguments."""
    # 2*pi = 6.28125 + 254/2^17 - 2.5590314e-06; the first two have 8 significant bits, so their products
    # with k < 2^16 are exact in fp32.
    k = tl.floor(angle * 0.15915494309189535 + 0.5)
    r = angle - k * 6.28125
    r = r - k * 0.0019378662109375
    r = r + k * 2.5590313512680e-06
    return tl.cos(r), tl.sin(r)


@triton.jit
def _norm_rope_inputs(rows, w_ptr, inv_freq_ptr, rows_ok, D: tl.constexpr, HALF: tl.constexpr,
                      BLOCK_D: tl.constexpr):  # fmt: skip
    """Everything _norm_rope_apply reads, loaded at once (no load waits on another's math): head rows at pointers
    rows [R] -> (x [R, BLOCK_D], its rotation partners xp, the norm weight w and its partners wp [1, BLOCK_D] fp32,
    inv_freq [BLOCK_D] over the rotated dims)."""
    d = tl.arange(0, BLOCK_D)
    rotated = d < 2 * HALF
    partner = tl.where(d < HALF, d + HALF, d - HALF)
    x = tl.load(rows[:, None] + d[None, :], mask=rows_ok[:, None] & (d < D)[None, :], other=0.0)
    xp = tl.load(rows[:, None] + partner[None, :], mask=rows_ok[:, None] & rotated[None, :], other=0.0)
    w = tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)[None, :]
    wp = tl.load(w_ptr + partner, mask=rotated, other=0.0).to(tl.float32)[None, :]
    inv_freq = tl.load(inv_freq_ptr + d % HALF, mask=rotated, other=0.0)
    return x, xp, w, wp, inv_freq


@triton.jit
def _norm_rope_apply(x, xp, w, wp, inv_freq, pos, eps, D: tl.constexpr, HALF: tl.constexpr, BLOCK_D: tl.constexpr):
    """_norm_rope_inputs' tiles -> [R, BLOCK_D] fp32: zero-centred RMSNorm (rounded to the input dtype, as the
    reference), then rotate-half RoPE at positions pos [R] on dims [0, 2*HALF):
    out[d] = y[d] cos - y[d+HALF] sin (d < HALF), y[d] cos + y[d-HALF] sin (HALF <= d < 2*HALF)."""
    d = tl.arange(0, BLOCK_D)
    rotated = d < 2 * HALF
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / D + eps)[:, None]  # [R, 1]
    y = (xf * rstd * (1.0 + w)).to(x.dtype).to(tl.float32)
    yp = (xp.to(tl.float32) * rstd * (1.0 + wp)).to(x.dtype).to(tl.float32)
    cos, sin = _cos_sin(pos.to(tl.float32)[:, None] * inv_freq[None, :])
    cos = cos.to(x.dtype).to(tl.float32)  # the reference rounds cos/sin to the model dtype
    sin = sin.to(x.dtype).to(tl.float32)
    rot = tl.where((d < HALF)[None, :], -yp, yp)
    return tl.where(rotated[None, :], y * cos + rot * sin, y)


@triton.jit
def _norm_rope(rows, w_ptr, pos, inv_freq_ptr, eps, rows_ok, D: tl.constexpr, HALF: tl.constexpr,
               BLOCK_D: tl.constexpr):  # fmt: skip
    """Head rows at pointers rows [R] -> normed and roped [R, BLOCK_D] fp32 (_norm_rope_inputs, _norm_rope_apply)."""
    x, xp, w, wp, inv_freq = _norm_rope_inputs(rows, w_ptr, inv_freq_ptr, rows_ok, D, HALF, BLOCK_D)
    return _norm_rope_apply(x, xp, w, wp, inv_freq, pos, eps, D, HALF, BLOCK_D)


@fast_launch
@triton.jit
def _prefill_norm_rope_kernel(
    q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, inv_freq_ptr, eps,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_kcb, stride_kch, stride_kcs, stride_vcb, stride_vch, stride_vcs, stride_pb, stride_pt,
    T, n_tokens, HQ: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Program (block of BLOCK_T tokens, head): q heads write their normed, roped rows to q_out [B, T, HQ, D]; kv
    heads write the normed, roped k rows and the v rows into the caches at the tokens' positions."""
    token = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)  # b * T + t
    head = tl.program_id(1)  # q heads, then kv heads
    ok = token < n_tokens
    b, t = token // T, token % T
    pos = tl.load(pos_ptr + b * stride_pb + t * stride_pt, mask=ok, other=0)  # [BLOCK_T]
    d = tl.arange(0, BLOCK_D)
    mask = ok[:, None] & (d < D)[None, :]
    if head < HQ:
        rows = q_ptr + b * stride_qb + t * stride_qt + head * stride_qh
        y = _norm_rope(rows, qw_ptr, pos, inv_freq_ptr, eps, ok, D, HALF, BLOCK_D)
        out = q_out_ptr + ((token * HQ + head) * D)[:, None] + d[None, :]
        tl.store(out, y.to(q_out_ptr.dtype.element_ty), mask=mask)
    else:
        kh = head - HQ
        rows = k_ptr + b * stride_kb + t * stride_kt + kh * stride_kh
        k_new = _norm_rope(rows, kw_ptr, pos, inv_freq_ptr, eps, ok, D, HALF, BLOCK_D)  # not `y`: triton 3.6 wants
        k_new = k_new.to(k_ptr.dtype.element_ty).to(k_cache_ptr.dtype.element_ty)  # one type per name across branches
        k_slots = k_cache_ptr + (b * stride_kcb + kh * stride_kch + pos * stride_kcs)[:, None] + d[None, :]
        tl.store(k_slots, k_new, mask=mask)
        v = tl.load(v_ptr + (b * stride_vb + t * stride_vt + kh * stride_vh)[:, None] + d[None, :], mask=mask)
        v_slots = v_cache_ptr + (b * stride_vcb + kh * stride_vch + pos * stride_vcs)[:, None] + d[None, :]
        tl.store(v_slots, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _kv_tile(k_row, v_row, n0, last, d, d_ok, stride_ks, stride_vs, BLOCK_N: tl.constexpr):
    """Cached keys and values n0 .. n0 + BLOCK_N - 1 of one kv head, zero at and past `last` -> [BLOCK_N, BLOCK_D]
    each (a tile wholly past `last` reads nothing)."""
    n = n0 + tl.arange(0, BLOCK_N)
    ok = (n < last)[:, None] & d_ok[None, :]
    k = tl.load(k_row + n[:, None] * stride_ks + d[None, :], mask=ok, other=0.0)
    v = tl.load(v_row + n[:, None] * stride_vs + d[None, :], mask=ok, other=0.0)
    return k, v


@fast_launch
@triton.jit
def _decode_kernel(
    q_ptr, gate_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, inv_freq_ptr, k_cache_ptr, v_cache_ptr, pos_ptr,
    o_part_ptr, lse_part_ptr, arrivals_ptr, out_ptr, eps, scale_log2,
    stride_qb, stride_qh, stride_gb, stride_gh, stride_kb, stride_kh, stride_vb, stride_vh,
    stride_kcb, stride_kch, stride_kcs, stride_vcb, stride_vch, stride_vcs, stride_pb,
    HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
    NUM_SPLITS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    REDUCE_G: tl.constexpr, REDUCE_S: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    allow_dependents(PDL)
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    # Before the PDL wait: the position and this split's first K/V tile. No kernel this one may overlap writes
    # them: the positions are the forward's prologue's (kernels/embedding) and the keys < pos this layer's
    # attention of earlier steps (or the prefill's kernels), all written by the time that launch without PDL
    # completes; no kernel after it starts before. (After the wait they were two dependent round trips, the
    # position's then the tile's, ahead of all the math.)
    pos = tl.load(pos_ptr + b * stride_pb)  # this row's query position: keys 0..pos are visible
    n_tiles = tl.cdiv(pos + 1, BLOCK_N)
    tiles_per_split = tl.cdiv(n_tiles, NUM_SPLITS)
    start = split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, pos + 1)
    last = tl.minimum(end, pos)  # keys start .. last - 1 come from the cache (none in an empty split)
    k_cache_row = k_cache_ptr + b * stride_kcb + kv_head * stride_kch
    v_cache_row = v_cache_ptr + b * stride_vcb + kv_head * stride_vch
    k_next, v_next = _kv_tile(k_cache_row, v_cache_row, start, last, d, d_ok, stride_kcs, stride_vcs, BLOCK_N)
    wait_for_producers(PDL)
    # Then every load of the projection's outputs at once: the new token's q, k, v and the gate (every split
    # loads them, empty ones too: a few KB); the q/k norm and RoPE math runs while the tile comes from HBM.
    g = tl.arange(0, BLOCK_G)
    q_heads = kv_head * G + g  # GQA: q head i reads kv head i // G
    g_ok = g < G
    q_rows = q_ptr + b * stride_qb + q_heads * stride_qh
    qx, qxp, qw, qwp, freq = _norm_rope_inputs(q_rows, qw_ptr, inv_freq_ptr, g_ok, D, HALF, BLOCK_D)
    one = tl.arange(0, 1)
    k_row = k_ptr + b * stride_kb + kv_head * stride_kh + one
    kx, kxp, kw, kwp, _ = _norm_rope_inputs(k_row, kw_ptr, inv_freq_ptr, one == 0, D, HALF, BLOCK_D)
    v_new = tl.load(v_ptr + b * stride_vb + kv_head * stride_vh + d, mask=d_ok, other=0.0)
    v_new = v_new.to(v_cache_ptr.dtype.element_ty)
    rg = tl.arange(0, REDUCE_G)
    heads = kv_head * G + rg  # the same q heads as the merge's (and the gate's) rows
    out_ok = (rg < G)[:, None] & d_ok[None, :]
    gate = tl.load(gate_ptr + b * stride_gb + heads[:, None] * stride_gh + d[None, :], mask=out_ok, other=0.0)
    q = _norm_rope_apply(qx, qxp, qw, qwp, freq, pos + 0 * g, eps, D, HALF, BLOCK_D)
    q = q.to(q_ptr.dtype.element_ty).to(k_cache_ptr.dtype.element_ty)  # [BLOCK_G, BLOCK_D]
    k_new = tl.sum(_norm_rope_apply(kx, kxp, kw, kwp, freq, pos + one, eps, D, HALF, BLOCK_D), axis=0)
    k_new = k_new.to(k_ptr.dtype.element_ty).to(k_cache_ptr.dtype.element_ty)  # [BLOCK_D]
    if start <= pos:  # splits past the row's context compute nothing (the merge skips them) but still arrive
        if end == pos + 1:  # this split owns key `pos`: write the new K/V into the cache
            tl.store(k_cache_row + pos * stride_kcs + d, k_new, mask=d_ok)
            tl.store(v_cache_row + pos * stride_vcs + d, v_new, mask=d_ok)

        # Key `pos` comes from registers, not the cache (no launch orders the cache write before the reads): the
        # split that owns it starts the softmax with it, the tiles then read only keys < pos straight into the
        # dots (no select on the tiles, which would hold them in registers).
        owns_new = end == pos + 1
        s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], axis=1) * scale_log2  # [BLOCK_G]
        m = tl.where(owns_new, s_new, float("-inf"))
        l = tl.where(owns_new, 1.0, 0.0) + tl.zeros([BLOCK_G], tl.float32)
        acc = l[:, None] * v_new.to(tl.float32)[None, :]  # [BLOCK_G, BLOCK_D]
        for n0 in range(start, last, BLOCK_N):
            k, v = k_next, v_next  # [BLOCK_N, BLOCK_D]; the next tile loads while this one is used
            k_next, v_next = _kv_tile(k_cache_row, v_cache_row, n0 + BLOCK_N, last, d, d_ok, stride_kcs, stride_vcs,
                                      BLOCK_N)  # fmt: skip
            n = n0 + tl.arange(0, BLOCK_N)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_G, BLOCK_N], log2 units
            s = tl.where((n < last)[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new[:, None])
            l = l * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m = m_new
        part = (b * HQ + q_heads) * NUM_SPLITS + split  # [BLOCK_G] rows of o_part [B, HQ, NUM_SPLITS, D]
        tl.store(o_part_ptr + part[:, None] * D + d[None, :], acc / l[:, None], mask=g_ok[:, None] & d_ok[None, :])
        tl.store(lse_part_ptr + part, m + tl.log2(l), mask=g_ok)

    # The last split of (row, kv head) to arrive merges all of them: every thread's partial stores come before
    # the release, and every read of the others' partials after the acquire (made by one thread)
    tl.debug_barrier()
    arrivals = arrivals_ptr + b * HKV + kv_head
    earlier = tl.atomic_add(arrivals, 1, sem="acq_rel", scope="gpu")
    tl.debug_barrier()
    if earlier == NUM_SPLITS - 1:
        n_active = tl.cdiv(n_tiles, tiles_per_split)  # the splits that wrote a partial
        s = tl.arange(0, REDUCE_S)
        part = (b * HQ + heads) * NUM_SPLITS  # [REDUCE_G]
        # One pass, rescaled as it goes (a flash-decoding merge): each step's log-sum-exps and partial outputs
        # load together, so a merge of up to REDUCE_S splits is one L2 round trip (the max first, then the
        # outputs, were two).
        lse_max = tl.full([REDUCE_G], float("-inf"), tl.float32)
        acc = tl.zeros([REDUCE_G, BLOCK_D], tl.float32)
        weight_sum = tl.zeros([REDUCE_G], tl.float32)
        for s0 in range(0, n_active, REDUCE_S):
            ok = (rg < G)[:, None] & (s0 + s < n_active)[None, :]  # [REDUCE_G, REDUCE_S]
            lse = tl.load(
                lse_part_ptr + part[:, None] + s0 + s[None, :], mask=ok, other=float("-inf"), cache_modifier=".cg"
            )
            rows = (part[:, None] + s0 + s[None, :])[:, :, None] * D + d[None, None, :]  # [REDUCE_G, REDUCE_S, BLOCK_D]
            o = tl.load(o_part_ptr + rows, mask=ok[:, :, None] & d_ok[None, None, :], other=0.0, cache_modifier=".cg")
            new_max = tl.maximum(lse_max, tl.max(lse, axis=1))
            new_max = tl.where(new_max > float("-inf"), new_max, 0.0)  # heads past G: no partials, no NaN
            alpha = tl.exp2(lse_max - new_max)  # 0 at the first step
            w = tl.exp2(lse - new_max[:, None])
            acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o, axis=1)
            weight_sum = weight_sum * alpha + tl.sum(w, axis=1)
            lse_max = new_max
        out = acc / tl.where(rg < G, weight_sum, 1.0)[:, None] * tl.sigmoid(gate.to(tl.float32))
        out_rows = out_ptr + (b * HQ + heads[:, None]) * D + d[None, :]  # out [B, 1, HQ * D]
        tl.store(out_rows, out.to(out_ptr.dtype.element_ty), mask=out_ok)
        tl.store(arrivals, 0)


@fast_launch
@triton.jit
def _prefill_kernel(
    q_ptr, gate_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, out_ptr, scale_log2,
    stride_qb, stride_qt, stride_qh, stride_gb, stride_gt, stride_gh,
    stride_kcb, stride_kch, stride_kcs, stride_vcb, stride_vch, stride_vcs,
    stride_pb, stride_pt, stride_ob, stride_ot, stride_oh,
    T, HQ: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Flash attention of BLOCK_M query tokens of one q head over the (already written) cache, times
    sigmoid(gate): query t sees keys 0..pos[t]; the key loop stops at the block's largest position."""
    m_block = tl.num_programs(0) - 1 - tl.program_id(0)  # longest key ranges first
    b = tl.program_id(1).to(tl.int64) // HQ
    head = tl.program_id(1) % HQ
    kv_head = head // G
    t = (m_block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # t * stride may pass 2^31 for long prompts
    d = tl.arange(0, BLOCK_D)
    t_ok, d_ok = t < T, d < D
    pos = tl.load(pos_ptr + b * stride_pb + t * stride_pt, mask=t_ok, other=-1)  # [BLOCK_M]
    rows_ok = t_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + b * stride_qb + t[:, None] * stride_qt + head * stride_qh + d[None, :], mask=rows_ok, other=0.0)
    q = q.to(k_cache_ptr.dtype.element_ty)  # [BLOCK_M, BLOCK_D]
    k_cache_row = k_cache_ptr + b * stride_kcb + kv_head * stride_kch
    v_cache_row = v_cache_ptr + b * stride_vcb + kv_head * stride_vch
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    last = tl.max(pos, axis=0)  # the block's last visible key
    for n0 in range(0, last + 1, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = (n <= last)[:, None] & d_ok[None, :]
        k = tl.load(k_cache_row + n[:, None] * stride_kcs + d[None, :], mask=n_ok, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_cache_row + n[:, None] * stride_vcs + d[None, :], mask=n_ok, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N], log2 units
        s = tl.where(n[None, :] <= pos[:, None], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # padding rows (t >= T) see no key at all
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new
    gate = tl.load(gate_ptr + b * stride_gb + t[:, None] * stride_gt + head * stride_gh + d[None, :], mask=rows_ok)
    out = acc / tl.where(t_ok, l, 1.0)[:, None] * tl.sigmoid(gate.to(tl.float32))
    out = out.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + b * stride_ob + t[:, None] * stride_ot + head * stride_oh + d[None, :], out, mask=rows_ok)


@functools.cache
def num_splits(batch: int, kv_heads: int, cache_len: int, device: torch.device) -> int:
    """Static split-K width: enough (row, kv head, split) programs to fill the GPU twice over, no more
    splits than key tiles in the cache. Depends on shapes only, never on positions (CUDA graphs)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    return max(1, min(cdiv(2 * sms, batch * kv_heads), cdiv(cache_len, BLOCK_N), MAX_SPLITS))


@functools.cache
def _decode_config(G: int, D: int, splits: int, dtype: torch.dtype) -> dict:
    """Launch options of the decode kernel (experiments/tune_attention.py, H200, bf16 at 35B dims: 8 warps, one
    stage; a second stage won nothing and would not fit fp32 tiles at head dim 256); the merge reads [heads,
    splits, D] partial tiles of at most REDUCE_TILE elements."""
    block_d = max(next_power_of_2(D), 16)  # tl.dot needs every dim >= 16
    reduce_g = next_power_of_2(G)
    reduce_s = max(1, min(next_power_of_2(splits), REDUCE_TILE // (reduce_g * block_d)))
    return dict(
        BLOCK_G=max(next_power_of_2(G), 16), BLOCK_D=block_d, BLOCK_N=BLOCK_N, REDUCE_G=reduce_g,
        REDUCE_S=reduce_s, DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
        num_warps=8, num_stages=1,
    )  # fmt: skip


# launch options over _prefill_config's for 16-bit caches (experiments/tune_prefill.py sweeps them)
PREFILL_OPTIONS: dict = {}
# decode: "splits" over num_splits(), launch options over _decode_config's (experiments/tune_decode_loop.py)
DECODE_OPTIONS: dict = {}


def _prefill_config(D: int, dtype: torch.dtype) -> dict:
    """Launch options of the prefill kernel: wide rows (fp32 at head dim 256) take 32-key tiles; 16-bit rows at head
    dim 256 128-query tiles (tune_prefill on the H200, 35B at 4096 tokens: 564 µs with the norm + RoPE launch, 752
    with 64-query tiles)."""
    wide = max(next_power_of_2(D), 16) * dtype.itemsize > WIDE_ROW_BYTES
    block_m = 128 if D >= 256 and not wide else 64
    config = dict(BLOCK_M=block_m, BLOCK_N=32 if wide else 64, num_warps=8 if D >= 256 else 4, num_stages=2)
    return config if wide else {**config, **PREFILL_OPTIONS}


# the decode kernel's counters, one per (row, kv head): its last split to arrive merges (invariants: ArrivalCounters)
split_arrivals = ArrivalCounters()
# the decode kernel's split partials (o_part, lse_part), written before they are read (invariants: Workspaces)
decode_workspace = Workspaces()


def decode_attention_into(
    q,
    gate,
    k,
    v,
    q_weight,
    k_weight,
    k_cache,
    v_cache,
    positions,
    inv_freq,
    eps,
    scale,
    out,
    o_part,
    lse_part,
    options=None,
) -> None:
    """One query token per row (T == 1), one launch: norm + RoPE q and k, write k/v into the caches at
    positions[:, 0], attend over keys 0..pos, times sigmoid(gate) -> out [B, 1, HQ * D] (contiguous).
    q, gate [B, 1, HQ, D] and k, v [B, 1, HKV, D] may be strided views (head dim contiguous). o_part
    [B, HQ, splits, D] and lse_part [B, HQ, splits] (fp32) are the split-K workspace; splits = o_part.shape[2].
    options: launch options over _decode_config's (BLOCK_N, num_warps, num_stages; the tuner's candidates)."""
    B, _, HQ, D = q.shape
    HKV = k_cache.shape[1]
    splits = o_part.shape[2]
    assert q.stride(-1) == gate.stride(-1) == k.stride(-1) == v.stride(-1) == 1
    assert k_cache.stride(-1) == v_cache.stride(-1) == 1
    assert out.is_contiguous() and o_part.is_contiguous() and lse_part.is_contiguous()
    G = HQ // HKV
    on = pdl(q)
    _decode_kernel[(B, HKV, splits)](
        q, gate, k, v, q_weight, k_weight, inv_freq, k_cache, v_cache, positions, o_part, lse_part,
        split_arrivals(B * HKV, q.device), out, eps, scale * 1.4426950408889634,
        q.stride(0), q.stride(2), gate.stride(0), gate.stride(2), k.stride(0), k.stride(2), v.stride(0), v.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), positions.stride(0),
        HQ=HQ, HKV=HKV, G=G, D=D, HALF=inv_freq.shape[0], NUM_SPLITS=splits, PDL=on, launch_pdl=on,
        **{**_decode_config(G, D, splits, k_cache.dtype), **(options or {})},
    )  # fmt: skip


def prefill_norm_rope_into(q, k, v, q_weight, k_weight, k_cache, v_cache, positions, inv_freq, eps, q_normed) -> None:
    """q/k norm + RoPE of a prompt: q into q_normed [B, T, HQ, D] (contiguous), k and v into the caches at
    positions [B, T], as naive writes them. q, k, v may be strided views (head dim contiguous)."""
    B, T, HQ, D = q.shape
    HKV = k_cache.shape[1]
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1 and q_normed.is_contiguous()
    assert k_cache.stride(-1) == v_cache.stride(-1) == 1
    block_t = NORM_ROPE_CONFIG["BLOCK_T"]
    _prefill_norm_rope_kernel[(cdiv(B * T, block_t), HQ + HKV)](
        q, k, v, q_weight, k_weight, q_normed, k_cache, v_cache, positions, inv_freq, eps,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1),
        v.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), positions.stride(0), positions.stride(1),
        T, B * T, HQ=HQ, D=D, HALF=inv_freq.shape[0], BLOCK_T=block_t, BLOCK_D=next_power_of_2(D),
        num_warps=NORM_ROPE_CONFIG["num_warps"],
    )  # fmt: skip


def prefill_attention_into(
    q, gate, k, v, q_weight, k_weight, k_cache, v_cache, positions, inv_freq, eps, scale, out, q_normed
) -> None:
    """Any T, two launches: prefill_norm_rope_into, then out [B, T, HQ * D] = causal GQA attention of each query
    over keys 0..its position, times sigmoid(gate). q, gate, k, v may be strided views (head dim contiguous)."""
    B, T, HQ, D = q.shape
    HKV = k_cache.shape[1]
    assert gate.stride(-1) == 1 and out.is_contiguous()
    prefill_norm_rope_into(q, k, v, q_weight, k_weight, k_cache, v_cache, positions, inv_freq, eps, q_normed)
    config = _prefill_config(D, k_cache.dtype)
    _prefill_kernel[(cdiv(T, config["BLOCK_M"]), B * HQ)](
        q_normed, gate, k_cache, v_cache, positions, out, scale * 1.4426950408889634,
        q_normed.stride(0), q_normed.stride(1), q_normed.stride(2), gate.stride(0), gate.stride(1), gate.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), positions.stride(0), positions.stride(1), out.stride(0), out.stride(1), D,
        T, HQ=HQ, G=HQ // HKV, D=D, BLOCK_D=max(next_power_of_2(D), 16),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", **config,
    )  # fmt: skip


def _launch(q, gate, k, v, q_weight, k_weight, k_cache, v_cache, positions, inv_freq, eps, scale) -> torch.Tensor:
    # One entry for every T: the decode/prefill choice happens here, at run time, so torch.export with a
    # dynamic T records no guard on T == 1.
    B, T, HQ, D = q.shape
    out = q.new_empty(B, T, HQ * D)
    if T == 1:
        splits = DECODE_OPTIONS.get("splits") or num_splits(B, k_cache.shape[1], k_cache.shape[2], q.device)
        o_part = decode_workspace((B, HQ, splits, D), torch.float32, q.device)
        lse_part = decode_workspace((B, HQ, splits), torch.float32, q.device)
        args = (q_weight, k_weight, k_cache, v_cache, positions, inv_freq, eps, scale, out, o_part, lse_part)
        options = {name: value for name, value in DECODE_OPTIONS.items() if name != "splits"} or None
        decode_attention_into(q, gate, k, v, *args, options=options)
    else:
        q_normed = torch.empty(B, T, HQ, D, dtype=q.dtype, device=q.device)
        args = (q_weight, k_weight, k_cache, v_cache, positions, inv_freq, eps, scale, out, q_normed)
        prefill_attention_into(q, gate, k, v, *args)
    return out


@torch.library.custom_op("qmoe_attention::gated_attention", mutates_args=("k_cache", "v_cache"))
def _gated_attention_op(
    q: torch.Tensor,
    gate: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    eps: float,
    scale: float,
) -> torch.Tensor:
    return _launch(q, gate, k, v, q_weight, k_weight, k_cache, v_cache, positions, inv_freq, eps, scale)


@_gated_attention_op.register_fake
def _(q, gate, k, v, q_weight, k_weight, k_cache, v_cache, positions, inv_freq, eps, scale):
    B, T, HQ, D = q.shape
    return q.new_empty(B, T, HQ * D)


def gated_attention(
    q: torch.Tensor,  # [B, T, Hq, D] raw query (before its norm)
    gate: torch.Tensor,  # [B, T, Hq, D] output-gate logits
    k: torch.Tensor,  # [B, T, Hkv, D] raw key
    v: torch.Tensor,  # [B, T, Hkv, D]
    q_weight: torch.Tensor,  # [D]
    k_weight: torch.Tensor,  # [D]
    k_cache: torch.Tensor,  # [B, Hkv, S, D], written in place at `positions`
    v_cache: torch.Tensor,  # [B, Hkv, S, D]
    positions: torch.Tensor,  # [B, T] int64
    inv_freq: torch.Tensor,  # [R/2] fp32
    eps: float,
    scale: float,
) -> torch.Tensor:
    """naive.gated_attention: q/k norm + RoPE, causal GQA attention over the cache, times sigmoid(gate)
    -> [B, T, Hq * D]; decode (T == 1) in one launch, prefill in two."""
    op = _gated_attention_op if kernels.tracing() else _launch
    return op(q, gate, k, v, q_weight, k_weight, k_cache, v_cache, positions, inv_freq, eps, scale)
