"""Fused sampling in Triton: logits [B, V] -> token ids int64 [B], no sort of the vocabulary, no pass over a row in
a single program.

`greedy` (every row at temperature 0, chosen by the caller from its run config) is one launch: a chunked argmax
whose last chunk of a row to arrive combines the row's chunks (`_greedy_kernel`). `sample`:

Same semantics as `naive.py` (read its docstring). Each row is cut into `split` chunks, one program per
(row, chunk) in every launch but 2a, so each pass over a row is spread over many programs; a launch that a row does
not need costs its programs a few loads. Three launches when launch 3's grid fits on the GPU at once (batches
up to ~16 on the H200), else four (launch 3 as one grid of one program per SM), all with Programmatic Dependent
Launch on sm_90 (an idle launch overlaps the previous one's tail):

1. `_stats_kernel`: per chunk, NaN flag, max and its lowest index (the greedy answer), and for sampled rows
   the smallest finite logit and the number of finite logits, the sum of p_i = 2^((x_i - max) * log2(e) /
   temperature) and the sum and sum of squares of the finite logits (not for rows from tiles, which read none),
   the maxima of groups of its slots and of its tiles of 128 tokens -> a small workspace; a chunk whose rows are
   all from tiles (2a) and hold no NaN or +inf needs only the tile and group maxima (`_tile_maxima_pass`, a max per
   token). It also zeroes the rows' counters of the later launches.
2a. `_tiles_kernel` (where launch 2's grid takes more than one wave: `tiles_pay_off`): a sampled top-k row with k
   <= its group maxima is finished by one program: s is the k-th largest group maximum, never above the cut
   (`_group_bound`), and only the tiles whose max reaches s are read (`_gather_tiles`).
2b. `_gather_count_kernel`, every other row, one pass:
   every program combines the chunk stats, gathers every x >= s of its chunk into the row's list of CAP slots
   (slot from an atomic counter: the list's order does not matter, see 5.); s is a speculative threshold, and the
   pass also counts (and, for top-p without top-k, weighs) x >= t_j at NT thresholds
   (half geometric between the max and the smallest logit, half from a normal fit of the row: where it predicts
   k/2 .. 8 CAP tokens above, or, for top-p without top-k, around the cut it predicts). The row's last program
   to arrive sums the partials in chunk order and decides: the list holds the cut (s at or below it, <= CAP
   tokens) -> finish (5.) now; else a bracket of <= CAP tokens that holds the cut -- [t_j, max] for a threshold
   t_j at or below it, or between the two thresholds around it -> the gather (3.); else the radix rounds (4.)
   from that bracket. Rows without a filter, and min-p alone over more than CAP tokens, race over the row.
3. `_resolve_kernel`, steps of one pass each for the rows launch 2 left open (others exit at once): the
   gather (the bracket's keys into the list; the keys above it counted, weighed and raced; the last program
   finishes, 5.), a radix round, or the race. One launch that runs every step, its programs waiting for each
   decision (`_await_counts`), when all of its programs are resident at once; else one grid of at most one
   program per SM over every (row, chunk), a barrier of the whole grid between steps (`_grid_steps`; it leaves
   after one load when no row is open).
4. The radix rounds, at most 2 * rounds_per_phase(bins), for rows whose bracket holds more than CAP tokens: each
   narrows the row's bracket of order-preserving int32 keys around the cut by a factor `bins`, top-k's cut first,
   then top-p's within the top-k set, until it holds <= CAP tokens (then the gather) or one key (then top-p's
   phase, or the race among the kept x of every chunk).
5. The finish (`_finish_from_list`, in the row's last program): sorts the keys of the list's filled prefix
   (the first CAP / 4, CAP / 2 or CAP slots, the fewest that hold it) in registers, takes the k-th key (top-k;
   less the tokens above a gathered bracket), then the first sorted position whose mass before it (and above the
   bracket) reaches top_p times the top-k set's mass (top-p), keeps every token at or above the cuts (ties kept)
   and with p >= min_p, and draws by an exponential race: argmax over kept i of log2(p_i) - log2(-ln U_i),
   lowest index on ties (the tokens above a bracket race in the gather's pass).

U_i comes from Triton's Philox keyed by the row's seed with counter (step, token index): the same
(logits, parameters, seed, step) give the same token on every call and at any batch position, and nothing
depends on a global generator, so CUDA graph replay is safe. The torch version cannot reproduce the
Philox bits (it uses its own hash), so the two agree exactly on greedy and in distribution otherwise.
"""

import functools
import os

import torch
import triton
import triton.language as tl

import kernels
from kernels.counters import ArrivalCounters, Workspaces
from kernels.launch import cdiv, fast_launch, next_power_of_2
from kernels.pdl import allow_dependents, pdl, wait_for_producers
from kernels.sampling.naive import INVALID_TOKEN

# Globals read inside kernels must be constexprs (triton 3.6 refuses plain ones).
LOG2E = tl.constexpr(1.4426950408889634)
FLT_MAX = tl.constexpr(3.4028234663852886e38)  # the largest finite fp32
INVALID = tl.constexpr(INVALID_TOKEN)
KEY_MIN = tl.constexpr(-(2**31))  # below every key of a non-NaN float
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # Triton reads it at import too
# tl.sort's xor reductions run element by element in the CPU interpreter (minutes for the tests' batches); there
# the same bitonic network is built from reshapes and sums (which compile badly for the GPU: spills at CAP 256)
SORT_NETWORK = tl.constexpr(INTERPRETED)
SPLIT_MAX = 128  # programs per row, at most
GROUPS = 128  # group maxima per row from the stats launch: top-k's list threshold for k <= this
MIN_SPLIT_R = 8  # programs per row of launch 3 when it waits inside (fewer: a launch per step, resolve_plan)
STEP_PROGRAMS_PER_SM = 4  # launch 3's programs per SM when it is a launch per step (2 resident at its registers)
TILE_TOKENS = 128  # a tile (a warp's 128-bit loads): launch 2 reads only the tiles that reach a row's group bound
TILES_PER_LOAD = 32  # selected tiles loaded at once by those rows (4,096 tokens: 16 a thread)
GREEDY_SPLIT_MAX = 256  # the greedy pass has no per-row state to combine: more, smaller chunks at B = 1


@triton.jit
def _ordered_key(x):
    """fp32 -> int32 whose signed order is the float order (x is not NaN; -0.0 already folded into +0.0)."""
    bits = x.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def ordered_keys(x: torch.Tensor) -> torch.Tensor:
    """_ordered_key on the host: logits -> their int32 keys (fp32, -0.0 folded into +0.0) as int64."""
    bits = (x.float() + 0.0).view(torch.int32)
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).long()


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
def _block_mask(off, end, row_ok, BLOCK: tl.constexpr):
    """Columns off .. off + BLOCK -> (cols [BLOCK], mask [R, BLOCK]: cols < end on rows that are ok)."""
    cols = off + tl.arange(0, BLOCK)
    return cols, row_ok[:, None] & (cols < end)[None, :]


@triton.jit
def _load_block(base, off, end, row_ok, BLOCK: tl.constexpr):
    """The rows' logits at columns off .. off + BLOCK as fp32 [R, BLOCK], -inf past `end` and on rows not ok."""
    cols, msk = _block_mask(off, end, row_ok, BLOCK)
    return tl.load(base + cols[None, :], mask=msk, other=float("-inf")).to(tl.float32)


@triton.jit
def _chunk_span(chunk, chunk_blocks, V, BLOCK: tl.constexpr):
    """Columns [start, end) of a row's chunk: whole blocks (aligned, vectorised loads), the last one cut at V."""
    chunk_len = chunk_blocks * BLOCK
    start = chunk * chunk_len
    return start, tl.minimum(start + chunk_len, V)


@triton.jit
def _next_block(base, x_next, off, end, row_ok, BLOCK: tl.constexpr):
    """A pass's step at block `off`: (its logits, loaded one step earlier, with -0.0 as +0.0; the load of the block
    after it; cols; mask). Every pass thus keeps two blocks in flight per program: waiting on each block's load
    before its math held the passes at ~1.9 TB/s (stats) and ~0.25 TB/s (gather + count) at B = 256 on the H200
    (profile_sampling at 9be5f7d). Start with x_next = _load_block(base, start, end, row_ok, BLOCK)."""
    x = x_next + 0.0
    x_next = _load_block(base, off + BLOCK, end, row_ok, BLOCK)
    cols, msk = _block_mask(off, end, row_ok, BLOCK)
    return x, x_next, cols, msk


@triton.jit
def _key_value(key):
    """The inverse of _ordered_key: int32 key -> fp32."""
    return (key ^ ((key >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


# the row's counters (int32 [N_COUNTERS + 2 * steps + 1, B]), zeroed by the stats launch: arrivals and list fill of
# launch 2, list fill of launch 3's gathers, the race's arrivals, the decisions made (one per round or gather), the
# rows launch 2 left open (entry 0), then the arrivals of each step of launch 3; for launch 3 as one grid (GRID): its
# barrier's arrivals (entry 0), then per step the programs that worked (entry 0)
C_COUNT_ARRIVED, C_COUNT_LIST, C_GATHER_LIST, C_RACE_ARRIVED, C_DECIDED, C_OPEN = (tl.constexpr(i) for i in range(6))
N_COUNTERS = tl.constexpr(6)
N_STATS_F = tl.constexpr(5)  # per chunk: max, sum of p relative to it, smallest finite logit, sum x, sum x^2
N_STATS_I = tl.constexpr(3)  # per chunk: first argmax, finite count, NaN flag


@triton.jit
def _from_tiles(temperature, top_k, in_batch, tiles_on, split, G: tl.constexpr):
    """The rows that launch 2 finishes from tiles (_tiles_kernel): sampled, top-k 0 < k <= their split * G group
    maxima, tiles_on (tiles_pay_off). From the parameters alone: the stats launch reads it too (these rows need no
    sum of p and no moments), and the gather + count programs of these rows leave after two loads."""
    on = in_batch.to(tl.int32) * 0 + tiles_on != 0  # (a scalar bool and a tensor do not mix in the interpreter)
    return in_batch & (temperature > 0) & (top_k > 0) & (top_k <= split * G) & on


@triton.jit
def _max_keep_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


STORE_ASM = tl.constexpr(not INTERPRETED)  # inline PTX: not in the interpreter


@triton.jit
def _store_in_place(ptrs, values, mask, ASM: tl.constexpr):
    """tl.store(ptrs, values, mask) of fp32 values in the layout they have (ASM: inline PTX, one st.global per
    element a thread holds, the same address from every thread that holds a copy). tl.store gives a reduction's
    result the coalesced layout of its pointers, through shared memory: 2 barriers per block in a pass."""
    if ASM:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.global.f32 [$1], $2; mov.b32 $0, 0; }",
            "=r,l,f,r", [ptrs.to(tl.int64), values, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip
    else:
        tl.store(ptrs, values, mask=mask)


@triton.jit
def _store_chunk_stats(part_f_ptr, part_i_ptr, part_g_ptr, rows, row_ok, chunk, split, m, total, x_min, s1, s2, arg,
                       n_finite, has_nan, group_max, G: tl.constexpr):  # fmt: skip
    """A chunk's statistics -> part_f [B, split, N_STATS_F], part_i [B, split, N_STATS_I] (the columns that
    _combine_stats reads) and its G group maxima [R, G] -> part_g [B, split, G]."""
    part = (rows * split + chunk) * N_STATS_F
    tl.store(part_f_ptr + part, m, mask=row_ok)
    tl.store(part_f_ptr + part + 1, total, mask=row_ok)  # relative to the chunk max
    tl.store(part_f_ptr + part + 2, x_min, mask=row_ok)
    tl.store(part_f_ptr + part + 3, s1, mask=row_ok)
    tl.store(part_f_ptr + part + 4, s2, mask=row_ok)
    part = (rows * split + chunk) * N_STATS_I
    tl.store(part_i_ptr + part, arg, mask=row_ok)
    tl.store(part_i_ptr + part + 1, n_finite, mask=row_ok)
    tl.store(part_i_ptr + part + 2, has_nan, mask=row_ok)
    g = tl.arange(0, G)
    tl.store(part_g_ptr + (rows * split + chunk)[:, None] * G + g[None, :], group_max, mask=row_ok[:, None])


@triton.jit
def _tile_maxima_pass(base, part_t_ptr, n_tiles, rows, row_ok, start, end, R: tl.constexpr, BLOCK: tl.constexpr,
                      G: tl.constexpr, TILE: tl.constexpr):  # fmt: skip
    """1, rows from tiles: the maxima of the chunk's tiles of TILE tokens -> part_t [B, n_tiles], and the maxima
    of its G groups [R, G] (group g: the tiles g * T / G .. (g + 1) * T / G - 1 of every block, T = BLOCK / TILE:
    the slots of _stats_pass's group g). All that launch 2a reads of a chunk without NaN or +inf, whose argmax no
    row needs (the NaN-keeping max tells the caller, which then runs _stats_pass): a max per token, against the
    ~20 instructions of _stats_pass's statistics (B = 256: the stats launch took 110 of the call's 146 us,
    profile_sampling at 0006c4a)."""
    T: tl.constexpr = BLOCK // TILE
    g_max = tl.full((R, T), float("-inf"), tl.float32)
    x_next = _load_block(base, start, end, row_ok, BLOCK)
    for off in range(start, end, BLOCK):
        x = x_next
        x_next = _load_block(base, off + BLOCK, end, row_ok, BLOCK)
        t_max = tl.reduce(tl.reshape(x, (R, T, TILE)), 2, _max_keep_nan) + 0.0  # [R, T]; -0.0 as +0.0
        tiles = off // TILE + tl.arange(0, T)
        t_ok = row_ok[:, None] & (tiles * TILE < end)[None, :]
        _store_in_place(part_t_ptr + rows[:, None] * n_tiles + tiles[None, :], t_max, t_ok, STORE_ASM)
        g_max = _max_keep_nan(g_max, t_max)
    return tl.reduce(tl.reshape(g_max, (R, G, T // G)), 2, _max_keep_nan)


@triton.jit
def _stats_pass(base, part_f_ptr, part_i_ptr, part_g_ptr, part_t_ptr, n_tiles, rows, row_ok, chunk, split, start,
                end, V, sampled, weighed, c, R: tl.constexpr, BLOCK: tl.constexpr, G: tl.constexpr,
                TILE: tl.constexpr):  # fmt: skip
    """1, every other chunk: its statistics -> part_f [B, split, 5], part_i [B, split, 3] (N_STATS_F /
    N_STATS_I), the maxima of its G groups of slots -> part_g [B, split, G], and (TILE > 0) of its tiles of TILE
    tokens -> part_t [B, n_tiles]. Rows from tiles (not `weighed`) get no sum of p, sum or sum of squares (zeros:
    launch 2a reads none of them). Every statistic is kept per slot of the block and reduced once after the
    loop; a tile is a warp's span of the block (32 threads x 4 tokens on the GPU), so its max needs no cross-warp
    reduction."""
    any_sampled = tl.max(sampled.to(tl.int32)) > 0
    any_weighed = tl.max(weighed.to(tl.int32)) > 0
    best = tl.full((R, BLOCK), float("-inf"), tl.float32)  # per slot: max, its earliest index, NaN seen
    best_idx = tl.zeros((R, BLOCK), tl.int32) + V
    nan_slots = tl.zeros((R, BLOCK), tl.int32)
    # the sum of p per slot, relative to a reference shared by RW slots that one thread holds (its 128-bit load):
    # their max (0 while -inf or infinite), so a token costs one exp2 and each RW of them one rescale
    RW: tl.constexpr = 4 if BLOCK >= 4 else BLOCK
    NG: tl.constexpr = BLOCK // RW
    total = tl.zeros((R, NG, RW), tl.float32)  # sum of exp2((x - ref) * c)
    g_max = tl.full((R, NG), float("-inf"), tl.float32)
    n_finite = tl.zeros((R, BLOCK), tl.int32)
    x_min = tl.full((R, BLOCK), float("inf"), tl.float32)
    s1 = tl.zeros((R, BLOCK), tl.float32)
    s2 = tl.zeros((R, BLOCK), tl.float32)
    x_next = _load_block(base, start, end, row_ok, BLOCK)
    for off in range(start, end, BLOCK):
        x, x_next, cols, msk = _next_block(base, x_next, off, end, row_ok, BLOCK)
        nan = x != x
        nan_slots |= nan.to(tl.int32)
        x = tl.where(nan, float("-inf"), x)
        m_new = tl.maximum(best, x)
        if any_weighed:
            xg = tl.reshape(x, (R, NG, RW))
            g_new = tl.maximum(g_max, tl.max(xg, 2))  # [R, NG]
            ref_old = tl.where((g_max == float("-inf")) | (g_max == float("inf")), 0.0, g_max)
            ref = tl.where((g_new == float("-inf")) | (g_new == float("inf")), 0.0, g_new)
            # an empty group (total 0) must not rescale by exp2(-ref * c), which overflows at low temperature
            rescale = tl.where(g_max == float("-inf"), 0.0, tl.exp2((ref_old - ref) * c))
            total = total * rescale[:, :, None] + tl.exp2((xg - ref[:, :, None]) * c[:, :, None])
            g_max = g_new
            xf = tl.where((x > float("-inf")) & (x < float("inf")), x, 0.0)
            s1 += xf
            s2 += xf * xf
        if any_sampled:
            finite = (x > float("-inf")) & (x < float("inf"))
            n_finite += finite.to(tl.int32)
            x_min = tl.minimum(x_min, tl.where(finite, x, float("inf")))
            if TILE > 0:  # launch 2's rows from tiles read only the tiles whose max reaches their threshold
                tiles = off // TILE + tl.arange(0, BLOCK // TILE)
                t_max = tl.max(tl.reshape(x, (R, BLOCK // TILE, TILE)), 2)  # [R, BLOCK // TILE]
                t_ok = sampled[:, None] & (tiles * TILE < end)[None, :]
                tl.store(part_t_ptr + rows[:, None] * n_tiles + tiles[None, :], t_max, mask=t_ok)
        up = x > best  # strict: a slot keeps its earliest index on ties
        best_idx = tl.where(up, cols[None, :], best_idx)
        best = m_new
    m = tl.max(best, 1)
    ref = tl.where((m == float("-inf")) | (m == float("inf")), 0.0, m)
    ref_group = tl.where((g_max == float("-inf")) | (g_max == float("inf")), 0.0, g_max)
    scale = tl.where(g_max == float("-inf"), 0.0, tl.exp2((ref_group - ref[:, None]) * c))  # [R, NG]
    # group g: slots g * BLOCK / G .. (g + 1) * BLOCK / G - 1 (each a token of every block of the chunk)
    group_max = tl.max(tl.reshape(best, (R, G, BLOCK // G)), 2)  # [R, G]
    _store_chunk_stats(part_f_ptr, part_i_ptr, part_g_ptr, rows, row_ok, chunk, split, m,
                       tl.sum(tl.sum(total, 2) * scale, 1), tl.min(x_min, 1), tl.sum(s1, 1), tl.sum(s2, 1),
                       tl.min(tl.where(best == m[:, None], best_idx, V), 1), tl.sum(n_finite, 1),
                       tl.max(nan_slots, 1), group_max, G)  # fmt: skip


@fast_launch
@triton.jit(do_not_specialize=["B", "temp_stride", "top_k_stride", "n_counters", "split", "chunk_blocks"])
def _stats_kernel(
    logits_ptr, stride_row, B, V, temp_ptr, temp_stride, top_k_ptr, top_k_stride, part_f_ptr, part_i_ptr, part_g_ptr,
    part_t_ptr, n_tiles, counter_ptr, n_counters, split, chunk_blocks, R: tl.constexpr, BLOCK: tl.constexpr,
    G: tl.constexpr, TILE: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """1. One chunk of R rows: _tile_maxima_pass when every row is from tiles (_from_tiles; TILE > 0) and the
    chunk holds no NaN and no +inf, else _stats_pass (also after the first, which then stored nothing but tile
    maxima that the second overwrites); zeroes the rows' counters (counter_ptr [n_counters, B]). A chunk of the
    first kind stores max, no sums, smallest finite logit -FLT_MAX and as many finite logits as it has tokens
    (bounds: where fewer than k groups hold a finite logit, launch 2a's list threshold is the smallest finite
    logit or -FLT_MAX, the list holds every finite logit either way, and the finish's k-th key past them keeps
    them all), first argmax V (no row from tiles reads it: their max is finite)."""
    allow_dependents(PDL)
    rows = tl.program_id(0) * R + tl.arange(0, R)
    row_ok = rows < B
    chunk = tl.program_id(1)
    base = logits_ptr + rows[:, None].to(tl.int64) * stride_row
    wait_for_producers(PDL)
    temperature = tl.load(temp_ptr + rows * temp_stride, mask=row_ok, other=0.0).to(tl.float32)
    sampled = row_ok & (temperature > 0)
    c = tl.where(sampled, LOG2E / tl.maximum(temperature, 1e-30), LOG2E)[:, None]  # > 0: no 0 * inf below
    k = tl.load(top_k_ptr + rows * top_k_stride, mask=row_ok, other=0)
    tiled = _from_tiles(temperature, k, row_ok, TILE, split, G)  # sampled rows only
    start, end = _chunk_span(chunk, chunk_blocks, V, BLOCK)
    done = row_ok & False
    if TILE > 0 and BLOCK // TILE >= G:
        if tl.min((tiled | ~row_ok).to(tl.int32)) > 0:
            group_max = _tile_maxima_pass(base, part_t_ptr, n_tiles, rows, row_ok, start, end, R, BLOCK, G, TILE)
            m = tl.reduce(group_max, 1, _max_keep_nan)
            done = row_ok & (m < float("inf"))  # False for NaN
            if tl.min((done | ~row_ok).to(tl.int32)) > 0:
                _store_chunk_stats(part_f_ptr, part_i_ptr, part_g_ptr, rows, row_ok, chunk, split, m, 0.0, -FLT_MAX,
                                   0.0, 0.0, V, end - start, 0, group_max, G)  # fmt: skip
    if tl.min((done | ~row_ok).to(tl.int32)) == 0:
        weighed = sampled & ~tiled  # rows from tiles read neither the sum of p nor the moments
        _stats_pass(base, part_f_ptr, part_i_ptr, part_g_ptr, part_t_ptr, n_tiles, rows, row_ok, chunk, split, start,
                    end, V, sampled, weighed, c, R, BLOCK, G, TILE)  # fmt: skip
    first_chunk = row_ok & (rows * 0 + chunk == 0)
    for i in range(n_counters):  # nothing persists between calls
        tl.store(counter_ptr + i * B + rows, tl.zeros((R,), tl.int32), mask=first_chunk)


@triton.jit
def _combine_stats(part_f_ptr, part_i_ptr, rows, row_ok, split, c, V, SPLIT: tl.constexpr):
    """The row stats from its chunks' (written by the stats launch) -> max, first argmax, sum of p, smallest
    finite logit, finite count, NaN flag, mean and standard deviation of the finite logits."""
    sp = tl.arange(0, SPLIT)
    pm = row_ok[:, None] & (sp < split)[None, :]
    parts = (rows[:, None] * split + sp[None, :]) * N_STATS_F  # [R, SPLIT]
    parts_i = (rows[:, None] * split + sp[None, :]) * N_STATS_I
    # every load first: a cross-thread reduction is a barrier, and no load moves above one (sm_90 SASS: one L2
    # round trip per statistic when each load sat before its own reduction)
    ms = tl.load(part_f_ptr + parts, mask=pm, other=float("-inf"))
    totals = tl.load(part_f_ptr + parts + 1, mask=pm, other=0.0)
    x_mins = tl.load(part_f_ptr + parts + 2, mask=pm, other=float("inf"))
    s1s = tl.load(part_f_ptr + parts + 3, mask=pm, other=0.0)
    s2s = tl.load(part_f_ptr + parts + 4, mask=pm, other=0.0)
    args = tl.load(part_i_ptr + parts_i, mask=pm, other=V)
    n_finites = tl.load(part_i_ptr + parts_i + 1, mask=pm, other=0)
    nans = tl.load(part_i_ptr + parts_i + 2, mask=pm, other=0)
    m = tl.max(ms, 1)
    ref = tl.where((m == float("-inf")) | (m == float("inf")), 0.0, m)
    scale = tl.where(ms == float("-inf"), 0.0, tl.exp2((ms - ref[:, None]) * c[:, None]))
    total = tl.sum(totals * scale, 1)  # chunk sums are relative to their own max
    x_min = tl.min(x_mins, 1)
    s1 = tl.sum(s1s, 1)
    s2 = tl.sum(s2s, 1)
    arg = tl.min(tl.where(ms == m[:, None], args, V), 1).to(tl.int64)  # the first chunk holding the max
    n_finite = tl.sum(n_finites, 1).to(tl.int64)
    has_nan = tl.max(nans, 1)
    n = tl.maximum(n_finite, 1).to(tl.float32)
    mean = s1 / n
    std = tl.sqrt(tl.maximum(s2 / n - mean * mean, 0.0))
    # only a guide for thresholds (huge logits overflow x^2): anything not finite falls back to the range
    mean = tl.where((mean == mean) & (tl.abs(mean) < float("inf")), mean, 0.5 * m + 0.5 * x_min)
    std = tl.where((std == std) & (std < float("inf")), std, 0.25 * (m - x_min))
    return m, arg, total, x_min, n_finite, has_nan, mean, std


# runtime values that would otherwise compile a variant each time they hit 1 (B = 1, strides of broadcast scalars)
SEARCH_RUNTIME_ARGS = ["B", "temp_stride", "top_k_stride", "top_p_stride", "min_p_stride", "seed_stride",
                       "step_stride", "split", "chunk_blocks"]  # fmt: skip


@triton.jit
def _row_setup(
    rows, row_ok, V, temperature, top_k, top_p_ptr, top_p_stride, min_p_ptr, min_p_stride, part_f_ptr, part_i_ptr,
    split, SPLIT: tl.constexpr,
):  # fmt: skip
    """What launch 2 knows of its rows `row_ok` (temperature and top_k: loaded already): parameters, row stats
    (launch 1), which filters are on."""
    temperature = tl.where(row_ok, temperature, 0.0).to(tl.float32)
    top_k = tl.where(row_ok, top_k, 0).to(tl.int64)
    top_p = tl.load(top_p_ptr + rows * top_p_stride, mask=row_ok, other=1.0).to(tl.float32)
    min_p = tl.minimum(tl.load(min_p_ptr + rows * min_p_stride, mask=row_ok, other=0.0).to(tl.float32), 1.0)
    sampled = row_ok & (temperature > 0)
    # log2(e) / T, so p = exp2((x - max) * c); T clamped so that c stays finite
    c = tl.where(sampled, LOG2E / tl.maximum(temperature, 1e-30), 0.0)
    m, arg, total, x_min, n_finite, has_nan, mean, std = _combine_stats(
        part_f_ptr, part_i_ptr, rows, row_ok, split, tl.where(sampled, c, LOG2E), V, SPLIT
    )
    invalid = (has_nan > 0) | (m == float("-inf"))
    token = tl.where(invalid, INVALID, arg)  # greedy; an +inf logit wins (first one)
    active = sampled & ~invalid & (m < float("inf"))
    k_on = active & (top_k > 0) & (top_k < n_finite)
    p_on = active & (top_p < 1.0)
    mp_on = active & (min_p > 0.0)
    filtered = k_on | p_on | mp_on
    unfiltered = active & ~filtered  # plain softmax: the race over the row, no cut
    top_k = tl.where(k_on, top_k, 0)
    top_p = tl.where(p_on, top_p, 1.0)
    min_p = tl.where(mp_on, min_p, 0.0)
    return (row_ok, top_k, top_p, min_p, c, m, total, x_min, n_finite, mean, std, token, k_on, p_on, mp_on, filtered,
            unfiltered)  # fmt: skip


@triton.jit
def _normal_threshold(mean, std, n, want):
    """The logit above which a normal fit N(mean, std^2) of n logits predicts `want` of them (Abramowitz-Stegun
    26.2.23 for the quantile, |error| < 4.5e-4 in z: only a guide, every count is exact)."""
    q = want / tl.maximum(n, 1).to(tl.float32)
    qq = tl.minimum(tl.maximum(tl.minimum(q, 1.0 - q), 1e-12), 0.5)
    t = tl.sqrt(-2.0 * tl.log(qq))
    z = t - (2.515517 + 0.802853 * t + 0.010328 * t * t) / (1.0 + t * (1.432788 + t * (0.189269 + 0.001308 * t)))
    return mean + std * tl.where(q > 0.5, -z, z)


@triton.jit
def _speculative_threshold(m, c, total, V, x_min, n_finite, mean, std, top_k, top_p, min_p, k_on, p_on, mp_on,
                           filtered, CAP: tl.constexpr):  # fmt: skip
    """The speculative gather's threshold, checked after the pass. top-k: where the normal fit predicts
    max(2k, CAP / 8) tokens (at most (k + CAP) / 2), kept if at least k came; else min-p: p(spec) ~ min_p / 2 <
    min_p; top-p: tokens with p / total < (1 - top_p) / V hold < 1 - top_p of the mass. +inf for rows without
    a filter."""
    tail = (1.0 - tl.where(p_on, top_p, 0.9)) / V
    spec = m + tl.log2(tail * total) / c
    spec_min_p = m + (tl.log2(tl.where(mp_on, min_p, 1.0)) - 1.0) / c
    spec = tl.where(mp_on, tl.where(p_on, tl.maximum(spec, spec_min_p), spec_min_p), spec)
    k = top_k.to(tl.float32)
    want = tl.minimum(tl.maximum(2.0 * k, CAP / 8), (k + CAP) * 0.5)
    spec = tl.where(k_on, _normal_threshold(mean, std, n_finite, want), spec)
    spec = tl.where(spec == spec, spec, x_min)
    return tl.where(filtered, tl.minimum(tl.maximum(spec, x_min), m), float("inf"))  # the max is always kept


@triton.jit
def _load_group_maxima(part_g_ptr, rows, row_ok, split, G: tl.constexpr, SPLIT: tl.constexpr):
    """The rows' split * G group maxima from the stats launch -> [R, SPLIT * G], -inf past them."""
    u = tl.arange(0, SPLIT * G)
    valid = row_ok[:, None] & (u < split * G)[None, :]
    return tl.load(part_g_ptr + rows[:, None] * (split * G) + u[None, :], mask=valid, other=float("-inf"))


@triton.jit
def _group_bound(maxima, top_k):
    """Top-k's list threshold from the stats launch's group maxima ([R, SPLIT * G], _load_group_maxima): the k-th
    largest of the row's split * G group maxima (ties counted) -> s [R], for rows with top-k on and k <= split * G.
    Each of the k groups whose max is >= s holds a token >= s, so at least k tokens are >= s: s is at or below
    the k-th largest logit, and the gather at s holds top-k's cut. Only tokens of groups whose max is >= s pass it
    (each group holds V / (split * G) of the row), so the list stays short (a few hundred tokens on every benchmark
    shape at k = 50, without counting a threshold per token)."""
    # ge[i]: how many maxima are >= maxima[i]; the largest maximum with ge >= k is the k-th largest
    ge = tl.sum((maxima[:, None, :] >= maxima[:, :, None]).to(tl.int32), 2)  # [R, SPLIT * G]
    return tl.max(tl.where(ge.to(tl.int64) >= top_k[:, None], maxima, float("-inf")), 1)


@triton.jit
def _count_thresholds(m, x_min, n_finite, mean, std, c, top_k, top_p, k_on, p_on, filtered, CAP: tl.constexpr,
                      NT: tl.constexpr, LOG_NT: tl.constexpr):  # fmt: skip
    """[R, NT] decreasing logit thresholds in [min, max]: NT / 2 geometric, max - (max - min) * 2^((j + 1 - NT / 2)
    / 2), and NT / 2 from the normal fit N(mean, std^2) of the row. Top-p without top-k: around the cut x* the fit
    predicts (weighted by p ~ exp(x / T), the fit is N(mean + std^2 / T, std^2), of which top_p lies above x*), at
    3/8 CAP, 2 CAP, ... tokens on either side by the fit's density at x*: where the fit is close, launch 2 finds
    the cut within a bracket of <= CAP tokens, and launch 3 gathers it in one pass (flat rows at top-p 0.95 took
    the radix rounds from a bracket of ~117k tokens). Else at geometrically spaced counts (top-k: k / 2 .. 8 CAP;
    else 16 .. n_finite)."""
    j = tl.arange(0, NT)
    HALF: tl.constexpr = NT // 2
    geo = m[:, None] - (m - x_min)[:, None] * tl.exp2((j[None, :] + 1 - HALF).to(tl.float32) * 0.5)
    lo_c = tl.where(k_on, tl.maximum(top_k.to(tl.float32) * 0.5, 1.0), 16.0)
    hi_c = tl.where(k_on, 8.0 * CAP, n_finite.to(tl.float32))
    i = tl.maximum(j - HALF, 0).to(tl.float32) / (HALF - 1)
    want = lo_c[:, None] * tl.exp2(tl.log2(tl.maximum(hi_c / lo_c, 1.0))[:, None] * i[None, :])
    fit = _normal_threshold(mean[:, None], std[:, None], n_finite[:, None], want)
    n = n_finite.to(tl.float32)
    x_p = _normal_threshold(mean + std * std * c / LOG2E, std, n_finite, top_p * n)  # [R]
    z = (x_p - mean) / std
    density = n / (std * 2.5066282746310002) * tl.exp(-0.5 * z * z)  # tokens per unit of x at x*
    QUARTER: tl.constexpr = HALF // 2 if HALF >= 2 else 1
    side = tl.where(j < HALF + QUARTER, 1.0, -1.0)  # above x* (fewer tokens), then below
    away = tl.where(j < HALF + QUARTER, HALF + QUARTER - 1 - j, j - HALF - QUARTER).to(tl.float32)  # 0: nearest
    tokens = CAP * 0.375 * tl.exp2(away * 2.415)  # 3/8 CAP, 2 CAP, ... (x 16 / 3)
    around = x_p[:, None] + (side * tokens)[None, :] / density[:, None]
    fit = tl.where((p_on & ~k_on)[:, None], around, fit)
    thr = tl.where(j[None, :] < HALF, geo, fit)
    thr = tl.minimum(tl.maximum(tl.where(thr == thr, thr, x_min[:, None]), x_min[:, None]), m[:, None])
    thr = tl.where(filtered[:, None], thr, 0.0)
    return _sort_descending(thr, thr.shape[0], NT, LOG_NT)


@triton.jit
def _gather_block(x, cols, take, rows, list_ptr, buf_val_ptr, buf_idx_ptr, CAP: tl.constexpr):
    """Appends the taken x [R, N] (token ids: cols, [1, N] or [R, N]) to their rows' lists of CAP slots; the slot
    comes from the row's list counter (the list's order is free: the finish sorts it and breaks race ties by token
    id) -> the slots [R, N] (undefined where not taken)."""
    pos = tl.atomic_add(list_ptr + rows[:, None] + cols * 0, 1, mask=take, sem="relaxed")
    at = rows[:, None].to(tl.int64) * CAP + pos
    ok = take & (pos < CAP)
    tl.store(buf_val_ptr + at, x, mask=ok)
    tl.store(buf_idx_ptr + at, cols + pos * 0, mask=ok)
    return pos


@triton.jit
def _sort_descending(keys, R: tl.constexpr, N: tl.constexpr, LOG_N: tl.constexpr):
    """[R, N] keys (int32 or float, no NaN) sorted along the last axis, largest first: tl.sort on the GPU; in the
    CPU interpreter (SORT_NETWORK) a bitonic network from reshapes, sums over a pair axis and joins (tl.sort's
    network, whose xor reductions the interpreter runs element by element; test_sort_network_is_tl_sort)."""
    if not SORT_NETWORK:
        return tl.sort(keys, 1, descending=True)
    for stage in tl.static_range(1, LOG_N + 1):
        for sub in tl.static_range(stage):
            # compare i with i + 2^(stage - 1 - sub), in blocks of twice that
            y = tl.reshape(keys, (R, N >> (stage - sub), 2, 1 << (stage - 1 - sub)))
            half = tl.arange(0, 2)[None, None, :, None]
            left = tl.sum(tl.where(half == 0, y, 0), 2)  # [R, blocks, 2^(stage - 1 - sub)]
            right = tl.sum(tl.where(half == 1, y, 0), 2)
            outer = tl.arange(0, N >> (stage - sub))[None, :, None]
            desc = ((outer >> sub) & 1) == 0  # bitonic blocks of 2^stage alternate; the last stage descends
            first = tl.where(desc, tl.maximum(left, right), tl.minimum(left, right))
            second = tl.where(desc, tl.minimum(left, right), tl.maximum(left, right))
            keys = tl.reshape(tl.permute(tl.join(first, second), (0, 1, 3, 2)), (R, N))
    return keys


@triton.jit
def _finish_from_prefix(buf_val_ptr, buf_idx_ptr, rows, fin, n_buf, m, c, top_k, top_p, min_p, k_on, p_on, target,
                        n_above, mass_above, race_above, idx_above, seed, step, CAP: tl.constexpr, N: tl.constexpr,
                        LOG_N: tl.constexpr):  # fmt: skip
    """_finish_from_list on the first N slots of the rows' lists of CAP slots (N >= every fin row's n_buf)."""
    slot = tl.arange(0, N)
    valid = fin[:, None] & (slot[None, :] < n_buf[:, None])
    at = rows[:, None].to(tl.int64) * CAP + slot[None, :]
    vals = tl.load(buf_val_ptr + at, mask=valid, other=float("-inf"), volatile=True) + 0.0
    idx = tl.load(buf_idx_ptr + at, mask=valid, other=0, volatile=True)
    keys = tl.where(valid, _ordered_key(vals), KEY_MIN)
    srt = _sort_descending(keys, rows.shape[0], N, LOG_N)  # the list's n_buf keys first
    listed = valid & (srt > KEY_MIN)
    p_srt = tl.where(listed, tl.exp2((_key_value(srt) - m[:, None]) * c[:, None]), 0.0)
    kth = (tl.minimum(tl.maximum(top_k - n_above, 1), n_buf) - 1).to(tl.int32)  # n_above < k <= n_above + n_buf
    key_k = tl.where(k_on, tl.sum(tl.where(slot[None, :] == kth[:, None], srt, 0), 1), KEY_MIN)
    in_k = listed & (srt >= key_k[:, None])
    p_k = tl.where(in_k, p_srt, 0.0)
    target = tl.where(target < 0, top_p * (mass_above + tl.sum(p_k, 1)), target)  # top_p times the top-k set's mass
    before = tl.cumsum(p_k, 1) - p_k  # the list's mass strictly before each sorted position
    # mass above the list + before < target (a [R] shift: adding it to the [R, N] cumsum made triton 3.6's resolve
    # kernel spill 3.4 KB at 128 registers, sm_90 AOT)
    n_p = tl.sum((in_k & (before < (target - mass_above)[:, None])).to(tl.int32), 1)
    deferred = p_on & k_on & (n_above > 0) & (n_p == 0)  # the mass above the list reaches the target already
    n_p = tl.maximum(n_p, 1)
    key_p = tl.sum(tl.where(slot[None, :] == (n_p - 1)[:, None], srt, 0), 1)
    cut = tl.where(p_on, tl.maximum(key_p, key_k), key_k)
    keep = valid & (keys >= cut[:, None])
    keep &= tl.exp2((vals - m[:, None]) * c[:, None]) >= min_p[:, None]  # min_p 0 when off
    race = tl.where(keep, _race_key(vals, m[:, None], c[:, None], seed[:, None], step[:, None], idx), float("-inf"))
    best = tl.maximum(tl.max(race, 1), race_above)
    token = tl.min(tl.where(keep & (race == best[:, None]), idx, 2**31 - 1), 1)
    token = tl.minimum(token, tl.where(race_above == best, idx_above, 2**31 - 1))
    return token.to(tl.int64), cut, key_k, deferred, target


@triton.jit
def _finish_from_list(buf_val_ptr, buf_idx_ptr, rows, fin, n_buf, m, c, top_k, top_p, min_p, k_on, p_on, target,
                      n_above, mass_above, race_above, idx_above, seed, step, CAP: tl.constexpr,
                      LOG_CAP: tl.constexpr):  # fmt: skip
    """The exact cuts and the draw for rows `fin`, whose list holds n_buf <= CAP tokens: every token of a bracket of
    keys that holds the cuts to find, n_above tokens above it (mass mass_above; the best race key among those with
    p >= min_p, race_above, at token idx_above). Launch 2's lists hold every token at or above a threshold (n_above
    0). Sorts the keys of the lists' filled prefix in registers (descending): the first CAP / 4, CAP / 2 or CAP
    slots, the fewest that hold every fin row's n_buf (the speculative gather aims at max(2k, CAP / 8) tokens: at
    k < 64 most lists fill a quarter). k_on: top-k's cut is the (k - n_above)-th key; top-p's (p_on) is the key at the
    last sorted position whose mass before it (mass_above included) is < target (target < 0: top_p times the top-k
    set's mass, z); every token at or above both cuts with p >= min_p races; the largest race key wins, lowest
    token id on ties. The slots past the prefix are empty (KEY_MIN, never kept), so no comparison changes with it;
    only top-p's fp32 sums (z, the cumulative mass) may round otherwise on the GPU, whose order of additions follows
    the tensor's layout. -> (int64 tokens [R], the cut: int32 key, top-k's cut, deferred: rows with top-k on and
    tokens above the list whose top-p cut lies above it (their token is not drawn), the top-p target)."""
    n_most = tl.max(tl.where(fin, n_buf, 0))  # the fullest list among the rows that finish here
    if CAP < 32:  # a quarter would hold < 8 slots: nothing to save, and numpy (the interpreter's tl.sum) adds < 8
        # values in another order than 8 or more, so there the prefix would change top-p's sums
        token, cut, key_k, deferred, target = _finish_from_prefix(
            buf_val_ptr, buf_idx_ptr, rows, fin, n_buf, m, c, top_k, top_p, min_p, k_on, p_on, target, n_above,
            mass_above, race_above, idx_above, seed, step, CAP, CAP, LOG_CAP)  # fmt: skip
    elif n_most <= CAP // 4:
        token, cut, key_k, deferred, target = _finish_from_prefix(
            buf_val_ptr, buf_idx_ptr, rows, fin, n_buf, m, c, top_k, top_p, min_p, k_on, p_on, target, n_above,
            mass_above, race_above, idx_above, seed, step, CAP, CAP // 4, LOG_CAP - 2)  # fmt: skip
    elif n_most <= CAP // 2:
        token, cut, key_k, deferred, target = _finish_from_prefix(
            buf_val_ptr, buf_idx_ptr, rows, fin, n_buf, m, c, top_k, top_p, min_p, k_on, p_on, target, n_above,
            mass_above, race_above, idx_above, seed, step, CAP, CAP // 2, LOG_CAP - 1)  # fmt: skip
    else:
        token, cut, key_k, deferred, target = _finish_from_prefix(
            buf_val_ptr, buf_idx_ptr, rows, fin, n_buf, m, c, top_k, top_p, min_p, k_on, p_on, target, n_above,
            mass_above, race_above, idx_above, seed, step, CAP, CAP, LOG_CAP)  # fmt: skip
    return token, cut, key_k, deferred, target


@triton.jit
def _finish_launch2(buf_val_ptr, buf_idx_ptr, rows, fin, n_buf, m, c, total, top_k, top_p, min_p, k_on, p_on, seed,
                    step, CAP: tl.constexpr, LOG_CAP: tl.constexpr):  # fmt: skip
    """_finish_from_list for launch 2's lists (every token at or above a threshold: nothing above them) -> tokens."""
    none = tl.zeros_like(n_buf)
    token, _, _, _, _ = _finish_from_list(
        buf_val_ptr, buf_idx_ptr, rows, fin, n_buf, m, c, top_k, top_p, min_p, k_on, p_on,
        tl.where(k_on, -1.0, top_p * total), none, none.to(tl.float32), none.to(tl.float32) + float("-inf"),
        none + (2**31 - 1), seed, step, CAP, LOG_CAP,
    )  # fmt: skip
    return token


# the state of a row (int64 [B, N_STATE] and fp32 [B, N_STATE]), written by the row's last program to arrive in
# launch 2 and in each step of launch 3, read by every program of the row in the next step
PHASE_NONE = tl.constexpr(0)  # the row is finished (or never needed more than launch 2)
PHASE_TOP_K = tl.constexpr(1)  # rounds narrow [lo, hi] to the k-th largest key
PHASE_TOP_P = tl.constexpr(2)  # rounds narrow [lo, hi] to the top-p cut within the top-k set
PHASE_RACE = tl.constexpr(3)  # the cut is known: the race draws the token (then PHASE_NONE)
PHASE_GATHER = tl.constexpr(4)  # launch 3 lists the bracket [lo, hi] (<= CAP keys), races above it, finishes
# int64 columns: phase, bracket, cut (the kept keys are >= it), k (0: off), key of the max, rounds run per phase,
# the path the row took (PATH_*: which launch finishes it; tests and the benchmark read it), the key of launch 2's
# list threshold and the number of x at or above it (the list holds the first CAP of them), the cut a gather
# resolves (PHASE_TOP_K: top-k's, then top-p's if it lies in the list; PHASE_TOP_P: top-p's, top-k's being below)
S_PHASE, S_LO, S_HI, S_CUT, S_K, S_TOP, S_ROUNDS_K, S_ROUNDS_P, S_PATH, S_SPEC, S_LISTED, S_FOR = (
    tl.constexpr(i) for i in range(12)
)
PATH_STATS = tl.constexpr(0)  # greedy, NaN, all -inf or +inf rows: the stats' answer
PATH_LIST = tl.constexpr(2)  # the speculative gather held the cut: finished by launch 2
PATH_REGATHER = tl.constexpr(3)  # finished by launch 3 from a gather between launch 2's counted thresholds
PATH_RADIX = tl.constexpr(4)  # the radix rounds found the cut, the race drew
PATH_RACE = tl.constexpr(5)  # no cut to find (no filter, or min-p alone over more than CAP tokens): the race
# fp32 columns: max, log2(e) / T, top_p (1: off), top-p target mass (< 0: top_p times the top-k set's mass, set by
# the first top-p round or found by a top-k gather), min_p (0: off)
F_M, F_C, F_TOP_P, F_TARGET, F_MIN_P = (tl.constexpr(i) for i in range(5))
N_STATE = tl.constexpr(12)


@triton.jit
def _count_outcome(search_i_ptr, search_f_ptr, counter_ptr, B, rows, last, split, thr, m, c, total, x_min, n_finite,
                   spec, top_k, top_p, min_p, k_on, p_on, mp_on, filtered, CAP: tl.constexpr,
                   NT: tl.constexpr, SPLIT: tl.constexpr):  # fmt: skip
    """The partials of launch 2 summed in chunk order by the row's last program -> (list size, rows whose list
    holds the cut, rows to gather in launch 3, rows for the radix rounds, their bracket [lo, hi] of keys). A row
    gathers where the highest threshold at or below the cut has <= CAP tokens above it (the bracket [t_j, max]:
    the whole kept set), else where <= CAP tokens lie between the two thresholds around the cut (top-k or top-p:
    the tokens above the bracket race in the same pass)."""
    SW: tl.constexpr = NT + 1
    sp = tl.arange(0, SPLIT)
    j = tl.arange(0, NT)
    pm = last[:, None] & (sp < split)[None, :]
    parts = (rows[:, None] * split + sp[None, :]) * SW  # [R, SPLIT]
    pm3 = pm[:, :, None] & (j >= 0)[None, None, :]
    parts3 = parts[:, :, None] + j[None, None, :]  # [R, SPLIT, NT]
    # the loads before the reductions (barriers): one L2 round trip, not four
    n_list = tl.load(counter_ptr + C_COUNT_LIST * B + rows, mask=last, other=0, volatile=True)
    mass_specs = tl.load(search_f_ptr + parts + NT, mask=pm, other=0.0, volatile=True)
    cnts = tl.load(search_i_ptr + parts3, mask=pm3, other=0, volatile=True)
    masses = tl.load(search_f_ptr + parts3, mask=pm3, other=0.0, volatile=True)
    mass_spec = tl.sum(mass_specs, 1)
    cnt = tl.sum(cnts, 1)  # [R, NT]
    mass = tl.sum(masses, 1)
    spec_ok = tl.where(
        k_on, n_list >= top_k, (p_on & (mass_spec >= top_p * total)) | (mp_on & (tl.exp2((spec - m) * c) < min_p))
    )
    listed = last & filtered & spec_ok & (n_list <= CAP)
    # thresholds provably at or below the cut: count >= k with top-k, else the mass or min-p bound
    p_of_thr = tl.exp2((thr - m[:, None]) * c[:, None])
    below_cut = tl.where(
        k_on[:, None],
        cnt >= top_k[:, None],
        (p_on[:, None] & (mass >= (top_p * total)[:, None])) | (mp_on[:, None] & (p_of_thr < min_p[:, None])),
    )
    usable = below_cut & (cnt <= CAP)
    s = tl.max(tl.where(usable, thr, float("-inf")), 1)  # the highest usable threshold: the fewest tokens
    regather = last & filtered & ~listed & (s > float("-inf"))
    # the bracket: between the highest threshold at or below the cut and the lowest one above it (counts increase
    # with j: at_or_below holds from some j on)
    at_or_below = tl.where(k_on[:, None], cnt >= top_k[:, None], mass >= (top_p * total)[:, None])
    lo_x = tl.maximum(tl.max(tl.where(at_or_below, thr, float("-inf")), 1), x_min)
    hi_x = tl.min(tl.where(at_or_below, float("inf"), thr), 1)
    n_lo = tl.min(tl.where(at_or_below, cnt, n_finite.to(tl.int32)[:, None]), 1)  # tokens >= lo_x
    n_hi = tl.max(tl.where(at_or_below, 0, cnt), 1)  # tokens >= hi_x
    top = _ordered_key(m).to(tl.int64)
    lo = _ordered_key(lo_x + 0.0).to(tl.int64)
    hi = tl.maximum(tl.where(hi_x < float("inf"), _ordered_key(hi_x + 0.0).to(tl.int64) - 1, top), lo)
    bracket = last & filtered & ~listed & ~regather & (k_on | p_on) & (n_lo - n_hi <= CAP)
    radix = last & filtered & ~listed & ~regather & ~bracket
    lo = tl.where(regather, _ordered_key(s + 0.0).to(tl.int64), lo)
    hi = tl.where(regather, top, hi)
    return n_list, listed, regather | bracket, radix, lo, hi


@triton.jit
def _gather_above(x, cols, msk, spec, appending, rows, list_ptr, buf_val_ptr, buf_idx_ptr, CAP: tl.constexpr):
    """Launch 2's gather of one block: its x >= spec into the lists of the rows still `appending`; a block with
    none skips the append (most blocks hold no token of a short list) -> (the mask of the gathered x, appending:
    false from a slot >= CAP on). A full list has overflowed (the row's count passed CAP), so more appends only
    contend for its counter: top-p 0.95 on flat rows appended every token, 247k atomics a row, 33 ms at B = 256
    (results/ab_sampling_rounds.json at 0006c4a)."""
    take = (x >= spec[:, None]) & msk & appending[:, None]
    if tl.max(tl.max(take.to(tl.int32), 1), 0) > 0:
        pos = _gather_block(x, cols[None, :], take, rows, list_ptr, buf_val_ptr, buf_idx_ptr, CAP)
        appending = appending & (tl.max(tl.where(take, pos, 0), 1) < CAP)
    return take, appending


@triton.jit
def _write_state(state_i_ptr, state_f_ptr, out_ptr, open_ptr, rows, last, token, listed, gather, radix, unfiltered,
                 lo, hi, spec, n_list, top_k, top_p, min_p, k_on, p_on, c, m, total, x_min):  # fmt: skip
    """Launch 2's decision for rows `last` -> their state (phase, bracket, path, ...) and token (INVALID_TOKEN for
    rows still open: a later launch writes it; one it misses stays invalid). `gather`: launch 3 lists the bracket
    [lo, hi] and finishes. Rows whose bracket holds more than CAP tokens (`radix`): the radix rounds narrow it
    (top-k's cut, then top-p's) over all the row's programs; min-p is closed form (applied in the race), so min-p
    alone and rows without a filter (cut: the smallest key) go to the race."""
    phase = tl.where(radix, tl.where(k_on, PHASE_TOP_K, tl.where(p_on, PHASE_TOP_P, PHASE_RACE)), PHASE_NONE)
    phase = tl.where(gather, PHASE_GATHER, tl.where(unfiltered, PHASE_RACE, phase))
    st = state_i_ptr + rows * N_STATE
    tl.store(st + S_PHASE, phase.to(tl.int64), mask=last)
    tl.store(st + S_LO, lo, mask=last)
    tl.store(st + S_HI, hi, mask=last)
    tl.store(st + S_CUT, _ordered_key(x_min).to(tl.int64), mask=last)  # the race without a cut: every finite x
    tl.store(st + S_K, top_k, mask=last)
    tl.store(st + S_TOP, _ordered_key(m).to(tl.int64), mask=last)
    tl.store(st + S_ROUNDS_K, tl.zeros_like(lo), mask=last)
    tl.store(st + S_ROUNDS_P, tl.zeros_like(lo), mask=last)
    path = tl.where(phase == PHASE_RACE, PATH_RACE, tl.where(phase == PHASE_GATHER, PATH_REGATHER, PATH_RADIX))
    path = tl.where(phase == PHASE_NONE, tl.where(listed, PATH_LIST, PATH_STATS), path)
    tl.store(st + S_PATH, path.to(tl.int64), mask=last)
    tl.store(st + S_SPEC, _ordered_key(spec + 0.0).to(tl.int64), mask=last)
    tl.store(st + S_LISTED, n_list.to(tl.int64), mask=last)
    tl.store(st + S_FOR, tl.where(k_on, PHASE_TOP_K, PHASE_TOP_P).to(tl.int64), mask=last)
    sf = state_f_ptr + rows * N_STATE
    tl.store(sf + F_M, m, mask=last)
    tl.store(sf + F_C, c, mask=last)
    tl.store(sf + F_TOP_P, top_p, mask=last)
    # top-p without top-k: top_p times the row's mass; after top-k, top_p times the top-k set's mass, from the first
    # top-p round or a top-k gather
    tl.store(sf + F_TARGET, tl.where(k_on, -1.0, top_p * total), mask=last)
    tl.store(sf + F_MIN_P, min_p, mask=last)
    tl.store(out_ptr + rows, tl.where(phase != PHASE_NONE, INVALID, token), mask=last)
    n_open = tl.sum((last & (phase != PHASE_NONE)).to(tl.int32))
    if n_open > 0:  # launch 3 as one grid leaves at once when no row is open
        tl.atomic_add(open_ptr, n_open, sem="relaxed")


@triton.jit
def _gather_tiles(base, t_max, spec, rows, filtered, tile_list_ptr, n_tiles, buf_val_ptr, buf_idx_ptr, V,
                  CAP: tl.constexpr, TILE: tl.constexpr, N_TILES: tl.constexpr, NS: tl.constexpr):  # fmt: skip
    """Every x >= spec of the rows `filtered` into their lists, by one program -> the number of such x [R]. Only a
    tile whose max (t_max [R, N_TILES], from the stats launch) is >= spec holds one: the selected tiles' ids are
    listed (tile_list [B, n_tiles]), then read NS tiles at a time, each x >= spec appended at its prefix-sum
    position (no atomics). At top-k 50 that is about k tiles of a row on every benchmark shape, a few % of it."""
    t = tl.arange(0, N_TILES)
    sel = filtered[:, None] & (t_max >= spec[:, None])  # [R, N_TILES]
    rank = tl.cumsum(sel.to(tl.int32), 1) - 1
    tile_list = tile_list_ptr + rows[:, None] * n_tiles
    tl.store(tile_list + rank, t[None, :] + rank * 0, mask=sel)
    n_sel = tl.sum(sel.to(tl.int32), 1)
    tl.debug_barrier()  # the tile list's stores before its loads (one program: bar.sync orders global memory)
    slot = tl.arange(0, NS)
    lane = tl.arange(0, TILE)
    n_list = tl.zeros_like(n_sel)
    for first in range(0, tl.max(n_sel), NS):
        used = (first + slot)[None, :] < n_sel[:, None]  # [R, NS]
        tile = tl.load(tile_list + (first + slot)[None, :], mask=used, other=0, volatile=True)
        cols = tile[:, :, None] * TILE + lane[None, None, :]  # [R, NS, TILE]
        msk = used[:, :, None] & (cols < V)
        x = tl.load(base[:, :, None] + cols, mask=msk, other=float("-inf")) + 0.0  # -0.0 as +0.0
        x = tl.reshape(x, (rows.shape[0], NS * TILE))
        cols = tl.reshape(cols, (rows.shape[0], NS * TILE))
        take = tl.reshape(msk, (rows.shape[0], NS * TILE)) & (x >= spec[:, None])
        pos = n_list[:, None] + tl.cumsum(take.to(tl.int32), 1) - 1
        at = rows[:, None].to(tl.int64) * CAP + pos
        tl.store(buf_val_ptr + at, x, mask=take & (pos < CAP))
        tl.store(buf_idx_ptr + at, cols, mask=take & (pos < CAP))
        n_list += tl.sum(take.to(tl.int32), 1)
    tl.debug_barrier()  # the list's stores before the finish loads them
    return n_list


@triton.jit
def _gather_count_pass(base, x_next, start, stop, spec, thr, m, c, rows, filtered, use_mass, list_ptr, buf_val_ptr,
                       buf_idx_ptr, CAP: tl.constexpr, BLOCK: tl.constexpr, NT: tl.constexpr):  # fmt: skip
    """Launch 2's pass with the thresholds: each x >= spec into its row's list (until it overflows), and per row
    the count (top-p without top-k, use_mass: also the mass) of x >= thr[j] and the mass of the listed x -> ([R,
    NT], [R, NT], [R]). Per slot and threshold, reduced across threads once after the loop (as in the radix
    rounds): the same time as a tl.histogram of each token's bucket for counts, and top-p's masses without one
    cross-thread reduction per threshold and block (B = 256 top-p 0.95: llm 2,046 -> 1,196 us, flat 5,549 -> 4,696:
    results/probe_sampling_count.json)."""
    cnt_slots = tl.zeros((rows.shape[0], BLOCK, NT), tl.int32)
    mass_slots = tl.zeros((rows.shape[0], BLOCK, NT), tl.float32)
    mass_spec = tl.zeros((rows.shape[0], BLOCK), tl.float32)
    appending = filtered
    for off in range(start, stop, BLOCK):
        x, x_next, cols, msk = _next_block(base, x_next, off, stop, filtered, BLOCK)
        take, appending = _gather_above(x, cols, msk, spec, appending, rows, list_ptr, buf_val_ptr, buf_idx_ptr, CAP)
        passed = x[:, :, None] >= thr[:, None, :]  # masked x are -inf, below every threshold of an active row
        cnt_slots += passed.to(tl.int32)
        if use_mass:  # only top-p without top-k reads masses (with top-k, the list's count decides)
            p = tl.exp2((x - m[:, None]) * c[:, None])
            mass_spec += tl.where(take, p, 0.0)
            mass_slots += tl.where(passed, p[:, :, None], 0.0)
    return tl.sum(cnt_slots, 1), tl.sum(mass_slots, 1), tl.sum(mass_spec, 1)


@fast_launch
@triton.jit(do_not_specialize=SEARCH_RUNTIME_ARGS + ["n_tiles"])
def _tiles_kernel(
    logits_ptr, stride_row, B, V,
    temp_ptr, temp_stride, top_k_ptr, top_k_stride, top_p_ptr, top_p_stride, min_p_ptr, min_p_stride,
    seed_ptr, seed_stride, step_ptr, step_stride,
    part_f_ptr, part_i_ptr, part_g_ptr, part_t_ptr, n_tiles, tile_list_ptr, buf_val_ptr, buf_idx_ptr, counter_ptr,
    out_ptr, state_i_ptr, state_f_ptr, split, R: tl.constexpr, CAP: tl.constexpr, LOG_CAP: tl.constexpr,
    SPLIT: tl.constexpr, G: tl.constexpr, TILE: tl.constexpr, N_TILES: tl.constexpr, NS: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """2a. Rows from tiles (_from_tiles), one program each: top-k is on with k' = min(k, finite logits) (the same
    kept set as top-k off when k' is all of them, so that the top-k set's mass, not the row's sum of p, is top-p's
    reference; the count is an upper bound where chunks took _tile_maxima_pass, and a k' above the finite logits
    keeps them all as well: the finish's k'-th key lies past the list). List threshold s: the k'-th largest group
    maximum (_group_bound), at or below the k'-th logit, clamped to [smallest finite logit, max]; only the tiles
    whose max reaches it are read (_gather_tiles). The list holds the cut unless it overflows CAP: then the radix
    rounds start from [s, max]. Its own launch (not a branch of launch 2): a chain of one program whose registers,
    ~1 wave of programs and length are its own."""
    allow_dependents(PDL)
    rows = tl.program_id(0) * R + tl.arange(0, R)
    base = logits_ptr + rows[:, None].to(tl.int64) * stride_row
    wait_for_producers(PDL)
    in_batch = rows < B
    temperature = tl.load(temp_ptr + rows * temp_stride, mask=in_batch, other=0.0)
    k = tl.load(top_k_ptr + rows * top_k_stride, mask=in_batch, other=0)
    here = _from_tiles(temperature, k, in_batch, 1, split, G)
    if tl.max(here.to(tl.int32)) > 0:
        maxima = _load_group_maxima(part_g_ptr, rows, here, split, G, SPLIT)  # with the setup's loads: one round trip
        t = tl.arange(0, N_TILES)
        t_ok = here[:, None] & (t < n_tiles)[None, :]
        t_max = tl.load(part_t_ptr + rows[:, None] * n_tiles + t[None, :], mask=t_ok, other=float("-inf"))
        seed = tl.load(seed_ptr + rows * seed_stride, mask=here, other=0).to(tl.int64)
        step = tl.load(step_ptr + rows * step_stride, mask=here, other=0).to(tl.int64)
        (row_ok, top_k, top_p, min_p, c, m, total, x_min, n_finite, mean, std, token, k_on, p_on, mp_on, filtered,
         unfiltered) = _row_setup(rows, here, V, temperature, k, top_p_ptr, top_p_stride, min_p_ptr, min_p_stride,
                                  part_f_ptr, part_i_ptr, split, SPLIT)  # fmt: skip
        active = filtered | unfiltered
        top_k = tl.where(active, tl.minimum(k.to(tl.int64), n_finite), 0)
        k_on = active
        s = tl.minimum(tl.maximum(_group_bound(maxima, top_k), x_min), m)
        n_list = _gather_tiles(base, t_max, s, rows, active, tile_list_ptr, n_tiles, buf_val_ptr, buf_idx_ptr, V,
                               CAP, TILE, N_TILES, NS)  # fmt: skip
        listed = active & (n_list <= CAP)
        radix = active & ~listed
        if tl.max(listed.to(tl.int32)) > 0:
            drawn = _finish_launch2(buf_val_ptr, buf_idx_ptr, rows, listed, n_list, m, c, total, top_k, top_p, min_p,
                                    k_on, p_on, seed, step, CAP, LOG_CAP)  # fmt: skip
            token = tl.where(listed, drawn, token)
        _write_state(state_i_ptr, state_f_ptr, out_ptr, counter_ptr + C_OPEN * B, rows, here, token, listed,
                     listed & False, radix, unfiltered & False, _ordered_key(s + 0.0).to(tl.int64),
                     _ordered_key(m).to(tl.int64), s, n_list, top_k, top_p, min_p, k_on, p_on, c, m, total,
                     x_min)  # fmt: skip


@fast_launch
@triton.jit(do_not_specialize=SEARCH_RUNTIME_ARGS + ["tiles_on"])
def _gather_count_kernel(
    logits_ptr, stride_row, B, V,
    temp_ptr, temp_stride, top_k_ptr, top_k_stride, top_p_ptr, top_p_stride, min_p_ptr, min_p_stride,
    seed_ptr, seed_stride, step_ptr, step_stride,
    part_f_ptr, part_i_ptr, tiles_on, search_f_ptr, search_i_ptr, buf_val_ptr, buf_idx_ptr, counter_ptr, out_ptr,
    state_i_ptr, state_f_ptr, split, chunk_blocks, R: tl.constexpr, BLOCK: tl.constexpr, CAP: tl.constexpr,
    LOG_CAP: tl.constexpr, NT: tl.constexpr, LOG_NT: tl.constexpr, SPLIT: tl.constexpr, G: tl.constexpr,
    ITEMS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """2b. Every row not from tiles (_from_tiles): one pass over each (row block, chunk) item, _gather_count_item.
    The P programs take items pid, pid + P, ... (ITEMS at most each) and drop the items of rows from tiles after
    one load of all their items' parameters: a batch of such rows costs no wave of programs that only leave (2,048
    of them took 28 us at B = 256, profile_sampling at a034b2f). Item i is chunk i // blocks of row block i %
    blocks: programs that run at once work on different rows, whose list counters sit in different L2 slices."""
    allow_dependents(PDL)
    P = tl.num_programs(0)
    blocks = tl.cdiv(B, R)
    slot = tl.arange(0, ITEMS)
    items = tl.program_id(0) + P * slot
    rows = (items % blocks)[:, None] * R + tl.arange(0, R)[None, :]  # [ITEMS, R]
    wait_for_producers(PDL)
    ok = (items < blocks * split)[:, None] & (rows < B)
    temperature = tl.load(temp_ptr + rows * temp_stride, mask=ok, other=0.0)
    k = tl.load(top_k_ptr + rows * top_k_stride, mask=ok, other=0)
    work = tl.max((ok & ~_from_tiles(temperature, k, ok, tiles_on, split, G)).to(tl.int32), 1)  # [ITEMS]
    for n in range(ITEMS):
        if tl.sum(tl.where(slot == n, work, 0)) > 0:
            item = tl.program_id(0) + P * n
            _gather_count_item(
                logits_ptr, stride_row, (item % blocks) * R + tl.arange(0, R), item // blocks, B, V, temp_ptr,
                temp_stride, top_k_ptr, top_k_stride, top_p_ptr, top_p_stride, min_p_ptr, min_p_stride, seed_ptr,
                seed_stride, step_ptr, step_stride, part_f_ptr, part_i_ptr, tiles_on, search_f_ptr, search_i_ptr,
                buf_val_ptr, buf_idx_ptr, counter_ptr, out_ptr, state_i_ptr, state_f_ptr, split, chunk_blocks, R,
                BLOCK, CAP, LOG_CAP, NT, LOG_NT, SPLIT, G,
            )  # fmt: skip


@triton.jit
def _gather_count_item(
    logits_ptr, stride_row, rows, chunk, B, V,
    temp_ptr, temp_stride, top_k_ptr, top_k_stride, top_p_ptr, top_p_stride, min_p_ptr, min_p_stride,
    seed_ptr, seed_stride, step_ptr, step_stride,
    part_f_ptr, part_i_ptr, tiles_on, search_f_ptr, search_i_ptr, buf_val_ptr, buf_idx_ptr, counter_ptr, out_ptr,
    state_i_ptr, state_f_ptr, split, chunk_blocks, R: tl.constexpr, BLOCK: tl.constexpr, CAP: tl.constexpr,
    LOG_CAP: tl.constexpr, NT: tl.constexpr, LOG_NT: tl.constexpr, SPLIT: tl.constexpr, G: tl.constexpr,
):  # fmt: skip
    """One (row block, chunk) item of launch 2b for its rows not from tiles: one pass over the chunk gathers x >=
    spec (a speculative threshold) into the row's list and counts (top-p without top-k: also weighs) x >= t_j at
    NT thresholds; the row's last program to arrive decides (_count_outcome), finishes the rows whose list holds
    the cut and writes the others' state (gather, radix rounds, race) and every row's token (INVALID_TOKEN for
    the rows still open)."""
    start, end = _chunk_span(chunk, chunk_blocks, V, BLOCK)
    base = logits_ptr + rows[:, None].to(tl.int64) * stride_row
    in_batch = rows < B
    temperature = tl.load(temp_ptr + rows * temp_stride, mask=in_batch, other=0.0)  # (L2 hits: loaded before)
    k = tl.load(top_k_ptr + rows * top_k_stride, mask=in_batch, other=0)
    shared = in_batch & ~_from_tiles(temperature, k, in_batch, tiles_on, split, G)
    if tl.max(shared.to(tl.int32)) > 0:
        seed = tl.load(seed_ptr + rows * seed_stride, mask=shared, other=0).to(tl.int64)
        step = tl.load(step_ptr + rows * step_stride, mask=shared, other=0).to(tl.int64)
        (row_ok, top_k, top_p, min_p, c, m, total, x_min, n_finite, mean, std, token, k_on, p_on, mp_on, filtered,
         unfiltered) = _row_setup(rows, shared, V, temperature, k, top_p_ptr, top_p_stride, min_p_ptr, min_p_stride,
                                  part_f_ptr, part_i_ptr, split, SPLIT)  # fmt: skip
        spec = _speculative_threshold(m, c, total, V, x_min, n_finite, mean, std, top_k, top_p, min_p, k_on, p_on,
                                      mp_on, filtered, CAP)  # fmt: skip
        j = tl.arange(0, NT)
        sbase = (rows * split + chunk) * (NT + 1)  # this chunk's partials
        if tl.max(filtered.to(tl.int32)) > 0:  # [R, NT], decreasing
            thr = _count_thresholds(m, x_min, n_finite, mean, std, c, top_k, top_p, k_on, p_on, filtered, CAP, NT,
                                    LOG_NT)  # fmt: skip
            use_mass = tl.max((p_on & ~k_on).to(tl.int32)) > 0
            cnt, mass, mass_spec = _gather_count_pass(
                base, _load_block(base, start, end, filtered, BLOCK), start, end, spec, thr, m, c, rows, filtered,
                use_mass, counter_ptr + C_COUNT_LIST * B, buf_val_ptr, buf_idx_ptr, CAP, BLOCK, NT,
            )  # fmt: skip
        else:  # no pass
            thr = tl.zeros((R, NT), tl.float32)
            cnt = tl.zeros((R, NT), tl.int32)
            mass = tl.zeros((R, NT), tl.float32)
            mass_spec = tl.zeros((R,), tl.float32)
        tl.store(search_i_ptr + sbase[:, None] + j[None, :], cnt, mask=shared[:, None])
        tl.store(search_f_ptr + sbase[:, None] + j[None, :], mass, mask=shared[:, None])
        tl.store(search_f_ptr + sbase + NT, mass_spec, mask=shared)
        tl.debug_barrier()  # every thread's stores before the release below
        arrived = tl.atomic_add(counter_ptr + C_COUNT_ARRIVED * B + rows, 1, mask=shared, sem="acq_rel", scope="gpu")
        last = shared & (arrived == split - 1)  # the row's last program to arrive decides for it
        if tl.max(last.to(tl.int32)) > 0:  # (the finish in this region: triton 3.6 fails to compile it after it)
            n_list, listed, gather, radix, lo, hi = _count_outcome(
                search_i_ptr, search_f_ptr, counter_ptr, B, rows, last, split, thr, m, c, total, x_min, n_finite, spec,
                top_k, top_p, min_p, k_on, p_on, mp_on, filtered, CAP, NT, SPLIT,
            )  # fmt: skip
            if tl.max(listed.to(tl.int32)) > 0:
                drawn = _finish_launch2(buf_val_ptr, buf_idx_ptr, rows, listed, n_list, m, c, total, top_k, top_p,
                                        min_p, k_on, p_on, seed, step, CAP, LOG_CAP)  # fmt: skip
                token = tl.where(listed, drawn, token)
            _write_state(state_i_ptr, state_f_ptr, out_ptr, counter_ptr + C_OPEN * B, rows, last, token, listed,
                         gather, radix, unfiltered, lo, hi, spec, n_list, top_k, top_p, min_p, k_on, p_on, c, m,
                         total, x_min)  # fmt: skip


@triton.jit
def _gather_step(base, rows, busy, chunk, chunk_blocks, V, B, seed_ptr, seed_stride, step_ptr, step_stride, st, sf,
                 buf_val_ptr, buf_idx_ptr, round_cnt_ptr, round_mass_ptr, race_f_ptr, race_i_ptr, arrived_ptr,
                 decided_ptr, counter_ptr, out_ptr, split, BLOCK: tl.constexpr, NB: tl.constexpr, CAP: tl.constexpr,
                 LOG_CAP: tl.constexpr, SPLIT: tl.constexpr):  # fmt: skip
    """Rows `busy` (PHASE_GATHER): their bracket [lo, hi] of keys holds the cut that S_FOR names and at most CAP
    tokens. Every program appends its chunk's keys in the bracket to the row's list, and counts, weighs and races
    (p >= min_p) its keys above hi -> partials (counts and masses in column NB of the rounds' partials, as a round's
    keys above hi); the row's last program to arrive sums them in chunk order and finishes from the list
    (_finish_from_list): the token, or, when a top-k gather finds top-p's cut above hi, the top-p phase over
    [hi + 1, max] with the target top_p times the top-k set's mass. Counts the decision at decided_ptr."""
    lo = tl.load(st + S_LO, mask=busy, other=0).to(tl.int32)
    hi = tl.load(st + S_HI, mask=busy, other=-1).to(tl.int32)
    m = tl.load(sf + F_M, mask=busy, other=0.0)
    c = tl.load(sf + F_C, mask=busy, other=0.0)
    min_p = tl.load(sf + F_MIN_P, mask=busy, other=0.0)
    seed = tl.load(seed_ptr + rows * seed_stride, mask=busy, other=0).to(tl.int64)
    step = tl.load(step_ptr + rows * step_stride, mask=busy, other=0).to(tl.int64)
    n_above = tl.zeros((rows.shape[0], BLOCK), tl.int32)
    mass_above = tl.zeros((rows.shape[0], BLOCK), tl.float32)
    best = tl.full((rows.shape[0], BLOCK), float("-inf"), tl.float32)
    best_idx = tl.zeros((rows.shape[0], BLOCK), tl.int32) + V
    start, end = _chunk_span(chunk, chunk_blocks, V, BLOCK)
    x_next = _load_block(base, start, end, busy, BLOCK)
    for off in range(start, end, BLOCK):
        x, x_next, cols, msk = _next_block(base, x_next, off, end, busy, BLOCK)
        key = _ordered_key(x)
        inside = msk & (key >= lo[:, None]) & (key <= hi[:, None])
        if tl.max(tl.max(inside.to(tl.int32), 1), 0) > 0:  # most blocks hold no key of a bracket of <= CAP
            _gather_block(x, cols[None, :], inside, rows, counter_ptr + C_GATHER_LIST * B, buf_val_ptr, buf_idx_ptr,
                          CAP)  # fmt: skip
        above = msk & (key > hi[:, None])
        if tl.max(tl.max(above.to(tl.int32), 1), 0) > 0:
            p = tl.exp2((x - m[:, None]) * c[:, None])
            n_above += above.to(tl.int32)
            mass_above += tl.where(above, p, 0.0)
            race = _race_key(x, m[:, None], c[:, None], seed[:, None], step[:, None], cols)
            race = tl.where(above & (p >= min_p[:, None]), race, float("-inf"))  # min_p 0 when off
            up = race > best  # strict: a slot keeps its earliest index on ties
            best_idx = tl.where(up, cols[None, :], best_idx)
            best = tl.where(up, race, best)
    chunk_best = tl.max(best, 1)
    part = rows * split + chunk
    tl.store(race_f_ptr + part, chunk_best, mask=busy)
    tl.store(race_i_ptr + part, tl.min(tl.where(best == chunk_best[:, None], best_idx, V), 1), mask=busy)
    tl.store(round_cnt_ptr + part * (NB + 1) + NB, tl.sum(n_above, 1), mask=busy)
    tl.store(round_mass_ptr + part * (NB + 1) + NB, tl.sum(mass_above, 1), mask=busy)
    tl.debug_barrier()  # every thread's stores before the release below
    arrived = tl.atomic_add(arrived_ptr + rows, 1, mask=busy, sem="acq_rel", scope="gpu")
    last = busy & (arrived == split - 1)
    if tl.max(last.to(tl.int32)) > 0:
        sp = tl.arange(0, SPLIT)
        pm = last[:, None] & (sp < split)[None, :]
        parts = rows[:, None] * split + sp[None, :]  # [R, SPLIT], summed in chunk order
        bests = tl.load(race_f_ptr + parts, mask=pm, other=float("-inf"), volatile=True)
        ids = tl.load(race_i_ptr + parts, mask=pm, other=2**31 - 1, volatile=True)
        n_above_parts = tl.load(round_cnt_ptr + parts * (NB + 1) + NB, mask=pm, other=0, volatile=True)
        mass_above_parts = tl.load(round_mass_ptr + parts * (NB + 1) + NB, mask=pm, other=0.0, volatile=True)
        n_list = tl.load(counter_ptr + C_GATHER_LIST * B + rows, mask=last, other=0, volatile=True)
        top_k = tl.load(st + S_K, mask=last, other=0)
        resolves = tl.load(st + S_FOR, mask=last, other=0)
        top = tl.load(st + S_TOP, mask=last, other=0)
        top_p = tl.load(sf + F_TOP_P, mask=last, other=1.0)
        target = tl.load(sf + F_TARGET, mask=last, other=0.0)
        race_above = tl.max(bests, 1)
        fin = last & (n_list <= CAP)  # always, by the decision that sent the row here
        token, cut, key_k, deferred, target = _finish_from_list(
            buf_val_ptr, buf_idx_ptr, rows, fin, n_list, m, c, top_k, top_p, min_p,
            (resolves == PHASE_TOP_K) & (top_k > 0), top_p < 1.0, target, tl.sum(n_above_parts, 1).to(tl.int64),
            tl.sum(mass_above_parts, 1), race_above,
            tl.min(tl.where(bests == race_above[:, None], ids, 2**31 - 1), 1), seed, step, CAP, LOG_CAP,
        )  # fmt: skip
        deferred &= fin
        tl.store(out_ptr + rows, tl.where(fin, token, INVALID), mask=last & ~deferred)
        tl.store(st + S_PHASE, tl.where(deferred, PHASE_TOP_P, PHASE_NONE).to(tl.int64), mask=last)
        tl.store(st + S_CUT, tl.where(deferred, key_k, cut).to(tl.int64), mask=last)
        tl.store(st + S_LO, hi.to(tl.int64) + 1, mask=deferred)  # n_above > 0: hi < max
        tl.store(st + S_HI, top, mask=deferred)
        tl.store(sf + F_TARGET, target, mask=deferred)
        tl.store(counter_ptr + C_GATHER_LIST * B + rows, tl.zeros_like(rows), mask=deferred)  # the next gather's
        tl.debug_barrier()  # the decision's stores before its release
        tl.atomic_add(decided_ptr + rows, 1, mask=last, sem="release", scope="gpu")


@triton.jit
def _round_step(base, rows, busy, phase, chunk, chunk_blocks, V, st, sf, round_cnt_ptr, round_mass_ptr,
                arrived_ptr, decided_ptr, split, BLOCK: tl.constexpr, NB: tl.constexpr, CAP: tl.constexpr,
                SPLIT: tl.constexpr):  # fmt: skip
    """One round of the radix selection for rows `busy` (a top-k or top-p phase). The row's bracket [lo, hi] of
    order-preserving int32 keys holds the cut (the largest key t with count(key >= t) >= k, or mass(key >= t) >=
    target); NB thresholds t_j = lo + j * (hi - lo + 1) // NB split it. Every program counts (top-k) or weighs
    (top-p) key >= t_j over its chunk, and counts key > hi -> partials [B, split, NB + 1]; the row's last program
    to arrive sums them in chunk order, narrows the bracket to [t_j, t_{j+1} - 1] of the largest t_j that passes
    (width w -> ceil(w / NB): a phase ends, lo == hi, within ceil(32 / log2(NB)) rounds; a bracket of <= CAP
    tokens ends it earlier, in a gather, _gather_step) and counts the decision at decided_ptr (the other programs
    wait for it before their next step). A top-p phase after top-k starts with lo at top-k's cut:
    its first round's mass at t_0 = lo is the mass of the top-k set, and its target is top_p times that (the same
    sums as every later round's); top-p alone starts in the bracket launch 2 found, with the target top_p times
    the row's sum of p."""
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
    cnt_slots = tl.zeros((rows.shape[0], BLOCK, NB), tl.int32)  # per slot: one cross-thread reduction after the loop
    mass_slots = tl.zeros((rows.shape[0], BLOCK, NB), tl.float32)
    cnt_above = tl.zeros((rows.shape[0], BLOCK), tl.int32)  # key > hi: at or above every threshold
    mass_above = tl.zeros((rows.shape[0], BLOCK), tl.float32)
    start, end = _chunk_span(chunk, chunk_blocks, V, BLOCK)
    x_next = _load_block(base, start, end, busy, BLOCK)
    for off in range(start, end, BLOCK):
        x, x_next, cols, msk = _next_block(base, x_next, off, end, busy, BLOCK)  # -0.0 as +0.0: every key
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
    part = (rows * split + chunk) * (NB + 1)
    tl.store(round_cnt_ptr + part[:, None] + j[None, :], cnt, mask=busy[:, None])
    tl.store(round_mass_ptr + part[:, None] + j[None, :], mass, mask=busy[:, None])
    tl.store(round_cnt_ptr + part + NB, tl.sum(cnt_above, 1), mask=busy)
    tl.debug_barrier()  # every thread's stores before the release below
    arrived = tl.atomic_add(arrived_ptr + rows, 1, mask=busy, sem="acq_rel", scope="gpu")
    last = busy & (arrived == split - 1)
    if tl.max(last.to(tl.int32)) > 0:
        sp = tl.arange(0, SPLIT)
        pm = last[:, None] & (sp < split)[None, :]
        parts = (rows[:, None] * split + sp[None, :]) * (NB + 1)  # [R, SPLIT]
        pm3 = pm[:, :, None] & (j >= 0)[None, None, :]
        cnt = tl.sum(tl.load(round_cnt_ptr + parts[:, :, None] + j[None, None, :], mask=pm3, other=0, volatile=True),
                     1)  # [R, NB], chunk order  # fmt: skip
        mass = tl.sum(tl.load(round_mass_ptr + parts[:, :, None] + j[None, None, :], mask=pm3, other=0.0,
                              volatile=True), 1)  # fmt: skip
        n_top = tl.sum(tl.load(round_cnt_ptr + parts + NB, mask=pm, other=0, volatile=True), 1)  # keys > hi
        in_k = phase == PHASE_TOP_K
        k = tl.load(st + S_K, mask=last, other=0)
        top_p = tl.load(sf + F_TOP_P, mask=last, other=1.0)
        target = tl.load(sf + F_TARGET, mask=last, other=0.0)
        # a top-p phase's first round after top-k: the mass at t_0 = lo (top-k's cut) is the top-k set's
        target = tl.where((target < 0) & ~in_k, top_p * tl.sum(tl.where(j[None, :] == 0, mass, 0.0), 1), target)
        ok = tl.where(in_k[:, None], cnt.to(tl.int64) >= k[:, None], mass >= target[:, None])  # true, then false
        j_cut = tl.maximum(tl.sum(ok.to(tl.int32), 1) - 1, 0)
        new_lo = tl.sum(tl.where(j[None, :] == j_cut[:, None], thr, 0), 1)
        next_thr = tl.sum(tl.where(j[None, :] == j_cut[:, None] + 1, thr, 0), 1)
        new_hi = tl.maximum(tl.where(j_cut + 1 < NB, next_thr - 1, hi), new_lo)
        n_in = tl.sum(tl.where(j[None, :] == j_cut[:, None], cnt, 0), 1) - tl.where(
            j_cut + 1 < NB, tl.sum(tl.where(j[None, :] == j_cut[:, None] + 1, cnt, 0), 1), n_top
        )  # tokens in the new bracket
        done = new_hi == new_lo
        gather = ~done & (n_in <= CAP)  # the list holds the bracket: one pass finishes the phase
        to_p = in_k & done & (top_p < 1.0)  # top-k done: top-p next, over the top-k set, else the race
        next_phase = tl.where(done, tl.where(to_p, PHASE_TOP_P, PHASE_RACE), tl.where(gather, PHASE_GATHER, phase))
        tl.store(st + S_PHASE, next_phase, mask=last)
        tl.store(st + S_FOR, phase, mask=last & gather)
        tl.store(st + S_LO, new_lo, mask=last)
        tl.store(st + S_HI, tl.where(to_p, tl.load(st + S_TOP, mask=last, other=0), new_hi), mask=last)
        tl.store(st + S_CUT, new_lo, mask=last)
        tl.store(sf + F_TARGET, tl.where(to_p, -1.0, target), mask=last)
        rounds_at = tl.where(in_k, S_ROUNDS_K, S_ROUNDS_P)
        tl.store(st + rounds_at, tl.load(st + rounds_at, mask=last, other=0) + 1, mask=last)
        tl.debug_barrier()  # the decision's stores before its release
        tl.atomic_add(decided_ptr + rows, 1, mask=last, sem="release", scope="gpu")


@triton.jit
def _race_step(base, rows, racing, chunk, chunk_blocks, V, seed_ptr, seed_stride, step_ptr, step_stride, st, sf,
               race_f_ptr, race_i_ptr, arrived_ptr, out_ptr, split, BLOCK: tl.constexpr,
               SPLIT: tl.constexpr):  # fmt: skip
    """Rows `racing` (PHASE_RACE: the cut is known, from the rounds or none): the exponential race over the kept x
    of this chunk (key >= cut, p >= min_p) -> partials; the row's last program to arrive takes the best (lowest
    index on ties, chunks being in token order) and writes the token."""
    cut = tl.load(st + S_CUT, mask=racing, other=0).to(tl.int32)
    m = tl.load(sf + F_M, mask=racing, other=0.0)
    c = tl.load(sf + F_C, mask=racing, other=0.0)
    min_p = tl.load(sf + F_MIN_P, mask=racing, other=0.0)
    seed = tl.load(seed_ptr + rows * seed_stride, mask=racing, other=0).to(tl.int64)
    step = tl.load(step_ptr + rows * step_stride, mask=racing, other=0).to(tl.int64)
    best = tl.full((rows.shape[0], BLOCK), float("-inf"), tl.float32)
    best_idx = tl.zeros((rows.shape[0], BLOCK), tl.int32) + V
    start, end = _chunk_span(chunk, chunk_blocks, V, BLOCK)
    x_next = _load_block(base, start, end, racing, BLOCK)
    for off in range(start, end, BLOCK):
        x, x_next, cols, msk = _next_block(base, x_next, off, end, racing, BLOCK)
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
    arrived = tl.atomic_add(arrived_ptr + rows, 1, mask=racing, sem="acq_rel", scope="gpu")
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
        tl.store(st + S_PHASE, tl.zeros_like(rows).to(tl.int64) + PHASE_NONE, mask=last)


SPIN_LIMIT = tl.constexpr(1 << 20)  # acquire polls per wait (~1 s): a lost program gives INVALID_TOKEN, not a hang


@triton.jit
def _await_counts(count_ptr, waiting, target):
    """Spins until the counters at count_ptr (one per row: a row's round decisions, or the grid barrier's
    arrivals) of the rows `waiting` reach `target` -> the rows whose count came (all of them, unless SPIN_LIMIT
    ran out: those rows stay INVALID_TOKEN)."""
    seen = tl.atomic_add(count_ptr, 0, mask=waiting, sem="acquire", scope="gpu")
    spins = 0
    while (tl.min(tl.where(waiting, seen, target)) < target) & (spins < SPIN_LIMIT):
        seen = tl.atomic_add(count_ptr, 0, mask=waiting, sem="acquire", scope="gpu")
        spins += 1
    tl.debug_barrier()  # no thread reads what the count releases before the acquire
    return waiting & (seen >= target)


@triton.jit
def _resolve_step(base, rows, phase, s, chunk, chunk_blocks, V, B, seed_ptr, seed_stride, step_ptr, step_stride, st,
                  sf, buf_val_ptr, buf_idx_ptr, round_cnt_ptr, round_mass_ptr, race_f_ptr, race_i_ptr, counter_ptr,
                  out_ptr, split, BLOCK: tl.constexpr, BLOCK_R: tl.constexpr, NB: tl.constexpr, CAP: tl.constexpr,
                  LOG_CAP: tl.constexpr, SPLIT: tl.constexpr):  # fmt: skip
    """Step s of launch 3 for rows in `phase`: the pass each open row's phase asks for -> the rows whose step ends in
    a decision (a round or a gather: they may go on)."""
    gathering = phase == PHASE_GATHER
    if tl.max(gathering.to(tl.int32)) > 0:
        _gather_step(base, rows, gathering, chunk, chunk_blocks, V, B, seed_ptr, seed_stride, step_ptr, step_stride,
                     st, sf, buf_val_ptr, buf_idx_ptr, round_cnt_ptr, round_mass_ptr, race_f_ptr, race_i_ptr,
                     counter_ptr + (N_COUNTERS + s) * B, counter_ptr + C_DECIDED * B, counter_ptr, out_ptr, split,
                     BLOCK, NB, CAP, LOG_CAP, SPLIT)  # fmt: skip
    rounds = (phase == PHASE_TOP_K) | (phase == PHASE_TOP_P)
    if tl.max(rounds.to(tl.int32)) > 0:
        _round_step(base, rows, rounds, phase, chunk, chunk_blocks * (BLOCK // BLOCK_R), V, st, sf, round_cnt_ptr,
                    round_mass_ptr, counter_ptr + (N_COUNTERS + s) * B, counter_ptr + C_DECIDED * B, split, BLOCK_R,
                    NB, CAP, SPLIT)  # fmt: skip
    racing = phase == PHASE_RACE
    if tl.max(racing.to(tl.int32)) > 0:
        _race_step(base, rows, racing, chunk, chunk_blocks, V, seed_ptr, seed_stride, step_ptr, step_stride, st, sf,
                   race_f_ptr, race_i_ptr, counter_ptr + C_RACE_ARRIVED * B, out_ptr, split, BLOCK, SPLIT)  # fmt: skip
    return rounds | gathering


@fast_launch
@triton.jit(do_not_specialize=["B", "seed_stride", "step_stride", "split", "chunk_blocks", "first_step", "steps"])
def _resolve_kernel(
    logits_ptr, stride_row, B, V, seed_ptr, seed_stride, step_ptr, step_stride, state_i_ptr, state_f_ptr,
    buf_val_ptr, buf_idx_ptr, round_cnt_ptr, round_mass_ptr, race_f_ptr, race_i_ptr, counter_ptr, out_ptr, split,
    chunk_blocks, first_step, steps, R: tl.constexpr, BLOCK: tl.constexpr, BLOCK_R: tl.constexpr, NB: tl.constexpr,
    CAP: tl.constexpr, LOG_CAP: tl.constexpr, SPLIT: tl.constexpr, PERSISTENT: tl.constexpr, GRID: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """3. Steps first_step .. first_step + steps - 1 for the rows launch 2 left open (the others exit at once):
    each step is one pass over the chunk for every open row, the one its phase asks for: the gather (the row is
    finished, or goes on to top-p's rounds), a radix round, or the race (finished). A row in the rounds or a
    gather takes its next step once the step's decision is made: PERSISTENT, the row's programs wait for it here
    (all of them are resident: see launch()); GRID, a grid of resident programs runs every step over all (row,
    chunk) items, a barrier of the whole grid between steps (_grid_steps); else each launch is one step (steps =
    1, the host launches the next: the CPU interpreter, which runs one program after another)."""
    allow_dependents(PDL)
    if GRID:
        wait_for_producers(PDL)
        _grid_steps(logits_ptr, stride_row, B, V, seed_ptr, seed_stride, step_ptr, step_stride, state_i_ptr,
                    state_f_ptr, buf_val_ptr, buf_idx_ptr, round_cnt_ptr, round_mass_ptr, race_f_ptr, race_i_ptr,
                    counter_ptr, out_ptr, split, chunk_blocks, steps, R, BLOCK, BLOCK_R, NB, CAP, LOG_CAP,
                    SPLIT)  # fmt: skip
    else:  # (a return inside a constexpr if does not compile for the GPU)
        rows = tl.program_id(0) * R + tl.arange(0, R)
        chunk = tl.program_id(1)
        st = state_i_ptr + rows * N_STATE
        sf = state_f_ptr + rows * N_STATE
        base = logits_ptr + rows[:, None].to(tl.int64) * stride_row
        wait_for_producers(PDL)
        phase = tl.load(st + S_PHASE, mask=rows < B, other=0)
        if PERSISTENT:
            s = first_step
            while (s < first_step + steps) & (tl.max((phase != PHASE_NONE).to(tl.int32)) > 0):
                rounds = _resolve_step(base, rows, phase, s, chunk, chunk_blocks, V, B, seed_ptr, seed_stride, step_ptr,
                                       step_stride, st, sf, buf_val_ptr, buf_idx_ptr, round_cnt_ptr, round_mass_ptr,
                                       race_f_ptr, race_i_ptr, counter_ptr, out_ptr, split, BLOCK, BLOCK_R, NB, CAP,
                                       LOG_CAP, SPLIT)  # fmt: skip
                # a row in the rounds or a gather since step 0 has had s + 1 decisions once this step's is made
                rounds = _await_counts(counter_ptr + C_DECIDED * B + rows, rounds, s + 1)
                # a raced row is finished; a row in the rounds or a gather goes on in the phase its decision set
                phase = tl.where(rounds, tl.load(st + S_PHASE, mask=rounds, other=0, volatile=True), PHASE_NONE)
                s += 1
        elif tl.max((phase != PHASE_NONE).to(tl.int32)) > 0:  # one step, without the loop: 124 registers at 4 bins
            # against 228 (sm_90 AOT), so more idle programs of a large batch (this path) run per SM; the test above
            # lets them exit next to the phase load (sm_90: one predicated EXIT) instead of after three branches
            _resolve_step(base, rows, phase, first_step, chunk, chunk_blocks, V, B, seed_ptr, seed_stride, step_ptr,
                          step_stride, st, sf, buf_val_ptr, buf_idx_ptr, round_cnt_ptr, round_mass_ptr, race_f_ptr,
                          race_i_ptr, counter_ptr, out_ptr, split, BLOCK, BLOCK_R, NB, CAP, LOG_CAP, SPLIT)  # fmt: skip


@triton.jit
def _grid_steps(logits_ptr, stride_row, B, V, seed_ptr, seed_stride, step_ptr, step_stride, state_i_ptr, state_f_ptr,
                buf_val_ptr, buf_idx_ptr, round_cnt_ptr, round_mass_ptr, race_f_ptr, race_i_ptr, counter_ptr, out_ptr,
                split, chunk_blocks, steps, R: tl.constexpr, BLOCK: tl.constexpr, BLOCK_R: tl.constexpr,
                NB: tl.constexpr, CAP: tl.constexpr, LOG_CAP: tl.constexpr, SPLIT: tl.constexpr):  # fmt: skip
    """Launch 3 as one grid of resident programs (at most one per SM: launch()): nothing to do when launch 2 left no
    row open (C_OPEN, one load); else step after step, every program takes (row block, chunk) items pid, pid + P,
    ... and runs the step each open row's phase asks for; a barrier of the whole grid orders one step's decisions
    before the next step's reads. The grid stops after a step in which no program worked (every row finished in
    the one before): the count of programs that worked is final once all have arrived, so every program reads the
    same and stops together. A barrier that SPIN_LIMIT polls do not complete (a program not resident) stops it:
    those rows stay INVALID_TOKEN."""
    P = tl.num_programs(0)
    n_items = tl.cdiv(B, R) * split
    arrive_ptr = counter_ptr + (N_COUNTERS + steps) * B
    go = tl.atomic_add(counter_ptr + C_OPEN * B, 0, sem="acquire", scope="gpu")
    s = 0
    while (s < steps) & (go > 0):
        worked = 0  # items this program ran a step on
        for item in range(tl.program_id(0), n_items, P):
            rows = (item // split) * R + tl.arange(0, R)
            chunk = item % split
            st = state_i_ptr + rows * N_STATE
            phase = tl.load(st + S_PHASE, mask=rows < B, other=0, volatile=True)
            if tl.max((phase != PHASE_NONE).to(tl.int32)) > 0:
                _resolve_step(logits_ptr + rows[:, None].to(tl.int64) * stride_row, rows, phase, s, chunk,
                              chunk_blocks, V, B, seed_ptr, seed_stride, step_ptr, step_stride, st,
                              state_f_ptr + rows * N_STATE, buf_val_ptr, buf_idx_ptr, round_cnt_ptr, round_mass_ptr,
                              race_f_ptr, race_i_ptr, counter_ptr, out_ptr, split, BLOCK, BLOCK_R, NB, CAP, LOG_CAP,
                              SPLIT)  # fmt: skip
                worked += 1
        worked_ptr = counter_ptr + (N_COUNTERS + steps + 1 + s) * B
        if worked > 0:
            tl.atomic_add(worked_ptr, 1, sem="relaxed", scope="gpu")
        tl.debug_barrier()  # every thread's stores before the release below
        tl.atomic_add(arrive_ptr, 1, sem="acq_rel", scope="gpu")
        one = tl.arange(0, 1)  # the barrier as a row of _await_counts
        passed = tl.max(_await_counts(arrive_ptr + one * 0, one == 0, P * (s + 1)).to(tl.int32)) > 0
        go = tl.where(passed, tl.atomic_add(worked_ptr, 0, sem="acquire", scope="gpu"), 0)
        s += 1


def resolve_plan(blocks: int, split: int, sms: int) -> tuple[bool, int]:
    """(launch 3 waits inside, its programs per row) for `blocks` row blocks of `split` chunks on `sms` SMs (0:
    the CPU interpreter): waiting needs the whole grid resident, one program per SM, with >= MIN_SPLIT_R programs
    per row (or all `split` of them). A launch per step has about STEP_PROGRAMS_PER_SM programs per SM (at most
    `split` per row): a step that no row needs costs its grid's launch (33 such steps with 2,048 programs each took
    163 us at B = 256, profile_sampling at 2afaede), and a round that rows need fills the GPU with that many."""
    if sms == 0:
        return False, split
    split_r = min(split, sms // blocks)
    if split_r >= min(split, MIN_SPLIT_R):  # split >= 1: never 0 programs
        return True, split_r
    return False, max(1, min(split, cdiv(STEP_PROGRAMS_PER_SM * sms, blocks)))


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def rounds_per_phase(bins: int) -> int:
    """Radix rounds that bring any bracket of int32 keys (width <= 2^32) to one key with `bins` thresholds."""
    width, rounds = 2**32, 0
    while width > 1:
        width, rounds = -(-width // bins), rounds + 1
    return rounds


def tiles_pay_off(B: int, split: int, sms: int) -> bool:
    """Whether launch 2a finishes top-k rows from tiles (one program a row): not when launch 2b's grid (B * split
    programs, one row each) fits in one wave on `sms` SMs (0: the CPU interpreter, always). There every row's pass
    is spread over its chunks' programs at once and beats the one program's chain: B = 1 top-k 50 + top-p 0.9,
    23.8 / 22.4 us (llm / ties) against 24.5 / 32.0 from tiles (results/ab_sampling.json at a034b2f). From two
    waves up the tiles win: B = 256, 158 us against 650 (a9bf946's pass)."""
    return sms == 0 or B * split > sms


def group_count(split: int, block: int) -> int:
    """Group maxima per program of the stats launch: a power of 2, GROUPS // split of them (at least 1), at most
    a block's slots (a group is a set of slots)."""
    return min(1 << (max(1, GROUPS // split).bit_length() - 1), block)


def launch(logits, temperature, top_k, top_p, min_p, seed, step, block=None, cap=None, nt=8, rows=None, split=None,
           bins=None, rounds=None, state=None, persistent=None, tiles=None, grid_steps=None, tile_warps=4,
           count_warps=4):  # fmt: skip
    """Run the kernels on [B] parameter tensors (any stride, e.g. expanded scalars) -> int64 [B].

    block / cap (the row's list: the finish sorts it in registers) / nt (thresholds counted in launch 2, a power
    of 2 >= 4; 8: at B = 256 top-k 50 + top-p 0.9 825 us against 1,072 with 16 and the same tokens on every
    shape, while 4 sent zipf rows to the radix rounds, 5.4 ms: results/probe_sampling_count.json) / rows (rows per
    program) / split (programs per row, <= SPLIT_MAX) / bins (radix thresholds per round, a power of 2; default on
    the GPU 16 below B = 64 and 4 from it, 16 in the CPU interpreter) are tuning knobs; tests shrink cap to send
    rows to the gather and the radix rounds and set split on the CPU. tile_warps: the warps of launch 2a's
    programs (one row's chain each; 4: two programs per SM, B = 256's 256 rows in one wave, 158 -> 149 us against
    8 warps, results/ab_sampling.json at a034b2f). count_warps: the warps of launch 2b's programs (a power of 2 <=
    8; 8 // count_warps programs per SM, blocks of 128 * count_warps tokens). 4: B = 1 top-k 50 + top-p 0.9 24.2
    -> 19.7 us on llm rows, 22.7 -> 17.1 on ties, B = 256 147.2 -> 144.8 against 8 (the B = 1 finish, one
    program's sort and sums, runs over fewer warps); 2: 36.3 us at B = 1 (results/ab_sampling_warps.json at
    ed7f8c4, where w4b512 is this default).
    rounds (default: the bound, 2 * rounds_per_phase(bins)), state (an int64 [B, N_STATE] tensor that receives
    the rows' state: phase, cut, rounds per phase) and persistent (launch 3 as one launch that waits inside, or one
    per step, instead of resolve_plan's choice; waiting in the CPU interpreter needs split = 1) are test hooks.
    tiles (whether sampled top-k rows with k up to their ~GROUPS group maxima are finished from tiles by one
    program; default: tiles_pay_off; False: every row takes the gather + count pass) is both. grid_steps: launch 3
    as one grid of at most one program per SM that runs every step with a grid barrier between them (_grid_steps;
    one program in the CPU interpreter). Default (None): on the GPU wherever it cannot wait inside (resolve_plan),
    in place of B >= 17's 33 one-step launches (B = 256 top-k 50 + top-p 0.9: 267 -> 219 us when no row needs
    them, results/ab_sampling.json at d362d0f); a launch per step in the CPU interpreter. False: resolve_plan's
    launches (a test hook and the A/B's other side)."""
    B, V = logits.shape
    out = torch.empty(B, dtype=torch.int64, device=logits.device)
    if B == 0:
        return out
    assert logits.stride(1) == 1, "logits rows must be contiguous"
    assert nt >= 4 and nt & (nt - 1) == 0, "nt must be a power of 2 >= 4"
    assert count_warps in (1, 2, 4, 8), "count_warps must be 1, 2, 4 or 8"
    if bins is None:  # H200, results/bench_sampling_1b7448f.json: 64 bins made a round 5-7x slower than 16 ([64, 64]
        # threshold tile per block); 4 bins (more, streaming rounds) win at B = 256, 16 (fewer launches) at B = 1
        bins = (16 if B < 64 else 4) if logits.is_cuda else 16
    assert bins >= 2 and bins & (bins - 1) == 0, "bins must be a power of 2"
    if block is None:
        block = min(2048, next_power_of_2(V))
    block_c = min(block, 128 * count_warps)  # launch 2b keeps more per slot: 4 tokens a thread
    block_r = min(block, max(16, 4096 // bins))  # [R, BLOCK, bins] slots per radix program: 16 per thread
    if cap is None:  # the list never needs more than V slots
        cap = max(2, min(1024, next_power_of_2(V)))
    assert cap >= 2 and cap & (cap - 1) == 0, "cap must be a power of 2 (the finish's sorting network)"
    log_cap = cap.bit_length() - 1
    if split is None and logits.is_cuda:  # spread every pass over ~2048 programs (bytes in flight), chunks of at
        split = min(SPLIT_MAX, cdiv(2048, B), cdiv(V, block))  # least a block (one row per program on the GPU)
    split = 1 if split is None else split
    assert 1 <= split <= SPLIT_MAX
    sms = _sm_count(logits.device) if logits.is_cuda else 0  # 0: the CPU interpreter
    if tiles is None:
        tiles = tiles_pay_off(B, split, sms)
    n_groups = group_count(split, block)
    chunk_blocks = cdiv(cdiv(V, split), block)  # chunk length in blocks (the radix rounds: block_r)
    tile_len = min(TILE_TOKENS, block_c)  # a block holds whole tiles
    n_tiles = cdiv(V, tile_len)
    if rows is None:  # one row per program on the GPU; batches of rows in the CPU interpreter
        # the largest [R, ., .] tile of the kernels, per row
        tile = max(block * nt, cap * 4, block_r * bins, nt * 32, (next_power_of_2(split) * n_groups) ** 2,
                   TILES_PER_LOAD * tile_len, next_power_of_2(n_tiles))  # fmt: skip
        rows = 1 if logits.is_cuda else min(next_power_of_2(B), max(1, 2**20 // tile))
    if rounds is None:
        rounds = 2 * rounds_per_phase(bins)  # top-k then top-p
    device = logits.device
    part_f = torch.empty(B, split, N_STATS_F.value, dtype=torch.float32, device=device)
    part_i = torch.empty(B, split, N_STATS_I.value, dtype=torch.int32, device=device)
    part_g = torch.empty(B, split, n_groups, dtype=torch.float32, device=device)
    part_t = torch.empty(B, n_tiles, dtype=torch.float32, device=device)
    tile_list = torch.empty(B, n_tiles, dtype=torch.int32, device=device)
    search_f = torch.empty(B, split, nt + 1, dtype=torch.float32, device=device)
    search_i = torch.empty(B, split, nt + 1, dtype=torch.int32, device=device)
    buf_val = torch.empty(B, cap, dtype=torch.float32, device=device)
    buf_idx = torch.empty(B, cap, dtype=torch.int32, device=device)
    if state is None:
        state = torch.empty(B, N_STATE.value, dtype=torch.int64, device=device)
    state_f = torch.empty(B, N_STATE.value, dtype=torch.float32, device=device)
    round_cnt = torch.empty(B, split, bins + 1, dtype=torch.int32, device=device)  # + keys above the bracket
    round_mass = torch.empty(B, split, bins + 1, dtype=torch.float32, device=device)
    race_f = torch.empty(B, split, dtype=torch.float32, device=device)
    race_i = torch.empty(B, split, dtype=torch.int32, device=device)
    steps = rounds + 1  # the rounds, then the race
    counters = torch.empty(N_COUNTERS.value + 2 * steps + 1, B, dtype=torch.int32, device=device)  # zeroed by launch 1
    blocks = cdiv(B, rows)
    grid = (blocks, split)
    on = pdl(logits)
    opts = {"num_warps": 8 if logits.is_cuda else 1, "PDL": on, "launch_pdl": on}
    SPLIT = next_power_of_2(split)
    _stats_kernel[grid](
        logits, logits.stride(0), B, V, temperature, temperature.stride(0), top_k, top_k.stride(0), part_f, part_i,
        part_g, part_t, n_tiles,
        counters, counters.shape[0], split, chunk_blocks, R=rows, BLOCK=block, G=n_groups,
        TILE=tile_len if tiles else 0, **opts,  # no tile maxima (and their store's barriers) where no row reads them
    )  # fmt: skip
    params = [x for t in (temperature, top_k, top_p, min_p, seed, step) for x in (t, t.stride(0))]
    if tiles:
        _tiles_kernel[(blocks,)](
            logits, logits.stride(0), B, V, *params, part_f, part_i, part_g, part_t, n_tiles, tile_list, buf_val,
            buf_idx, counters, out, state, state_f, split, R=rows, CAP=cap, LOG_CAP=log_cap, SPLIT=SPLIT, G=n_groups,
            TILE=tile_len, N_TILES=next_power_of_2(n_tiles), NS=TILES_PER_LOAD,
            **opts | {"num_warps": tile_warps if logits.is_cuda else 1},
        )  # fmt: skip
    items = blocks * split
    # 8 warps' worth of programs per SM (what its registers allow); the interpreter runs 2 items a program (the
    # item loop is tested there)
    item_programs = min(items, sms * (8 // count_warps)) if logits.is_cuda else cdiv(items, 2)
    _gather_count_kernel[(item_programs,)](
        logits, logits.stride(0), B, V, *params, part_f, part_i, int(tiles), search_f, search_i, buf_val, buf_idx,
        counters, out, state, state_f, split, chunk_blocks * (block // block_c), R=rows, BLOCK=block_c, CAP=cap,
        LOG_CAP=log_cap, NT=nt, LOG_NT=nt.bit_length() - 1, SPLIT=SPLIT, G=n_groups,
        ITEMS=next_power_of_2(cdiv(items, item_programs)), **opts | {"num_warps": count_warps if logits.is_cuda else 1},
    )  # fmt: skip
    # Launch 3 waits inside for its rows' round decisions when its whole grid is resident at once (one program
    # per SM always fits), with `split_r` >= MIN_SPLIT_R programs per row: then a waiting program's siblings
    # are running. Else, on the GPU, one grid of at most one program per SM with a grid barrier between steps;
    # in the interpreter (which runs one program after another) one launch per step.
    waits, split_r = resolve_plan(blocks, split, sms)
    if grid_steps is None:  # the GPU's default where launch 3 cannot wait inside (B >= 17 on the H200)
        grid_steps = logits.is_cuda and persistent is None and not waits
    if grid_steps:  # launch 2b's items; resident: one program per SM at most
        programs = min(items, sms) if logits.is_cuda else 1
        _resolve_kernel[(programs, 1)](
            logits, logits.stride(0), B, V, seed, seed.stride(0), step, step.stride(0), state, state_f, buf_val,
            buf_idx, round_cnt, round_mass, race_f, race_i, counters, out, split, chunk_blocks, 0, steps, R=rows,
            BLOCK=block, BLOCK_R=block_r, NB=bins, CAP=cap, LOG_CAP=log_cap, SPLIT=SPLIT, PERSISTENT=False, GRID=True,
            **opts,
        )  # fmt: skip
        return out
    if persistent is None:
        persistent = waits
    else:  # the interpreter runs a program to its end before the next: a wait for a sibling would never end
        assert logits.is_cuda or split == 1 or not persistent, "waiting inside on the CPU needs split = 1"
        split_r = split
    chunk_r = cdiv(cdiv(V, split_r), block)
    per_launch = steps if persistent else 1
    for first in range(0, steps, per_launch):
        _resolve_kernel[(blocks, split_r)](
            logits, logits.stride(0), B, V, seed, seed.stride(0), step, step.stride(0), state, state_f, buf_val,
            buf_idx, round_cnt, round_mass, race_f, race_i, counters, out, split_r, chunk_r, first, per_launch,
            R=rows, BLOCK=block, BLOCK_R=block_r, NB=bins, CAP=cap, LOG_CAP=log_cap,
            SPLIT=next_power_of_2(split_r), PERSISTENT=persistent, GRID=False, **opts,
        )  # fmt: skip
    return out


# one counter per row: the row's last chunk to arrive combines the row's chunks (invariants: ArrivalCounters)
@triton.jit
def _argmax_step(x, cols, best, best_idx):
    """A block of a running argmax per slot -> (best, best_idx): strict, so a slot keeps its earliest index on ties
    and a NaN never moves it."""
    up = x > best
    best_idx = tl.where(up, cols, best_idx)  # before best: the order the greedy kernel's SASS was timed with
    return tl.where(up, x, best), best_idx


@triton.jit
def _lowest_argmax(best, best_idx, none):
    """The slots' max and its lowest index (`none` where no slot holds it: a NaN max)."""
    m = tl.max(best, 0)
    return m, tl.min(tl.where(best == m, best_idx, none), 0)


@triton.jit
def _combine_chunk_maxima(max_ptrs, idx_ptrs, mask):
    """A row's last program: its chunks' (max, lowest index) partials -> (any NaN, the max of the others, its lowest
    index). Read past L1 (.cg): other programs wrote them."""
    ms = tl.load(max_ptrs, mask=mask, other=float("-inf"), cache_modifier=".cg")
    idxs = tl.load(idx_ptrs, mask=mask, other=2**31 - 1, cache_modifier=".cg")
    has_nan = tl.max((ms != ms).to(tl.int32), 0) > 0
    m, idx = _lowest_argmax(tl.where(ms != ms, float("-inf"), ms), idxs, 2**31 - 1)
    return has_nan, m, idx


greedy_arrivals = ArrivalCounters()
# each chunk's maximum and its index, written before the row's last chunk reads them (invariants: Workspaces)
greedy_workspace = Workspaces()


@fast_launch
@triton.jit(do_not_specialize=["B", "split", "chunk_blocks"])
def _greedy_kernel(logits_ptr, stride_row, B, V, part_max_ptr, part_idx_ptr, arrivals_ptr, out_ptr, split, chunk_blocks,
                   BLOCK: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """Greedy, program (chunk, row): the chunk's max (NaN if it holds a NaN) and its lowest index; the row's last
    chunk to arrive combines the row's chunks -> the lowest index of the row max, INVALID for a row with a NaN or
    only -inf. (A second launch combined them: 3.2 us of the H200 decode step, profile_decode_loop.) Everything it
    reads is the lm_head's: with PDL only its start overlaps the lm_head's tail."""
    allow_dependents(PDL)
    wait_for_producers(PDL)
    chunk = tl.program_id(0)
    row = tl.program_id(1)
    base = logits_ptr + row.to(tl.int64) * stride_row
    best = tl.full((BLOCK,), float("-inf"), tl.float32)
    best_idx = tl.zeros((BLOCK,), tl.int32) + V
    nan_seen = tl.zeros((BLOCK,), tl.int32)
    start, end = _chunk_span(chunk, chunk_blocks, V, BLOCK)
    for off in range(start, end, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        nan_seen |= (x != x).to(tl.int32)
        best, best_idx = _argmax_step(x, cols, best, best_idx)
    m, idx = _lowest_argmax(best, best_idx, V)
    parts = row * split
    tl.store(part_max_ptr + parts + chunk, tl.where(tl.max(nan_seen, 0) > 0, float("nan"), m))
    tl.store(part_idx_ptr + parts + chunk, idx)
    # every thread's stores before the release, every read of the others' partials after the acquire
    tl.debug_barrier()
    arrivals = arrivals_ptr + row
    if tl.atomic_add(arrivals, 1, sem="acq_rel", scope="gpu") == split - 1:
        sp = tl.arange(0, SPLIT)
        has_nan, m, idx = _combine_chunk_maxima(part_max_ptr + parts + sp, part_idx_ptr + parts + sp, sp < split)
        tl.store(out_ptr + row, tl.where(has_nan | (m == float("-inf")), INVALID, idx.to(tl.int64)))
        tl.store(arrivals, 0)


def argmax_chunks(B: int, V: int, cuda: bool, block: int | None = None, split: int | None = None) -> tuple:
    """(block, split, chunk length in blocks) of the chunked argmax launches (greedy, shard_candidates): ~8192
    programs in all on the GPU (B = 1 spreads over every SM, and at large B the last wave leaves few SMs idle),
    one chunk a row on the CPU; block / split given are kept (tuning knobs)."""
    block = min(2048, next_power_of_2(V)) if block is None else block
    if split is None:
        split = min(GREEDY_SPLIT_MAX, cdiv(8192, B), cdiv(V, block)) if cuda else 1
    return block, split, cdiv(cdiv(V, split), block)


def launch_greedy(
    logits: torch.Tensor,
    block: int | None = None,
    split: int | None = None,
    out: torch.Tensor | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Argmax per row (lowest index on ties, INVALID_TOKEN for NaN / all -inf rows) in one launch -> int64 [B]
    (into `out` when given: an exported method's planned buffer).

    The row is cut into `split` chunks (~8192 programs in all on the GPU: B = 1 spreads over every SM, and at
    large B the last wave leaves few SMs idle); a row's last chunk combines <= GREEDY_SPLIT_MAX partials.
    block / split / num_warps are tuning knobs."""
    B, V = logits.shape
    out = logits.new_empty(B, dtype=torch.int64) if out is None else out
    if B == 0:
        return out
    block, split, chunk_blocks = argmax_chunks(B, V, logits.is_cuda, block, split)
    if num_warps is None:
        num_warps = 8 if logits.is_cuda else 1
    part_max = greedy_workspace((B, split), torch.float32, logits.device)
    part_idx = greedy_workspace((B, split), torch.int32, logits.device)
    on = pdl(logits)
    _greedy_kernel[(split, B)](
        logits, logits.stride(0), B, V, part_max, part_idx, greedy_arrivals(B, logits.device), out, split,
        chunk_blocks, BLOCK=block, SPLIT=next_power_of_2(split), PDL=on, launch_pdl=on, num_warps=num_warps,
    )  # fmt: skip
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
    """sample() when every row has temperature <= 0, in one launch: logits [B, V] -> int64 [B].

    The caller chooses it from its run config (the parameters are device tensors: the kernel cannot know that
    all rows are greedy without a host sync); `sample` stays right for any mix of greedy and sampled rows."""
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    return greedy_op(logits) if kernels.tracing() else launch_greedy(logits)


# vocab-parallel sampling (qmoe/parallel/sampling.py): a rank's candidates from its slice of the logits
shard_arrivals = ArrivalCounters()
# each chunk's (max, race key) and their indices, written before the row's last chunk reads them (Workspaces)
shard_workspace = Workspaces()


@fast_launch
@triton.jit(do_not_specialize=["B", "start", "split", "chunk_blocks"])
def _shard_candidates_kernel(logits_ptr, stride_row, B, V, start, m_ptr, temperature_ptr, cut_ptr, min_p_ptr,
                             seed_ptr, step_ptr, part_f_ptr, part_i_ptr, arrivals_ptr, cand_ptr, split, chunk_blocks,
                             BLOCK: tl.constexpr, SPLIT: tl.constexpr, RACE: tl.constexpr,
                             PDL: tl.constexpr):  # fmt: skip
    """Program (chunk, row) of a rank's slice [B, V] of the tokens start .. start + V - 1: the chunk's max (NaN if
    it holds a NaN) and its lowest index; with RACE also the best race key among the kept tokens (ordered key >=
    cut[row], x > -inf, p = 2^((x - m[row]) * c) >= min_p[row], m the row's max over every rank) and its lowest
    index, the key `sample`'s race draws for that token (Philox counter (step, global index)). The row's last chunk
    to arrive combines the row's chunks -> out[row] fp64: (max, its global index[, race key, its global index])."""
    allow_dependents(PDL)
    wait_for_producers(PDL)
    chunk = tl.program_id(0)
    row = tl.program_id(1)
    base = logits_ptr + row.to(tl.int64) * stride_row
    best = tl.full((BLOCK,), float("-inf"), tl.float32)
    best_idx = tl.zeros((BLOCK,), tl.int32) + V
    nan_seen = tl.zeros((BLOCK,), tl.int32)
    race_best = tl.full((BLOCK,), float("-inf"), tl.float32)
    race_idx = tl.zeros((BLOCK,), tl.int32) + V
    if RACE:
        m = tl.load(m_ptr + row)
        temperature = tl.load(temperature_ptr + row)
        c = LOG2E / tl.maximum(temperature, 1e-30)  # as `sample` computes it for a sampled row
        cut = tl.load(cut_ptr + row)
        min_p = tl.load(min_p_ptr + row)
        seed = tl.load(seed_ptr + row)
        step = tl.load(step_ptr + row)
    start_col, end = _chunk_span(chunk, chunk_blocks, V, BLOCK)
    for off in range(start_col, end, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32) + 0.0  # -0.0 as +0.0
        nan_seen |= (x != x).to(tl.int32)
        best, best_idx = _argmax_step(x, cols, best, best_idx)
        if RACE:
            keep = (_ordered_key(x) >= cut) & (x > float("-inf")) & (tl.exp2((x - m) * c) >= min_p)
            race = tl.where(keep, _race_key(x, m, c, seed, step, cols + start), float("-inf"))
            race_best, race_idx = _argmax_step(race, cols, race_best, race_idx)
    m_chunk, idx = _lowest_argmax(best, best_idx, V)
    parts = (row * split + chunk) * 2
    tl.store(part_f_ptr + parts, tl.where(tl.max(nan_seen, 0) > 0, float("nan"), m_chunk))
    tl.store(part_i_ptr + parts, idx)
    if RACE:
        r_chunk, r_idx = _lowest_argmax(race_best, race_idx, V)
        tl.store(part_f_ptr + parts + 1, r_chunk)
        tl.store(part_i_ptr + parts + 1, r_idx)
    # every thread's stores before the release, every read of the others' partials after the acquire
    tl.debug_barrier()
    arrivals = arrivals_ptr + row
    if tl.atomic_add(arrivals, 1, sem="acq_rel", scope="gpu") == split - 1:
        sp = tl.arange(0, SPLIT)
        slots = (row * split + sp) * 2
        has_nan, m_row, idx = _combine_chunk_maxima(part_f_ptr + slots, part_i_ptr + slots, sp < split)
        out = cand_ptr + row * (4 if RACE else 2)
        tl.store(out, tl.where(has_nan, float("nan"), m_row).to(tl.float64))
        tl.store(out + 1, (idx + start).to(tl.float64))
        if RACE:
            _, r_row, r_idx = _combine_chunk_maxima(part_f_ptr + slots + 1, part_i_ptr + slots + 1, sp < split)
            tl.store(out + 2, r_row.to(tl.float64))
            tl.store(out + 3, (r_idx + start).to(tl.float64))
        tl.store(arrivals, 0)


def launch_shard_candidates(
    logits: torch.Tensor,
    start: int,
    race: tuple[torch.Tensor, ...] | None = None,
    block: int | None = None,
    split: int | None = None,
) -> torch.Tensor:
    """A vocab-parallel rank's candidates, in one launch: logits [B, V] of the tokens start .. start + V - 1 ->
    fp64 [B, 2] (max, NaN if the row holds one; its lowest global index, start + V for a row of only -inf), or
    with `race` = (m fp32, temperature fp32, cut int32, min_p fp32, seed int64, step int64), each [B] and
    contiguous, fp64 [B, 4]: also the best race key among the kept tokens and its lowest global index (-inf and
    start + V where none is kept). The greedy kernel's chunking (block / split are tuning knobs)."""
    B, V = logits.shape
    out = logits.new_empty((B, 4 if race is not None else 2), dtype=torch.float64)
    if B == 0:
        return out
    block, split, chunk_blocks = argmax_chunks(B, V, logits.is_cuda, block, split)
    part_f = shard_workspace((B, split, 2), torch.float32, logits.device)
    part_i = shard_workspace((B, split, 2), torch.int32, logits.device)
    m, temperature, cut, min_p, seed, step = race if race is not None else (logits,) * 6  # unread without RACE
    on = pdl(logits)
    _shard_candidates_kernel[(split, B)](
        logits, logits.stride(0), B, V, start, m, temperature, cut, min_p, seed, step, part_f, part_i,
        shard_arrivals(B, logits.device), out, split, chunk_blocks, BLOCK=block, SPLIT=next_power_of_2(split),
        RACE=race is not None, PDL=on, launch_pdl=on, num_warps=8 if logits.is_cuda else 1,
    )  # fmt: skip
    return out


@torch.library.custom_op("qmoe::shard_candidates", mutates_args=())
def shard_candidates_op(
    logits: torch.Tensor,
    start: int,
    m: torch.Tensor | None,
    temperature: torch.Tensor | None,
    cut: torch.Tensor | None,
    min_p: torch.Tensor | None,
    seed: torch.Tensor | None,
    step: torch.Tensor | None,
) -> torch.Tensor:
    race = (m, temperature, cut, min_p, seed, step) if m is not None else None
    return launch_shard_candidates(logits, start, race)


@shard_candidates_op.register_fake
def _(logits, start, m, temperature, cut, min_p, seed, step):
    return logits.new_empty((logits.shape[0], 4 if m is not None else 2), dtype=torch.float64)


def shard_candidates(logits: torch.Tensor, start: int, race: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
    """launch_shard_candidates through its custom op where a tracer needs the fake."""
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    if kernels.tracing():
        return shard_candidates_op(logits, start, *(race if race is not None else (None,) * 6))
    return launch_shard_candidates(logits, start, race)


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
    B, device = logits.shape[0], logits.device
    op = sample_op if kernels.tracing() else launch  # the custom op only where a tracer needs its fake
    return op(
        logits if logits.stride(-1) == 1 else logits.contiguous(),  # rows may share storage (stride 0)
        per_row(temperature, torch.float32, B, device),
        per_row(top_k, torch.int64, B, device),
        per_row(top_p, torch.float32, B, device),
        per_row(min_p, torch.float32, B, device),
        per_row(seed, torch.int64, B, device),
        per_row(step, torch.int64, B, device),
    )


def per_row(x, dtype: torch.dtype, B: int, device) -> torch.Tensor:
    """A sampling parameter as a [B] tensor on `device`: a tensor converted and broadcast (stride 0 for a scalar
    one), a Python scalar as a fill kernel (capturable: no host copy)."""
    if isinstance(x, torch.Tensor):
        return x.to(device=device, dtype=dtype).expand(B)
    return torch.full((B,), x, dtype=dtype, device=device)
