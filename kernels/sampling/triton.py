"""Fused sampling in Triton: logits [B, V] -> token ids int64 [B] in one launch, no sort of the vocabulary.

Same semantics as `naive.py` (read its docstring); per row, programs stream the logits in blocks:

1. stats pass: NaN flag, max and its lowest index (the greedy answer: temperature <= 0 stops here), and for
   sampled rows the online sum of p_i = 2^((x_i - max) * log2(e) / temperature), the smallest finite logit
   and the number of finite logits. At small batch the row is split over `split` programs; each writes its
   chunk's stats and the last to finish (an atomic counter, no waiting) combines them and goes on alone.
2. search pass: counts (and masses, for top-p without top-k) of x >= s_j at NT logit thresholds spread
   geometrically between the max and the smallest logit, and a speculative gather of every x >= s, kept if
   s proves to be at or below the cut (min-p: p(s) < min_p; top-p: the tokens with normalised
   p < (1 - top_p) / V carry less than 1 - top_p of the mass; top-k: at least k tokens gathered) and at
   most CAP tokens were gathered.
3. gather pass, only if 2. did not gather a usable set: all x >= s_j for the highest threshold that is
   provably at or below the cut and holds at most CAP tokens. The exact top-k / top-p / min-p cut is found
   on the <= CAP gathered logits in registers (bisection of their keys), and the token is drawn by an
   exponential race: argmax over kept i of log2(p_i) - log2(-ln U_i).
4. fallback, when the kept set has more than CAP tokens (flat rows, huge k): exact bisection of the cut on
   the order-preserving int32 keys of the logits, NT thresholds per pass over the row, then a race pass.

U_i comes from Triton's Philox keyed by the row's seed with counter (step, token index): the same
(logits, parameters, seed, step) give the same token on every call and at any batch position, and nothing
depends on a global generator, so CUDA graph replay is safe. The torch version cannot reproduce the
Philox bits (it uses its own hash), so the two agree exactly on greedy and in distribution otherwise.
"""

import torch
import triton
import triton.language as tl

from kernels.sampling.naive import INVALID_TOKEN

# Globals read inside kernels must be constexprs (triton 3.6 refuses plain ones).
LOG2E = tl.constexpr(1.4426950408889634)
INVALID = tl.constexpr(INVALID_TOKEN)
SPLIT_MAX = 64  # programs per row in the stats pass, at most


@triton.jit
def _ordered_key(x):
    """fp32 -> int32 whose signed order is the float order (x is not NaN; -0.0 already folded into +0.0)."""
    bits = x.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _race_key(x, m, c, seed, step, idx):
    """log2(p / E), E = -ln U ~ Exp(1), U from Philox(seed; step, idx): the kept token with the largest wins."""
    bits = tl.randint(seed, (step << 32) + idx)  # uint32, counter = (idx, step)
    u = ((bits >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)  # (0, 1), 24 bits
    return (x - m) * c - tl.log2(-tl.log(u))


@triton.jit
def _load_block(base, off, V, row_ok, BLOCK: tl.constexpr):
    cols = off + tl.arange(0, BLOCK)
    msk = row_ok[:, None] & (cols < V)[None, :]
    x = tl.load(base + cols[None, :], mask=msk, other=float("-inf")).to(tl.float32)
    return x, cols, msk


@triton.jit
def _bisect_key(base, V, row_ok, m, c, lo, hi, mass_lo, kth, target, USE_MASS: tl.constexpr,
                BLOCK: tl.constexpr, NT: tl.constexpr):  # fmt: skip
    """Largest int32 key in [lo, hi) with count(key(x) >= it) >= kth (or mass >= target with USE_MASS),
    NT thresholds per pass over the row; pred(lo) holds, pred(hi) does not, rows with hi - lo <= 1 are done.
    Returns the key and the mass of the x at or above it."""
    j = tl.arange(0, NT)
    while tl.max((hi - lo > 1).to(tl.int32)) > 0:
        live = hi - lo > 1
        thr = lo[:, None] + ((hi - lo)[:, None] * (j[None, :] + 1)) // (NT + 1)  # [R, NT] increasing
        cnt = tl.zeros(thr.shape, tl.int64)
        mass = tl.zeros(thr.shape, tl.float32)
        for off in range(0, V, BLOCK):
            x, cols, msk = _load_block(base, off, V, row_ok & live, BLOCK)
            x = x + 0.0  # rows here have no NaN
            ge = (_ordered_key(x)[:, :, None] >= thr[:, None, :]) & msk[:, :, None]  # [R, BLOCK, NT]
            cnt += tl.sum(ge.to(tl.int64), 1)
            p = tl.exp2((x - m[:, None]) * c[:, None])
            mass += tl.sum(tl.where(ge, p[:, :, None], 0.0), 1)
        ok = (mass >= target[:, None]) if USE_MASS else (cnt >= kth[:, None])
        # pred is monotone (true for low keys): lo moves to the highest true threshold, hi to the lowest false
        n_ok = tl.sum(ok.to(tl.int32), 1)
        mass_at_lo = tl.sum(tl.where(j[None, :] == n_ok[:, None] - 1, mass, 0.0), 1)
        mass_lo = tl.where(live & (n_ok > 0), mass_at_lo, mass_lo)
        lo = tl.where(live, tl.max(tl.where(ok, thr, lo[:, None]), 1), lo)
        hi = tl.where(live, tl.min(tl.where(ok, hi[:, None], thr), 1), hi)
    return lo, mass_lo


@triton.jit
def _bisect_tile(keys, p, lo, hi, kth, target, USE_MASS: tl.constexpr, NT: tl.constexpr):
    """_bisect_key on a [R, CAP] tile of keys and probabilities held in registers."""
    j = tl.arange(0, NT)
    while tl.max((hi - lo > 1).to(tl.int32)) > 0:
        live = hi - lo > 1
        thr = lo[:, None] + ((hi - lo)[:, None] * (j[None, :] + 1)) // (NT + 1)
        ge = keys[:, :, None] >= thr[:, None, :]  # [R, CAP, NT]
        if USE_MASS:
            ok = tl.sum(tl.where(ge, p[:, :, None], 0.0), 1) >= target[:, None]
        else:
            ok = tl.sum(ge.to(tl.int32), 1) >= kth[:, None]
        lo = tl.where(live, tl.max(tl.where(ok, thr, lo[:, None]), 1), lo)
        hi = tl.where(live, tl.min(tl.where(ok, hi[:, None], thr), 1), hi)
    return lo


# runtime values that would otherwise compile a variant each time they hit 1 (B = 1, strides of broadcast scalars)
@triton.jit(
    do_not_specialize=["B", "temp_stride", "top_k_stride", "top_p_stride", "min_p_stride", "seed_stride",
                       "step_stride", "split", "chunk_len"]
)  # fmt: skip
def _sample_kernel(
    logits_ptr, stride_row, B, V,
    temp_ptr, temp_stride, top_k_ptr, top_k_stride, top_p_ptr, top_p_stride, min_p_ptr, min_p_stride,
    seed_ptr, seed_stride, step_ptr, step_stride,
    buf_val_ptr, buf_idx_ptr, part_f_ptr, part_i_ptr, counter_ptr, out_ptr, split, chunk_len,
    R: tl.constexpr, BLOCK: tl.constexpr, BLOCK_T: tl.constexpr, CAP: tl.constexpr, NT: tl.constexpr,
    SPLIT_MAX: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * R + tl.arange(0, R)
    row_ok = rows < B
    base = logits_ptr + rows[:, None].to(tl.int64) * stride_row
    temperature = tl.load(temp_ptr + rows * temp_stride, mask=row_ok, other=0.0).to(tl.float32)
    top_k = tl.load(top_k_ptr + rows * top_k_stride, mask=row_ok, other=0).to(tl.int64)
    top_p = tl.load(top_p_ptr + rows * top_p_stride, mask=row_ok, other=1.0).to(tl.float32)
    min_p = tl.minimum(tl.load(min_p_ptr + rows * min_p_stride, mask=row_ok, other=0.0).to(tl.float32), 1.0)
    seed = tl.load(seed_ptr + rows * seed_stride, mask=row_ok, other=0).to(tl.int64)
    step = tl.load(step_ptr + rows * step_stride, mask=row_ok, other=0).to(tl.int64)
    sampled = row_ok & (temperature > 0)
    # log2(e) / T, so p = exp2((x - max) * c); T clamped so that c stays finite
    c = tl.where(sampled, LOG2E / tl.maximum(temperature, 1e-30), 0.0)

    # ---- 1. stats pass
    m = tl.full((R,), float("-inf"), tl.float32)
    arg = tl.zeros((R,), tl.int64)
    has_nan = tl.zeros((R,), tl.int32)
    total = tl.zeros((R,), tl.float32)  # sum of exp2((x - m) * c)
    n_finite = tl.zeros((R,), tl.int64)
    x_min = tl.full((R,), float("inf"), tl.float32)
    any_sampled = tl.max(sampled.to(tl.int32)) > 0
    chunk = tl.program_id(1)
    for off in range(chunk * chunk_len, tl.minimum(chunk * chunk_len + chunk_len, V), BLOCK):
        x, cols, msk = _load_block(base, off, V, row_ok, BLOCK)
        nan = x != x
        has_nan |= tl.max(nan.to(tl.int32), 1)
        x = tl.where(nan, float("-inf"), x) + 0.0
        blk_max = tl.max(x, 1)
        blk_arg = tl.argmax(x, 1, tie_break_left=True).to(tl.int64) + off
        arg = tl.where(blk_max > m, blk_arg, arg)  # strict: the earlier block keeps ties
        m_new = tl.maximum(m, blk_max)
        if any_sampled:
            ref = tl.where((m_new == float("-inf")) | (m_new == float("inf")), 0.0, m_new)
            total = total * tl.exp2((m - ref) * c) + tl.sum(tl.exp2((x - ref[:, None]) * c[:, None]), 1)
            finite = x > float("-inf")
            n_finite += tl.sum(finite.to(tl.int64), 1)
            x_min = tl.minimum(x_min, tl.min(tl.where(finite, x, float("inf")), 1))
        m = m_new
    if split > 1:  # publish this chunk's stats; the row's last program to arrive combines them
        part = (rows * split + chunk) * 3
        tl.store(part_f_ptr + part, m, mask=row_ok)
        tl.store(part_f_ptr + part + 1, total, mask=row_ok)
        tl.store(part_f_ptr + part + 2, x_min, mask=row_ok)
        tl.store(part_i_ptr + part, arg, mask=row_ok)
        tl.store(part_i_ptr + part + 1, n_finite, mask=row_ok)
        tl.store(part_i_ptr + part + 2, has_nan.to(tl.int64), mask=row_ok)
        tl.debug_barrier()  # every thread's stores before the release below
        arrived = tl.atomic_add(counter_ptr + rows, 1, mask=row_ok, sem="acq_rel", scope="gpu")
        row_ok &= arrived == split - 1
        sampled &= row_ok
        tl.store(counter_ptr + rows, 0, mask=row_ok)  # ready for the next launch (and CUDA graph replay)
        sp = tl.arange(0, SPLIT_MAX)
        parts = (rows[:, None] * split + sp[None, :]) * 3  # [R, SPLIT_MAX]
        pm = row_ok[:, None] & (sp < split)[None, :]
        ms = tl.load(part_f_ptr + parts, mask=pm, other=float("-inf"), volatile=True)
        m = tl.max(ms, 1)
        args = tl.load(part_i_ptr + parts, mask=pm, other=0, volatile=True)
        arg = tl.min(tl.where(ms == m[:, None], args, V), 1)  # the first chunk holding the max
        ref = tl.where((m == float("-inf")) | (m == float("inf")), 0.0, m)
        totals = tl.load(part_f_ptr + parts + 1, mask=pm, other=0.0, volatile=True)
        scale = tl.where(ms == float("-inf"), 0.0, tl.exp2((ms - ref[:, None]) * c[:, None]))
        total = tl.sum(totals * scale, 1)  # chunk sums are relative to their own max
        x_min = tl.min(tl.load(part_f_ptr + parts + 2, mask=pm, other=float("inf"), volatile=True), 1)
        n_finite = tl.sum(tl.load(part_i_ptr + parts + 1, mask=pm, other=0, volatile=True), 1)
        has_nan = tl.max(tl.load(part_i_ptr + parts + 2, mask=pm, other=0, volatile=True), 1).to(tl.int32)
    invalid = (has_nan > 0) | (m == float("-inf"))
    token = tl.where(invalid, INVALID, arg)  # greedy; an +inf logit wins (first one)
    active = sampled & ~invalid & (m < float("inf"))

    if tl.max(active.to(tl.int32)) > 0:
        k_on = active & (top_k > 0) & (top_k < n_finite)
        p_on = active & (top_p < 1.0)
        mp_on = active & (min_p > 0.0)
        filtered = k_on | p_on | mp_on
        buf_val = buf_val_ptr + rows[:, None].to(tl.int64) * CAP
        buf_idx = buf_idx_ptr + rows[:, None].to(tl.int64) * CAP
        log2_min_p = tl.log2(tl.where(mp_on, min_p, 1.0))

        # ---- 2. search pass: thresholds s_0 = max, s_j = max - (max - min) * 2^((j + 1 - NT) / 2)
        j = tl.arange(0, NT)
        frac = tl.where(j == 0, 0.0, tl.exp2((j + 1 - NT).to(tl.float32) * 0.5))
        thr = tl.maximum(m[:, None] - (m - x_min)[:, None] * frac[None, :], x_min[:, None])  # [R, NT] decreasing
        # speculative gather threshold, checked after the pass: min-p: p(spec) ~ min_p / 2 < min_p; top-p: tokens
        # with p / total < tail hold < 1 - top_p of the mass; top-k: a guess (that tail at top_p 0.9), kept if
        # at least k tokens are at or above it
        tail = (1.0 - tl.where(p_on, top_p, 0.9)) / V
        spec = m + tl.log2(tail * total) / c
        spec_min_p = m + (log2_min_p - 1.0) / c
        spec = tl.where(mp_on & ~k_on, tl.where(p_on, tl.maximum(spec, spec_min_p), spec_min_p), spec)
        spec = tl.where(filtered, tl.minimum(spec, m), float("inf"))  # the max is always kept
        use_mass = tl.max((p_on & ~k_on).to(tl.int32)) > 0
        # counts and masses accumulate per slot (no cross-thread reduction in the loop), reduced once after it
        cnt_slots = tl.zeros((R, BLOCK_T, NT), tl.int32)
        mass_slots = tl.zeros((R, BLOCK_T, NT), tl.float32)
        mass_spec_slots = tl.zeros((R, BLOCK_T), tl.float32)
        n_spec = tl.zeros((R,), tl.int64)
        for off in range(0, V, BLOCK_T):  # [R, BLOCK_T, NT] tiles: a smaller block
            x, cols, msk = _load_block(base, off, V, filtered, BLOCK_T)
            x = tl.where(x != x, float("-inf"), x)
            p = tl.exp2((x - m[:, None]) * c[:, None])
            ge = (x[:, :, None] >= thr[:, None, :]) & msk[:, :, None]  # [R, BLOCK_T, NT]
            cnt_slots += ge.to(tl.int32)
            if use_mass:
                mass_slots += tl.where(ge, p[:, :, None], 0.0)
            take = (x >= spec[:, None]) & msk
            pos = n_spec[:, None] + tl.cumsum(take.to(tl.int64), 1) - 1
            tl.store(buf_val + pos, x, mask=take & (pos < CAP))
            tl.store(buf_idx + pos, cols[None, :].broadcast_to(x.shape), mask=take & (pos < CAP))
            n_spec += tl.sum(take.to(tl.int64), 1)
            mass_spec_slots += tl.where(take, p, 0.0)
        cnt = tl.sum(cnt_slots.to(tl.int64), 1)  # [R, NT]
        mass = tl.sum(mass_slots, 1)
        mass_spec = tl.sum(mass_spec_slots, 1)
        spec_ok = tl.where(
            k_on, n_spec >= top_k, (p_on & (mass_spec >= top_p * total)) | (mp_on & (tl.exp2((spec - m) * c) < min_p))
        )
        gathered = filtered & spec_ok & (n_spec <= CAP)
        # thresholds provably at or below the cut: count >= k with top-k, else the mass or min-p bound
        below_cut = tl.where(
            k_on[:, None],
            cnt >= top_k[:, None],
            (p_on[:, None] & (mass >= (top_p * total)[:, None]))
            | (mp_on[:, None] & (tl.exp2((thr - m[:, None]) * c[:, None]) < min_p[:, None])),
        )
        usable = below_cut & (cnt <= CAP)
        j_best = tl.min(tl.where(usable, j[None, :], NT), 1)
        regather = filtered & ~gathered & (j_best < NT)
        s = tl.max(tl.where(j[None, :] == j_best[:, None], thr, float("-inf")), 1)

        # ---- 3. gather pass at the best usable threshold
        n_buf = tl.where(gathered, n_spec, 0)
        if tl.max(regather.to(tl.int32)) > 0:
            for off in range(0, V, BLOCK):
                x, cols, msk = _load_block(base, off, V, regather, BLOCK)
                take = (x >= s[:, None]) & msk  # NaN rows never get here
                pos = n_buf[:, None] + tl.cumsum(take.to(tl.int64), 1) - 1
                tl.store(buf_val + pos, x, mask=take & (pos < CAP))
                tl.store(buf_idx + pos, cols[None, :].broadcast_to(x.shape), mask=take & (pos < CAP))
                n_buf += tl.sum(take.to(tl.int64), 1)
        in_buf = gathered | regather
        tl.debug_barrier()  # the buffer was written by other threads of this program

        # exact cut on the <= CAP gathered logits, then the race among them
        if tl.max(in_buf.to(tl.int32)) > 0:
            slot = tl.arange(0, CAP)
            bmask = in_buf[:, None] & (slot[None, :] < n_buf[:, None])
            vals = tl.load(buf_val + slot[None, :], mask=bmask, other=float("-inf"))
            idx = tl.load(buf_idx + slot[None, :], mask=bmask, other=0).to(tl.int64)
            keys = _ordered_key(vals + 0.0).to(tl.int64)
            p = tl.where(bmask, tl.exp2((vals - m[:, None]) * c[:, None]), 0.0)
            lo = tl.min(tl.where(bmask, keys, _ordered_key(m).to(tl.int64)[:, None]), 1)
            top = _ordered_key(m).to(tl.int64) + 1
            key_k = _bisect_tile(keys, p, lo, tl.where(k_on, top, lo + 1), top_k, total, False, NT)
            z = tl.where(k_on, tl.sum(tl.where(keys >= key_k[:, None], p, 0.0), 1), total)  # top-p after top-k
            key_cut = _bisect_tile(keys, p, key_k, tl.where(p_on, top, key_k + 1), top_k, top_p * z, True, NT)
            keep = bmask & (keys >= key_cut[:, None])
            keep &= ~mp_on[:, None] | (tl.exp2((vals - m[:, None]) * c[:, None]) >= min_p[:, None])
            race = tl.where(keep, _race_key(vals, m[:, None], c[:, None], seed[:, None], step[:, None], idx), -1e38)
            win = tl.argmax(race, 1, tie_break_left=True)
            drawn = tl.max(tl.where(slot[None, :] == win[:, None], idx, -1), 1)
            token = tl.where(in_buf, drawn, token)

        # ---- 4. rows whose kept set may exceed CAP (or without filters): exact cut, then a race over the row
        full = active & ~in_buf
        if tl.max(full.to(tl.int32)) > 0:
            lo = _ordered_key(x_min).to(tl.int64)
            top = _ordered_key(m).to(tl.int64) + 1
            key_k, z = _bisect_key(base, V, full, m, c, lo, tl.where(full & k_on, top, lo + 1), total, top_k,
                                   total, False, BLOCK_T, NT)  # fmt: skip
            key_cut, _ = _bisect_key(base, V, full, m, c, key_k, tl.where(full & p_on, top, key_k + 1), z, top_k,
                                     top_p * z, True, BLOCK_T, NT)  # fmt: skip
            best = tl.full((R,), float("-inf"), tl.float32)
            best_idx = tl.zeros((R,), tl.int64)
            for off in range(0, V, BLOCK):
                x, cols, msk = _load_block(base, off, V, full, BLOCK)
                x = x + 0.0
                keep = msk & (_ordered_key(x) >= key_cut[:, None]) & (x > float("-inf"))
                keep &= ~mp_on[:, None] | (tl.exp2((x - m[:, None]) * c[:, None]) >= min_p[:, None])
                race = tl.where(keep, _race_key(x, m[:, None], c[:, None], seed[:, None], step[:, None], cols), -1e38)
                blk_best = tl.max(race, 1)
                blk_idx = tl.argmax(race, 1, tie_break_left=True).to(tl.int64) + off
                best_idx = tl.where(blk_best > best, blk_idx, best_idx)
                best = tl.maximum(best, blk_best)
            token = tl.where(full, best_idx, token)

    tl.store(out_ptr + rows, token, mask=row_ok)


_counters = {}  # device -> int32 zeros, one per row; the last program of a row resets its counter


def arrival_counters(n: int, device) -> torch.Tensor:
    """Zeroed per-row counters for the split stats pass, kept between calls (one launch at a time per device)."""
    device = torch.device(device)
    buf = _counters.get(device)
    if buf is None or buf.numel() < n:
        buf = _counters[device] = torch.zeros(max(n, 256), dtype=torch.int32, device=device)
    return buf


def launch(logits, temperature, top_k, top_p, min_p, seed, step, block=None, cap=None, nt=8, rows=None, split=None):
    """Run the kernel on [B] parameter tensors (any stride, e.g. expanded scalars) -> int64 [B].

    block / cap / nt / rows (rows per program) / split (programs per row in the stats pass, <= 64) are
    tuning knobs; tests shrink cap to exercise the fallback and set split on the CPU."""
    B, V = logits.shape
    out = torch.empty(B, dtype=torch.int64, device=logits.device)
    if B == 0:
        return out
    assert logits.stride(1) == 1, "logits rows must be contiguous"
    if block is None:
        block = min(4096, triton.next_power_of_2(V))
    block_t = min(block, 1024)
    if cap is None:  # the gather buffer never needs more than V slots
        cap = min(1024, triton.next_power_of_2(V))
    if rows is None:  # one row per program on the GPU; batches of rows in the CPU interpreter
        rows = 1 if logits.is_cuda else min(triton.next_power_of_2(B), max(1, 2**20 // (max(block, cap) * nt)))
    if split is None:  # spread the stats pass (all of greedy) over ~1024 programs: bytes in flight
        split = min(SPLIT_MAX, max(1, 1024 // (B * rows))) if logits.is_cuda else 1
    assert 1 <= split <= SPLIT_MAX
    chunk_len = triton.cdiv(triton.cdiv(V, split), block) * block
    device = logits.device
    buf_val = torch.empty(B, cap, dtype=torch.float32, device=device)
    buf_idx = torch.empty(B, cap, dtype=torch.int32, device=device)
    part_f = torch.empty(B, split, 3, dtype=torch.float32, device=device)
    part_i = torch.empty(B, split, 3, dtype=torch.int64, device=device)
    counters = arrival_counters(B, device) if split > 1 else part_i
    params = [(t, t.stride(0)) for t in (temperature, top_k, top_p, min_p, seed, step)]
    _sample_kernel[(triton.cdiv(B, rows), split)](
        logits, logits.stride(0), B, V, *(x for pair in params for x in pair),
        buf_val, buf_idx, part_f, part_i, counters, out, split, chunk_len,
        R=rows, BLOCK=block, BLOCK_T=block_t, CAP=cap, NT=nt, SPLIT_MAX=SPLIT_MAX,
        num_warps=8 if logits.is_cuda else 1,
    )  # fmt: skip
    return out


@torch.library.custom_op("qmoe::sample", mutates_args=())
def sample_op(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seed: torch.Tensor,
    step: torch.Tensor,
) -> torch.Tensor:
    return launch(logits, temperature, top_k, top_p, min_p, seed, step)


@sample_op.register_fake
def _(logits, temperature, top_k, top_p, min_p, seed, step):
    return logits.new_empty(logits.shape[0], dtype=torch.int64)


def sample(logits, temperature, top_k, top_p, min_p, seed, step) -> torch.Tensor:
    """logits [B, V] (fp32 / bf16 / fp16) -> int64 [B]; parameters are [B] device tensors or scalars."""
    B = logits.shape[0]

    def per_row(x, dtype):
        if isinstance(x, torch.Tensor):
            return x.to(device=logits.device, dtype=dtype).expand(B)
        return torch.full((B,), x, dtype=dtype, device=logits.device)  # a fill kernel: capturable, no copy

    return sample_op(
        logits if logits.stride(-1) == 1 else logits.contiguous(),  # rows may share storage (stride 0)
        per_row(temperature, torch.float32),
        per_row(top_k, torch.int64),
        per_row(top_p, torch.float32),
        per_row(min_p, torch.float32),
        per_row(seed, torch.int64),
        per_row(step, torch.int64),
    )
