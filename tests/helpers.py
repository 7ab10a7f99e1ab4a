"""Test helpers: the tiny model's architecture, NaN-poisoned outputs, relative error against a reference, FP8
activations as the prefill kernels quantize them and data / a patch for Triton's interpreter's e4m3 conversion."""

import contextlib
from pathlib import Path

import torch
import yaml

from kernels.fp8 import BLOCK_K, FP8_MAX, dequantize, quantize_rows
from qmoe.model import ModelConfig

# The default model (configs/model/qwen35_moe_tiny.yaml): every structural feature at CPU-test size.
TINY_ARCH = yaml.safe_load((Path(__file__).parents[1] / "configs/model/qwen35_moe_tiny.yaml").read_text())["arch"]


def tiny_config(**changes) -> ModelConfig:
    return ModelConfig.from_dict({**TINY_ARCH, **changes})


def linear_config(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K=1) -> dict:
    """A kernels/linear launch config forced through linear_into(config=...): 4 warps, one stage."""
    return dict(BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, SPLIT_K=SPLIT_K, num_warps=4, num_stages=1)


def persistent_config(BLOCK_N, BLOCK_K, programs_per_sm) -> dict:
    """The persistent GEMV's config: row blocks of BLOCK_N strided over programs_per_sm programs per SM."""
    return {**linear_config(1, BLOCK_N, BLOCK_K), "PERSISTENT": programs_per_sm}


def fused_padding(model) -> list[tuple[torch.Tensor, int]]:
    """(fused buffer, bytes of zero rows its storage holds past it) for each projection buffer fuse_projections_
    made (weights and fp8 scales): the rows up to a multiple of 16 bytes of elements."""
    fused = [b for n, b in model.named_buffers() if b is not None and n.endswith(("in_proj", "qkv_proj", "proj_scale"))]
    return [(b, b.untyped_storage().nbytes() - b.nbytes) for b in fused]


def poisoned(*shape, dtype=torch.float32, device="cpu") -> torch.Tensor:
    """An output buffer filled with NaN, so anything a kernel forgets to write fails the comparison."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere in out gives inf."""
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def captured(fn):
    """(CUDA graph, its static output) of fn(), captured after one warm-up call on a side stream (compilation and
    first-call allocations stay out of the capture); replay the graph after writing new inputs in place."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] as the FP8 prefill kernels see it: each (row, 128-wide K group) quantized by quantize_rows' rule
    (kernels/fp8.quantize_tile), dequantized to float64."""
    q, s = quantize_rows(x)
    return dequantize(q, s, torch.float64)


# Triton's CPU interpreter (triton 3.9, runtime/interpreter.py _convert_float) converts fp32 -> e4m3 wrongly in three
# cases, checked with a one-line conversion kernel against torch (tests/kernel_ops/test_fp8_quantize.py keeps the
# check): ties round away from zero (RNE: to even); a value that rounds up into the next binade loses the carry when
# the exponent field is odd (125 -> 64, 31.7 -> 16, 1.97 -> 1: ~3 % of uniform values); e4m3 subnormals (|q| <
# 2^-6) come out wrong. Everything else (exact values, values off a tie that do not carry) converts right.
E4M3_MIN_NORMAL = 2.0**-6
E4M3_MANTISSA_BITS = 3


def _e4m3_grid(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """|q| (float64, normal e4m3 range) -> (the e4m3 value at or below it, the spacing of e4m3 values there)."""
    _, e = torch.frexp(q.abs())  # |q| = m * 2^e, m in [0.5, 1)
    ulp = torch.ldexp(torch.ones_like(q), e - 1 - E4M3_MANTISSA_BITS)
    return torch.floor(q.abs() / ulp) * ulp, ulp


def fp8_interpreter_unsafe(x: torch.Tensor) -> torch.Tensor:
    """The elements of x [..., K] whose quantized value (quantize_rows' rule) the interpreter converts wrongly:
    bool [..., K]."""
    K = x.shape[-1]
    pad = -K % BLOCK_K
    xf = torch.nn.functional.pad(x.float(), (0, pad)).unflatten(-1, (-1, BLOCK_K))
    _, scale = quantize_rows(x)
    q = (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).double()  # in fp32, as the kernel divides
    lo, ulp = _e4m3_grid(q)
    frac = (q.abs() - lo) / ulp
    subnormal = (q != 0) & (q.abs() < E4M3_MIN_NORMAL)
    tie = frac == 0.5
    carry = (frac > 0.5) & (torch.frexp(lo + ulp)[0] == 0.5)  # rounds up to a power of two
    return (subnormal | tie | carry).flatten(-2)[..., :K]


def fp8_interpreter_safe(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] (any float dtype) with each element whose quantized value the interpreter would convert wrongly
    moved to a quarter of the e4m3 spacing above the e4m3 value below it (subnormal ones to 0), in x's dtype. Each
    group's largest magnitude (448 after scaling: never unsafe) and so its scale are unchanged; the other moved
    elements shrink by less than one e4m3 step (< 12.5 %). Exact kernels then match quantize_rows bit for bit."""
    x = x.clone()
    for _ in range(3):  # rounding the moved values to x's dtype could, in principle, land on an unsafe one again
        bad = fp8_interpreter_unsafe(x)
        if not bad.any():
            return x
        K = x.shape[-1]
        _, scale = quantize_rows(x)
        scale = scale.double().repeat_interleave(BLOCK_K, -1)[..., :K]
        q = x.double() / scale
        lo, ulp = _e4m3_grid(q)
        safe = torch.where(q.abs() < E4M3_MIN_NORMAL, 0.0, torch.sign(q) * (lo + ulp / 4)) * scale
        x = torch.where(bad, safe.to(x.dtype), x)
    raise AssertionError("fp8_interpreter_safe: some elements stay unsafe after 3 rounds")


@contextlib.contextmanager
def exact_fp8_interpreter():
    """Within the block, Triton's interpreter converts fp32 -> e4m3 (float8e4nv) as sm_89+ hardware does (cvt.rn.
    satfinite: round to nearest even, finite values past +-448 and inf saturate, NaN stays NaN), through torch.
    For values a test cannot choose: an activation a kernel computes and then quantizes (the MoE down kernel's h).
    Other conversions keep the interpreter's own code."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter._convert_float

    def convert(input, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype == tl.float8e4nv:
            values = torch.from_numpy(np.ascontiguousarray(input).view(np.float32).copy())
            q = values.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)  # clamp keeps NaN, saturates inf
            return q.view(torch.uint8).numpy().reshape(input.shape)
        return original(input, input_dtype, output_dtype, rounding_mode)

    interpreter._convert_float = convert
    try:
        yield
    finally:
        interpreter._convert_float = original
