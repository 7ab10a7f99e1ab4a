"""The dense projection with FP8 weights (kernels/fp8.py layout) against the dequantized weight in float64: both
kernel paths, split-K across scale-block boundaries, N and K not multiples of 128, the cuBLAS hand-over, fused row
slices. Activations fp32 / fp16 (the interpreter's tl.dot is wrong on bf16). Above 64 rows FP8 x FP8 (the activations
quantized by the pre-pass kernels/fp8.quantize_activations, then X_FP8: fp8 x fp8 steps),
against the same quantization in float64 on interpreter-safe activations
(tests/helpers.fp8_interpreter_safe), bf16 included (its dot is on fp8 tiles)."""

import pytest
import torch

from kernels.fp8 import dequantize, quantize_rows
from kernels.linear import naive
from kernels.linear import triton as lin
from tests.helpers import exact_fp8_interpreter, fp8_interpreter_safe, poisoned, quantized_activations, rel_err
from tests.helpers import linear_config as config
from tests.helpers import persistent_config as persistent

# The weight is exactly its fp8 values times the scales, so the only error is the arithmetic's.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def make(M, N, K, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen).to(dtype)
    w = torch.randn(N, K, generator=gen) / K**0.5
    w[:, 128:256] *= 50  # scale blocks of very different size: a scale applied to the wrong K block shows
    q, scale = quantize_rows(w)
    return x, q, scale


def reference(x, q, scale):
    return x.double() @ dequantize(q, scale, torch.float64).T


CASES = [
    (1, 37, 300, config(1, 8, 128), "GEMV, one scale block per step: N tail 37, K tail 44 (300 = 2 * 128 + 44)"),
    (1, 29, 300, config(1, 4, 32), "GEMV, four steps per scale block, K tail inside the last block"),
    (1, 33, 300, config(1, 4, 64, SPLIT_K=3), "GEMV split-K: splits of 2 steps start mid-scale-block"),
    (3, 17, 200, config(1, 16, 64), "GEMV path at M = 3, N < BLOCK_N"),
    (1, 37, 300, config(1, 8, 256), "GEMV, two 128-column sub-steps per step, the second step past K (tail)"),
    (1, 21, 700, config(1, 4, 512, SPLIT_K=2), "GEMV split-K of 512-column steps in 4 sub-steps, K tail"),
    (1, 40, 300, config(16, 16, 32), "dot path at M = 1: 15 masked rows"),
    (7, 45, 300, config(16, 32, 64, SPLIT_K=2), "dot split-K, M < BLOCK_M, N and K tails"),
    (37, 23, 136, config(16, 16, 128), "dot, three M tiles, K = 128 + 8"),
    (64, 130, 256, config(64, 32, 128), "dot at M = 64, N = 130 (two 128-row blocks in a checkpoint's terms)"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M,N,K,cfg,reason", CASES, ids=[c[-1].split(":")[0] for c in CASES])
def test_fp8_linear_into(M, N, K, cfg, reason, dtype):
    x, q, scale = make(M, N, K, dtype, seed=M + N + K)
    _, split, _, _ = lin.make_plan(M, N, K, cfg, fp8=True)
    out = poisoned(M, N, dtype=dtype)
    ws = poisoned(split, M, N) if split > 1 else None
    lin.linear_into(x, q, out, config=cfg, workspace=ws, scale=scale)
    assert rel_err(out, reference(x, q, scale)) < TOL[dtype], reason


@pytest.mark.parametrize("M", [1, 5, 64, 65], ids=["M1", "M5", "M64 last skinny", "M65 dequantized"])
def test_fp8_linear_default_configs_and_reference(M):
    """The public op (default configs: GEMV steps of up to 1024 columns, one scale per 128, dot steps of at most
    128; above 64 rows the dequantized weight and F.linear) and naive.linear, across the hand-over."""
    x, q, scale = make(M, 70, 300, torch.float32, seed=M)
    ref = reference(x, q, scale)
    assert rel_err(lin.linear(x, q, scale), ref) < TOL[torch.float32]
    assert rel_err(naive.linear(x, q, scale), ref) < TOL[torch.float32]
    assert lin.default_config(M, 70, 300, 8, fp8=True)["BLOCK_K"] <= (1024 if M == 1 else 128)


def test_fp8_row_slice_of_a_fused_buffer():
    """A sub-projection of a fused fp8 buffer (the model's layout): weight and scale row slices with their strides."""
    x, q, scale = make(1, 70, 300, torch.float32, seed=3)
    out = lin.linear(x, q[33:34], scale[33:34])  # shared_expert_gate: one row
    assert rel_err(out, reference(x, q[33:34], scale[33:34])) < TOL[torch.float32]


# (N, K, config, reason); the interpreter's grid is programs_per_sm * 8 "SMs"
PERSISTENT_CASES = [
    (37, 300, persistent(4, 512, 1), "K tail in the third scale block, the fourth 128-column sub-step wholly past K"),
    (67, 256, persistent(1, 256, 1), "one row per block, two scale blocks, 67 blocks over 8 programs"),
    (12, 64, persistent(4, 64, 2), "K under one scale block (SUB_K = 64), fewer blocks (3) than programs"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("N,K,cfg,reason", PERSISTENT_CASES, ids=[c[-1].split(",")[0] for c in PERSISTENT_CASES])
def test_fp8_persistent_gemv(N, K, cfg, reason, dtype):
    """The persistent GEMV on fp8 weights: each block's scales come with its rows (prefetched with them), one per
    128 columns (make's second scale block is 50x the others: a scale on the wrong block shows). Output poisoned;
    with the add + RMSNorm prologue, normed and hidden too."""
    x, q, scale = make(1, N, K, dtype, seed=N + K)
    out = poisoned(1, N, dtype=dtype)
    lin.linear_into(x, q, out, config=cfg, scale=scale)
    assert rel_err(out, reference(x, q, scale)) < TOL[dtype], reason
    gen = torch.Generator().manual_seed(K)
    residual, nw = torch.randn(1, K, generator=gen).to(dtype), (0.1 * torch.randn(K, generator=gen)).to(dtype)
    out, normed, hidden = poisoned(1, N, dtype=dtype), poisoned(1, K, dtype=dtype), poisoned(1, K, dtype=dtype)
    lin.linear_into(x, q, out, config=cfg, scale=scale, norm=(residual, nw, 1e-6, normed, hidden))
    ref_out, ref_normed, _ = naive.add_rms_norm_linear(x.double(), residual.double(), nw.double(), 1e-6, q, scale)
    tol = TOL[dtype] if dtype == torch.float32 else 1e-2  # fp16: normed is rounded before the products
    assert rel_err(out, ref_out) < tol, reason
    assert rel_err(normed, ref_normed) < tol, reason
    assert torch.equal(hidden, x + residual), reason


def test_fp8_configs_and_inputs_are_checked():
    with pytest.raises(ValueError, match=r"fp8 on the dot path needs BLOCK_K <= 128"):
        lin.make_plan(2, 8, 512, config(16, 16, 256), fp8=True)
    x, q, scale = make(1, 8, 300, torch.float32)
    with pytest.raises(ValueError, match=r"row-contiguous float32 scale \[8, 3\], got .* torch.float32 \[8, 1\]"):
        lin.linear(x, q, scale[:, :1])
    with pytest.raises(ValueError, match=r"x is torch.float32 but weight is torch.float8_e4m3fn"):
        lin.linear(x, q)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "N,K", [(12352, 2048), (9216, 2048), (1281, 2048), (2048, 512), (248320, 2048), (20608, 3072), (17408, 3072),
            (3072, 8192), (2305, 3072)],
)  # fmt: skip
@pytest.mark.parametrize("M", [1, 8, 64, 65])
def test_fp8_linear_gpu_bf16(N, K, M):
    """35B projection shapes (gdn_in, attn_qkv, moe_in, shared_down, lm_head) and the 122B's FP8 ones (gdn_in,
    attn_qkv, the out-projections, moe_in; their M = 1 entries tuned in its decode loop) in bf16 on the GPU's table
    configs (the H200's register-capped in-projection entries included; else the defaults; above 64 rows:
    the dequantized weight and cuBLAS), against fp32 on the dequantized weight: the bf16 activations' and output's
    rounding only; a CUDA-graph replay equals eager."""
    from tests.helpers import captured

    gen = torch.Generator(device="cuda").manual_seed(N + M)
    x = torch.randn(M, K, device="cuda", generator=gen).bfloat16()
    q, scale = quantize_rows(torch.randn(N, K, device="cuda", generator=gen) / K**0.5)
    ref = x.float() @ dequantize(q, scale).T
    out = lin.linear(x, q, scale)
    assert out.dtype == torch.bfloat16 and rel_err(out, ref) < 1e-2
    graph, replayed = captured(lambda: lin.linear(x, q, scale))
    graph.replay()
    torch.testing.assert_close(replayed, out, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("norm", [False, True], ids=["plain", "add+rmsnorm"])
@pytest.mark.parametrize(
    "N,K,cfg",
    [(12352, 2048, persistent(1, 2048, 8)), (9216, 2048, persistent(2, 2048, 4)), (2048, 4096, persistent(1, 4096, 4)),
     (1281, 2048, persistent(2, 2048, 4))],
    ids=["gdn_in", "attn_qkv", "gdn_out", "moe_in 1281 rows: a short last block"],
)  # fmt: skip
def test_fp8_persistent_gemv_35b_gpu(N, K, cfg, norm):
    """The persistent GEMV on fp8 weights in bf16 at 35B shapes, forced whatever the table holds: as accurate as
    the one-block-per-program GEMV against fp64 on the dequantized weight (normed too), bit-identical when replayed
    in a CUDA graph (PDL on)."""
    from tests.helpers import captured

    gen = torch.Generator(device="cuda").manual_seed(N)
    x = torch.randn(1, K, device="cuda", generator=gen).bfloat16()
    residual = torch.randn(1, K, device="cuda", generator=gen).bfloat16()
    nw = (0.1 * torch.randn(K, device="cuda", generator=gen)).bfloat16()
    q, scale = quantize_rows(torch.randn(N, K, device="cuda", generator=gen) / K**0.5)

    def run(config):
        normed, hidden = torch.empty_like(x), torch.empty_like(x)
        norm_args = (residual, nw, 1e-6, normed, hidden) if norm else None
        out = torch.empty(1, N, dtype=x.dtype, device="cuda")
        return lin.linear_into(x, q, out, config=config, scale=scale, norm=norm_args), normed

    one_block = config(1, 4, 2048 if K <= 2048 else 4096)
    ref_out, ref_normed, _ = naive.add_rms_norm_linear(x.double(), residual.double(), nw.double(), 1e-6, q, scale)
    ref = ref_out if norm else x.double() @ dequantize(q, scale, torch.float64).T
    graph, (static_out, static_normed) = captured(lambda: run(cfg))
    graph.replay()
    torch.cuda.synchronize()
    one_out, one_normed = run(one_block)
    assert rel_err(static_out, ref) <= 1.1 * rel_err(one_out, ref) + 1e-4
    if norm:
        assert rel_err(static_normed, ref_normed) <= 1.1 * rel_err(one_normed, ref_normed) + 1e-4
    assert torch.equal(static_out, run(cfg)[0])


@pytest.mark.gpu
@pytest.mark.parametrize(
    "N,K", [(12352, 2048), (9216, 2048), (1281, 2048), (2048, 4096), (2048, 512), (1000, 1000)],
    ids=["gdn_in", "attn_qkv", "moe_in", "gdn_out", "shared_down", "N and K tails"],
)  # fmt: skip
@pytest.mark.parametrize("M", [4096, 1000])
def test_fp8_prefill_gpu_35b(N, K, M, monkeypatch):
    """The FP8 x FP8 prefill (QMOE_FP8_PREFILL=fp8) compiled for the GPU (the activation pre-pass, then fp8 wgmma) at
    the 35B projection shapes, bf16: against fp32 on the activations quantized by quantize_rows (the pre-pass is
    bit-identical to it, so only accumulation order and bf16 output rounding differ); bit-reproducible; two
    launches. Then the default: the dequantize pass and cuBLAS, against fp32 on the unquantized activations."""
    monkeypatch.setattr(lin, "FP8_PREFILL", "fp8")
    gen = torch.Generator(device="cuda").manual_seed(N + K + M)
    x = torch.randn(M, K, device="cuda", generator=gen).bfloat16()
    x[7] *= 100
    q, scale = quantize_rows(torch.randn(N, K, device="cuda", generator=gen) / K**0.5)
    out = lin.linear(x, q, scale)
    ref = quantized_activations(x.float()).float() @ dequantize(q, scale).T
    assert out.dtype == torch.bfloat16 and rel_err(out, ref) < 1e-2
    assert rel_err(out, x.float() @ dequantize(q, scale).T) < ACT_QUANT_TOL
    assert torch.equal(lin.linear(x, q, scale), out)
    assert gpu_kernels(lambda: lin.linear(x, q, scale)) == ["_quantize_activations_kernel", "_linear_kernel"]
    monkeypatch.setattr(lin, "FP8_PREFILL", "dequantize")
    out = lin.linear(x, q, scale)
    assert out.dtype == torch.bfloat16 and rel_err(out, x.float() @ dequantize(q, scale).T) < 1e-2
    assert gpu_kernels(lambda: lin.linear(x, q, scale))[0] == "_dequantize_rows_kernel"


def gpu_kernels(fn) -> list[str]:
    """The names of the GPU kernels fn() launches (torch.profiler's trace, as qmoe.runtime.profile reads it)."""
    import json
    import tempfile

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    return [e["name"] for e in events if e.get("cat") == "kernel"]


# FP8 x FP8 against the unquantized activations: e4m3 keeps 3 mantissa bits, so rounding moves an element by up to
# half a step, 2^-4 of its value at the bottom of a binade and 2^-5 at its top, uniformly: 2^-4 / sqrt(3) = 3.6 % RMS
# relative down to 1.8 %, ~2.6 % over a binade (measured: 2.5 % per element on randn). A dot product of many such
# errors of random sign has about the same relative error (measured 2.1-2.9 % on these shapes). 5 % leaves room for
# short K (few terms) without hiding a wrong scale (a scale of the wrong group or token is off by 50x or 100x here).
ACT_QUANT_TOL = 0.05
# FP8 x FP8 against float64 on the same quantized activations: the fp8 products are exact in fp32, so what is left is
# fp32 accumulation, and the output's rounding to fp16 (2^-11) or bf16 (the interpreter truncates: 2^-8)
QUANT_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def prefill_x(M, K, dtype, seed):
    """Activations for the FP8 x FP8 path: random, one token 100x the others (its groups' scales are its own), an
    all-zero group (scale 1), a group led by a negative value; interpreter-safe (exact comparisons on the CPU)."""
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(seed))
    x[3] *= 100  # (fp16 outputs stay finite)
    x[5, : min(K, 128)] = 0
    x[6, 1] = -40.0
    return fp8_interpreter_safe(x.to(dtype))


# (M, N, K, config, reason): BLOCK_K = 128 (one activation and one weight scale group per step)
QUANT_CASES = [
    (65, 40, 300, config(16, 16, 128), "M 65: 5 row tiles, the last 1 row; K = 128 + 128 + 44, N tail"),
    (130, 33, 256, config(64, 32, 128, SPLIT_K=2), "split-K, one group per split; 3 row tiles, the last 2 rows"),
    (70, 130, 100, config(32, 64, 128), "K < 128: one padded group; N = 130, 3 row tiles"),
    (100, 48, 640, config(32, 16, 128, SPLIT_K=3), "split-K of 5 groups into splits of 2, 2, 1"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("M,N,K,cfg,reason", QUANT_CASES, ids=[c[-1].split(":")[0] for c in QUANT_CASES])
def test_fp8_prefill_quantizes_activations_in_a_prepass(M, N, K, cfg, reason, dtype):
    """linear_into(quantize_x=True): FP8 x FP8 with each (token, 128-wide group) of x quantized by the pre-pass, into
    NaN-filled outputs and split-K workspaces. Against the per-group quantized activations times the weight: only
    the accumulation's and the output's rounding; against the unquantized activations: the activations' FP8
    rounding, the op's stated error."""
    x, q, scale = make(M, N, K, torch.float32, seed=M + K)
    x = prefill_x(M, K, dtype, seed=M + N)
    _, split, _, meta = lin.make_plan(M, N, K, cfg, fp8=True, fp8_x=True)
    assert meta["X_FP8"]
    out = poisoned(M, N, dtype=dtype)
    ws = poisoned(split, M, N) if split > 1 else None
    lin.linear_into(x, q, out, config=cfg, workspace=ws, scale=scale, quantize_x=True)
    w = dequantize(q, scale, torch.float64)
    assert rel_err(out, quantized_activations(x) @ w.T) < QUANT_TOL[dtype], reason
    assert rel_err(out, x.double() @ w.T) < ACT_QUANT_TOL, reason
    assert rel_err(out[3:4], x[3:4].double() @ w.T) < ACT_QUANT_TOL, "the large token"
    assert rel_err(out[:3], x[:3].double() @ w.T) < ACT_QUANT_TOL, "the others: not swamped by the large token"


@pytest.mark.parametrize("M,N,K", [(65, 40, 300), (300, 24, 128)], ids=["M 65", "M 300: 3 default row tiles"])
def test_fp8_prefill_public_op_runs_fp8_x_fp8(M, N, K, monkeypatch):
    """linear() above 64 rows with an fp8 weight and QMOE_FP8_PREFILL=fp8: the pre-pass, then the FP8 x FP8 tile
    (FP8_PREFILL_CONFIG)."""
    monkeypatch.setattr(lin, "FP8_PREFILL", "fp8")
    x, q, scale = make(M, N, K, torch.float32, seed=M)
    x = prefill_x(M, K, torch.float32, seed=K)
    out = lin.linear(x, q, scale)
    assert rel_err(out, quantized_activations(x) @ dequantize(q, scale, torch.float64).T) < QUANT_TOL[torch.float32]
    grid, split, _, meta = lin.fp8_prefill_plan(M, N, K)
    assert meta["X_FP8"] and meta["BLOCK_K"] == 128 and split == 1
    assert grid == (-(-M // lin.FP8_PREFILL_CONFIG["BLOCK_M"]) * -(-N // lin.FP8_PREFILL_CONFIG["BLOCK_N"]),)


def test_fp8_prefill_configs_are_checked():
    """X_FP8 runs one activation scale group per K step: any BLOCK_K but 128 is refused in one line, as are the
    GEMV path and a weight that is not fp8; an x_scale of the wrong shape or with a non-fp8 x, and quantize_x
    together with x_scale, too."""
    for bad in (config(64, 64, 64), config(64, 64, 32, SPLIT_K=2), config(1, 8, 128)):
        with pytest.raises(ValueError, match=r"FP8 x FP8 \(fp8 activations\) needs an fp8 weight and the dot path "
                           r"with BLOCK_K = 128"):  # fmt: skip
            lin.make_plan(65, 40, 300, bad, fp8=True, fp8_x=True)
    x, q, scale = make(65, 40, 300, torch.float32)
    with pytest.raises(ValueError, match=r"got fp8=False"):
        lin.linear_into(x, dequantize(q, scale), torch.empty(65, 40), quantize_x=True)
    xq, xs = quantize_rows(x)
    for bad_x, bad_s in ((xq, xs[:, :2]), (x, xs), (xq, xs.double())):
        with pytest.raises(ValueError, match=r"x_scale goes with an fp8 x"):
            lin.linear_into(bad_x, q, torch.empty(65, 40), scale=scale, x_scale=bad_s)
    with pytest.raises(ValueError, match=r"not both"):
        lin.linear_into(xq, q, torch.empty(65, 40), scale=scale, x_scale=xs, quantize_x=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_prefill_takes_prequantized_activations(dtype):
    """linear_into(x fp8, x_scale=...): the GEMM alone on activations quantized elsewhere (quantize_rows), its x a
    row slice (a row stride), NaN-filled output and split-K workspace: equal to the same product in float64."""
    M, N, K, cfg = 70, 45, 300, config(32, 32, 128, SPLIT_K=2)
    _, q, scale = make(M, N, K, torch.float32, seed=3)
    x = prefill_x(M, K, torch.float32, seed=4)
    xq, xs = quantize_rows(x)
    wide = torch.zeros(M, K + 16, dtype=torch.uint8).view(xq.dtype)
    wide[:, 16:] = xq
    out, ws = poisoned(M, N, dtype=dtype), poisoned(2, M, N)
    lin.linear_into(wide[:, 16:], q, out, config=cfg, workspace=ws, scale=scale, x_scale=xs)
    assert rel_err(out, dequantize(xq, xs, torch.float64) @ dequantize(q, scale, torch.float64).T) < QUANT_TOL[dtype]


@pytest.mark.parametrize("M", [65, 200])
def test_add_rms_norm_linear_fp8_prefill(M, monkeypatch):
    """The add + RMSNorm before an fp8 projection above 64 rows (QMOE_FP8_PREFILL=fp8): the norm kernel, then the
    pre-pass quantizes the normed rows (computed by a kernel, so the interpreter's conversion is made exact), then
    FP8 x FP8."""
    monkeypatch.setattr(lin, "FP8_PREFILL", "fp8")
    N, K = 40, 300
    x, q, scale = make(M, N, K, torch.float32, seed=M)
    gen = torch.Generator().manual_seed(2)
    residual, nw = torch.randn(M, K, generator=gen), 0.1 * torch.randn(K, generator=gen)
    with exact_fp8_interpreter():
        out, normed, hidden = lin.add_rms_norm_linear(x, residual, nw, 1e-6, q, scale)
    _, ref_normed, _ = naive.add_rms_norm_linear(x, residual, nw, 1e-6, q, scale)
    assert rel_err(normed, ref_normed) < TOL[torch.float32] and torch.equal(hidden, x + residual)
    w = dequantize(q, scale, torch.float64)
    assert rel_err(out, quantized_activations(normed) @ w.T) < QUANT_TOL[torch.float32]
    assert rel_err(out, normed.double() @ w.T) < ACT_QUANT_TOL


@pytest.mark.parametrize("M,N,K", [(65, 40, 300), (130, 13, 100)], ids=["K tail", "N 13, K < 128"])
def test_fp8_prefill_default_dequantizes_then_runs_the_gemm(M, N, K):
    """Above 64 rows an fp8 projection's default (FP8_PREFILL = dequantize) is the weight dequantized by the Triton
    pass, then F.linear: the torch path's product exactly (naive.linear dequantizes in torch), no activation
    rounding (N = 13, not a multiple of 16 bytes: the dequantized weight runs the Triton tile, another summation
    order); the same through add_rms_norm_linear."""
    assert lin.FP8_PREFILL == "dequantize"
    x, q, scale = make(M, N, K, torch.float32)
    got, want = lin.linear(x, q, scale), naive.linear(x, q, scale)
    assert torch.equal(got, want) if N % 4 == 0 else rel_err(got, want) < TOL[torch.float32]
    residual, nw = torch.randn(M, K), 0.1 * torch.randn(K)
    got, want = (
        lin.add_rms_norm_linear(x, residual, nw, 1e-6, q, scale),
        naive.add_rms_norm_linear(x, residual, nw, 1e-6, q, scale),
    )
    assert rel_err(got[0], want[0]) < TOL[torch.float32] and rel_err(got[1], want[1]) < TOL[torch.float32]


@pytest.mark.parametrize(
    "M,N,K,cfg,reason",
    [
        (1, 37, 300, config(1, 8, 128), "one scale per step; the peeled first step takes its own scale"),
        (1, 33, 300, config(1, 4, 64, SPLIT_K=3), "split-K: each split's peeled step starts mid-scale-block"),
    ],
    ids=["gemv", "split-k"],
)
def test_add_rms_norm_linear_fp8(M, N, K, cfg, reason):
    """The add + RMSNorm prologue on an fp8 weight: the projection of the normed rows equals the dequantized
    weight's, normed and hidden are the norm's."""
    x, q, scale = make(M, N, K, torch.float32, seed=K)
    gen = torch.Generator().manual_seed(1)
    residual, nw = torch.randn(M, K, generator=gen), 0.1 * torch.randn(K, generator=gen)
    out, normed, hidden = poisoned(M, N), poisoned(M, K), poisoned(M, K)
    _, split, _, _ = lin.make_plan(M, N, K, cfg, fp8=True)
    ws = poisoned(split, M, N) if split > 1 else None
    norm = (residual, nw, 1e-6, normed, hidden)
    lin.linear_into(x, q, out, config=cfg, workspace=ws, scale=scale, norm=norm)
    ref_out, ref_normed, _ = naive.add_rms_norm_linear(x.double(), residual.double(), nw.double(), 1e-6, q, scale)
    assert rel_err(out, ref_out) < TOL[torch.float32], reason
    assert rel_err(normed, ref_normed) < TOL[torch.float32], reason
    assert torch.equal(hidden, x + residual), reason
