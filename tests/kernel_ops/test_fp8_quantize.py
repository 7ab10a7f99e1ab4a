"""kernels/fp8.quantize_tile (the activation quantization inside the FP8 prefill GEMMs) against quantize_rows, the
torch rule it must equal bit for bit: on the CPU interpreter on data whose quantized values it converts right
(tests/helpers.fp8_interpreter_safe), on the GPU on any data. Also the interpreter's fp32 -> e4m3 defect itself, so
the claim the helpers rest on stays checked."""

import pytest
import torch
import triton
import triton.language as tl

from kernels.fp8 import (
    FP8,
    FP8_MAX,
    _div_rn_rows,
    dequantize,
    dequantize_rows,
    quantize_activations,
    quantize_rows,
    quantize_tile,
)
from tests.helpers import exact_fp8_interpreter, fp8_interpreter_safe, fp8_interpreter_unsafe


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, s_ptr, M, K, BLOCK_M: tl.constexpr):
    """Program (row tile, K group): quantize_tile of x[rows, group] -> q [M, K] fp8, s [M, ceil(K / 128)]."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    group = tl.program_id(1)
    cols = group * 128 + tl.arange(0, 128)
    mask = (rows < M)[:, None] & (cols < K)[None, :]
    x = tl.load(x_ptr + rows[:, None] * K + cols[None, :], mask=mask, other=0.0)  # past K: 0, the torch padding
    q, scale = quantize_tile(x)
    tl.store(q_ptr + rows[:, None] * K + cols[None, :], q, mask=mask)
    tl.store(s_ptr + rows * tl.cdiv(K, 128) + group, scale, mask=rows < M)


def quantize(x: torch.Tensor, block_m: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    M, K = x.shape
    q = torch.full((M, K), 0x7F, dtype=torch.uint8, device=x.device).view(FP8)  # NaN: a forgotten store shows
    s = torch.full((M, triton.cdiv(K, 128)), float("nan"), device=x.device)
    _quantize_kernel[(triton.cdiv(M, block_m), triton.cdiv(K, 128))](x, q, s, M, K, BLOCK_M=block_m)
    return q, s


def assert_bit_identical(x: torch.Tensor, block_m: int = 64) -> None:
    q, s = quantize(x, block_m)
    ref_q, ref_s = quantize_rows(x)
    assert torch.equal(s.view(torch.int32), ref_s.view(torch.int32)), "scales differ"
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)), (
        f"{(q.view(torch.uint8) != ref_q.view(torch.uint8)).sum().item()} fp8 values differ"
    )


@triton.jit
def _convert_kernel(x_ptr, q_ptr, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(q_ptr + offs, tl.load(x_ptr + offs, mask=offs < N).to(tl.float8e4nv), mask=offs < N)


def converted(x: torch.Tensor) -> torch.Tensor:
    q = torch.empty(x.shape, dtype=FP8, device=x.device)
    _convert_kernel[(triton.cdiv(x.numel(), 1024),)](x, q, x.numel(), BLOCK=1024)
    return q.view(torch.uint8)


def e4m3_values() -> torch.Tensor:
    """Every finite positive e4m3fn value, ascending."""
    v = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    return v[torch.isfinite(v) & (v > 0)].unique()


def test_interpreter_fp32_to_e4m3_is_wrong_only_where_the_helper_says():
    """The interpreter (no GPU) against torch's conversion (RNE) on values in [-448, 448]: every value it gets wrong is
    one fp8_interpreter_unsafe flags (ties, round-ups into a power of two, e4m3 subnormals), at a scale of 1 (a group
    whose largest magnitude is 448 has scale 1 exactly, so q = x). Passes as well if a later Triton fixes it."""
    v = e4m3_values()
    mids = (v[:-1] + v[1:]) / 2
    probes = [v, mids, torch.nextafter(mids, torch.tensor(0.0)), torch.nextafter(mids, torch.tensor(1e9))]
    probes.append((torch.rand(20000, generator=torch.Generator().manual_seed(0)) * 2 - 1) * FP8_MAX)
    x = torch.cat(probes)
    x = torch.cat([x, -x])
    x = torch.nn.functional.pad(x, (0, -x.numel() % 127))
    groups = torch.cat([torch.full((x.numel() // 127, 1), FP8_MAX), x.view(-1, 127)], 1)  # scale 1 per group
    assert torch.equal(quantize_rows(groups)[1], torch.ones(groups.shape[0], 1))
    wrong = converted(groups.flatten()) != groups.flatten().to(FP8).view(torch.uint8)
    assert not (wrong & ~fp8_interpreter_unsafe(groups).flatten()).any()
    if torch.cuda.is_available() or not wrong.any():
        return
    # the defect as described in tests/helpers.py: the three kinds, and nothing else
    ties, carries, subnormals = torch.tensor([2.125, 17.0]), torch.tensor([125.0, 31.7, 1.97]), v[:7] * 1.3
    for kind in (ties, carries, subnormals):
        assert (converted(kind) != kind.to(FP8).view(torch.uint8)).any()


F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
# (M, K, BLOCK_M, reason)
SHAPES = [
    (1, 128, 16, "one row, one group: 15 masked rows"),
    (37, 300, 64, "M < BLOCK_M; K = 2 * 128 + 44: the last group is padded with zeros"),
    (130, 256, 64, "three row tiles, the last holds 2 rows"),
    (64, 100, 64, "K < 128"),
]


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize("M,K,block_m,reason", SHAPES, ids=[s[-1].split(":")[0] for s in SHAPES])
def test_quantize_tile_equals_quantize_rows(M, K, block_m, reason, dtype):
    """Bit-identical q and scales on interpreter-safe data, with the groups that single out a rule: all zero
    (scale 1), the largest magnitude negative (the scale comes from |x|: q = -448 there), one row 1000x the others
    (its own scales), a group of values around 1e-3 of the others (many small q), a group around 1e-30 (scales
    below 2^-80: the per-element tl.div_rn branch)."""
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M + K))
    x[0, : min(K, 128)] = 0
    if M > 3:
        x[1, 5] = -50.0  # far above the rest of its group, negative
        x[2] *= 1000
        x[3, : min(K, 128)] *= 1e-3
    if M > 4 and dtype != F16:  # a group below 448 * 2^-80: its tile takes the per-element division
        x[4, : min(K, 128)] *= 1e-30
    x = fp8_interpreter_safe(x.to(dtype))
    assert_bit_identical(x, block_m)
    q, s = quantize(x, block_m)
    assert torch.equal(s[0, 0], torch.tensor(1.0)) and not q[0, : min(K, 128)].float().any()
    if M > 3:
        assert q[1, 5].float() == -FP8_MAX


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy's inf / inf, meant
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_quantize_tile_inf_and_nan(dtype):
    """What happens with non-finite activations (quantize_rows' rule): an inf makes its group's scale inf, its q NaN
    (inf / inf) and the group's finite q 0; a NaN is NaN in q and the group's scale comes from its other elements
    (the amax skips NaN); a group of NaN only gets scale 1. Either way the products are NaN, so the token's outputs
    are NaN, as on the torch path. Here with the interpreter's conversion made exact (its NaN -> e4m3 is wrong too);
    on the GPU as compiled in the gpu test."""
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(0))
    x[0, 3], x[1, 200], x[2, 7], x[3, 130], x[4, :128] = (
        float("inf"),
        float("-inf"),
        float("nan"),
        float("nan"),
        float("nan"),
    )
    x = x.to(dtype)
    with exact_fp8_interpreter():
        q, s = quantize(x)
    ref_q, ref_s = quantize_rows(x)
    assert torch.equal(s, ref_s) and s[0, 0] == float("inf") and s[4, 0] == 1.0
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
    assert q[0, 3].float().isnan() and not q[0, 4:128].float().any()
    assert q[2, 7].float().isnan() and q.float()[2, :128].nan_to_num().abs().max() == FP8_MAX


def test_exact_fp8_interpreter_converts_like_torch():
    """The test-only patch: RNE on ties, carries into the next binade and subnormals; saturation past 448 (the
    hardware's satfinite, where torch would give NaN); the interpreter's own conversion back afterwards."""
    v = e4m3_values()
    x = torch.cat([v, (v[:-1] + v[1:]) / 2, v * 1.97, torch.tensor([500.0, float("inf"), -1e9])])
    with exact_fp8_interpreter():
        got = converted(x)
    assert torch.equal(got, x.clamp(-FP8_MAX, FP8_MAX).to(FP8).view(torch.uint8))
    if not torch.cuda.is_available():
        assert not torch.equal(converted(x), got)  # restored: the interpreter's own (wrong) conversion again


def hard_rows(M: int, K: int, device: str) -> torch.Tensor:
    """Rows built to hit every rounding case: groups led by 448 (scale exactly 1), then exact e4m3 values, exact ties
    between neighbours, values just above / below ties, values rounding up into a power of two, e4m3 subnormals and
    values below the smallest subnormal; then random rows with heavy tails (many small q), the last row tiny."""
    v = e4m3_values()
    mids = (v[:-1] + v[1:]) / 2
    cases = torch.cat([v, mids, torch.nextafter(mids, torch.tensor(0.0)), torch.nextafter(mids, torch.tensor(1e9)),
                       v * 1.97, v[:8] / 3, torch.tensor([2.0**-10, 2.0**-11, 3 * 2.0**-11])])  # fmt: skip
    cases = torch.cat([cases, -cases])
    cases = torch.nn.functional.pad(cases, (0, -cases.numel() % 127)).view(-1, 127)
    led = torch.cat([torch.full((cases.shape[0], 1), FP8_MAX), cases], 1)  # [R, 128]
    gen = torch.Generator().manual_seed(M)
    x = torch.randn(M, K, generator=gen) ** 3 * torch.rand(M, 1, generator=gen) * 10
    r = min(M, led.shape[0])
    x[:r, :128] = led[:r]
    x[-1, :128] *= 1e-30  # scales below 2^-80 (fp32, bf16): the per-element division (fp16 flushes it to 0)
    return x.to(device)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize("block_m", [64, 128])
def test_quantize_tile_gpu_bit_identical(dtype, block_m):
    """Compiled for the GPU (cvt.rn.satfinite, div.rn), on any data: bit-identical to quantize_rows on the GPU."""
    x = hard_rows(4099, 2048 + 72, "cuda").to(dtype)
    assert_bit_identical(x, block_m)


@pytest.mark.gpu
def test_quantize_tile_gpu_inf_and_nan():
    """Non-finite values on the GPU: scales bit-identical; q equal where finite, NaN at the same places (the sign bit
    of a NaN byte is not compared)."""
    x = torch.randn(5, 256, device="cuda")
    x[0, 3], x[1, 200], x[2, 7], x[3, 130], x[4, :128] = (
        float("inf"),
        float("-inf"),
        float("nan"),
        float("nan"),
        float("nan"),
    )
    q, s = quantize(x)
    ref_q, ref_s = quantize_rows(x)
    assert torch.equal(s, ref_s)
    nan, ref_nan = q.float().isnan(), ref_q.float().isnan()
    assert torch.equal(nan, ref_nan)
    assert torch.equal(q.view(torch.uint8)[~nan], ref_q.view(torch.uint8)[~nan])


@triton.jit
def _div_kernel(x_ptr, s_ptr, q_ptr, R: tl.constexpr):
    rows = tl.arange(0, R)
    offs = rows[:, None] * 128 + tl.arange(0, 128)[None, :]
    tl.store(q_ptr + offs, _div_rn_rows(tl.load(x_ptr + offs), tl.load(s_ptr + rows)))


def test_div_rn_rows_is_ieee_division():
    """quantize_tile's division (one reciprocal per row, Markstein's fma correction) equals IEEE x / s bit for bit:
    random and adversarial scales (significands 1, 1 + ulp, 2 - ulp, amax / 448 of random amax), dividends with
    every magnitude a quotient up to 448 can have, quotients exactly on e4m3 ties, signed zeros. The interpreter's
    fma rounds once, as the GPU's does (a wider sweep over every significand: the report of this change)."""
    gen = torch.Generator().manual_seed(0)
    R = 64
    s = torch.rand(R, generator=gen) * 1000 * (1 / FP8_MAX) + 1e-6
    s[:3] = torch.tensor([1.0, 1.0 + 2**-23, 2.0 - 2**-23])
    s[3:8] = torch.tensor([2.0**-80, 2.0**100, 3.0, 1.5, 0.1])
    q = torch.rand(R, 128, generator=gen) * 2 * FP8_MAX - FP8_MAX
    q[:, :32] = torch.ldexp(torch.rand(R, 32, generator=gen) + 1, torch.randint(-12, 9, (R, 32), generator=gen))
    v = e4m3_values()
    q[:, 32:64] = ((v[:-1] + v[1:]) / 2)[torch.randint(0, v.numel() - 1, (R, 32), generator=gen)]  # ties
    x = q * s[:, None]
    x[0, 0], x[1, 0] = 0.0, -0.0
    got = torch.empty_like(x)
    _div_kernel[(1,)](x, s, got, R=R)
    assert torch.equal(got.view(torch.int32), (x / s[:, None]).view(torch.int32))


def assert_prepass_bit_identical(x: torch.Tensor, block_m: int = 64) -> None:
    q, s = quantize_activations(x, block_m)
    ref_q, ref_s = quantize_rows(x)
    assert q.dtype == FP8 and s.dtype == torch.float32 and q.is_contiguous() and s.is_contiguous()
    assert torch.equal(s.view(torch.int32), ref_s.view(torch.int32)), "scales differ"
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)), (
        f"{(q.view(torch.uint8) != ref_q.view(torch.uint8)).sum().item()} fp8 values differ"
    )


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize("M,K,block_m,reason", SHAPES, ids=[s[-1].split(":")[0] for s in SHAPES])
def test_quantize_activations_equals_quantize_rows(M, K, block_m, reason, dtype):
    """The pre-pass (kernels/fp8.quantize_activations) on interpreter-safe data with the same special groups as
    above, its x a row slice of a wider buffer (a row stride): q and scales bit-identical to quantize_rows."""
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M + K))
    x[0, : min(K, 128)] = 0
    if M > 3:
        x[1, 5] = -50.0
        x[2] *= 1000
        x[3, : min(K, 128)] *= 1e-3
    if M > 4 and dtype != F16:
        x[4, : min(K, 128)] *= 1e-30
    x = fp8_interpreter_safe(x.to(dtype))
    wide = torch.full((M, K + 40), float("nan"), dtype=dtype)  # NaN beside the rows: a read past K shows
    wide[:, 20 : 20 + K] = x
    assert_prepass_bit_identical(wide[:, 20 : 20 + K], block_m)
    assert_prepass_bit_identical(x, block_m)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_quantize_activations_inf_nan_and_empty():
    """Non-finite values follow quantize_rows (the interpreter's conversion made exact); M = 0 returns empty tensors
    of the right shapes; a non-2-D x is refused."""
    x = torch.randn(5, 300, generator=torch.Generator().manual_seed(1))
    x[0, 3], x[1, 200], x[2, 7], x[4, :128] = float("inf"), float("-inf"), float("nan"), float("nan")
    with exact_fp8_interpreter():
        q, s = quantize_activations(x)
    ref_q, ref_s = quantize_rows(x)
    assert torch.equal(s, ref_s) and torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
    q, s = quantize_activations(torch.empty(0, 300))
    assert q.shape == (0, 300) and s.shape == (0, 3)
    with pytest.raises(ValueError, match="must be"):
        quantize_activations(torch.empty(2, 3, 4))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [F32, F16, BF16])
def test_quantize_activations_gpu_bit_identical(dtype):
    """The pre-pass compiled for the GPU on hard data (hard_rows), rows strided: bit-identical to quantize_rows."""
    x = hard_rows(4099, 2048 + 72, "cuda").to(dtype)
    assert_prepass_bit_identical(x)
    wide = torch.zeros(4099, 2048 + 200, dtype=dtype, device="cuda")
    wide[:, 64 : 64 + x.shape[1]] = x
    assert_prepass_bit_identical(wide[:, 64 : 64 + x.shape[1]], 32)


DEQUANTIZE_CASES = [
    (1, 128, "one row, one whole block"),
    (37, 300, "a partial last row tile (16-row programs) and a partial last block (K = 300)"),
    (16, 100, "K < 128: one partial block"),
    (70, 640, "whole blocks, 5 row tiles"),
]


def random_fp8(rows: int, cols: int, gen, nan: bool) -> torch.Tensor:
    """[rows, cols] random e4m3 codes, the first row ending in 0, -0, the smallest subnormal, 448 and (nan) NaN. Without
    nan its codes become +-448: Triton's CPU interpreter reads them as +-480 (e4m3 without NaN), the GPU as NaN."""
    codes = torch.randint(0, 256, (rows, cols), generator=gen, dtype=torch.uint8)
    codes[0, -5:] = torch.tensor([0x00, 0x80, 0x01, 0x7E, 0x7F], dtype=torch.uint8)
    if not nan:
        codes = torch.where(codes & 0x7F == 0x7F, codes - 1, codes)
    return codes.view(FP8)


@pytest.mark.parametrize("N,K,reason", DEQUANTIZE_CASES, ids=[c[2] for c in DEQUANTIZE_CASES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # bf16: the interpreter truncates; the GPU test
def test_dequantize_rows_equals_dequantize(N, K, reason, dtype):
    """The Triton pass is torch's dequantize bit for bit (fp32 product, one rounding) over the e4m3 codes (random
    bytes: zeros, subnormals, +-448; NaN in the GPU test) and scales over twelve binades, for a weight that is a row
    slice of a wider fused buffer (a row stride and an offset)."""
    gen = torch.Generator().manual_seed(N * K)
    weight = random_fp8(N + 5, K + 32, gen, nan=False)[:N, 32:]  # from column 32 of wider rows
    blocks = -(-K // 128)
    scale = torch.exp2(torch.randint(-10, 2, (N, blocks), generator=gen).float()) * torch.rand(N, blocks, generator=gen)
    assert (weight.float() == 0).any() and (weight.float().abs() < 2**-6).any()
    torch.testing.assert_close(dequantize_rows(weight, scale, dtype), dequantize(weight, scale, dtype), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dequantize_rows_gpu_bit_identical(dtype):
    """On the GPU at the 35B DeltaNet in-projection's shape (what a prefill dequantizes per call), NaN codes
    included, the first rows of a larger buffer: torch's dequantize bit for bit."""
    gen = torch.Generator().manual_seed(0)
    weight = random_fp8(12352 + 40, 2048, gen, nan=True).cuda()[:12352]
    scale = torch.rand(12352, 16, generator=gen).cuda()
    got, want = dequantize_rows(weight, scale, dtype), dequantize(weight, scale, dtype)
    assert want.isnan().any()
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_dequantize_rows_refuses_what_it_cannot_read():
    q, scale = quantize_rows(torch.randn(8, 300))
    with pytest.raises(ValueError, match=r"dequantize_rows: weight \[N, K\] with contiguous rows"):
        dequantize_rows(q.t(), scale, torch.bfloat16)
    with pytest.raises(ValueError, match=r"dequantize_rows"):
        dequantize_rows(q, scale[:, :2], torch.bfloat16)
    assert dequantize_rows(q[:0], scale[:0], torch.bfloat16).shape == (0, 300)
