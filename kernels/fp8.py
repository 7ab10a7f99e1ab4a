"""FP8 weights: the one layout every fp8 kernel reads, and the conversions into and out of it.

A quantized weight is a pair: `weight` float8_e4m3fn [..., N, K] and `scale` float32 [..., N, ceil(K / 128)],
one multiplier per (row, 128-wide K block): w[..., n, k] = weight[..., n, k] * scale[..., n, k // 128].
Row-granular scales let projections of any row count be concatenated into one fused [sum n_i, K] buffer (the
router's 256 rows, the shared-expert gate's 1, DeltaNet's b / a 32 each) without a 128-row block straddling two of
them. Both checkpoint formats map onto it exactly: a 128x128 block scale is repeated over its block's rows
(`rows_from_blocks`), a per-channel scale [N, 1] over the K blocks (`rows_from_channels`). The scales cost 1/32 of
the fp8 bytes.

Activations are quantized by the same rule, per (token, 128-wide K group), in one pre-pass before the prefill
GEMMs (`quantize_activations`: x [M, K] -> fp8 q [M, K] and fp32 scales [M, ceil(K / 128)], one read of x, one
program per [BLOCK_M, 128] tile running `quantize_tile`, a Triton device function), bit-identical on the GPU to
`quantize_rows` on the same rows. The GEMMs then read fp8 activations and their scales: quantizing inside their K
loops instead re-quantized each activation tile once per output tile (N / BLOCK_N times), and its CUDA-core work
per step cost more than the step's wgmma (qmoe issue #16: 424 us per 35B dense projection at 4096 tokens).
The rule: scale = amax * fl32(1 / 448) (an all-zero group: 1), q = x / scale
(IEEE division) clamped to +-448 and rounded to nearest even e4m3. The scale is a product with the fp32
reciprocal, not a division, because that is what torch computes on CUDA for `amax / 448.0` (a division by a
Python scalar multiplies by its reciprocal there; on the CPU it divides, which differs in the last bit for about
half the groups): written out, the CPU, the GPU and the Triton tile agree.
"""

import torch
import triton
import triton.language as tl

from kernels.launch import cdiv, fast_launch
from kernels.pdl import allow_dependents, pdl, wait_for_producers

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
INV_FP8_MAX = 1.0 / FP8_MAX  # a Python float: torch and Triton both round it to fp32 before multiplying
_FP8_MAX = tl.constexpr(FP8_MAX)  # the same two for @triton.jit code (which reads only constexpr globals)
_INV_FP8_MAX = tl.constexpr(INV_FP8_MAX)
# quantize_tile's division by one reciprocal per row is exact for scales in this range (_div_rn_rows)
_MIN_FAST_SCALE = tl.constexpr(2.0**-80)
BLOCK_K = 128  # K columns per scale
QUANTIZE_CHUNK = 1 << 26  # elements quantized per step: bounds the fp32 temporaries (256 MB)


def k_blocks(K: int) -> int:
    return -(-K // BLOCK_K)


def scale_shape(shape) -> tuple:
    """The scale's shape for a weight of `shape` [..., N, K] -> [..., N, ceil(K / 128)]."""
    return (*shape[:-1], k_blocks(shape[-1]))


def expand_scale(scale: torch.Tensor, K: int) -> torch.Tensor:
    """[..., N, ceil(K / 128)] -> [..., N, K]: each scale repeated over its K block."""
    return scale.repeat_interleave(BLOCK_K, dim=-1)[..., :K]


def dequantize(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """weight [..., N, K] fp8 * scale [..., N, Kb] -> [..., N, K] in dtype (computed in fp32, rounded once). The
    reference of dequantize_rows, and what the CPU runs (its fp32 temporaries: ~13 bytes moved per element)."""
    return (weight.float() * expand_scale(scale.float(), weight.shape[-1])).to(dtype)


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] -> (fp8 [..., N, K], scale fp32 [..., N, Kb]) with scale = amax of the (row, K block) / 448
    (as amax * fl32(1 / 448): the module docstring), so each block's largest value maps onto e4m3's largest. An
    all-zero block gets scale 1. The amax skips NaN (as the GPU's max does in quantize_tile): a NaN element is NaN
    in q and leaves its block's scale to the others; an inf gives scale inf, so the block's finite elements are 0
    and the inf is NaN (inf / inf)."""
    K = w.shape[-1]
    pad = k_blocks(K) * BLOCK_K - K
    blocks = torch.nn.functional.pad(w.float(), (0, pad)).unflatten(-1, (-1, BLOCK_K))  # [..., N, Kb, 128]
    amax = blocks.abs().nan_to_num_(nan=0.0, posinf=float("inf")).amax(-1)  # [..., N, Kb]
    scale = torch.where(amax > 0, amax * INV_FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).flatten(-2)[..., :K].to(FP8)
    return q, scale


@torch.no_grad()
def quantize_into(weight: torch.Tensor, scale: torch.Tensor, w: torch.Tensor) -> None:
    """Quantize w [..., N, K] (any float dtype, on weight's device) into weight (fp8) and scale, a few rows at a
    time, so the fp32 temporaries stay small whatever the tensor's size."""
    rows = w.reshape(-1, w.shape[-1])
    step = max(1, QUANTIZE_CHUNK // max(1, w.shape[-1]))
    q_rows, s_rows = weight.view(-1, weight.shape[-1]), scale.view(-1, scale.shape[-1])
    for r in range(0, rows.shape[0], step):
        q_rows[r : r + step], s_rows[r : r + step] = quantize_rows(rows[r : r + step].to(weight.device))


def rows_from_blocks(scale_inv: torch.Tensor, N: int, K: int, block: tuple[int, int]) -> torch.Tensor:
    """A block-FP8 checkpoint's weight_scale_inv [..., ceil(N / bn), ceil(K / bk)] (bk a multiple of 128) ->
    [..., N, ceil(K / 128)] fp32."""
    bn, bk = block
    rows = scale_inv.float().repeat_interleave(bn, dim=-2)[..., :N, :]
    return rows.repeat_interleave(bk // BLOCK_K, dim=-1)[..., : k_blocks(K)]


def rows_from_channels(scale: torch.Tensor, K: int) -> torch.Tensor:
    """A per-channel checkpoint's weight_scale [..., N, 1] -> [..., N, ceil(K / 128)] fp32."""
    return scale.float().expand(*scale.shape[:-1], k_blocks(K)).contiguous()


@triton.jit
def _div_rn_rows(x, scale):
    """x [R, C] / scale [R] correctly rounded (= tl.div_rn(x, scale[:, None])) with one IEEE division per row:
    y = RN(1 / s), q0 = RN(x y), r = q0 s - x (exact in one fma), q = RN(q0 - r y) (Markstein's correction: with y
    correctly rounded and q0 within an ulp of x / s, the fma rounds to RN(x / s)). Three fp32 instructions per
    element instead of div.rn's ~10 with a reciprocal (MUFU) and a slow-path call each. Valid while nothing
    underflows: quantize_tile takes it only for scales in [2^-80, inf), where x = q s >= 2^-90 wherever q >= 2^-10
    (below that e4m3 rounds to 0 whatever the last bits). Checked bitwise against IEEE division on every fp32
    significand of x in five binades of quotients from 2^-9 to 2^9, both signs, for 128 scales (random amax / 448,
    significands 1, 1 + ulp, 2 - ulp, 2^-80 and 2^100 ranges): 1.6e10 quotients, no difference. -0 stays -0: the
    correction multiplies by -y (per row) instead of negating r, because Triton compiles -r as 0 - r, which is +0
    for r = +0 (the residual of x = -0), and +0 + -0 would give +0 (seen on the H200 with fp16 rows)."""
    y = tl.div_rn(1.0, scale)[:, None]
    s = scale[:, None]
    q0 = x * y
    r = tl.fma(q0, s, -x)
    return tl.fma(r, -y, q0)


@triton.jit
def quantize_tile(x):
    """An activation tile x [BLOCK_M, 128] (any float dtype, in registers; one 128-wide K group per row) ->
    (q float8e4nv [BLOCK_M, 128], scale fp32 [BLOCK_M]) by quantize_rows' rule, bit-identical to it on the GPU:
    the amax skips NaN (tl.max; quantize_rows' amax does too), the division is IEEE (_div_rn_rows, or tl.div_rn
    per element for a tile with a scale below 2^-80 or inf; Triton's `/` is approximate), the clamp keeps NaN, and
    the conversion rounds to nearest even (cvt.rn.satfinite on sm_89+).
    Columns past K must be loaded as 0 (they are quantize_rows' padding). Triton's CPU interpreter rounds some
    values wrongly in the last step (ties, values rounding up to a power of two, e4m3 subnormals, NaN:
    tests/helpers.py)."""
    xf = x.to(tl.float32)
    amax = tl.max(tl.abs(xf), axis=1)  # [BLOCK_M]
    scale = tl.where(amax > 0, amax * _INV_FP8_MAX, 1.0)
    if (tl.min(scale, 0) >= _MIN_FAST_SCALE) & (tl.max(scale, 0) < float("inf")):
        q = _div_rn_rows(xf, scale)
    else:  # tiny groups (whose residuals could underflow) or an inf: the per-element IEEE division
        q = tl.div_rn(xf, scale[:, None])
    q = tl.clamp(q, -_FP8_MAX, _FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    return q.to(tl.float8e4nv), scale


QUANTIZE_BLOCK_M = 64  # rows per program of the activation pre-pass: a [64, 128] tile (16 KB of bf16) per program


@fast_launch
@triton.jit(do_not_specialize=["M"])
def _quantize_activations_kernel(
    x_ptr, q_ptr, s_ptr, M, K, stride_xm, BLOCK_M: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr
):  # fmt: skip
    """Program (row tile, K group): quantize_tile of x[rows, group] -> q [M, K] fp8 (contiguous), s [M, Kb] fp32
    (contiguous). Columns past K load as 0 (quantize_rows' padding); rows past M are neither read nor written."""
    allow_dependents(PDL)
    wait_for_producers(PDL)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    group = tl.program_id(1)
    cols = group * 128 + tl.arange(0, 128)
    row_mask = rows < M
    rows64 = rows.to(tl.int64)
    if EVEN_K:
        mask = row_mask[:, None]
    else:
        mask = row_mask[:, None] & (cols < K)[None, :]
    x = tl.load(x_ptr + rows64[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
    q, scale = quantize_tile(x)
    tl.store(q_ptr + rows64[:, None] * K + cols[None, :], q, mask=mask)
    tl.store(s_ptr + rows64 * tl.cdiv(K, 128) + group, scale, mask=row_mask)


def quantize_activations(x: torch.Tensor, block_m: int = QUANTIZE_BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (fp32 / fp16 / bf16; any row stride, columns contiguous or copied so) -> (q float8_e4m3fn [M, K],
    scale fp32 [M, ceil(K / 128)]), both contiguous: quantize_rows' rule per (row, 128-wide K group) in one Triton
    pass over x, bit-identical to quantize_rows on the GPU (the interpreter's fp32 -> e4m3 conversion is wrong in
    places: tests/helpers.py). The prefill GEMMs' A operand."""
    if x.dim() != 2:
        raise ValueError(f"quantize_activations: x must be [M, K], got {list(x.shape)}")
    x = x if x.stride(1) == 1 else x.contiguous()
    M, K = x.shape
    q = torch.empty((M, K), dtype=FP8, device=x.device)
    scale = torch.empty((M, k_blocks(K)), dtype=torch.float32, device=x.device)
    if M == 0 or K == 0:
        return q, scale
    on = pdl(x)
    _quantize_activations_kernel[(cdiv(M, block_m), k_blocks(K))](
        x, q, scale, M, K, x.stride(0), BLOCK_M=block_m, EVEN_K=K % BLOCK_K == 0, PDL=on, launch_pdl=on
    )
    return q, scale


DEQUANTIZE_BLOCK_N = 16  # rows per program of dequantize_rows: [16, 128] fp8 in, 4 KB of bf16 out


@fast_launch
@triton.jit
def _dequantize_rows_kernel(w_ptr, s_ptr, out_ptr, N, K, stride_wn, BLOCK_N: tl.constexpr, EVEN_K: tl.constexpr):
    """Program (row tile, K block): out[rows, block] = w[rows, block] * s[rows, block], in fp32, rounded once to
    out's dtype. Rows past N and columns past K are neither read nor written."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    block = tl.program_id(1)
    cols = block * 128 + tl.arange(0, 128)
    row_mask = rows < N
    rows64 = rows.to(tl.int64)
    mask = row_mask[:, None] if EVEN_K else row_mask[:, None] & (cols < K)[None, :]
    w = tl.load(w_ptr + rows64[:, None] * stride_wn + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    scale = tl.load(s_ptr + rows64 * tl.cdiv(K, 128) + block, mask=row_mask, other=0.0)
    tl.store(
        out_ptr + rows64[:, None] * K + cols[None, :], (w * scale[:, None]).to(out_ptr.dtype.element_ty), mask=mask
    )


def dequantize_rows(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """dequantize(weight, scale, dtype) for weight [N, K] (rows contiguous, any row stride: a slice of a fused
    buffer) and its contiguous scale [N, ceil(K / 128)] in one Triton pass: 1 byte read and 2 written per element
    (bf16), where the torch composition moves ~13 through its fp32 temporaries. The bf16 weight of an FP8
    projection's prefill (kernels/linear/triton.py: FP8_PREFILL=dequantize)."""
    N, K = weight.shape
    if weight.stride(1) != 1 or tuple(scale.shape) != (N, k_blocks(K)) or not scale.is_contiguous():
        raise ValueError(
            f"dequantize_rows: weight [N, K] with contiguous rows and a contiguous scale [N, ceil(K / 128)], got "
            f"{list(weight.shape)} (strides {weight.stride()}) and {list(scale.shape)}"
        )
    out = torch.empty((N, K), dtype=dtype, device=weight.device)
    if N and K:
        _dequantize_rows_kernel[(cdiv(N, DEQUANTIZE_BLOCK_N), k_blocks(K))](
            weight, scale, out, N, K, weight.stride(0), BLOCK_N=DEQUANTIZE_BLOCK_N, EVEN_K=K % BLOCK_K == 0
        )
    return out
