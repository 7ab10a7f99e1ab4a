"""Triton attention: fused q/k RMSNorm + partial RoPE, flash-decoding and causal prefill over the static KV cache.

`attention` with T == 1 (decode) runs two kernels: a split-K pass where one program owns (row, kv head,
split) and computes all the q heads of its group against one load of each K/V tile (GQA), reading only
keys 0..pos of its row, and a reduction over the splits by log-sum-exp. The split grid is sized from the
static cache length (CUDA-graph safe); each split finds its own key range from the row's position and
an empty split exits at once. The new K/V is written into the cache by the program that owns `pos`, and
that program takes key `pos` from the input instead of the cache, so no launch orders the write.
T > 1 (prefill) writes the cache with torch indexing, then runs a causal flash-attention kernel per (query
block, q head) whose key loop stops at the block's last position. (The torch path's masked GQA SDPA falls
back to the math backend over all S cache slots; experiments/bench_attention.py times both.)

Every op is a `torch.library.custom_op` with a fake (torch.export); the cache-writing one declares
`mutates_args`. The `*_into` launchers write into caller-given outputs (tests poison them).
"""

import torch
import triton
import triton.language as tl

BLOCK_N = 64  # keys per decode tile, also the unit a decode split's key range is counted in
MAX_SPLITS = 128
# A K or V tile row (head block x element size) above this many bytes halves the tile bytes in flight:
# fp32 at head dim 256 would need 272 KiB (decode) / 208 KiB (prefill) of shared memory with the
# 16-bit configs, over or near the H200's 227 KiB.
WIDE_ROW_BYTES = 512


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
def _norm_rope_row(
    x_ptr, w_ptr, out_ptr, inv_freq_ptr, pos, eps, D: tl.constexpr, HALF: tl.constexpr, BLOCK_D: tl.constexpr
):
    """One head row: zero-centred RMSNorm (rounded to the input dtype, as the reference), then rotate-half
    RoPE on dims [0, 2*HALF): out[d] = y[d] cos - y[d+HALF] sin (d < HALF), y[d] cos + y[d-HALF] sin."""
    d = tl.arange(0, BLOCK_D)
    in_row = d < D
    rotated = d < 2 * HALF
    partner = tl.where(d < HALF, d + HALF, d - HALF)
    x = tl.load(x_ptr + d, mask=in_row, other=0.0)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / D + eps)
    w = tl.load(w_ptr + d, mask=in_row, other=0.0).to(tl.float32)
    y = (xf * rstd * (1.0 + w)).to(x.dtype).to(tl.float32)
    xp = tl.load(x_ptr + partner, mask=rotated, other=0.0).to(tl.float32)
    wp = tl.load(w_ptr + partner, mask=rotated, other=0.0).to(tl.float32)
    yp = (xp * rstd * (1.0 + wp)).to(x.dtype).to(tl.float32)
    inv_freq = tl.load(inv_freq_ptr + d % HALF, mask=rotated, other=0.0)
    cos, sin = _cos_sin(pos.to(tl.float32) * inv_freq)
    cos = cos.to(x.dtype).to(tl.float32)  # the reference rounds cos/sin to the model dtype
    sin = sin.to(x.dtype).to(tl.float32)
    rot = tl.where(d < HALF, -yp, yp)
    out = tl.where(rotated, y * cos + rot * sin, y)
    tl.store(out_ptr + d, out.to(out_ptr.dtype.element_ty), mask=in_row)


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr, k_ptr, qw_ptr, kw_ptr, q_out_ptr, k_out_ptr, pos_ptr, inv_freq_ptr, eps,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_pb, stride_pt,
    T, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)  # b * T + t
    head = tl.program_id(1)  # q heads, then k heads
    b, t = token // T, token % T
    pos = tl.load(pos_ptr + b * stride_pb + t * stride_pt)
    if head < HQ:
        x_ptr = q_ptr + b * stride_qb + t * stride_qt + head * stride_qh
        _norm_rope_row(x_ptr, qw_ptr, q_out_ptr + (token * HQ + head) * D, inv_freq_ptr, pos, eps, D, HALF, BLOCK_D)
    else:
        kh = head - HQ
        x_ptr = k_ptr + b * stride_kb + t * stride_kt + kh * stride_kh
        _norm_rope_row(x_ptr, kw_ptr, k_out_ptr + (token * HKV + kh) * D, inv_freq_ptr, pos, eps, D, HALF, BLOCK_D)


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, o_part_ptr, lse_part_ptr, scale_log2,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh,
    stride_kcb, stride_kch, stride_kcs, stride_vcb, stride_vch, stride_vcs, stride_pb,
    HQ: tl.constexpr, G: tl.constexpr, D: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    pos = tl.load(pos_ptr + b * stride_pb)  # this row's query position: keys 0..pos are visible
    tiles_per_split = tl.cdiv(tl.cdiv(pos + 1, BLOCK_N), NUM_SPLITS)
    start = split * tiles_per_split * BLOCK_N
    if start <= pos:  # splits past the row's context do nothing (the reduction skips them too)
        end = tl.minimum(start + tiles_per_split * BLOCK_N, pos + 1)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        q_heads = kv_head * G + g  # GQA: q head i reads kv head i // G
        g_ok = g < G
        d_ok = d < D
        q_mask = g_ok[:, None] & d_ok[None, :]
        q = tl.load(q_ptr + b * stride_qb + q_heads[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0)
        q = q.to(k_cache_ptr.dtype.element_ty)  # [BLOCK_G, BLOCK_D]
        k_cache_row = k_cache_ptr + b * stride_kcb + kv_head * stride_kch
        v_cache_row = v_cache_ptr + b * stride_vcb + kv_head * stride_vch
        k_new = tl.load(k_ptr + b * stride_kb + kv_head * stride_kh + d, mask=d_ok, other=0.0)
        v_new = tl.load(v_ptr + b * stride_vb + kv_head * stride_vh + d, mask=d_ok, other=0.0)
        k_new, v_new = k_new.to(k_cache_ptr.dtype.element_ty), v_new.to(v_cache_ptr.dtype.element_ty)
        if end == pos + 1:  # this split owns key `pos`: write the new K/V into the cache
            tl.store(k_cache_row + pos * stride_kcs + d, k_new, mask=d_ok)
            tl.store(v_cache_row + pos * stride_vcs + d, v_new, mask=d_ok)

        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for n0 in range(start, end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            old = (n < pos)[:, None] & d_ok[None, :]  # key `pos` comes from the input, not the cache
            is_new = (n == pos)[:, None]
            k = tl.load(k_cache_row + n[:, None] * stride_kcs + d[None, :], mask=old, other=0.0)  # [BLOCK_N, BLOCK_D]
            v = tl.load(v_cache_row + n[:, None] * stride_vcs + d[None, :], mask=old, other=0.0)
            k = tl.where(is_new, k_new[None, :], k)
            v = tl.where(is_new, v_new[None, :], v)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_G, BLOCK_N], log2 units
            s = tl.where((n < end)[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new[:, None])
            l = l * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m = m_new
        part = (b * HQ + q_heads) * NUM_SPLITS + split  # [BLOCK_G] rows of o_part [B, HQ, NUM_SPLITS, D]
        tl.store(o_part_ptr + part[:, None] * D + d[None, :], acc / l[:, None], mask=g_ok[:, None] & d_ok[None, :])
        tl.store(lse_part_ptr + part, m + tl.log2(l), mask=g_ok)


@triton.jit
def _decode_reduce_kernel(
    o_part_ptr, lse_part_ptr, out_ptr, pos_ptr, stride_pb, stride_ob, stride_oh,
    HQ: tl.constexpr, D: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    pos = tl.load(pos_ptr + b * stride_pb)
    n_tiles = tl.cdiv(pos + 1, BLOCK_N)
    n_active = tl.cdiv(n_tiles, tl.cdiv(n_tiles, NUM_SPLITS))  # the splits the split kernel wrote
    part = (b * HQ + head) * NUM_SPLITS
    s = tl.arange(0, BLOCK_S)
    lse = tl.load(lse_part_ptr + part + s, mask=s < n_active, other=float("-inf"))
    lse_max = tl.max(lse, axis=0)
    weight_sum = tl.sum(tl.exp2(lse - lse_max), axis=0)
    d = tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for i in range(n_active):
        w = tl.exp2(tl.load(lse_part_ptr + part + i) - lse_max)
        acc += w * tl.load(o_part_ptr + (part + i) * D + d, mask=d < D, other=0.0)
    tl.store(
        out_ptr + b * stride_ob + head * stride_oh + d, (acc / weight_sum).to(out_ptr.dtype.element_ty), mask=d < D
    )


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, out_ptr, scale_log2,
    stride_qb, stride_qt, stride_qh, stride_kcb, stride_kch, stride_kcs, stride_vcb, stride_vch, stride_vcs,
    stride_pb, stride_pt, stride_ob, stride_ot, stride_oh,
    T, HQ: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Flash attention of BLOCK_M query tokens of one q head over the (already written) cache: query t sees
    keys 0..pos[t]; the key loop stops at the block's largest position (causal skipping)."""
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
    out = (acc / tl.where(t_ok, l, 1.0)[:, None]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + b * stride_ob + t[:, None] * stride_ot + head * stride_oh + d[None, :], out, mask=rows_ok)


def qk_norm_rope_into(q, k, q_weight, k_weight, positions, inv_freq, eps, q_out, k_out) -> None:
    """q_out, k_out (contiguous [B, T, H, D]) = qk_norm_rope(q, k, ...); q and k may be strided views."""
    B, T, HQ, D = q.shape
    HKV = k.shape[2]
    assert q.stride(-1) == 1 and k.stride(-1) == 1, "head dim must be contiguous"
    _qk_norm_rope_kernel[(B * T, HQ + HKV)](
        q, k, q_weight, k_weight, q_out, k_out, positions, inv_freq, eps,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        positions.stride(0), positions.stride(1),
        T, HQ=HQ, HKV=HKV, D=D, HALF=inv_freq.shape[0], BLOCK_D=triton.next_power_of_2(D),
        num_warps=min(max(triton.next_power_of_2(D) // 256, 1), 4),
    )  # fmt: skip


def num_splits(batch: int, kv_heads: int, cache_len: int, device: torch.device) -> int:
    """Static split-K width: enough (row, kv head, split) programs to fill the GPU twice over, no more
    splits than key tiles in the cache. Depends on shapes only, never on positions (CUDA graphs)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    return max(1, min(triton.cdiv(2 * sms, batch * kv_heads), triton.cdiv(cache_len, BLOCK_N), MAX_SPLITS))


def _decode_config(D: int, dtype: torch.dtype) -> dict:
    """Launch options of the decode split kernel: wide rows (fp32 at head dim 256) drop the second pipeline
    stage, so K and V tiles (64 KiB each) are single-buffered; the split geometry (BLOCK_N) stays."""
    wide = max(triton.next_power_of_2(D), 16) * dtype.itemsize > WIDE_ROW_BYTES
    return dict(BLOCK_N=BLOCK_N, num_warps=4, num_stages=1 if wide else 2)


def _prefill_config(D: int, dtype: torch.dtype) -> dict:
    """Launch options of the prefill kernel: wide rows (fp32 at head dim 256) take 32-key tiles."""
    wide = max(triton.next_power_of_2(D), 16) * dtype.itemsize > WIDE_ROW_BYTES
    return dict(BLOCK_M=64, BLOCK_N=32 if wide else 64, num_warps=8 if D >= 256 else 4, num_stages=2)


def decode_attention_into(q, k, v, k_cache, v_cache, positions, scale, out, o_part, lse_part) -> None:
    """One query token per row (T == 1): write k/v into the caches at positions[:, 0], then
    out [B, 1, HQ, D] = softmax(q K^T * scale) V over keys 0..pos. o_part [B, HQ, splits, D] and
    lse_part [B, HQ, splits] (fp32) are the split-K workspace; splits = o_part.shape[2]."""
    B, _, HQ, D = q.shape
    HKV = k_cache.shape[1]
    splits = o_part.shape[2]
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1
    assert out.is_contiguous() and o_part.is_contiguous() and lse_part.is_contiguous()
    G = HQ // HKV
    BLOCK_D = max(triton.next_power_of_2(D), 16)  # tl.dot needs every dim >= 16
    _decode_split_kernel[(B, HKV, splits)](
        q, k, v, k_cache, v_cache, positions, o_part, lse_part, scale * 1.4426950408889634,
        q.stride(0), q.stride(2), k.stride(0), k.stride(2), v.stride(0), v.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), positions.stride(0),
        HQ=HQ, G=G, D=D, NUM_SPLITS=splits, BLOCK_G=max(triton.next_power_of_2(G), 16), BLOCK_D=BLOCK_D,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", **_decode_config(D, k_cache.dtype),
    )  # fmt: skip
    _decode_reduce_kernel[(B, HQ)](
        o_part, lse_part, out, positions, positions.stride(0), out.stride(0), out.stride(2),
        HQ=HQ, D=D, NUM_SPLITS=splits, BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=triton.next_power_of_2(D),
        BLOCK_N=BLOCK_N, num_warps=max(triton.next_power_of_2(D) // 256, 1),
    )  # fmt: skip


def prefill_attention_into(q, k, v, k_cache, v_cache, positions, scale, out) -> None:
    """Any T: write k/v [B, T, HKV, D] into the caches at positions [B, T] (as naive does), then
    out [B, T, HQ, D] = causal GQA attention of each query over keys 0..its position."""
    B, T, HQ, D = q.shape
    HKV = k_cache.shape[1]
    assert q.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1 and out.stride(-1) == 1
    batch = torch.arange(B, device=q.device)[:, None]  # [B, 1]
    k_cache[batch, :, positions] = k.to(k_cache.dtype)
    v_cache[batch, :, positions] = v.to(v_cache.dtype)
    config = _prefill_config(D, k_cache.dtype)
    _prefill_kernel[(triton.cdiv(T, config["BLOCK_M"]), B * HQ)](
        q, k_cache, v_cache, positions, out, scale * 1.4426950408889634,
        q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), positions.stride(0), positions.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        T, HQ=HQ, G=HQ // HKV, D=D, BLOCK_D=max(triton.next_power_of_2(D), 16),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", **config,
    )  # fmt: skip


@torch.library.custom_op("qmoe_attention::qk_norm_rope", mutates_args=())
def _qk_norm_rope_op(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    qk_norm_rope_into(q, k, q_weight, k_weight, positions, inv_freq, eps, q_out, k_out)
    return q_out, k_out


@_qk_norm_rope_op.register_fake
def _(q, k, q_weight, k_weight, positions, inv_freq, eps):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype, device=k.device)


@torch.library.custom_op("qmoe_attention::attention", mutates_args=("k_cache", "v_cache"))
def _attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    # One op for every T: the decode/prefill choice happens here, at run time, so torch.export with a
    # dynamic T records no guard on T == 1.
    B, T, HQ, D = q.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if T == 1:
        splits = num_splits(B, k_cache.shape[1], k_cache.shape[2], q.device)
        o_part = torch.empty(B, HQ, splits, D, dtype=torch.float32, device=q.device)
        lse_part = torch.empty(B, HQ, splits, dtype=torch.float32, device=q.device)
        decode_attention_into(q, k, v, k_cache, v_cache, positions, scale, out, o_part, lse_part)
    else:
        prefill_attention_into(q, k, v, k_cache, v_cache, positions, scale, out)
    return out


@_attention_op.register_fake
def _(q, k, v, k_cache, v_cache, positions, scale):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


def qk_norm_rope(
    q: torch.Tensor,  # [B, T, Hq, D]
    k: torch.Tensor,  # [B, T, Hkv, D]
    q_weight: torch.Tensor,  # [D]
    k_weight: torch.Tensor,  # [D]
    positions: torch.Tensor,  # [B, T] int64
    inv_freq: torch.Tensor,  # [R/2] fp32, R = rotary dim
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero-centred RMSNorm per head on q and k, then rotate-half RoPE on the first R dims of each head."""
    return _qk_norm_rope_op(q, k, q_weight, k_weight, positions, inv_freq, eps)


def attention(
    q: torch.Tensor,  # [B, T, Hq, D]
    k: torch.Tensor,  # [B, T, Hkv, D]
    v: torch.Tensor,  # [B, T, Hkv, D]
    k_cache: torch.Tensor,  # [B, Hkv, S, D], written in place at `positions`
    v_cache: torch.Tensor,  # [B, Hkv, S, D]
    positions: torch.Tensor,  # [B, T] int64, position of each query token
    scale: float,
) -> torch.Tensor:
    """Causal GQA attention of T new tokens over the cache (rows at their own positions) -> [B, T, Hq, D].
    Decode (T == 1) runs the split-K flash-decoding kernels, prefill the causal flash-attention kernel."""
    return _attention_op(q, k, v, k_cache, v_cache, positions, scale)
