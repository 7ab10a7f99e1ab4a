"""Dense projections y = x @ w^T for decode: a Triton skinny GEMM (a GEMV at M = 1), cuBLAS above 64 rows.

Shapes: x [..., K] read as M = x.numel() // K rows, weight [N, K] (rows contiguous), out [..., N] in x's dtype.

At M <= 64 the op reads the weight once and is bound by HBM bandwidth, so the kernel is built to stream it:
  BLOCK_M == 1  (M = 1): a GEMV without tensor cores. Each program owns BLOCK_N weight rows, loads
    [BLOCK_N, BLOCK_K] tiles with 16-byte vectors along K, accumulates elementwise in fp32 registers and reduces
    over K once, after the loop. Small BLOCK_N and wide BLOCK_K give many programs with many bytes in flight.
  PERSISTENT (M = 1, a config key): a few programs per SM stride over row blocks of the whole row each, x read
    and normalised once per program, the next two blocks' weights (and fp8 scales) in flight while one is used.
  BLOCK_M >= 16 (2 <= M <= 64): a tl.dot tile [BLOCK_M, BLOCK_K] x [BLOCK_K, BLOCK_N] with an fp32 accumulator
    (rows past M are masked; the tensor cores have compute to spare at these M).
Split-K (SPLIT_K > 1) gives shapes with few output tiles enough programs: split s writes its fp32 partial to a
workspace [S, M, N], and a second small kernel sums the S partials in split order and rounds once. No atomics
anywhere: the result is a function of the launch config only, bit-reproducible across runs, eager, CUDA-graph
replay and exported programs. The workspace is allocated per call through torch's caching allocator (CUDA
graphs capture it like any other temporary); nothing persists between calls.
Above 64 rows it calls F.linear: prefill is a compute-bound GEMM that cuBLAS already runs near the tensor-core
ceiling, except for an N that is not a multiple of 16 bytes of elements (_prefill_gemm: over the weight's padded rows
where its storage has them, else the dot path's tile).

FP8 weights (`scale` given; kernels/fp8.py: float8_e4m3fn [N, K], fp32 scale [N, ceil(K / 128)]) run the same
kernel with SCALED: the GEMV loads each BLOCK_K step at once and scales the products of each 128-column scale
block by its row scale (the H200 tables: 1024-2048-column steps of 2-4 rows, lm_head 128 x 32); the dot path
(BLOCK_K <= 128) converts the tile to x's dtype (exact: e4m3 fits bf16 and fp16) and scales the step's
[BLOCK_M, BLOCK_N] product by one scale per row; fp32 accumulation either way. Above 64 rows (prefill) with
QMOE_FP8_PREFILL=fp8, FP8 x FP8 in two launches: the pre-pass kernels/fp8.quantize_activations quantizes x once
per (token, 128-wide K group) (the weights' rule, bit-identical to quantize_rows on the GPU) into fp8 q [M, K] and
fp32 scales [M, ceil(K / 128)]; then the dot path with X_FP8 (BLOCK_K = 128, one scale group per step) runs tl.dot
on the two fp8 tiles (fp8 wgmma on sm_90) and scales each step's product by the token's and the row's scales.
(Quantizing in the K loop instead, as before, redid every activation tile N / BLOCK_N times, on CUDA cores that
then outweighed the wgmma: 424 us per 35B projection at 4096 tokens, issue #16.) Its error is the activations'
quantization: ~2^-4 / sqrt(3) relative per element, a few % of a projection (tests bound it).
The default (QMOE_FP8_PREFILL=dequantize) instead dequantizes the weight per call to x's dtype in one Triton pass
(kernels/fp8.dequantize_rows) and runs F.linear: on the H200 at 4096 tokens bf16 cuBLAS took 264.5 / 89.1 / 202.1
/ 87.9 us on the 35B gdn_in / gdn_out / attention qkv / attention out, the FP8 x FP8 tile with its pre-pass 344.9 /
140.6 / 252.8 / 139.5 (results/tune_fp8_prefill.json), and the pass moves 75 MB at the largest (~20 us at copy
bandwidth); its numerics are the bf16 model's on the dequantized weights, no activation rounding.

Launch configs come from configs/<gpu>.json (experiments/tune_gemv.py), keyed by (N, K, dtype, M bucket);
QMOE_GEMV_DEFAULT_CONFIGS=1, an unknown GPU or a missing entry use default_config(). Nothing autotunes at run
time. The config chosen for each (N, K, dtype, M) is cached with its grid, so an eager call does a dict lookup
and one launch (two with split-K).
"""

import math
import os
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

import kernels
from kernels.fp8 import BLOCK_K as SCALE_BLOCK_K
from kernels.fp8 import FP8, dequantize_rows, k_blocks, quantize_activations
from kernels.launch import cdiv, fast_launch, next_power_of_2
from kernels.linear import aligned_rows
from kernels.norm import triton as norm_triton
from kernels.pdl import allow_dependents, pdl, wait_for_producers
from kernels.tuned import load_table

__all__ = ["linear", "linear_out", "logits", "logits_out", "add_rms_norm_linear"]

MAX_M = 64  # rows up to which the Triton kernel runs; F.linear (cuBLAS) above
M_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
CONFIG_DIR = Path(__file__).parent / "configs"
CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps", "num_stages")
# optional: programs per SM of the persistent GEMV (_gemv_persistent_kernel; M = 1, BLOCK_K >= K, dense or fp8)
PERSISTENT_KEY = "PERSISTENT"
# optional: Triton's register cap per thread (a launch option). sm_90 gives 64K registers per SM: at 4 warps a
# program over 128 registers leaves room for 3 per SM, and a 512-program grid (the 35B out-projections at
# 4 x 2048, 132 registers) then runs in two waves
MAXNREG_KEY = "maxnreg"
OPTIONAL_KEYS = (PERSISTENT_KEY, MAXNREG_KEY)
REDUCE_BLOCK = 1024
# columns per step of the fused norm's row statistics: its own step, not BLOCK_K, so a narrow projection step
# (128 fp8 columns: 16 steps at K = 2048) does not make the statistics a chain of L2 round trips
# (measured in the loop: bf16 2.169 -> 2.162 ms, FP8 2.897 -> 2.877 ms, tune_decode_loop at 561ed5b)
MAX_NORM_BLOCK = 2048
# M > MAX_M with an N that cuBLAS runs slowly (_prefill_gemm): the best of six tiles (gemm_alignment.py, H200)
UNALIGNED_N_CONFIG = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, SPLIT_K=1, num_warps=8, num_stages=3)
# M > MAX_M with fp8 weights: the FP8 x FP8 tile on the pre-quantized activations (X_FP8; BLOCK_K must be 128, one
# activation and one weight scale per step). Not timed yet (experiments/tune_fp8_prefill.py); picked from sm_90
# compiles (experiments/aot_sm90.py, ptxas): 64 x 128 on 4 warps uses 218 registers and 74 KB of shared memory, no
# spill, so two programs fit an SM, and one's per-step scaling (two fp32 ops per output per step, as much CUDA-core
# time as the step's fp8 wgmma) can run under the other's wgmma; 64 x 256 on 8 warps fits too (210, 124 KB, one per
# SM); 128 x 128 on 8 warps spills 32 B, 128 x 128 on 4 and 64 x 256 on 4 spill ~600 / ~360 B
FP8_PREFILL_CONFIG = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, SPLIT_K=1, num_warps=4, num_stages=3)
FP8_PREFILL = os.environ.get("QMOE_FP8_PREFILL", kernels.ENVIRONMENT["QMOE_FP8_PREFILL"][0])  # the module docstring


# ----------------------------------------------------------------------------------------------- configs


def shape_key(N: int, K: int, dtype: torch.dtype) -> str:
    return f"N{N}_K{K}_{str(dtype).removeprefix('torch.')}"


def m_bucket(M: int) -> int:
    return next(b for b in M_BUCKETS if b >= M)


CONFIG_TABLE = load_table(CONFIG_DIR, "QMOE_GEMV_DEFAULT_CONFIGS")


def default_config(M: int, N: int, K: int, num_sms: int, fp8: bool = False) -> dict:
    """A reasoned config for shapes the table does not cover. M = 1: tiles of 8 KB (32 bf16 per thread, four
    16-byte loads each; fp8: BLOCK_K = 128, one scale block, 8192 elements) and BLOCK_N halved until there are
    >= 4 programs per SM. M > 1: a dot tile BLOCK_N = 64 halved (to 16) and then split along K until there are
    >= 2 programs per SM."""
    if M == 1 and fp8:  # 1024-column steps of 4 rows: bench_fp8's sweep winner at most H200 shapes (ceaa2ab)
        block_k, block_n = min(1024, max(16, next_power_of_2(K))), 4
        while block_n > 1 and cdiv(N, block_n) < 2 * num_sms:
            block_n //= 2
        return dict(BLOCK_M=1, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=1, num_warps=4, num_stages=1)
    if M == 1:
        block_k = min(512, max(16, next_power_of_2(K)))
        block_n = max(1, 4096 // block_k)
        while block_n > 1 and cdiv(N, block_n) < 4 * num_sms:
            block_n //= 2
        return dict(BLOCK_M=1, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=1, num_warps=4, num_stages=1)
    block_m, block_n, block_k = min(64, max(16, next_power_of_2(M))), 64, max(16, min(128, K))
    block_k = next_power_of_2(block_k)
    tiles = lambda: cdiv(M, block_m) * cdiv(N, block_n)
    while block_n > 16 and tiles() < 2 * num_sms:
        block_n //= 2
    k_blocks, split = cdiv(K, block_k), 1
    while split < 8 and tiles() * split < 2 * num_sms and k_blocks >= 2 * split:
        split *= 2
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, num_warps=4, num_stages=3)


def get_config(M: int, N: int, K: int, dtype: torch.dtype, num_sms: int) -> dict:
    """dtype: the weight's (float8_e4m3fn keys the FP8 entries)."""
    tuned = CONFIG_TABLE.get(shape_key(N, K, dtype), {}).get(str(m_bucket(M)))
    return tuned or default_config(M, N, K, num_sms, fp8=dtype == FP8)


def check_config(config: dict, fp8: bool = False, fp8_x: bool = False) -> None:
    """Raise ValueError for a config the kernel cannot run (a hand-written or corrupted table entry)."""
    if sorted(k for k in config if k not in OPTIONAL_KEYS) != sorted(CONFIG_KEYS):
        raise ValueError(
            f"linear config needs exactly the keys {CONFIG_KEYS} (and optionally {OPTIONAL_KEYS}), got {sorted(config)}"
        )
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    if not all(v > 0 and v & (v - 1) == 0 for v in (bm, bn, bk)):
        raise ValueError(f"linear config: BLOCK_M, BLOCK_N, BLOCK_K must be powers of two, got {config}")
    if bm != 1 and (bm < 16 or bn < 16 or bk < 16):
        raise ValueError(f"linear config: the dot path (BLOCK_M > 1) needs BLOCK_M, BLOCK_N, BLOCK_K >= 16: {config}")
    if config["SPLIT_K"] < 1:
        raise ValueError(f"linear config: SPLIT_K must be >= 1, got {config}")
    if fp8 and bm != 1 and bk > SCALE_BLOCK_K:  # the GEMV splits its steps into 128-column sub-steps
        raise ValueError(f"linear config: fp8 on the dot path needs BLOCK_K <= {SCALE_BLOCK_K}: {config}")
    persistent = config.get(PERSISTENT_KEY, 0)
    if not isinstance(persistent, int) or persistent < 0:
        raise ValueError(f"linear config: {PERSISTENT_KEY} is a number of programs per SM (>= 0), got {config}")
    maxnreg = config.get(MAXNREG_KEY, 0)
    if not isinstance(maxnreg, int) or not 0 <= maxnreg <= 255:
        raise ValueError(f"linear config: {MAXNREG_KEY} is a register cap per thread (up to 255), got {config}")
    if persistent and (bm != 1 or config["SPLIT_K"] != 1):
        raise ValueError(f"linear config: {PERSISTENT_KEY} runs the GEMV (BLOCK_M = 1, SPLIT_K = 1), got {config}")
    if fp8_x and (not fp8 or bm == 1 or bk != SCALE_BLOCK_K):
        raise ValueError(
            f"linear config: FP8 x FP8 (fp8 activations) needs an fp8 weight and the dot path with BLOCK_K = "
            f"{SCALE_BLOCK_K} (one activation scale group per K step), got fp8={fp8} and {config}"
        )


def make_plan(
    M: int, N: int, K: int, config: dict, fp8: bool = False, fp8_x: bool = False, num_sms: int = 8
) -> tuple:  # fmt: skip
    """Everything a launch needs that depends only on the shape -> (grid, split, k_per_split, kernel kwargs).
    The split is spread over whole BLOCK_K blocks and empty splits are dropped (K = 3 blocks, SPLIT_K = 2 ->
    splits of 2 and 1 blocks; K = 6 blocks, SPLIT_K = 4 -> 3 splits of 2), so only the last block of K is short.
    fp8_x: FP8 x FP8, x fp8 with per-(row, 128-group) scales (fp8 weights, BLOCK_K = 128).
    A PERSISTENT config: min(row blocks, PERSISTENT * num_sms) programs of _gemv_persistent_kernel (its kwargs
    carry BLOCK_M=1 and PERSISTENT=True, which linear_into takes off before the launch)."""
    check_config(config, fp8, fp8_x)
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    if config.get(PERSISTENT_KEY):
        if M != 1 or bk < K:
            raise ValueError(
                f"linear config: {PERSISTENT_KEY} needs M = 1 and BLOCK_K >= K = {K}, got M = {M}, {config}"
            )
        grid = (min(cdiv(N, bn), config[PERSISTENT_KEY] * num_sms),)
        meta = dict(BLOCK_M=1, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=K == bk, PERSISTENT=True, SCALED=fp8,
                    SUB_K=min(bk, SCALE_BLOCK_K), **launch_options(config))  # fmt: skip
        return grid, 1, K, meta
    k_blocks = cdiv(K, bk)
    blocks_per_split = cdiv(k_blocks, min(config["SPLIT_K"], k_blocks))
    split = cdiv(k_blocks, blocks_per_split)
    grid = (cdiv(M, bm) * cdiv(N, bn) * split,)
    meta = dict(
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=K % bk == 0, PARTIAL=split > 1, SCALED=fp8, X_FP8=fp8_x,
        SUB_K=min(bk, SCALE_BLOCK_K), NORM_BLOCK=min(next_power_of_2(K), MAX_NORM_BLOCK),
        **launch_options(config),
    )  # fmt: skip
    return grid, split, blocks_per_split * bk, meta


def launch_options(config: dict) -> dict:
    """The config's Triton launch options: num_warps, num_stages and, if capped, maxnreg."""
    cap = {MAXNREG_KEY: config[MAXNREG_KEY]} if config.get(MAXNREG_KEY) else {}
    return dict(num_warps=config["num_warps"], num_stages=config["num_stages"], **cap)


_PLANS: dict = {}  # (N, K, dtype, M) -> make_plan(...) for the table's (or the default) config; FP8 x FP8 prefill
# plans under (N, K, "fp8_prefill", M)


def cached_plan(M: int, N: int, K: int, dtype: torch.dtype, device: torch.device) -> tuple:
    """dtype: x's, or float8_e4m3fn for fp8 weights."""
    key = (N, K, dtype, M)
    plan = _PLANS.get(key)
    if plan is None:
        num_sms = sm_count(device)
        plan = _PLANS[key] = make_plan(M, N, K, get_config(M, N, K, dtype, num_sms), dtype == FP8, num_sms=num_sms)
    return plan


def sm_count(device: torch.device) -> int:
    """The device's SMs (8 for the CPU interpreter): what a persistent grid and the default configs size for."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


def fp8_prefill_plan(M: int, N: int, K: int) -> tuple:
    """The plan of the FP8 x FP8 prefill product (FP8_PREFILL_CONFIG on the pre-pass's fp8 activations)."""
    key = (N, K, "fp8_prefill", M)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = make_plan(M, N, K, FP8_PREFILL_CONFIG, fp8=True, fp8_x=True)
    return plan


# ----------------------------------------------------------------------------------------------- kernels


@triton.jit
def _row_rstd(x_ptr, res_ptr, rows, row_mask, K, stride_xm, stride_rm, eps, NORM_BLOCK: tl.constexpr):
    """rsqrt(mean(h^2) + eps) of rows [R] of h = x + residual (rounded to x's dtype as the norm kernel rounds it)
    -> [R] fp32. The whole row is read by every program (K of a few thousand: from L2)."""
    acc = tl.zeros((rows.shape[0], NORM_BLOCK), tl.float32)
    for k0 in range(0, K, NORM_BLOCK):
        offs = k0 + tl.arange(0, NORM_BLOCK)
        m = row_mask[:, None] & (offs < K)[None, :]
        h = tl.load(x_ptr + rows[:, None] * stride_xm + offs[None, :], mask=m, other=0.0)
        r = tl.load(res_ptr + rows[:, None] * stride_rm + offs[None, :], mask=m, other=0.0)
        hf = (h.to(tl.float32) + r.to(tl.float32)).to(h.dtype).to(tl.float32)
        acc += hf * hf
    return tl.rsqrt(tl.sum(acc, axis=1) / K + eps)


@triton.jit
def _norm_inputs(x_ptr, res_ptr, nw_ptr, rows, row_mask, offs_k, K, stride_xm, stride_rm):
    """The [R, BLOCK_K] tile of h = x + residual (rounded to x's dtype) and the norm weight's [BLOCK_K] fp32."""
    m = row_mask[:, None] & (offs_k < K)[None, :]
    h = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :], mask=m, other=0.0)
    r = tl.load(res_ptr + rows[:, None] * stride_rm + offs_k[None, :], mask=m, other=0.0)
    h = (h.to(tl.float32) + r.to(tl.float32)).to(h.dtype)
    return h, tl.load(nw_ptr + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)


@triton.jit
def _normed(h, w, normed_ptr, hidden_ptr, rows, row_mask, offs_k, K, rstd, write):
    """normed = rms_norm(h) * (1 + w) in h's dtype (norm.naive's roundings) from _norm_inputs' tiles; where `write`,
    also stores it and the new residual h into normed / hidden ([M, K], contiguous)."""
    normed = (h.to(tl.float32) * rstd[:, None] * (1.0 + w[None, :])).to(h.dtype)
    if write:
        m = row_mask[:, None] & (offs_k < K)[None, :]
        out_offs = rows[:, None] * K + offs_k[None, :]
        tl.store(normed_ptr + out_offs, normed, mask=m)
        tl.store(hidden_ptr + out_offs, h, mask=m)
    return normed


@triton.jit
def _normed_tile(x_ptr, res_ptr, nw_ptr, normed_ptr, hidden_ptr, rows, row_mask, offs_k, K, stride_xm, stride_rm,
                 rstd, write):  # fmt: skip
    """The [R, BLOCK_K] tile of normed = rms_norm(x + residual) * (1 + w) (_norm_inputs, then _normed)."""
    h, w = _norm_inputs(x_ptr, res_ptr, nw_ptr, rows, row_mask, offs_k, K, stride_xm, stride_rm)
    return _normed(h, w, normed_ptr, hidden_ptr, rows, row_mask, offs_k, K, rstd, write)


@triton.jit
def _first_normed_tile(x_ptr, res_ptr, nw_ptr, normed_ptr, hidden_ptr, rows, row_mask, offs_k, K, stride_xm,
                       stride_rm, eps, write, NORM_BLOCK: tl.constexpr):  # fmt: skip
    """-> (the first step's normed tile, rstd [R]). Its inputs load before the row statistics' loads, so the two
    L2 round trips after the PDL wait overlap instead of following each other (bf16 decode step 2.156 -> 2.150 ms
    alone, results/probe_decode_latency.json)."""
    h, w = _norm_inputs(x_ptr, res_ptr, nw_ptr, rows, row_mask, offs_k, K, stride_xm, stride_rm)
    rstd = _row_rstd(x_ptr, res_ptr, rows, row_mask, K, stride_xm, stride_rm, eps, NORM_BLOCK)
    return _normed(h, w, normed_ptr, hidden_ptr, rows, row_mask, offs_k, K, rstd, write), rstd


@triton.jit
def _x_tile(x_ptr, res_ptr, nw_ptr, normed_ptr, hidden_ptr, x_rows, row_mask, cols, K, stride_xm, stride_rm, rstd,
            write_normed, EVEN_K: tl.constexpr, NORM: tl.constexpr):  # fmt: skip
    """The [R, len(cols)] tile of the GEMV's input: x, or with NORM rms_norm(x + residual) (_normed_tile)."""
    if NORM:
        x = _normed_tile(x_ptr, res_ptr, nw_ptr, normed_ptr, hidden_ptr, x_rows, row_mask, cols, K, stride_xm,
                         stride_rm, rstd, write_normed)  # fmt: skip
    elif EVEN_K:
        x = tl.load(x_ptr + x_rows[:, None] * stride_xm + cols[None, :])
    else:
        x = tl.load(x_ptr + x_rows[:, None] * stride_xm + cols[None, :], mask=(cols < K)[None, :], other=0.0)
    return x


@triton.jit
def _w_tile(w_ptr, w_rows, cols, K, EVEN_K: tl.constexpr):
    """The weight tile [len(w_rows), len(cols)] (w_rows: row offsets), zero past K."""
    if EVEN_K:
        w = tl.load(w_ptr + w_rows[:, None] + cols[None, :])
    else:
        w = tl.load(w_ptr + w_rows[:, None] + cols[None, :], mask=(cols < K)[None, :], other=0.0)
    return w


@triton.jit
def _scaled_step(w, x, s_ptrs, k, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB_K: tl.constexpr):
    """The fp8 tile w [BLOCK_N, BLOCK_K] at columns k.. times x [1, BLOCK_K] -> [BLOCK_N, BLOCK_K / SUB_K] fp32:
    the products summed per SUB_K-column sub-step, each inside one scale block, times its row scale."""
    blocks = k // 128 + tl.arange(0, BLOCK_K // SUB_K)  # the step's scale blocks; none read past K
    scale = tl.load(s_ptrs[:, None] + blocks[None, :], mask=(blocks * 128 < K)[None, :], other=0.0)
    prod = w.to(tl.float32) * x.to(tl.float32)  # [BLOCK_N, BLOCK_K]
    return tl.sum(tl.reshape(prod, (BLOCK_N, BLOCK_K // SUB_K, SUB_K)), 2) * scale


@triton.jit
def _scaled_gemv(x_ptr, w_ptr, s_ptrs, res_ptr, nw_ptr, normed_ptr, hidden_ptr, x_rows, row_mask, w_rows, k_start,
                 k_end, K, stride_xm, stride_rm, eps, write_normed, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SUB_K: tl.constexpr, EVEN_K: tl.constexpr, NORM: tl.constexpr, NORM_BLOCK: tl.constexpr,
                 PDL: tl.constexpr):  # fmt: skip
    """The GEMV over fp8 weights -> [BLOCK_N] fp32: each BLOCK_K step loads its [BLOCK_N, BLOCK_K] tile at once
    and applies one row scale per SUB_K = min(BLOCK_K, 128) columns to that sub-step's summed products (the
    product reshaped to [BLOCK_N, BLOCK_K / SUB_K, SUB_K]), so a step is one memory round trip. Unrolled
    sub-steps (tl.static_range) compiled for sm_90 issued a later sub-step's loads after an earlier one's math.
    The first step's weights load before the PDL wait, as in the bf16 GEMV."""
    c = tl.arange(0, BLOCK_K)
    cols = k_start + c  # k_end is a multiple of BLOCK_K or K, so only K masks
    w = _w_tile(w_ptr, w_rows, cols, K, EVEN_K)
    wait_for_producers(PDL)
    rstd = 0.0
    if NORM:  # not _first_normed_tile: with the fp8 steps' wider tiles it made the FP8 step 1.720 -> 1.742 ms
        # (tune_decode_loop --step-only, results/probe_decode_latency.json), while the bf16 GEMV gains from it
        rstd = _row_rstd(x_ptr, res_ptr, x_rows, row_mask, K, stride_xm, stride_rm, eps, NORM_BLOCK)
    x = _x_tile(x_ptr, res_ptr, nw_ptr, normed_ptr, hidden_ptr, x_rows, row_mask, cols, K, stride_xm, stride_rm,
                rstd, write_normed, EVEN_K, NORM)  # fmt: skip
    acc = _scaled_step(w, x, s_ptrs, k_start, K, BLOCK_N, BLOCK_K, SUB_K)  # [BLOCK_N, BLOCK_K / SUB_K]
    for k in range(k_start + BLOCK_K, k_end, BLOCK_K):
        cols = k + c
        w = _w_tile(w_ptr, w_rows, cols, K, EVEN_K)
        x = _x_tile(x_ptr, res_ptr, nw_ptr, normed_ptr, hidden_ptr, x_rows, row_mask, cols, K, stride_xm, stride_rm,
                    rstd, write_normed, EVEN_K, NORM)  # fmt: skip
        acc += _scaled_step(w, x, s_ptrs, k, K, BLOCK_N, BLOCK_K, SUB_K)
    return tl.sum(acc, axis=1)


@fast_launch
@triton.jit(do_not_specialize=["M", "N"])
def _linear_kernel(
    x_ptr, w_ptr, out_ptr, s_ptr, M, N, K, stride_xm, stride_wn, stride_sn, k_per_split, SPLIT,
    res_ptr, nw_ptr, normed_ptr, hidden_ptr, stride_rm, eps, xs_ptr, stride_xsm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    PARTIAL: tl.constexpr, SCALED: tl.constexpr, X_FP8: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr,
    SUB_K: tl.constexpr, NORM_BLOCK: tl.constexpr, ROUND_X: tl.constexpr,
):  # fmt: skip
    """out = x @ w^T; with NORM (GEMV path only), x is first replaced by rms_norm(x + residual) * (1 + nw) (the
    add + RMSNorm before a projection, fused into its prologue: each program computes its row's rstd, the programs
    of the first N tile also write normed and the new residual for the layer's other readers).
    SCALED: w is fp8 with s [N, ceil(K / 128)] fp32 (s_ptr is unused otherwise): the GEMV runs _scaled_gemv; on
    the dot path BLOCK_K <= 128 divides 128, so step k is in scale block k // 128. X_FP8 (dot path, with
    SCALED, BLOCK_K = 128): x is fp8 too (kernels/fp8.quantize_activations' q) with its scales at xs [M, Kb]
    (row stride stride_xsm), and each step is an fp8 x fp8 tl.dot scaled by x's row scales and w's.
    ROUND_X (not with PARTIAL or X_FP8): the result is rounded to x's dtype, then stored in out's (fp32 logits
    equal to linear(x, w).float(), without the cast's launch)."""
    allow_dependents(PDL)
    # The M tiles of one weight tile are neighbours in launch order, so its re-reads (BLOCK_M < M) hit L2.
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_m
    split = (pid // num_m) % SPLIT
    pid_n = pid // (num_m * SPLIT)
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = k_start + tl.arange(0, BLOCK_K)
    # Rows past N re-read row N - 1 (unmasked loads keep the 16-byte vectors); the store drops them.
    w_rows = tl.minimum(offs_n, N - 1).to(tl.int64) * stride_wn
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = offs_m < M
    x_rows = tl.minimum(offs_m, M - 1).to(tl.int64)  # [BLOCK_M]; rows past M re-read row M - 1
    write_normed = pid_n == 0
    s_ptrs = s_ptr + tl.minimum(offs_n, N - 1).to(tl.int64) * stride_sn  # [BLOCK_N], at K block 0
    if BLOCK_M == 1 and SCALED:
        out = _scaled_gemv(
            x_ptr, w_ptr, s_ptrs, res_ptr, nw_ptr, normed_ptr, hidden_ptr, x_rows, row_mask, w_rows, k_start, k_end, K,
            stride_xm, stride_rm, eps, write_normed, BLOCK_N, BLOCK_K, SUB_K, EVEN_K, NORM, NORM_BLOCK, PDL,
        )  # fmt: skip
        offs_out = pid_m * N + offs_n
        mask = offs_n < N
    elif BLOCK_M == 1:
        x_ptrs = x_ptr + x_rows * stride_xm + offs_k[None, :]  # [1, BLOCK_K]
        w_ptrs = w_ptr + w_rows[:, None] + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
        # The first K block is peeled: its weight tile loads before the wait (weights are never written), so
        # under PDL it streams while the previous kernel finishes. Every split has at least one K block.
        k_mask = offs_k[None, :] < K
        if EVEN_K:
            w = tl.load(w_ptrs)
        else:
            w = tl.load(w_ptrs, mask=k_mask, other=0.0)
        wait_for_producers(PDL)
        if NORM:
            x, rstd = _first_normed_tile(x_ptr, res_ptr, nw_ptr, normed_ptr, hidden_ptr, x_rows, row_mask, offs_k, K,
                                         stride_xm, stride_rm, eps, write_normed, NORM_BLOCK)  # fmt: skip
        elif EVEN_K:
            x = tl.load(x_ptrs)
        else:
            x = tl.load(x_ptrs, mask=k_mask, other=0.0)
        acc = w.to(tl.float32) * x.to(tl.float32)  # [BLOCK_N, BLOCK_K]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        for k in range(k_start + BLOCK_K, k_end, BLOCK_K):
            k_mask = (k + tl.arange(0, BLOCK_K) < K)[None, :]
            if EVEN_K:
                w = tl.load(w_ptrs)
            else:
                w = tl.load(w_ptrs, mask=k_mask, other=0.0)
            if NORM:
                x = _normed_tile(x_ptr, res_ptr, nw_ptr, normed_ptr, hidden_ptr, x_rows, row_mask,
                                 k + tl.arange(0, BLOCK_K), K, stride_xm, stride_rm, rstd, write_normed)  # fmt: skip
            elif EVEN_K:
                x = tl.load(x_ptrs)
            else:
                x = tl.load(x_ptrs, mask=k_mask, other=0.0)
            acc += w.to(tl.float32) * x.to(tl.float32)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        out = tl.sum(acc, axis=1)  # [BLOCK_N]: one reduction over K, after the loop
        offs_out = pid_m * N + offs_n
        mask = offs_n < N
    else:
        wait_for_producers(PDL)
        x_ptrs = x_ptr + x_rows[:, None] * stride_xm + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
        w_ptrs = w_ptr + w_rows[None, :] + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        xs_ptrs = xs_ptr + x_rows * stride_xsm  # [BLOCK_M], at K block 0 (X_FP8 only)
        for k in range(k_start, k_end, BLOCK_K):
            k_mask = k + tl.arange(0, BLOCK_K) < K
            if EVEN_K:
                w = tl.load(w_ptrs)
            else:
                w = tl.load(w_ptrs, mask=k_mask[:, None], other=0.0)
            if EVEN_K:
                x = tl.load(x_ptrs)
            else:
                x = tl.load(x_ptrs, mask=k_mask[None, :], other=0.0)
            if X_FP8:  # fp8 x fp8 on the tensor cores; the token's and the row's scales on the product
                x_scale = tl.load(xs_ptrs + k // 128)  # [BLOCK_M]
                scale = tl.load(s_ptrs + k // 128)  # [BLOCK_N]
                acc += tl.dot(x, w) * (x_scale[:, None] * scale[None, :])
            elif SCALED:  # e4m3 -> x's dtype is exact; the scale applies to this step's product
                scale = tl.load(s_ptrs + k // 128)  # [BLOCK_N]
                if x.dtype == tl.float32:
                    acc += tl.dot(x, w.to(tl.float32), input_precision="ieee") * scale[None, :]
                else:
                    acc += tl.dot(x, w.to(x.dtype)) * scale[None, :]
            elif x.dtype == tl.float32:  # fp32 stays fp32 (no tf32), so the fp32 model matches the torch path
                acc = tl.dot(x, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(x, w, acc)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        out = acc
        offs_out = offs_m[:, None] * N + offs_n[None, :]
        mask = row_mask[:, None] & (offs_n < N)[None, :]
    if PARTIAL:  # fp32 partial of this split: workspace [SPLIT, M, N]
        tl.store(out_ptr + split * M * N + offs_out, out, mask=mask)
    else:
        out = out.to(x_ptr.dtype.element_ty) if ROUND_X else out
        tl.store(out_ptr + offs_out, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _row_block(w_ptr, s_ptr, block, n_blocks, N, stride_wn, stride_sn, offs_k, K, BLOCK_N: tl.constexpr,
               EVEN_K: tl.constexpr, SCALED: tl.constexpr, SUB_K: tl.constexpr):  # fmt: skip
    """The weight rows of row block `block` as one [BLOCK_N, BLOCK_K] tile (the whole row: BLOCK_K >= K) and, with
    SCALED (fp8), their scales [BLOCK_N, BLOCK_K / SUB_K] (one per 128 columns; else a dummy 1); all zero, with no
    memory traffic, for a block >= n_blocks. Rows past N re-read row N - 1 (unmasked along K, the loads keep their
    16-byte vectors); the store drops them."""
    offs_n = block * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    ptrs = w_ptr + (rows * stride_wn)[:, None] + offs_k[None, :]
    live = (offs_n < n_blocks * BLOCK_N)[:, None]  # [BLOCK_N, 1]: constant along K, so the vectors stay 16 bytes
    if EVEN_K:
        w = tl.load(ptrs, mask=live, other=0.0)
    else:
        w = tl.load(ptrs, mask=live & (offs_k < K)[None, :], other=0.0)
    scale = 1.0
    if SCALED:
        blocks = tl.arange(0, offs_k.shape[0] // SUB_K)  # the row's scale blocks; none read past K
        s_ptrs = s_ptr + (rows * stride_sn)[:, None] + blocks[None, :]
        scale = tl.load(s_ptrs, mask=live & (blocks * 128 < K)[None, :], other=0.0)
    return w, scale


@triton.jit
def _row_block_dot(w, scale, x, SCALED: tl.constexpr, SUB_K: tl.constexpr):
    """[BLOCK_N] fp32 = w [BLOCK_N, BLOCK_K] @ x [1, BLOCK_K] fp32; SCALED: each SUB_K-column sub-step's sum
    times its row scale (_row_block's)."""
    prod = w.to(tl.float32) * x
    if SCALED:
        sums = tl.sum(tl.reshape(prod, (prod.shape[0], prod.shape[1] // SUB_K, SUB_K)), 2) * scale
    else:
        sums = prod
    return tl.sum(sums, axis=1)


@fast_launch
@triton.jit(do_not_specialize=["N"])
def _gemv_persistent_kernel(
    x_ptr, w_ptr, out_ptr, s_ptr, N, K, stride_wn, stride_sn, res_ptr, nw_ptr, normed_ptr, hidden_ptr, stride_rm, eps,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, NORM: tl.constexpr, SCALED: tl.constexpr,
    SUB_K: tl.constexpr, PDL: tl.constexpr, ROUND_X: tl.constexpr,
):  # fmt: skip
    """out [N] = x [1, K] @ w^T, M = 1, by a few programs per SM: program p computes row blocks p, p + P, p + 2P, ...
    (P programs), each one [BLOCK_N, BLOCK_K >= K] tile. x (with NORM: rms_norm(x + residual) * (1 + nw), written
    with the new residual by program 0) is read and normalised once per program and stays in registers, and block
    b + P's weights load before block b's products: no weight load waits for x, and the first two blocks' loads
    are in flight while the program waits for its producer and reads x. (The one-block-per-program kernel reads
    and normalises x in every program, BLOCK_N rows at a time, and issues its second K step after the first
    one's products.) SCALED: fp8 weights, each block's scales [BLOCK_N, BLOCK_K / SUB_K] loaded with its rows and
    applied per 128-column sub-step, as in _scaled_step. ROUND_X: as in _linear_kernel."""
    allow_dependents(PDL)
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    n_blocks = tl.cdiv(N, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    w, scale = _row_block(w_ptr, s_ptr, pid, n_blocks, N, stride_wn, stride_sn, offs_k, K, BLOCK_N, EVEN_K, SCALED,
                          SUB_K)  # the grid has <= n_blocks  # fmt: skip
    w_next, scale_next = _row_block(w_ptr, s_ptr, pid + step, n_blocks, N, stride_wn, stride_sn, offs_k, K, BLOCK_N,
                                    EVEN_K, SCALED, SUB_K)  # fmt: skip
    wait_for_producers(PDL)
    row = tl.zeros((1,), tl.int64)
    row_mask = row == 0
    if NORM:
        h, nw = _norm_inputs(x_ptr, res_ptr, nw_ptr, row, row_mask, offs_k, K, K, stride_rm)  # [1, BLOCK_K]
        hf = h.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(hf * hf, axis=1) / K + eps)  # [1]
        x = _normed(h, nw, normed_ptr, hidden_ptr, row, row_mask, offs_k, K, rstd, pid == 0)
    else:
        x = tl.load(x_ptr + offs_k[None, :], mask=(offs_k < K)[None, :], other=0.0)
    x = x.to(tl.float32)  # [1, BLOCK_K]
    for block in range(pid, n_blocks, step):
        w_after, scale_after = _row_block(w_ptr, s_ptr, block + 2 * step, n_blocks, N, stride_wn, stride_sn, offs_k,
                                          K, BLOCK_N, EVEN_K, SCALED, SUB_K)  # fmt: skip
        out = _row_block_dot(w, scale, x, SCALED, SUB_K)  # [BLOCK_N]
        offs_n = block * BLOCK_N + tl.arange(0, BLOCK_N)
        out = out.to(x_ptr.dtype.element_ty) if ROUND_X else out
        tl.store(out_ptr + offs_n, out.to(out_ptr.dtype.element_ty), mask=offs_n < N)
        w, scale = w_next, scale_next
        w_next, scale_next = w_after, scale_after


@fast_launch
@triton.jit
def _split_k_reduce_kernel(ws_ptr, out_ptr, MN, SPLIT, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """out[i] = sum over s = 0, 1, ..., SPLIT - 1 of ws[s, i], in that order, rounded once to out's dtype."""
    allow_dependents(PDL)
    wait_for_producers(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLIT):
        acc += tl.load(ws_ptr + s * MN + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------- launchers


def _check(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None) -> None:
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"linear: weight must be [N, K] with K = x.shape[-1] = {x.shape[-1]}, got {weight.shape}")
    if weight.stride(1) != 1:
        raise ValueError(
            f"linear: weight rows must be contiguous (weight.stride(1) == 1), got strides {weight.stride()}; "
            "pass weight.contiguous() or a row slice of a contiguous buffer"
        )
    if scale is None and x.dtype != weight.dtype:
        raise ValueError(f"linear: x is {x.dtype} but weight is {weight.dtype}; both must have the same dtype")
    if scale is not None:
        want = (weight.shape[0], k_blocks(weight.shape[1]))
        if weight.dtype != FP8 or scale.dtype != torch.float32 or tuple(scale.shape) != want or scale.stride(1) != 1:
            raise ValueError(
                f"linear: a scaled weight is float8_e4m3fn [N, K] with a row-contiguous float32 scale {list(want)}, "
                f"got {weight.dtype} {list(weight.shape)} and {scale.dtype} {list(scale.shape)}"
            )


def _rows(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """t [..., K] -> (t, the stride between its rows) when the kernels can read it as it is: 2-D with contiguous
    rows, or contiguous; else (a contiguous copy, K). No view is made for the common cases: each is a dispatcher
    call, ~1.5 us of an eager decode op's host time on the H200 host."""
    if t.dim() == 2 and t.stride(1) == 1:
        return t, t.stride(0)
    if not t.is_contiguous():
        t = t.contiguous()
    return t, t.shape[-1]


def linear_into(
    x, weight, out, config=None, workspace=None, scale=None, quantize_x=False, norm=None, x_scale=None, round_x=False
) -> torch.Tensor:
    """out [..., N] (contiguous, out's dtype) = x [..., K] @ weight[N, K]^T with the Triton kernel at any M, the
    number of x's rows (its leading dimensions need no flattening: see _rows).
    config overrides the table (tests, tuner); workspace [SPLIT, M, N] fp32 is the split-K scratch (tests pass
    NaN-filled ones, so a partial the kernel forgets to write reaches the output; allocated here when None);
    scale: the fp32 [N, ceil(K / 128)] scale of an fp8 weight. FP8 x FP8 (an fp8 weight and a dot-path config
    with BLOCK_K = 128; config None: FP8_PREFILL_CONFIG) either with quantize_x (x quantized per (row, 128-wide
    K group) by the pre-pass kernels/fp8.quantize_activations first: two launches) or with x already fp8 and
    x_scale its fp32 [M, ceil(K / 128)] scales (rows contiguous).
    norm = (residual [M, K], norm_weight [K], eps, normed [M, K], hidden [M, K]), GEMV configs (BLOCK_M = 1) only:
    x is first replaced by rms_norm(x + residual) * (1 + norm_weight), which is written to normed, and x + residual
    to hidden. round_x: the result is rounded to x's dtype before it is stored in out's (fp32 logits; not with
    split-K or an fp8 x)."""
    K, N = x.shape[-1], weight.shape[0]
    M = x.numel() // K if K else math.prod(x.shape[:-1])
    fp8 = scale is not None
    fp8_x = quantize_x or x_scale is not None
    if not out.is_contiguous() or out.numel() != M * N:
        raise ValueError(f"linear_into: out must be contiguous with {M} x {N} elements, got {list(out.shape)}")
    x, stride_xm = _rows(x)  # a row stride is handled in the kernel; a K stride is not
    if fp8_x and fp8 and config is None:
        grid, split, k_per_split, meta = fp8_prefill_plan(M, N, K)
    elif config is not None or fp8_x:  # make_plan checks the config (and refuses FP8 x FP8 without fp8 weights)
        grid, split, k_per_split, meta = make_plan(
            M, N, K, config or FP8_PREFILL_CONFIG, fp8, fp8_x, num_sms=sm_count(x.device)
        )  # fmt: skip
    else:
        grid, split, k_per_split, meta = cached_plan(M, N, K, weight.dtype if fp8 else x.dtype, x.device)
    if quantize_x and x_scale is not None:
        raise ValueError("linear_into: pass quantize_x (x is quantized here) or x_scale (x is fp8 already), not both")
    if quantize_x:
        x, x_scale = quantize_activations(x.view(M, K))
        stride_xm = K
    elif fp8_x and (x.dtype != FP8 or x_scale.dtype != torch.float32 or tuple(x_scale.shape) != (M, k_blocks(K))
                    or x_scale.stride(1) != 1):  # fmt: skip
        raise ValueError(
            f"linear_into: x_scale goes with an fp8 x and is float32 [{M}, {k_blocks(K)}] with contiguous rows, got "
            f"x {x.dtype} and x_scale {x_scale.dtype} {list(x_scale.shape)}"
        )
    if round_x and (split > 1 or fp8_x):
        raise ValueError(f"linear_into: round_x stores the kernel's own result: no split-K or fp8 x, got {meta}")
    s, stride_sn = (scale, scale.stride(0)) if fp8 else (weight, 0)  # s unused without SCALED
    xs, stride_xsm = (x_scale, x_scale.stride(0)) if fp8_x else (s, 0)  # xs unused without X_FP8
    if norm is None:
        residual, norm_weight, eps, normed, hidden, stride_rm = x, x, 0.0, x, x, 0  # unused pointers
    elif meta["BLOCK_M"] != 1:
        raise ValueError(f"linear_into: the fused add + RMSNorm runs on the GEMV path (BLOCK_M = 1), got {meta}")
    else:
        residual, norm_weight, eps, normed, hidden = norm  # normed, hidden: contiguous, x's shape
        residual, stride_rm = _rows(residual)
    on = pdl(x)
    if meta.get("PERSISTENT"):
        meta = meta.copy()  # the plan's, without its two keys that are no kernel arguments (a copy: ~0.4 us less)
        del meta["BLOCK_M"], meta["PERSISTENT"]
        _gemv_persistent_kernel[grid](
            x, weight, out, s, N, K, weight.stride(0), stride_sn, residual, norm_weight, normed, hidden,
            stride_rm, eps, NORM=norm is not None, PDL=on, ROUND_X=round_x, launch_pdl=on, **meta,
        )  # fmt: skip
        return out
    if split > 1 and workspace is None:
        workspace = torch.empty((split, M, N), dtype=torch.float32, device=x.device)
    _linear_kernel[grid](
        x, weight, out if split == 1 else workspace, s, M, N, K,
        stride_xm, weight.stride(0), stride_sn, k_per_split, split,
        residual, norm_weight, normed, hidden, stride_rm, eps, xs, stride_xsm,
        NORM=norm is not None, PDL=on, ROUND_X=round_x, launch_pdl=on, **meta,
    )  # fmt: skip
    if split > 1:
        _split_k_reduce_kernel[(cdiv(M * N, REDUCE_BLOCK),)](
            workspace, out, M * N, split, BLOCK=REDUCE_BLOCK, PDL=on, launch_pdl=on
        )
    return out


def padded_rows(weight: torch.Tensor) -> torch.Tensor | None:
    """weight [N, K] (rows contiguous) as the first N rows of an [N_pad, K] view, N_pad the next multiple of 16
    bytes of elements, where its storage holds those rows (qwen35_moe.fuse_rows_ pads the buffers it makes); else
    None. Rows past N may belong to another tensor of the storage: only their products are computed, never used."""
    N, K = weight.shape
    n_pad = aligned_rows(N, weight.element_size())
    end = (weight.storage_offset() + n_pad * K) * weight.element_size()
    if weight.stride() != (K, 1) or end > weight.untyped_storage().nbytes():
        return None
    return weight.as_strided((n_pad, K), (K, 1))


def _prefill_gemm(x, weight, out=None) -> torch.Tensor:
    """The product above MAX_M rows: F.linear (into `out` when given). When N is not a multiple of 16 bytes of
    elements cuBLAS runs an sm75 `align1` kernel at ~77 TFLOP/s (the 35B MoE in-projection, N = 1281: 278 µs at
    4096 tokens, also into padded rows; the aligned rows and the rest as two products plus a copy 135-251 µs;
    results/gemm_alignment.json), so then: over the weight's padded rows where its storage has them (padded_rows:
    50.0 µs; the result is the first N columns of the padded product, rows N_pad apart), else with the Triton dot
    path's tile UNALIGNED_N_CONFIG (73.5 µs)."""
    K, N = x.shape[-1], weight.shape[0]
    if N == aligned_rows(N, x.element_size()) or x.numel() == 0 or K == 0:
        return F.linear(x, weight) if out is None else torch.matmul(x, weight.t(), out=out)
    padded = padded_rows(weight) if out is None else None
    if padded is not None:
        return F.linear(x, padded)[..., :N]
    out = x.new_empty(*x.shape[:-1], N) if out is None else out
    return linear_into(x, weight, out, config=UNALIGNED_N_CONFIG)


def _linear(x, weight, out=None, scale=None) -> torch.Tensor:
    _check(x, weight, scale)
    K, N = x.shape[-1], weight.shape[0]
    M = x.numel() // K if K else 0
    if M > MAX_M or M == 0 or K == 0:
        if scale is not None and M and K and FP8_PREFILL == "fp8":  # FP8 x FP8: the pre-pass, then the GEMM
            out = x.new_empty(*x.shape[:-1], N) if out is None else out
            return linear_into(x, weight, out, scale=scale, quantize_x=True)
        weight = weight if scale is None else dequantize_rows(weight, scale, x.dtype)  # per call
        return _prefill_gemm(x, weight, out)
    out = x.new_empty(*x.shape[:-1], N) if out is None else out  # sizes as ints: the cheapest allocation call
    return linear_into(x, weight, out, scale=scale)


def _scale_and_out(scale_out: tuple) -> tuple:
    """An out-variant's trailing arguments ([scale,] out) -> (scale or None, out)."""
    *scale, out = scale_out
    return scale[0] if scale else None, out


def linear_out(x: torch.Tensor, weight: torch.Tensor, *scale_out: torch.Tensor) -> torch.Tensor:
    """linear(x, weight[, scale]) written into `out` [..., N] (the last argument; contiguous, x's dtype): the
    out-variant an exported method uses to compute its output straight into the planned buffer."""
    scale, out = _scale_and_out(scale_out)
    return _linear(x, weight, out, scale)


def _projection_op(name: str, impl, dtype: torch.dtype | None = None):
    """The custom op `qmoe::<name>` (what torch.export records) over impl(x, weight, scale=...) -> [..., N], its
    fake's dtype `dtype` (None: x's)."""

    @torch.library.custom_op(f"qmoe::{name}", mutates_args=())
    def op(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        return impl(x, weight, scale=scale)

    @op.register_fake
    def _(x, weight, scale=None):
        return x.new_empty(*x.shape[:-1], weight.shape[0], dtype=dtype)

    return op


_linear_op = _projection_op("linear", _linear)


def _logits(x, weight, out=None, scale=None) -> torch.Tensor:
    _check(x, weight, scale)
    K, N = x.shape[-1], weight.shape[0]
    M = x.numel() // K if K else 0
    plan_dtype = x.dtype if scale is None else weight.dtype
    if M > MAX_M or M == 0 or K == 0 or cached_plan(M, N, K, plan_dtype, x.device)[1] > 1:  # the cast's launch
        logits = _linear(x, weight, scale=scale)
        return logits.float() if out is None else out.copy_(logits)  # copy_ casts into out: one kernel
    out = x.new_empty(*x.shape[:-1], N, dtype=torch.float32) if out is None else out
    return linear_into(x, weight, out, scale=scale, round_x=True)


def logits_out(x: torch.Tensor, weight: torch.Tensor, *scale_out: torch.Tensor) -> torch.Tensor:
    """logits(x, weight[, scale]) written into `out` [..., N] (the last argument; contiguous fp32): the
    out-variant of an exported method whose output is the logits."""
    scale, out = _scale_and_out(scale_out)
    return _logits(x, weight, out, scale)


_logits_op = _projection_op("logits", _logits, torch.float32)


def _add_rms_norm_linear(x, residual, norm_weight, eps, weight, scale=None):
    _check(x, weight, scale)
    K, N = x.shape[-1], weight.shape[0]
    M = x.numel() // K if K else 0
    plan_dtype = x.dtype if scale is None else weight.dtype
    if M > MAX_M or M == 0 or K == 0 or cached_plan(M, N, K, plan_dtype, x.device)[3]["BLOCK_M"] != 1:
        # A tile of rows: each program would normalise [BLOCK_M, K] from L2 per K block (measured slower at
        # M = 8 than the norm kernel), so the norm kernel runs first, then the projection.
        normed, hidden = norm_triton.add_rms_norm(x, residual, norm_weight, eps)
        return _linear(normed, weight, scale=scale), normed, hidden
    out, normed, hidden = x.new_empty(*x.shape[:-1], N), x.new_empty(*x.shape), x.new_empty(*x.shape)
    linear_into(x, weight, out, scale=scale, norm=(residual, norm_weight, eps, normed, hidden))
    return out, normed, hidden


@torch.library.custom_op("qmoe::add_rms_norm_linear", mutates_args=())
def _add_rms_norm_linear_op(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _add_rms_norm_linear(x, residual, norm_weight, eps, weight, scale)


@_add_rms_norm_linear_op.register_fake
def _(x, residual, norm_weight, eps, weight, scale=None):
    return x.new_empty(*x.shape[:-1], weight.shape[0]), torch.empty_like(x), torch.empty_like(x)


def add_rms_norm_linear(x, residual, norm_weight, eps, weight, scale=None):
    """naive.add_rms_norm_linear: (linear(normed, weight[, scale]), normed, hidden) with hidden = x + residual and
    normed = rms_norm(hidden) * (1 + norm_weight). On the GEMV path (M = 1; any M the table runs as GEMVs) the add
    and the norm run in its prologue (one launch: every program normalises its row; the first N tile's programs
    write normed and hidden); else the norm kernel, then the projection (Triton up to 64 rows, cuBLAS above)."""
    if kernels.tracing():
        args = (x, residual, norm_weight, eps, weight) + (() if scale is None else (scale,))
        return _add_rms_norm_linear_op(*args)
    return _add_rms_norm_linear(x, residual, norm_weight, eps, weight, scale)


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T -> [..., N] in x's dtype (naive.linear's semantics; fp32 accumulation).
    weight rows must be contiguous (stride(1) == 1; any row stride, e.g. a row slice of a fused buffer); x may
    be any view. scale: weight is fp8 (kernels/fp8.py). Through the custom op only while torch.export traces
    (the scale passed only when there is one, so dense graphs are unchanged); eager calls launch directly."""
    if kernels.tracing():
        return _linear_op(x, weight) if scale is None else _linear_op(x, weight, scale)
    return _linear(x, weight, scale=scale)


def logits(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """naive.logits: linear(x, weight[, scale]) rounded to x's dtype, as fp32 [..., N]. Up to 64 rows (split-K
    plans aside) the GEMV stores the rounded result as fp32 itself, so the step has no cast kernel (3.7 us at the
    35B's 248,320-entry vocabulary, results/profile_decode_loop.json at d2a60d7)."""
    if kernels.tracing():
        return _logits_op(x, weight) if scale is None else _logits_op(x, weight, scale)
    return _logits(x, weight, scale=scale)
