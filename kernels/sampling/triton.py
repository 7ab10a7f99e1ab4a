"""Fused sampling in Triton: logits [B, V] -> token ids int64 [B], no sort of the vocabulary, no pass over a row in
a single program.

`greedy` (every row at temperature 0, chosen by the caller from its run config) is two launches: a chunked
argmax then the combine of the chunks (`_chunk_argmax_kernel`, `_combine_argmax_kernel`). `sample`:

Same semantics as `naive.py` (read its docstring). Each row is cut into `split` chunks, one program per
(row, chunk) in every launch, so each pass over a row is spread over many programs; a launch that a row does
not need costs its programs a few loads. 5 + 2 * rounds_per_phase(bins) launches (21 with 16 bins):

1. `_stats_kernel`: per chunk, NaN flag, max and its lowest index (the greedy answer), and for sampled rows
   the sum of p_i = 2^((x_i - max) * log2(e) / temperature), the smallest finite logit and the number of
   finite logits -> a small workspace. It also zeroes the rows' arrival counters of the later launches.
2. `_speculative_gather_kernel` (filtered rows): every program combines the chunk stats, then gathers every
   x >= s of its chunk into the chunk's own CAP slots (token order) and sums their p.
3. `_threshold_count_kernel`: every program sums the gather's partials in chunk order (the same decisions
   everywhere, on every call) and keeps the gather if s proves to be at or below the cut (min-p: p(s) <
   min_p; top-p: the tokens with normalised p < (1 - top_p) / V carry less than 1 - top_p of the mass; top-k:
   at least k tokens gathered) and at most CAP tokens came. Rows where it missed count (and weigh, for top-p
   without top-k) x >= s_j at NT logit thresholds spread geometrically between the max and the smallest
   logit; rows without a filter run the exponential race over the chunk instead.
4. `_finish_kernel`: rows where the gather missed regather each chunk at the highest threshold provably at or
   below the cut holding at most CAP tokens. The row's last program to arrive (atomic counter, no waiting)
   finds the exact top-k / top-p / min-p cut on the <= CAP gathered logits in registers (bisection of their
   keys) and draws the token by an exponential race: argmax over kept i of log2(p_i) - log2(-ln U_i). Rows
   whose kept set may exceed CAP (flat rows, large k, ties at the cut, a k-th value in a flat tail) get a
   radix state instead: top-k phase, top-p phase, or (min-p alone, closed form) straight to the race.
5. `_radix_round_kernel`, 2 * rounds_per_phase(bins) launches: each narrows the row's bracket of
   order-preserving int32 keys around the cut by a factor `bins` (every program counts / weighs its chunk at
   `bins` thresholds, the row's last program to arrive sums the partials in chunk order and picks the bin),
   top-k's cut first, then top-p's within the top-k set. A bracket of one key is the cut (ties kept).
6. `_race_kernel`: rows with a cut from the rounds race over their kept x in every program; the last program
   to arrive takes the best of the chunks.

U_i comes from Triton's Philox keyed by the row's seed with counter (step, token index): the same
(logits, parameters, seed, step) give the same token on every call and at any batch position, and nothing
depends on a global generator, so CUDA graph replay is safe. The torch version cannot reproduce the
Philox bits (it uses its own hash), so the two agree exactly on greedy and in distribution otherwise.
"""

import torch
import triton
import triton.language as tl

import kernels
from kernels.launch import fast_launch
from kernels.sampling.naive import INVALID_TOKEN

# Globals read inside kernels must be constexprs (triton 3.6 refuses plain ones).
LOG2E = tl.constexpr(1.4426950408889634)
INVALID = tl.constexpr(INVALID_TOKEN)
SPLIT_MAX = 64  # programs per row, at most
GREEDY_SPLIT_MAX = 256  # the greedy pass has no per-row state to combine: more, smaller chunks at B = 1


@triton.jit
def _ordered_key(x):
    """fp32 -> int32 whose signed order is the float order (x is not NaN; -0.0 already folded into +0.0)."""
    bits = x.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _open_uniform(bits):
    """uint32 -> U in (0, 1) from its top 24 bits, (k + 0.5) / 2^24. k = 2^24 - 1 gives 1 - 2^-25, which fp32
    rounds up to 1.0 (E = 0: that token would win whatever its p, once in 2^24 token-draws): the largest fp32
    below 1 stands in for it."""
    u = ((bits >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
    return tl.minimum(u, 0.99999994)


@triton.jit
def _race_key(x, m, c, seed, step, idx):
    """log2(p / E), E = -ln U ~ Exp(1), U from Philox(seed; step, idx): the kept token with the largest wins."""
    bits = tl.randint(seed, (step << 32) + idx)  # uint32, counter = (idx, step)
    return (x - m) * c - tl.log2(-tl.log(_open_uniform(bits)))


@triton.jit
def _load_block(base, off, V, row_ok, BLOCK: tl.constexpr):
    cols = off + tl.arange(0, BLOCK)
    msk = row_ok[:, None] & (cols < V)[None, :]
    x = tl.load(base + cols[None, :], mask=msk, other=float("-inf")).to(tl.float32)
    return x, cols, msk


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


@fast_launch
@triton.jit(do_not_specialize=["B", "temp_stride", "n_counters", "split", "chunk_blocks"])
def _stats_kernel(
    logits_ptr, stride_row, B, V, temp_ptr, temp_stride, part_f_ptr, part_i_ptr, counter_ptr, n_counters, split,
    chunk_blocks, R: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """1. stats of one chunk of R rows -> part_f [B, split, 3] (max, sum of p relative to it, smallest finite
    logit) and part_i [B, split, 3] (first argmax, finite count, NaN flag); zeroes the rows' arrival counters
    (counter_ptr [n_counters, B]: one per later launch that has arrivals)."""
    rows = tl.program_id(0) * R + tl.arange(0, R)
    row_ok = rows < B
    chunk = tl.program_id(1)
    base = logits_ptr + rows[:, None].to(tl.int64) * stride_row
    temperature = tl.load(temp_ptr + rows * temp_stride, mask=row_ok, other=0.0).to(tl.float32)
    sampled = row_ok & (temperature > 0)
    c = tl.where(sampled, LOG2E / tl.maximum(temperature, 1e-30), 0.0)
    any_sampled = tl.max(sampled.to(tl.int32)) > 0
    # greedy's max / argmax / NaN flag per slot, reduced once after the loop; sampled rows' sums per block
    best = tl.full((R, BLOCK), float("-inf"), tl.float32)
    best_idx = tl.zeros((R, BLOCK), tl.int32) + V
    nan_slots = tl.zeros((R, BLOCK), tl.int32)
    m_run = tl.full((R,), float("-inf"), tl.float32)
    total = tl.zeros((R,), tl.float32)  # sum of exp2((x - m_run) * c)
    n_finite = tl.zeros((R,), tl.int32)
    x_min = tl.full((R,), float("inf"), tl.float32)
    chunk_len = chunk_blocks * BLOCK  # a multiple of BLOCK: aligned, vectorised loads
    start = chunk * chunk_len
    for off in range(start, tl.minimum(start + chunk_len, V), BLOCK):
        x, cols, msk = _load_block(base, off, V, row_ok, BLOCK)
        nan = x != x
        nan_slots |= nan.to(tl.int32)
        x = tl.where(nan, float("-inf"), x) + 0.0
        up = x > best  # strict: a slot keeps its earliest index on ties
        best_idx = tl.where(up, cols[None, :], best_idx)
        best = tl.where(up, x, best)
        if any_sampled:
            m_new = tl.maximum(m_run, tl.max(x, 1))
            ref = tl.where((m_new == float("-inf")) | (m_new == float("inf")), 0.0, m_new)
            total = total * tl.exp2((m_run - ref) * c) + tl.sum(tl.exp2((x - ref[:, None]) * c[:, None]), 1)
            m_run = m_new
            finite = x > float("-inf")
            n_finite += tl.sum(finite.to(tl.int32), 1)
            x_min = tl.minimum(x_min, tl.min(tl.where(finite, x, float("inf")), 1))
    m = tl.max(best, 1)
    part = (rows * split + chunk) * 3
    tl.store(part_f_ptr + part, m, mask=row_ok)
    tl.store(part_f_ptr + part + 1, total, mask=row_ok)  # relative to this chunk's max
    tl.store(part_f_ptr + part + 2, x_min, mask=row_ok)
    tl.store(part_i_ptr + part, tl.min(tl.where(best == m[:, None], best_idx, V), 1), mask=row_ok)
    tl.store(part_i_ptr + part + 1, n_finite, mask=row_ok)
    tl.store(part_i_ptr + part + 2, tl.max(nan_slots, 1), mask=row_ok)
    first_chunk = row_ok & (rows * 0 + chunk == 0)
    for i in range(n_counters):  # nothing persists between calls
        tl.store(counter_ptr + i * B + rows, tl.zeros((R,), tl.int32), mask=first_chunk)


@triton.jit
def _combine_stats(part_f_ptr, part_i_ptr, rows, row_ok, split, c, V, SPLIT: tl.constexpr):
    """The row stats from its chunks' (written by the previous launch)."""
    sp = tl.arange(0, SPLIT)
    parts = (rows[:, None] * split + sp[None, :]) * 3  # [R, SPLIT]
    pm = row_ok[:, None] & (sp < split)[None, :]
    ms = tl.load(part_f_ptr + parts, mask=pm, other=float("-inf"))
    m = tl.max(ms, 1)
    args = tl.load(part_i_ptr + parts, mask=pm, other=V)
    arg = tl.min(tl.where(ms == m[:, None], args, V), 1).to(tl.int64)  # the first chunk holding the max
    ref = tl.where((m == float("-inf")) | (m == float("inf")), 0.0, m)
    totals = tl.load(part_f_ptr + parts + 1, mask=pm, other=0.0)
    scale = tl.where(ms == float("-inf"), 0.0, tl.exp2((ms - ref[:, None]) * c[:, None]))
    total = tl.sum(totals * scale, 1)  # chunk sums are relative to their own max
    x_min = tl.min(tl.load(part_f_ptr + parts + 2, mask=pm, other=float("inf")), 1)
    n_finite = tl.sum(tl.load(part_i_ptr + parts + 1, mask=pm, other=0), 1).to(tl.int64)
    has_nan = tl.max(tl.load(part_i_ptr + parts + 2, mask=pm, other=0), 1)
    return m, arg, total, x_min, n_finite, has_nan


# runtime values that would otherwise compile a variant each time they hit 1 (B = 1, strides of broadcast scalars)
SEARCH_RUNTIME_ARGS = ["B", "temp_stride", "top_k_stride", "top_p_stride", "min_p_stride", "seed_stride",
                       "step_stride", "split", "chunk_blocks"]  # fmt: skip


@triton.jit
def _row_setup(
    logits_ptr, stride_row, B, V, temp_ptr, temp_stride, top_k_ptr, top_k_stride, top_p_ptr, top_p_stride,
    min_p_ptr, min_p_stride, part_f_ptr, part_i_ptr, split, R: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    """What every search pass knows of its R rows: parameters, row stats (launch 1) and which filters are on."""
    rows = tl.program_id(0) * R + tl.arange(0, R)
    row_ok = rows < B
    base = logits_ptr + rows[:, None].to(tl.int64) * stride_row
    temperature = tl.load(temp_ptr + rows * temp_stride, mask=row_ok, other=0.0).to(tl.float32)
    top_k = tl.load(top_k_ptr + rows * top_k_stride, mask=row_ok, other=0).to(tl.int64)
    top_p = tl.load(top_p_ptr + rows * top_p_stride, mask=row_ok, other=1.0).to(tl.float32)
    min_p = tl.minimum(tl.load(min_p_ptr + rows * min_p_stride, mask=row_ok, other=0.0).to(tl.float32), 1.0)
    sampled = row_ok & (temperature > 0)
    # log2(e) / T, so p = exp2((x - max) * c); T clamped so that c stays finite
    c = tl.where(sampled, LOG2E / tl.maximum(temperature, 1e-30), 0.0)
    m, arg, total, x_min, n_finite, has_nan = _combine_stats(part_f_ptr, part_i_ptr, rows, row_ok, split, c, V, SPLIT)
    invalid = (has_nan > 0) | (m == float("-inf"))
    token = tl.where(invalid, INVALID, arg)  # greedy; an +inf logit wins (first one)
    active = sampled & ~invalid & (m < float("inf"))
    k_on = active & (top_k > 0) & (top_k < n_finite)
    p_on = active & (top_p < 1.0)
    mp_on = active & (min_p > 0.0)
    filtered = k_on | p_on | mp_on
    unfiltered = active & ~filtered  # plain softmax: the race over the row, no cut
    return rows, row_ok, base, top_k, top_p, min_p, c, m, total, x_min, token, k_on, p_on, mp_on, filtered, unfiltered


@triton.jit
def _speculative_threshold(m, c, total, V, top_p, min_p, k_on, p_on, mp_on, filtered):
    """The speculative gather's threshold, checked after the pass: min-p: p(spec) ~ min_p / 2 < min_p; top-p:
    tokens with p / total < tail hold < 1 - top_p of the mass; top-k: a guess (that tail at top_p 0.9), kept
    if at least k tokens are at or above it. +inf for rows without a filter."""
    tail = (1.0 - tl.where(p_on, top_p, 0.9)) / V
    spec = m + tl.log2(tail * total) / c
    spec_min_p = m + (tl.log2(tl.where(mp_on, min_p, 1.0)) - 1.0) / c
    spec = tl.where(mp_on & ~k_on, tl.where(p_on, tl.maximum(spec, spec_min_p), spec_min_p), spec)
    return tl.where(filtered, tl.minimum(spec, m), float("inf"))  # the max is always kept


@triton.jit
def _gather_outcome(search_i_ptr, search_f_ptr, rows, split, m, c, total, top_k, top_p, min_p, spec,
                    k_on, p_on, mp_on, filtered, unfiltered, CAP: tl.constexpr, NT: tl.constexpr,
                    SPLIT: tl.constexpr):  # fmt: skip
    """The speculative gather's partials of all chunks, summed in chunk order (the same decision in every
    program, on every call) -> per-chunk counts [R, SPLIT], rows whose gather holds the cut, rows that missed."""
    sp = tl.arange(0, SPLIT)
    parts = (rows[:, None] * split + sp[None, :]) * (NT + 3)  # [R, SPLIT]
    pm = (filtered | unfiltered)[:, None] & (sp < split)[None, :]
    n_chunk = tl.load(search_i_ptr + parts + NT, mask=pm, other=0)  # [R, SPLIT]
    n_spec = tl.sum(n_chunk, 1)
    mass_spec = tl.sum(tl.load(search_f_ptr + parts + NT, mask=pm, other=0.0), 1)
    spec_ok = tl.where(
        k_on, n_spec >= top_k, (p_on & (mass_spec >= top_p * total)) | (mp_on & (tl.exp2((spec - m) * c) < min_p))
    )
    gathered = filtered & spec_ok & (n_spec <= CAP)
    return sp, parts, pm, n_chunk, gathered, filtered & ~gathered


@triton.jit
def _geometric_thresholds(m, x_min, NT: tl.constexpr):
    """[R, NT] decreasing logit thresholds s_0 = max, s_j = max - (max - min) * 2^((j + 1 - NT) / 2)."""
    j = tl.arange(0, NT)
    frac = tl.where(j == 0, 0.0, tl.exp2((j + 1 - NT).to(tl.float32) * 0.5))
    return tl.maximum(m[:, None] - (m - x_min)[:, None] * frac[None, :], x_min[:, None])


@fast_launch
@triton.jit(do_not_specialize=SEARCH_RUNTIME_ARGS)
def _speculative_gather_kernel(
    logits_ptr, stride_row, B, V,
    temp_ptr, temp_stride, top_k_ptr, top_k_stride, top_p_ptr, top_p_stride, min_p_ptr, min_p_stride,
    seed_ptr, seed_stride, step_ptr, step_stride,
    part_f_ptr, part_i_ptr, search_f_ptr, search_i_ptr, ends_ptr, buf_val_ptr, buf_idx_ptr, counter_ptr, out_ptr,
    state_i_ptr, state_f_ptr, split, chunk_blocks,
    R: tl.constexpr, BLOCK: tl.constexpr, BLOCK_T: tl.constexpr, CAP: tl.constexpr, NT: tl.constexpr,
    SPLIT: tl.constexpr, LOG_SPLIT: tl.constexpr,
):  # fmt: skip
    """2. Filtered rows: every x >= spec of this chunk into the chunk's own CAP slots (token order), and the
    count and mass of what came -> search partials."""
    rows, row_ok, base, top_k, top_p, min_p, c, m, total, x_min, token, k_on, p_on, mp_on, filtered, unfiltered = (
        _row_setup(logits_ptr, stride_row, B, V, temp_ptr, temp_stride, top_k_ptr, top_k_stride, top_p_ptr,
                   top_p_stride, min_p_ptr, min_p_stride, part_f_ptr, part_i_ptr, split, R, SPLIT)
    )  # fmt: skip
    chunk = tl.program_id(1)
    spec = _speculative_threshold(m, c, total, V, top_p, min_p, k_on, p_on, mp_on, filtered)
    sbase = (rows * split + chunk) * (NT + 3)  # this chunk's partials
    region = (rows * split + chunk).to(tl.int64)[:, None] * CAP  # this chunk's slots
    chunk_len = chunk_blocks * BLOCK  # a multiple of BLOCK: aligned, vectorised loads
    start = chunk * chunk_len
    mass_spec_slots = tl.zeros((R, BLOCK), tl.float32)
    n_spec = tl.zeros((R,), tl.int32)
    stop = tl.where(tl.max(filtered.to(tl.int32)) > 0, tl.minimum(start + chunk_len, V), start)  # else no pass
    for off in range(start, stop, BLOCK):
        x, cols, msk = _load_block(base, off, V, filtered, BLOCK)  # active rows have no NaN
        p = tl.exp2((x - m[:, None]) * c[:, None])
        take = (x >= spec[:, None]) & msk
        pos = n_spec[:, None] + tl.cumsum(take.to(tl.int32), 1) - 1
        tl.store(buf_val_ptr + region + pos, x, mask=take & (pos < CAP))
        tl.store(buf_idx_ptr + region + pos, cols[None, :].broadcast_to(x.shape), mask=take & (pos < CAP))
        n_spec += tl.sum(take.to(tl.int32), 1)
        mass_spec_slots += tl.where(take, p, 0.0)
    tl.store(search_i_ptr + sbase + NT, n_spec, mask=row_ok)
    tl.store(search_f_ptr + sbase + NT, tl.sum(mass_spec_slots, 1), mask=row_ok)


@fast_launch
@triton.jit(do_not_specialize=SEARCH_RUNTIME_ARGS)
def _threshold_count_kernel(
    logits_ptr, stride_row, B, V,
    temp_ptr, temp_stride, top_k_ptr, top_k_stride, top_p_ptr, top_p_stride, min_p_ptr, min_p_stride,
    seed_ptr, seed_stride, step_ptr, step_stride,
    part_f_ptr, part_i_ptr, search_f_ptr, search_i_ptr, ends_ptr, buf_val_ptr, buf_idx_ptr, counter_ptr, out_ptr,
    state_i_ptr, state_f_ptr, split, chunk_blocks,
    R: tl.constexpr, BLOCK: tl.constexpr, BLOCK_T: tl.constexpr, CAP: tl.constexpr, NT: tl.constexpr,
    SPLIT: tl.constexpr, LOG_SPLIT: tl.constexpr,
):  # fmt: skip
    """3. Rows whose gather missed: counts (and masses, for top-p without top-k) of x >= s_j at NT geometric
    thresholds over this chunk. Rows without a filter: the exponential race over this chunk."""
    rows, row_ok, base, top_k, top_p, min_p, c, m, total, x_min, token, k_on, p_on, mp_on, filtered, unfiltered = (
        _row_setup(logits_ptr, stride_row, B, V, temp_ptr, temp_stride, top_k_ptr, top_k_stride, top_p_ptr,
                   top_p_stride, min_p_ptr, min_p_stride, part_f_ptr, part_i_ptr, split, R, SPLIT)
    )  # fmt: skip
    chunk = tl.program_id(1)
    seed = tl.load(seed_ptr + rows * seed_stride, mask=row_ok, other=0).to(tl.int64)
    step = tl.load(step_ptr + rows * step_stride, mask=row_ok, other=0).to(tl.int64)
    spec = _speculative_threshold(m, c, total, V, top_p, min_p, k_on, p_on, mp_on, filtered)
    sp, parts, pm, n_chunk, gathered, counted = _gather_outcome(
        search_i_ptr, search_f_ptr, rows, split, m, c, total, top_k, top_p, min_p, spec, k_on, p_on, mp_on,
        filtered, unfiltered, CAP, NT, SPLIT,
    )  # fmt: skip
    thr = _geometric_thresholds(m, x_min, NT)
    j = tl.arange(0, NT)
    use_mass = tl.max((p_on & ~k_on).to(tl.int32)) > 0
    any_unfiltered = tl.max(unfiltered.to(tl.int32)) > 0
    sbase = (rows * split + chunk) * (NT + 3)
    chunk_len = chunk_blocks * BLOCK  # a multiple of BLOCK: aligned, vectorised loads
    start = chunk * chunk_len
    cnt = tl.zeros((R, NT), tl.int32)
    mass = tl.zeros((R, NT), tl.float32)
    race_slots = tl.full((R, BLOCK_T), float("-inf"), tl.float32)
    race_idx = tl.zeros((R, BLOCK_T), tl.int32) + V
    stop = tl.where(tl.max((counted | unfiltered).to(tl.int32)) > 0, tl.minimum(start + chunk_len, V), start)
    for off in range(start, stop, BLOCK_T):  # [R, BLOCK_T, NT] tiles: a smaller block
        x, cols, msk = _load_block(base, off, V, counted | unfiltered, BLOCK_T)
        ge = (x[:, :, None] >= thr[:, None, :]) & msk[:, :, None]  # [R, BLOCK_T, NT]
        cnt += tl.sum(ge.to(tl.int32), 1)
        if use_mass:
            p = tl.exp2((x - m[:, None]) * c[:, None])
            mass += tl.sum(tl.where(ge, p[:, :, None], 0.0), 1)
        if any_unfiltered:
            keep = unfiltered[:, None] & msk & (x > float("-inf"))
            race = _race_key(x, m[:, None], c[:, None], seed[:, None], step[:, None], cols)
            race = tl.where(keep, race, float("-inf"))
            up = race > race_slots  # strict: a slot keeps its earliest index on ties
            race_idx = tl.where(up, cols[None, :], race_idx)
            race_slots = tl.where(up, race, race_slots)
    tl.store(search_i_ptr + sbase[:, None] + j[None, :], cnt, mask=row_ok[:, None])
    tl.store(search_f_ptr + sbase[:, None] + j[None, :], mass, mask=row_ok[:, None])
    race_best = tl.max(race_slots, 1)
    tl.store(search_f_ptr + sbase + NT + 1, race_best, mask=row_ok)
    race_tok = tl.min(tl.where(race_slots == race_best[:, None], race_idx, V), 1)
    tl.store(search_i_ptr + sbase + NT + 1, race_tok, mask=row_ok)


# the radix state of a row (int64 [B, N_STATE] and fp32 [B, N_STATE]), written by the row's last program to
# arrive in launch 4 and in each radix round, read by every program of the row in the next launch
PHASE_NONE = tl.constexpr(0)  # the row is finished (or never needed the radix rounds)
PHASE_TOP_K = tl.constexpr(1)  # rounds narrow [lo, hi] to the k-th largest key
PHASE_TOP_P = tl.constexpr(2)  # rounds narrow [lo, hi] to the top-p cut within the top-k set
PHASE_RACE = tl.constexpr(3)  # the cut is known: the race launch draws the token (the state stays at this)
# int64 columns: phase, bracket, cut (the kept keys are >= it), k, key of the max, rounds run per phase
S_PHASE, S_LO, S_HI, S_CUT, S_K, S_TOP, S_ROUNDS_K, S_ROUNDS_P = (tl.constexpr(i) for i in range(8))
F_M, F_C, F_TOP_P, F_TARGET, F_MIN_P = (tl.constexpr(i) for i in range(5))  # fp32 columns
N_STATE = tl.constexpr(8)


@fast_launch
@triton.jit(do_not_specialize=SEARCH_RUNTIME_ARGS)
def _finish_kernel(
    logits_ptr, stride_row, B, V,
    temp_ptr, temp_stride, top_k_ptr, top_k_stride, top_p_ptr, top_p_stride, min_p_ptr, min_p_stride,
    seed_ptr, seed_stride, step_ptr, step_stride,
    part_f_ptr, part_i_ptr, search_f_ptr, search_i_ptr, ends_ptr, buf_val_ptr, buf_idx_ptr, counter_ptr, out_ptr,
    state_i_ptr, state_f_ptr, split, chunk_blocks,
    R: tl.constexpr, BLOCK: tl.constexpr, BLOCK_T: tl.constexpr, CAP: tl.constexpr, NT: tl.constexpr,
    SPLIT: tl.constexpr, LOG_SPLIT: tl.constexpr,
):  # fmt: skip
    """4. Rows whose gather missed regather this chunk at the highest geometric threshold provably at or below
    the cut holding <= CAP tokens. The row's last program to arrive (atomic counter, no waiting) finds the exact
    cut on the <= CAP gathered logits in registers and draws the token; rows without a filter take the best of
    the chunks' races; rows whose kept set may exceed CAP get their radix state (the rounds and the race launch
    finish them)."""
    rows, row_ok, base, top_k, top_p, min_p, c, m, total, x_min, token, k_on, p_on, mp_on, filtered, unfiltered = (
        _row_setup(logits_ptr, stride_row, B, V, temp_ptr, temp_stride, top_k_ptr, top_k_stride, top_p_ptr,
                   top_p_stride, min_p_ptr, min_p_stride, part_f_ptr, part_i_ptr, split, R, SPLIT)
    )  # fmt: skip
    chunk = tl.program_id(1)
    seed = tl.load(seed_ptr + rows * seed_stride, mask=row_ok, other=0).to(tl.int64)
    step = tl.load(step_ptr + rows * step_stride, mask=row_ok, other=0).to(tl.int64)
    spec = _speculative_threshold(m, c, total, V, top_p, min_p, k_on, p_on, mp_on, filtered)
    sp, parts, pm, n_chunk, gathered, counted = _gather_outcome(
        search_i_ptr, search_f_ptr, rows, split, m, c, total, top_k, top_p, min_p, spec, k_on, p_on, mp_on,
        filtered, unfiltered, CAP, NT, SPLIT,
    )  # fmt: skip
    thr = _geometric_thresholds(m, x_min, NT)
    j = tl.arange(0, NT)
    sbase = (rows * split + chunk) * (NT + 3)
    region = (rows * split + chunk).to(tl.int64)[:, None] * CAP
    chunk_len = chunk_blocks * BLOCK  # a multiple of BLOCK: aligned, vectorised loads
    start = chunk * chunk_len
    pm3 = (pm & counted[:, None])[:, :, None] & (j >= 0)[None, None, :]
    parts3 = parts[:, :, None] + j[None, None, :]  # [R, SPLIT, NT]
    cnt = tl.sum(tl.load(search_i_ptr + parts3, mask=pm3, other=0), 1)
    mass = tl.sum(tl.load(search_f_ptr + parts3, mask=pm3, other=0.0), 1)
    race_bests = tl.load(search_f_ptr + parts + NT + 1, mask=pm, other=float("-inf"))
    race_best = tl.max(race_bests, 1)
    race_ids = tl.load(search_i_ptr + parts + NT + 1, mask=pm, other=V)
    race_tok = tl.min(tl.where(race_bests == race_best[:, None], race_ids, V), 1).to(tl.int64)
    token = tl.where(unfiltered, race_tok, token)

    # thresholds provably at or below the cut: count >= k with top-k, else the mass or min-p bound
    below_cut = tl.where(
        k_on[:, None],
        cnt >= top_k[:, None],
        (p_on[:, None] & (mass >= (top_p * total)[:, None]))
        | (mp_on[:, None] & (tl.exp2((thr - m[:, None]) * c[:, None]) < min_p[:, None])),
    )
    usable = below_cut & (cnt <= CAP)
    j_best = tl.min(tl.where(usable, j[None, :], NT), 1)
    regather = counted & (j_best < NT)
    s = tl.max(tl.where(j[None, :] == j_best[:, None], thr, float("-inf")), 1)

    # parallel regather of this chunk at the best usable threshold, over the chunk's own slots
    n_re = tl.zeros((R,), tl.int32)
    stop = tl.where(tl.max(regather.to(tl.int32)) > 0, tl.minimum(start + chunk_len, V), start)
    for off in range(start, stop, BLOCK):
        x, cols, msk = _load_block(base, off, V, regather, BLOCK)
        take = (x >= s[:, None]) & msk  # NaN rows never get here
        pos = n_re[:, None] + tl.cumsum(take.to(tl.int32), 1) - 1
        tl.store(buf_val_ptr + region + pos, x, mask=take & (pos < CAP))
        tl.store(buf_idx_ptr + region + pos, cols[None, :].broadcast_to(x.shape), mask=take & (pos < CAP))
        n_re += tl.sum(take.to(tl.int32), 1)
    tl.store(search_i_ptr + sbase + NT + 2, n_re, mask=row_ok)
    tl.debug_barrier()  # every thread's stores before the release below
    arrived = tl.atomic_add(counter_ptr + rows, 1, mask=row_ok, sem="acq_rel", scope="gpu")
    row_ok &= arrived == split - 1  # the row's last program to arrive finishes it
    k_on &= row_ok
    p_on &= row_ok
    mp_on &= row_ok
    regather &= row_ok
    in_buf = (gathered | regather) & row_ok
    radix = filtered & row_ok & ~in_buf
    n_re_chunk = tl.load(search_i_ptr + parts + NT + 2, mask=pm & regather[:, None], other=0, volatile=True)
    n_chunk = tl.where(regather[:, None], n_re_chunk, n_chunk)  # [R, SPLIT]
    n_buf = tl.where(in_buf, tl.sum(n_chunk, 1), 0)
    # where slot i of the row's gathered list lives: chunk = number of chunk lists ending at or before i
    ends = tl.cumsum(n_chunk, 1)
    tl.store(ends_ptr + rows[:, None] * SPLIT + sp[None, :], ends, mask=in_buf[:, None])
    tl.debug_barrier()  # the ends were written by other threads of this program

    # exact cut on the <= CAP gathered logits, then the race among them
    if tl.max(in_buf.to(tl.int32)) > 0:
        slot = tl.arange(0, CAP)
        bmask = in_buf[:, None] & (slot[None, :] < n_buf[:, None])
        src_chunk = tl.zeros((R, CAP), tl.int32)
        for level in tl.static_range(LOG_SPLIT):  # binary search over the SPLIT ends
            half = SPLIT >> (level + 1)
            end = tl.load(ends_ptr + rows[:, None] * SPLIT + src_chunk + half - 1, mask=bmask, other=CAP + 1)
            src_chunk += tl.where(end <= slot[None, :], half, 0)
        prev = tl.load(ends_ptr + rows[:, None] * SPLIT + src_chunk - 1, mask=bmask & (src_chunk > 0), other=0)
        src = (rows[:, None] * split + src_chunk).to(tl.int64) * CAP + slot[None, :] - prev
        vals = tl.load(buf_val_ptr + src, mask=bmask, other=float("-inf"), volatile=True)
        idx = tl.load(buf_idx_ptr + src, mask=bmask, other=0, volatile=True).to(tl.int64)
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

    # rows whose kept set may exceed CAP: the radix rounds find top-k's cut, then top-p's, over all the row's
    # programs; min-p is closed form (applied in the race), so min-p alone goes straight to the race
    key_lo = _ordered_key(x_min).to(tl.int64)
    key_top = _ordered_key(m).to(tl.int64)
    phase = tl.where(radix, tl.where(k_on, PHASE_TOP_K, tl.where(p_on, PHASE_TOP_P, PHASE_RACE)), PHASE_NONE)
    st = state_i_ptr + rows * N_STATE
    tl.store(st + S_PHASE, phase.to(tl.int64), mask=row_ok)
    tl.store(st + S_LO, key_lo, mask=row_ok)
    tl.store(st + S_HI, key_top, mask=row_ok)
    tl.store(st + S_CUT, key_lo, mask=row_ok)  # min-p alone: every finite logit is above the (absent) cut
    tl.store(st + S_K, top_k, mask=row_ok)
    tl.store(st + S_TOP, key_top, mask=row_ok)
    tl.store(st + S_ROUNDS_K, tl.zeros((R,), tl.int64), mask=row_ok)
    tl.store(st + S_ROUNDS_P, tl.zeros((R,), tl.int64), mask=row_ok)
    sf = state_f_ptr + rows * N_STATE
    tl.store(sf + F_M, m, mask=row_ok)
    tl.store(sf + F_C, c, mask=row_ok)
    tl.store(sf + F_TOP_P, top_p, mask=row_ok)
    tl.store(sf + F_TARGET, tl.zeros((R,), tl.float32) - 1.0, mask=row_ok)  # < 0: set by the first top-p round
    tl.store(sf + F_MIN_P, tl.where(mp_on, min_p, 0.0), mask=row_ok)
    token = tl.where(radix, INVALID, token)  # the race launch overwrites it; a row it misses stays invalid
    tl.store(out_ptr + rows, token, mask=row_ok)


@fast_launch
@triton.jit(do_not_specialize=["B", "split", "chunk_blocks"])
def _radix_round_kernel(
    logits_ptr, stride_row, B, V, state_i_ptr, state_f_ptr, round_cnt_ptr, round_mass_ptr, counter_ptr, split,
    chunk_blocks, R: tl.constexpr, BLOCK: tl.constexpr, NB: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    """One round of the radix selection for the rows in a top-k / top-p phase (others exit at once). The row's
    bracket [lo, hi] of order-preserving int32 keys holds the cut (the largest key t with count(key >= t) >= k,
    or mass(key >= t) >= target); NB thresholds t_j = lo + j * (hi - lo + 1) // NB split it. Every program
    counts (top-k) or weighs (top-p) key >= t_j over its chunk -> partials [B, split, NB]; the row's last
    program to arrive sums them in chunk order and narrows the bracket to [t_j, t_{j+1} - 1] of the largest
    t_j that passes: width w -> ceil(w / NB), so a phase ends (lo == hi: the cut) within ceil(32 / log2(NB))
    rounds. A top-p phase starts with lo at top-k's cut (or the smallest logit): its first round's mass at
    t_0 = lo is the mass of the top-k set, and its target is top_p times that (the same sums as every later
    round's, so the cut is where this arithmetic says)."""
    rows = tl.program_id(0) * R + tl.arange(0, R)
    chunk = tl.program_id(1)
    st = state_i_ptr + rows * N_STATE
    sf = state_f_ptr + rows * N_STATE
    phase = tl.load(st + S_PHASE, mask=rows < B, other=0)
    busy = (rows < B) & ((phase == PHASE_TOP_K) | (phase == PHASE_TOP_P))
    if tl.max(busy.to(tl.int32)) > 0:
        base = logits_ptr + rows[:, None].to(tl.int64) * stride_row
        lo = tl.load(st + S_LO, mask=busy, other=0)
        hi = tl.load(st + S_HI, mask=busy, other=0)
        m = tl.load(sf + F_M, mask=busy, other=0.0)
        c = tl.load(sf + F_C, mask=busy, other=0.0)
        j = tl.arange(0, NB)
        thr = lo[:, None] + ((hi - lo + 1)[:, None] * j[None, :]) // NB  # [R, NB] int64, t_0 = lo, increasing
        thr32 = thr.to(tl.int32)  # between two int32 keys
        lo32 = lo.to(tl.int32)
        hi32 = hi.to(tl.int32)
        weigh = tl.max((busy & (phase == PHASE_TOP_P)).to(tl.int32)) > 0  # top-k rows only count
        cnt_slots = tl.zeros((R, BLOCK, NB), tl.int32)  # per slot: one cross-thread reduction after the loop
        mass_slots = tl.zeros((R, BLOCK, NB), tl.float32)
        cnt_above = tl.zeros((R, BLOCK), tl.int32)  # key > hi: at or above every threshold
        mass_above = tl.zeros((R, BLOCK), tl.float32)
        chunk_len = chunk_blocks * BLOCK  # a multiple of BLOCK: aligned, vectorised loads
        start = chunk * chunk_len
        for off in range(start, tl.minimum(start + chunk_len, V), BLOCK):
            x, cols, msk = _load_block(base, off, V, busy, BLOCK)
            x = x + 0.0  # -0.0 -> +0.0, as in every key
            key = _ordered_key(x)
            above = msk & (key > hi32[:, None])
            cnt_above += above.to(tl.int32)
            inside = msk & (key >= lo32[:, None]) & (key <= hi32[:, None])
            any_inside = tl.max(tl.max(inside.to(tl.int32), 1), 0) > 0  # else the block skips the thresholds
            key = tl.where(inside, key, -(2**31))  # below every threshold
            if weigh:
                p = tl.exp2((x - m[:, None]) * c[:, None])
                mass_above += tl.where(above, p, 0.0)
                if any_inside:
                    mass_slots += tl.where(key[:, :, None] >= thr32[:, None, :], p[:, :, None], 0.0)
            if any_inside:
                cnt_slots += (key[:, :, None] >= thr32[:, None, :]).to(tl.int32)  # [R, BLOCK, NB]
        cnt = tl.sum(cnt_slots, 1) + tl.sum(cnt_above, 1)[:, None]  # [R, NB]
        mass = tl.sum(mass_slots, 1) + tl.sum(mass_above, 1)[:, None]
        part = (rows[:, None] * split + chunk) * NB + j[None, :]
        tl.store(round_cnt_ptr + part, cnt, mask=busy[:, None])
        tl.store(round_mass_ptr + part, mass, mask=busy[:, None])
        tl.debug_barrier()  # every thread's stores before the release below
        arrived = tl.atomic_add(counter_ptr + rows, 1, mask=busy, sem="acq_rel", scope="gpu")
        last = busy & (arrived == split - 1)
        if tl.max(last.to(tl.int32)) > 0:
            sp = tl.arange(0, SPLIT)
            pm = last[:, None, None] & (sp < split)[None, :, None] & (j >= 0)[None, None, :]
            parts = (rows[:, None, None] * split + sp[None, :, None]) * NB + j[None, None, :]  # [R, SPLIT, NB]
            cnt = tl.sum(tl.load(round_cnt_ptr + parts, mask=pm, other=0, volatile=True), 1)  # chunk order
            mass = tl.sum(tl.load(round_mass_ptr + parts, mask=pm, other=0.0, volatile=True), 1)
            in_k = phase == PHASE_TOP_K
            k = tl.load(st + S_K, mask=last, other=0)
            top_p = tl.load(sf + F_TOP_P, mask=last, other=1.0)
            target = tl.load(sf + F_TARGET, mask=last, other=0.0)
            target = tl.where(target < 0, top_p * tl.sum(tl.where(j[None, :] == 0, mass, 0.0), 1), target)
            ok = tl.where(in_k[:, None], cnt.to(tl.int64) >= k[:, None], mass >= target[:, None])  # true, then false
            j_cut = tl.maximum(tl.sum(ok.to(tl.int32), 1) - 1, 0)
            new_lo = tl.sum(tl.where(j[None, :] == j_cut[:, None], thr, 0), 1)
            next_thr = tl.sum(tl.where(j[None, :] == j_cut[:, None] + 1, thr, 0), 1)
            new_hi = tl.maximum(tl.where(j_cut + 1 < NB, next_thr - 1, hi), new_lo)
            done = new_hi == new_lo
            to_p = in_k & done & (top_p < 1.0)  # top-k done: top-p next, over the top-k set, else the race
            next_phase = tl.where(done, tl.where(to_p, PHASE_TOP_P, PHASE_RACE), phase)
            tl.store(st + S_PHASE, next_phase, mask=last)
            tl.store(st + S_LO, new_lo, mask=last)
            tl.store(st + S_HI, tl.where(to_p, tl.load(st + S_TOP, mask=last, other=0), new_hi), mask=last)
            tl.store(st + S_CUT, new_lo, mask=last)
            tl.store(sf + F_TARGET, tl.where(to_p, -1.0, target), mask=last)
            rounds_at = tl.where(in_k, S_ROUNDS_K, S_ROUNDS_P)
            tl.store(st + rounds_at, tl.load(st + rounds_at, mask=last, other=0) + 1, mask=last)


@fast_launch
@triton.jit(do_not_specialize=["B", "seed_stride", "step_stride", "split", "chunk_blocks"])
def _race_kernel(
    logits_ptr, stride_row, B, V, seed_ptr, seed_stride, step_ptr, step_stride, state_i_ptr, state_f_ptr,
    race_f_ptr, race_i_ptr, counter_ptr, out_ptr, split, chunk_blocks,
    R: tl.constexpr, BLOCK: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    """Rows whose cut the rounds found (others exit at once): the exponential race over the kept x of this chunk
    (key >= cut, p >= min_p) -> partials; the row's last program to arrive takes the best (lowest index on
    ties, chunks being in token order) and writes the token."""
    rows = tl.program_id(0) * R + tl.arange(0, R)
    chunk = tl.program_id(1)
    st = state_i_ptr + rows * N_STATE
    sf = state_f_ptr + rows * N_STATE
    racing = (rows < B) & (tl.load(st + S_PHASE, mask=rows < B, other=0) == PHASE_RACE)
    if tl.max(racing.to(tl.int32)) > 0:
        base = logits_ptr + rows[:, None].to(tl.int64) * stride_row
        cut = tl.load(st + S_CUT, mask=racing, other=0).to(tl.int32)
        m = tl.load(sf + F_M, mask=racing, other=0.0)
        c = tl.load(sf + F_C, mask=racing, other=0.0)
        min_p = tl.load(sf + F_MIN_P, mask=racing, other=0.0)
        seed = tl.load(seed_ptr + rows * seed_stride, mask=racing, other=0).to(tl.int64)
        step = tl.load(step_ptr + rows * step_stride, mask=racing, other=0).to(tl.int64)
        best = tl.full((R, BLOCK), float("-inf"), tl.float32)
        best_idx = tl.zeros((R, BLOCK), tl.int32) + V
        chunk_len = chunk_blocks * BLOCK  # a multiple of BLOCK: aligned, vectorised loads
        start = chunk * chunk_len
        for off in range(start, tl.minimum(start + chunk_len, V), BLOCK):
            x, cols, msk = _load_block(base, off, V, racing, BLOCK)
            x = x + 0.0
            keep = msk & (_ordered_key(x) >= cut[:, None]) & (x > float("-inf"))
            keep &= tl.exp2((x - m[:, None]) * c[:, None]) >= min_p[:, None]  # min-p 0 when off
            race = _race_key(x, m[:, None], c[:, None], seed[:, None], step[:, None], cols)
            race = tl.where(keep, race, float("-inf"))
            up = race > best  # strict: a slot keeps its earliest index on ties
            best_idx = tl.where(up, cols[None, :], best_idx)
            best = tl.where(up, race, best)
        chunk_best = tl.max(best, 1)
        chunk_idx = tl.min(tl.where(best == chunk_best[:, None], best_idx, V), 1)
        tl.store(race_f_ptr + rows * split + chunk, chunk_best, mask=racing)
        tl.store(race_i_ptr + rows * split + chunk, chunk_idx, mask=racing)
        tl.debug_barrier()  # every thread's stores before the release below
        arrived = tl.atomic_add(counter_ptr + rows, 1, mask=racing, sem="acq_rel", scope="gpu")
        last = racing & (arrived == split - 1)
        if tl.max(last.to(tl.int32)) > 0:
            sp = tl.arange(0, SPLIT)
            pm = last[:, None] & (sp < split)[None, :]
            bests = tl.load(race_f_ptr + rows[:, None] * split + sp[None, :], mask=pm, other=float("-inf"),
                            volatile=True)  # fmt: skip
            ids = tl.load(race_i_ptr + rows[:, None] * split + sp[None, :], mask=pm, other=V, volatile=True)
            winner = tl.max(bests, 1)
            token = tl.min(tl.where(bests == winner[:, None], ids, V), 1).to(tl.int64)
            tl.store(out_ptr + rows, token, mask=last)


def rounds_per_phase(bins: int) -> int:
    """Radix rounds that bring any bracket of int32 keys (width <= 2^32) to one key with `bins` thresholds."""
    width, rounds = 2**32, 0
    while width > 1:
        width, rounds = -(-width // bins), rounds + 1
    return rounds


def launch(logits, temperature, top_k, top_p, min_p, seed, step, block=None, cap=None, nt=8, rows=None, split=None,
           bins=16, rounds=None, state=None):  # fmt: skip
    """Run the kernels on [B] parameter tensors (any stride, e.g. expanded scalars) -> int64 [B].

    block / cap / nt / rows (rows per program) / split (programs per row, <= 64) / bins (radix thresholds per
    round, a power of 2) are tuning knobs; tests shrink cap to send rows to the radix rounds and set split on
    the CPU.
    rounds (default: the bound, 2 * rounds_per_phase(bins)) and state (an int64 [B, N_STATE] tensor that
    receives the rows' radix state: phase, cut, rounds per phase) are test hooks."""
    B, V = logits.shape
    out = torch.empty(B, dtype=torch.int64, device=logits.device)
    if B == 0:
        return out
    assert logits.stride(1) == 1, "logits rows must be contiguous"
    if block is None:
        block = min(2048, triton.next_power_of_2(V))
    block_t = min(block, 1024)
    block_r = min(block, max(16, 4096 // bins))  # [R, BLOCK, bins] slots per radix program: 16 per thread
    if cap is None:  # the gather buffer never needs more than V slots
        cap = min(1024, triton.next_power_of_2(V))
    if rows is None:  # one row per program on the GPU; batches of rows in the CPU interpreter
        tile = max(max(block, cap) * nt, block_r * bins)  # the largest [R, ., .] tile of the kernels, per row
        rows = 1 if logits.is_cuda else min(triton.next_power_of_2(B), max(1, 2**20 // tile))
    if split is None:  # spread both passes over ~2048 programs (bytes in flight), chunks of at least a block
        split = min(SPLIT_MAX, triton.cdiv(2048, B * rows), triton.cdiv(V, block)) if logits.is_cuda else 1
    assert 1 <= split <= SPLIT_MAX
    assert bins >= 2 and bins & (bins - 1) == 0, "bins must be a power of 2"
    if rounds is None:
        rounds = 2 * rounds_per_phase(bins)  # top-k then top-p
    chunk_blocks = triton.cdiv(triton.cdiv(V, split), block)  # chunk length in blocks (the radix rounds: block_r)
    device = logits.device
    part_f = torch.empty(B, split, 3, dtype=torch.float32, device=device)
    part_i = torch.empty(B, split, 3, dtype=torch.int32, device=device)
    search_f = torch.empty(B, split, nt + 3, dtype=torch.float32, device=device)
    search_i = torch.empty(B, split, nt + 3, dtype=torch.int32, device=device)
    ends = torch.empty(B, triton.next_power_of_2(split), dtype=torch.int32, device=device)
    buf_val = torch.empty(B, split, cap, dtype=torch.float32, device=device)
    buf_idx = torch.empty(B, split, cap, dtype=torch.int32, device=device)
    if state is None:
        state = torch.empty(B, N_STATE.value, dtype=torch.int64, device=device)
    state_f = torch.empty(B, N_STATE.value, dtype=torch.float32, device=device)
    round_cnt = torch.empty(B, split, bins, dtype=torch.int32, device=device)
    round_mass = torch.empty(B, split, bins, dtype=torch.float32, device=device)
    race_f = torch.empty(B, split, dtype=torch.float32, device=device)
    race_i = torch.empty(B, split, dtype=torch.int32, device=device)
    # one arrival counter per row and launch that has arrivals (finish, each round, race): zeroed by launch 1
    counters = torch.empty(rounds + 2, B, dtype=torch.int32, device=device)
    grid = (triton.cdiv(B, rows), split)
    num_warps = 8 if logits.is_cuda else 1
    SPLIT = triton.next_power_of_2(split)
    _stats_kernel[grid](
        logits, logits.stride(0), B, V, temperature, temperature.stride(0), part_f, part_i, counters, rounds + 2, split,
        chunk_blocks, R=rows, BLOCK=block, num_warps=num_warps,
    )  # fmt: skip
    params = [(t, t.stride(0)) for t in (temperature, top_k, top_p, min_p, seed, step)]
    for kernel in (_speculative_gather_kernel, _threshold_count_kernel, _finish_kernel):
        kernel[grid](
            logits, logits.stride(0), B, V, *(x for pair in params for x in pair),
            part_f, part_i, search_f, search_i, ends, buf_val, buf_idx, counters[0], out, state, state_f,
            split, chunk_blocks, R=rows, BLOCK=block, BLOCK_T=block_t, CAP=cap, NT=nt, SPLIT=SPLIT,
            LOG_SPLIT=SPLIT.bit_length() - 1, num_warps=num_warps,
        )  # fmt: skip
    for r in range(rounds):
        _radix_round_kernel[grid](
            logits, logits.stride(0), B, V, state, state_f, round_cnt, round_mass, counters[1 + r], split,
            chunk_blocks * (block // block_r), R=rows, BLOCK=block_r, NB=bins, SPLIT=SPLIT, num_warps=num_warps,
        )  # fmt: skip
    _race_kernel[grid](
        logits, logits.stride(0), B, V, seed, seed.stride(0), step, step.stride(0), state, state_f, race_f, race_i,
        counters[rounds + 1], out, split, chunk_blocks, R=rows, BLOCK=block, SPLIT=SPLIT, num_warps=num_warps,
    )  # fmt: skip
    return out


@fast_launch
@triton.jit(do_not_specialize=["B", "split", "chunk_blocks"])
def _chunk_argmax_kernel(logits_ptr, stride_row, B, V, part_max_ptr, part_idx_ptr, split, chunk_blocks,
                         BLOCK: tl.constexpr):  # fmt: skip
    """Greedy pass 1, program (chunk, row): the chunk's max (NaN if it holds a NaN) and its lowest index."""
    chunk = tl.program_id(0)
    row = tl.program_id(1)
    base = logits_ptr + row.to(tl.int64) * stride_row
    best = tl.full((BLOCK,), float("-inf"), tl.float32)
    best_idx = tl.zeros((BLOCK,), tl.int32) + V
    nan_seen = tl.zeros((BLOCK,), tl.int32)
    chunk_len = chunk_blocks * BLOCK  # a multiple of BLOCK: aligned, vectorised loads
    start = chunk * chunk_len
    for off in range(start, tl.minimum(start + chunk_len, V), BLOCK):
        cols = off + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        nan_seen |= (x != x).to(tl.int32)
        up = x > best  # strict: a slot keeps its earliest index on ties; NaN never moves it
        best_idx = tl.where(up, cols, best_idx)
        best = tl.where(up, x, best)
    m = tl.max(best, 0)
    idx = tl.min(tl.where(best == m, best_idx, V), 0)
    part = row * split + chunk
    tl.store(part_max_ptr + part, tl.where(tl.max(nan_seen, 0) > 0, float("nan"), m))
    tl.store(part_idx_ptr + part, idx)


@fast_launch
@triton.jit(do_not_specialize=["B", "split"])
def _combine_argmax_kernel(part_max_ptr, part_idx_ptr, out_ptr, B, split, R: tl.constexpr, SPLIT: tl.constexpr):
    """Greedy pass 2: the chunks' maxima of R rows -> the lowest index of the row max, INVALID for a row with a
    NaN or only -inf."""
    rows = tl.program_id(0) * R + tl.arange(0, R)
    sp = tl.arange(0, SPLIT)
    pm = (rows < B)[:, None] & (sp < split)[None, :]
    parts = rows[:, None] * split + sp[None, :]  # [R, SPLIT]
    ms = tl.load(part_max_ptr + parts, mask=pm, other=float("-inf"))
    has_nan = tl.max((ms != ms).to(tl.int32), 1) > 0
    m = tl.max(tl.where(ms != ms, float("-inf"), ms), 1)
    idx = tl.min(tl.where(ms == m[:, None], tl.load(part_idx_ptr + parts, mask=pm, other=2**31 - 1), 2**31 - 1), 1)
    token = tl.where(has_nan | (m == float("-inf")), INVALID, idx.to(tl.int64))
    tl.store(out_ptr + rows, token, mask=rows < B)


def launch_greedy(
    logits: torch.Tensor,
    block: int | None = None,
    split: int | None = None,
    out: torch.Tensor | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Argmax per row (lowest index on ties, INVALID_TOKEN for NaN / all -inf rows) in two launches -> int64 [B]
    (into `out` when given: an exported method's planned buffer).

    The row is cut into `split` chunks (~8192 programs in all on the GPU: B = 1 spreads over every SM, and at
    large B the last wave leaves few SMs idle); the second launch reduces <= GREEDY_SPLIT_MAX partials per row.
    block / split / num_warps are tuning knobs."""
    B, V = logits.shape
    out = torch.empty(B, dtype=torch.int64, device=logits.device) if out is None else out
    if B == 0:
        return out
    if block is None:
        block = min(2048, triton.next_power_of_2(V))
    if split is None:
        split = min(GREEDY_SPLIT_MAX, triton.cdiv(8192, B), triton.cdiv(V, block)) if logits.is_cuda else 1
    if num_warps is None:
        num_warps = 8 if logits.is_cuda else 1
    chunk_blocks = triton.cdiv(triton.cdiv(V, split), block)  # chunk length in blocks
    part_max = torch.empty(B, split, dtype=torch.float32, device=logits.device)
    part_idx = torch.empty(B, split, dtype=torch.int32, device=logits.device)
    _chunk_argmax_kernel[(split, B)](
        logits, logits.stride(0), B, V, part_max, part_idx, split, chunk_blocks, BLOCK=block, num_warps=num_warps
    )
    rows = 16 if logits.is_cuda else min(triton.next_power_of_2(B), 64)
    _combine_argmax_kernel[(triton.cdiv(B, rows),)](
        part_max,
        part_idx,
        out,
        B,
        split,
        R=rows,
        SPLIT=triton.next_power_of_2(split),
        num_warps=4 if logits.is_cuda else 1,
    )
    return out


@torch.library.custom_op("qmoe::greedy", mutates_args=())
def greedy_op(logits: torch.Tensor) -> torch.Tensor:
    return launch_greedy(logits)


@greedy_op.register_fake
def _(logits):
    return logits.new_empty(logits.shape[0], dtype=torch.int64)


def greedy_out(logits: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """greedy(logits) written into `out` [B] int64: the out-variant that lets an exported method's token land in
    its planned buffer (qmoe/export/program.py outputs_in_place)."""
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    return launch_greedy(logits, out=out)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """sample() when every row has temperature <= 0, in two launches: logits [B, V] -> int64 [B].

    The caller chooses it from its run config (the parameters are device tensors: the kernel cannot know that
    all rows are greedy without a host sync); `sample` stays right for any mix of greedy and sampled rows."""
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    return greedy_op(logits) if kernels.tracing() else launch_greedy(logits)


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

    op = sample_op if kernels.tracing() else launch  # the custom op only where a tracer needs its fake
    return op(
        logits if logits.stride(-1) == 1 else logits.contiguous(),  # rows may share storage (stride 0)
        per_row(temperature, torch.float32),
        per_row(top_k, torch.int64),
        per_row(top_p, torch.float32),
        per_row(min_p, torch.float32),
        per_row(seed, torch.int64),
        per_row(step, torch.int64),
    )
