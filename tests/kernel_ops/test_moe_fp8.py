"""The Triton MoE block with FP8 weights (kernels/fp8.py layout) against the reference on the dequantized weights in
float64: GEMV (M = 1), decode (M <= 64) and the sorted prefill path, experts in FP8 with the shared expert in FP8 or
not (the two checkpoint formats), several scale blocks along every K, empty experts, poisoned scratch. The sorted
prefill kernels run FP8 x FP8 (x and h quantized by the pre-pass kernels/fp8.quantize_activations):
against sorted_fp8_reference, the same
quantization in float64, with the interpreter's fp32 -> e4m3 conversion made exact (tests/helpers.py: h is computed
in the kernel, so no input data can keep its quantization clear of the interpreter's wrong cases)."""

import pytest
import torch

from kernels.fp8 import dequantize, quantize_rows
from kernels.moe import naive
from kernels.moe import triton as moe
from tests.helpers import exact_fp8_interpreter, poisoned, quantized_activations, rel_err
from tests.kernel_ops.test_moe import decode_poisoned, make_routing, same_experts

# fp8 weights are exact; the only error is the arithmetic's (fp16: the activations and h round as in the dense path)
TOL = {torch.float32: 1e-5, torch.float16: 3e-3}
# the sorted FP8 x FP8 prefill also in bf16 (its dots are on fp8 tiles): h's and the partials' rounding to bf16
PREFILL_TOL = {**TOL, torch.bfloat16: 1e-2}


def quantized(w):
    """w [..., N, K] with K blocks of very different size (a scale read for the wrong block shows) -> fp8, scale."""
    w = w.clone()
    w[..., 128:256] *= 30
    return quantize_rows(w)


def fp8_block_args(M, H, E, I, Is, dtype, shared_fp8, router=None, seed=0):
    """(x, proj, w13, w2, shared_down, scales): the experts fp8, the shared down projection fp8 when shared_fp8."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, H, generator=gen).to(dtype)
    w13, s13 = quantized(torch.randn(E, 2 * I, H, generator=gen) / H**0.5)
    w2, s2 = quantized(torch.randn(E, H, I, generator=gen) / I**0.5)
    in_proj = torch.randn(E + 2 * Is + 1, H, generator=gen) / H**0.5
    proj = (x.float() @ in_proj.T).to(dtype)
    if router is not None:
        proj[:, :E] = router(M, E).to(dtype)
    shared_down, s_shared = quantized(torch.randn(H, Is, generator=gen) / Is**0.5)
    if not shared_fp8:
        shared_down, s_shared = dequantize(shared_down, s_shared, dtype), None
    return (x, proj, w13, w2, shared_down), (s13, s2, s_shared)


def reference(args, scales, top_k):
    x, proj, w13, w2, shared_down = args
    s13, s2, s_shared = scales
    f64 = torch.float64
    shared = shared_down.double() if s_shared is None else dequantize(shared_down, s_shared, f64)
    return naive.moe_block(
        x.double(), proj.double(), dequantize(w13, s13, f64), dequantize(w2, s2, f64), shared, top_k=top_k
    )


# Tiles small enough that every K loop runs several steps (2 per scale block), large enough for the interpreter.
FP8_SMALL = {
    "BLOCK_M": 16,
    "up": {"BLOCK_N": 32, "BLOCK_K": 64, "num_warps": 4, "num_stages": 1},
    "down": {"BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 1},
}
F32, F16 = torch.float32, torch.float16
# (M, H, E, I, Is, K, router, dtype, shared fp8, reason); H = 300 is scale blocks 128, 128, 44 and I = 136 is 128, 8
DECODE_CASES = [
    (5, 300, 6, 136, 40, 2, None, F32, True, "scale blocks along H and I with tails, Is < 128, block format"),
    (5, 300, 6, 136, 40, 2, None, F16, False, "fp16, the shared expert dense (compressed-tensors)"),
    (12, 160, 16, 136, 136, 2, same_experts([0, 3]), F32, True, "14 of 16 experts get no token"),
    (1, 160, 8, 136, 200, 3, None, F16, True, "one token on the tiled decode path, Is > I"),
]


@pytest.mark.parametrize(
    "M,H,E,I,Is,K,router,dtype,shared_fp8,reason", DECODE_CASES, ids=[c[-1].split(",")[0] for c in DECODE_CASES]
)
def test_fp8_moe_block_decode(M, H, E, I, Is, K, router, dtype, shared_fp8, reason):
    args, scales = fp8_block_args(M, H, E, I, Is, dtype, shared_fp8, router)
    scratch = decode_poisoned(args[0], I, K, FP8_SMALL)
    out = moe.moe_block_decode(*args, K, FP8_SMALL, scratch, *scales)
    assert rel_err(out, reference(args, scales, K)) < TOL[dtype], reason


def gemv_config(up_k, down_k):
    return {
        "BLOCK_M": 1,
        "up": {"BLOCK_N": 16, "BLOCK_K": up_k, "num_warps": 4, "num_stages": 1},
        "down": {"BLOCK_N": 16, "BLOCK_K": down_k, "num_warps": 4, "num_stages": 1},
    }


def nan_tailed(scale):
    """scale in a buffer that continues with NaN: a scale read past its end (a sub-step wholly past K of the last
    expert's last row) poisons the output instead of reading whatever follows in memory."""
    buf = torch.full((scale.numel() + 4096,), float("nan"), device=scale.device)
    buf[: scale.numel()] = scale.flatten()
    return buf[: scale.numel()].view(scale.shape)


LAST = same_experts([7, 2])  # the last of 8 experts is routed: its last rows' scales end the scale tensors
# (H, E, I, Is, K, up BLOCK_K, down BLOCK_K, router, dtype, shared fp8, reason); the weights' K block 1 is 30x block 0
GEMV_CASES = [
    (300, 8, 136, 40, 2, 64, 64, None, F32, True, "BLOCK_K 64: H and I over several scale blocks with tails"),
    (256, 5, 40, 200, 5, 64, 64, None, F16, False, "BLOCK_K 64: K = E, Is > I: the down loop runs past I"),
    (300, 8, 136, 40, 2, 128, 128, LAST, F32, True, "BLOCK_K 128: 3 steps along H, 2 along I, both with tails"),
    (300, 8, 136, 40, 2, 256, 256, LAST, F16, False, "BLOCK_K 256: H's last step has a sub-step wholly past H"),
    (512, 8, 384, 136, 2, 256, 256, LAST, F32, True, "BLOCK_K 256 dividing H (EVEN_K); I's second step half past I"),
    (300, 8, 136, 200, 3, 512, 512, LAST, F32, False, "BLOCK_K 512: one step per row, H and I end mid step"),
    (512, 8, 256, 40, 2, 512, 256, None, F16, True, "BLOCK_K 512 = H: 4 sub-steps in one EVEN_K step"),
]


@pytest.mark.parametrize(
    "H,E,I,Is,K,up_k,down_k,router,dtype,shared_fp8,reason", GEMV_CASES, ids=[c[-1] for c in GEMV_CASES]
)
@pytest.mark.parametrize("M", [1, 2], ids=["one token", "2 tokens"])
def test_fp8_moe_block_gemv(H, E, I, Is, K, up_k, down_k, router, dtype, shared_fp8, reason, M):
    """M tokens on the GEMV kernels: each BLOCK_K step loads its columns at once and scales each 128-column sub-step
    by its own block's scale. Kills: one scale for every sub-step of a step (block 1 is 30x block 0), a scale
    index that restarts each step, a dropped K mask on the tail (the next row's weights), a scale read past K
    (nan_tailed: the last expert's last rows read NaN), scratch a kernel forgets to write (NaN)."""
    args, scales = fp8_block_args(M, H, E, I, Is, dtype, shared_fp8, router, seed=H + up_k)
    scales = tuple(None if s is None else nan_tailed(s) for s in scales)
    config = gemv_config(up_k, down_k)
    scratch = decode_poisoned(args[0], I, K, config)
    out = moe.moe_block_decode(*args, K, config, scratch, *scales)
    assert rel_err(out, reference(args, scales, K)) < TOL[dtype], reason


def sorted_fp8_reference(x, w13, s13, w2, s2, weights, ids, h=None):
    """The FP8 x FP8 prefill experts in float64 -> (h [P, I], partials [P, H]): x quantized per (token, 128-wide
    group), h = silu(x_q @ gate^T) * (x_q @ up^T), partial = weight * h_q @ w2^T with h_q the quantization of `h`
    (the kernel's own h, as the down kernel reads it) or, without it, of the reference h rounded to x's dtype."""
    f64 = torch.float64
    K, I = ids.shape[1], w2.shape[2]
    e = ids.flatten()
    a = quantized_activations(x).repeat_interleave(K, 0)  # [P, H], pair p = t * K + k
    gate_up = torch.einsum("ph,pnh->pn", a, dequantize(w13, s13, f64)[e])  # [P, 2I]
    gate, up = gate_up[:, :I], gate_up[:, I:]
    ref_h = torch.nn.functional.silu(gate) * up
    h_q = quantized_activations(ref_h.to(x.dtype) if h is None else h)
    partials = torch.einsum("pi,phi->ph", h_q, dequantize(w2, s2, f64)[e]) * weights.flatten().double()[:, None]
    return ref_h, partials


# Tiles for the interpreter: BLOCK_K 128 (fixed on this path), several row blocks per expert, N tails
PREFILL_FP8_SMALL = {
    "BLOCK_M": 16,
    "up": {"BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 1},
    "down": {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 1},
}
# FP8 x FP8 against the unquantized experts: x's quantization (~2.6 % RMS, tests/kernel_ops/test_linear_fp8.py) reaches
# h through both gate and up, and h's own adds to it: measured 4.3-4.7 % on these and larger shapes
PREFILL_ACT_TOL = 0.08
# (M, H, E, I, K, experts used, reason); H = 300 is 128 + 128 + 44 columns, I = 136 is 128 + 8
PREFILL_CASES = [
    (
        40,
        300,
        6,
        136,
        2,
        [0, 1, 3, 5],
        PREFILL_FP8_SMALL,
        "2 of 6 experts empty; H and I tails; 80 pairs in blocks of 16",
    ),
    (
        37,
        128,
        8,
        256,
        2,
        [2, 7],
        PREFILL_FP8_SMALL,
        "two experts take every token: 2 full blocks and a 5-row tail each",
    ),
    (
        37,
        128,
        8,
        256,
        2,
        [2, 7],
        {**PREFILL_FP8_SMALL, "BLOCK_M": 32, "SUB_TILES": 1},
        "sub-tiles: the 5-row tails on 16-row tiles of 32-row blocks",
    ),
]


@pytest.mark.parametrize("dtype", [F32, F16, torch.bfloat16])
@pytest.mark.parametrize(
    "M,H,E,I,K,experts,config,reason", PREFILL_CASES, ids=[c[-1].split(";")[0].split(":")[0] for c in PREFILL_CASES]
)
def test_fp8_sorted_prefill_is_fp8_x_fp8(M, H, E, I, K, experts, config, reason, dtype):
    """The sorted prefill kernels with fp8 experts, NaN scratch: the up kernel's h against float64 on the quantized
    activations, the down kernel's partials against float64 on the quantization of the kernel's own h (each stage
    exact but for fp32 accumulation and the stores' rounding), and the whole against the unquantized experts."""
    args, (s13, s2, _) = fp8_block_args(M, H, E, I, 8, dtype, shared_fp8=False, seed=M + I)
    x, _, w13, w2, _ = args
    weights, ids = make_routing(M, E, K, experts=experts, seed=M)
    h, partials = poisoned(M * K, I, dtype=dtype), poisoned(M * K, H, dtype=dtype)
    with exact_fp8_interpreter():
        moe.routed_partials_into(x, w13, w2, weights, ids, h, partials, config, s13, s2)
    ref_h, _ = sorted_fp8_reference(x, w13, s13, w2, s2, weights, ids)
    assert rel_err(h, ref_h) < PREFILL_TOL[dtype], reason
    _, ref_partials = sorted_fp8_reference(x, w13, s13, w2, s2, weights, ids, h=h)
    assert rel_err(partials, ref_partials) < PREFILL_TOL[dtype], reason
    f64 = torch.float64
    exact = naive.fused_moe(x.double(), dequantize(w13, s13, f64), dequantize(w2, s2, f64), weights.double(), ids)
    assert rel_err(partials.view(M, K, H).double().sum(1), exact) < PREFILL_ACT_TOL, reason


def test_fp8_sorted_prefill_configs_are_checked():
    """FP8 x FP8 steps one 128-wide scale group per K step: a prefill config with another BLOCK_K is one line."""
    M, H, E, I, K = 40, 300, 6, 136, 2
    args, (s13, s2, _) = fp8_block_args(M, H, E, I, 8, F32, shared_fp8=False)
    x, _, w13, w2, _ = args
    weights, ids = make_routing(M, E, K)
    h, partials = poisoned(M * K, I), poisoned(M * K, H)
    for bad in (FP8_SMALL, {**PREFILL_FP8_SMALL, "down": {**PREFILL_FP8_SMALL["down"], "BLOCK_K": 64}}):
        with pytest.raises(ValueError, match=r"sorted prefill path \(FP8 x FP8\) need BLOCK_K = 128 in up and down"):
            moe.routed_partials_into(x, w13, w2, weights, ids, h, partials, bad, s13, s2)
    assert moe.get_config(4096, E, H, I, torch.float8_e4m3fn) is moe.DEFAULT_CONFIGS["prefill_fp8"]


@pytest.mark.parametrize("M", [1, 3, 65], ids=["M1 gemv_fp8", "M3 decode", "M65 prefill"])
def test_fp8_moe_block_default_configs(M):
    """The public op with its default configs (fp8 GEMV: BLOCK_K 1024 up, 512 down, past H = 300 and I = 136; the
    prefill's FP8 x FP8 tiles: the routed experts' activations quantized, the shared expert dequantized), and the
    torch reference given fp8 weights."""
    args, scales = fp8_block_args(M, 300, 6, 136, 40, torch.float32, shared_fp8=True, seed=M)
    ref = reference(args, scales, 2)
    with exact_fp8_interpreter():
        out = moe.moe_block(*args, 2, *scales)
    assert rel_err(out, ref) < (PREFILL_ACT_TOL if M > moe.DECODE_MAX_M else TOL[torch.float32])
    assert rel_err(naive.moe_block(*args, 2, *scales), ref) < TOL[torch.float32]


def test_fp8_scales_and_configs_are_checked():
    args, (s13, s2, s_shared) = fp8_block_args(1, 300, 6, 136, 40, torch.float32, shared_fp8=True)
    with pytest.raises(ValueError, match=r"w13 and w2 are fp8 together"):
        moe.moe_block_decode(*args, 2, None, None, s13, None, s_shared)
    with pytest.raises(ValueError, match=r"shared_down is float8_e4m3fn but has no scale"):
        moe.moe_block_decode(*args, 2, None, None, s13, s2, None)
    with pytest.raises(ValueError, match=r"w2 with a scale must be .* float32 scale \[6, 300, 2\]"):
        moe.moe_block_decode(*args, 2, None, None, s13, s2[..., :1], s_shared)
    # the tiled path's tl.dot steps lie inside one scale block; only the GEMV splits a step into sub-steps
    wide_dot = {**FP8_SMALL, "up": {**FP8_SMALL["up"], "BLOCK_K": 256}}
    with pytest.raises(ValueError, match=r"tiled path \(BLOCK_M > 1\) need BLOCK_K <= 128"):
        moe.moe_block_decode(*args, 2, wide_dot, None, s13, s2, s_shared)
    with pytest.raises(ValueError, match=r"need BLOCK_K dividing 128 or a multiple of it"):
        moe.moe_block_decode(*args, 2, gemv_config(128, 96), None, s13, s2, s_shared)


# (H, I, M): the 35B at decode sizes and past them (the prefill path); the 122B's decode entries (tuned in its loop)
MOE_GPU_CASES = [(2048, 512, M) for M in (1, 8, 64, 65)] + [(3072, 1024, M) for M in (1, 8)]


@pytest.mark.gpu
@pytest.mark.parametrize("shared_fp8", [True, False], ids=["block format", "shared expert dense"])
@pytest.mark.parametrize(
    "H,I,M", MOE_GPU_CASES, ids=[f"{'35B' if h == 2048 else '122B'} M{m}" for h, _, m in MOE_GPU_CASES]
)
def test_fp8_moe_block_gpu(H, I, M, shared_fp8):
    """35B and 122B shapes (E 256, H, I = Is, top-8) in bf16 on the GPU's table configs against the fp32 block on
    the routed experts' dequantized weights (their router columns: the renormalised top-k weights are the same; the
    other experts' fp32 copies would not fit beside the test's parallel workers at 122B); bit-reproducible."""
    torch.manual_seed(M)
    E, K = 256, 8
    x = torch.randn(M, H, device="cuda").bfloat16()
    bf16 = torch.bfloat16
    w13, s13 = quantize_rows(torch.randn(E, 2 * I, H, device="cuda", dtype=bf16) / H**0.5)
    w2, s2 = quantize_rows(torch.randn(E, H, I, device="cuda", dtype=bf16) / I**0.5)
    shared, s_shared = quantize_rows(torch.randn(H, I, device="cuda") / I**0.5)
    if not shared_fp8:
        shared, s_shared = dequantize(shared, s_shared, torch.bfloat16), None
    proj = torch.randn(M, E + 2 * I + 1, device="cuda").bfloat16()
    args, scales = (x, proj, w13, w2, shared), (s13, s2, s_shared)
    out = moe.moe_block(*args, K, *scales)
    f32 = torch.float32
    shared32 = shared.float() if s_shared is None else dequantize(shared, s_shared)
    used = naive.route(proj[:, :E].float(), K)[1].unique()
    sub_proj = torch.cat([proj[:, used], proj[:, E:]], 1).float()
    w13_used, w2_used = dequantize(w13[used], s13[used], f32), dequantize(w2[used], s2[used], f32)
    ref = naive.moe_block(x.float(), sub_proj, w13_used, w2_used, shared32, K)
    assert rel_err(out, ref) < (PREFILL_ACT_TOL if M > moe.DECODE_MAX_M else 2e-2)  # prefill: FP8 x FP8 experts
    assert torch.equal(moe.moe_block(*args, K, *scales), out)


@pytest.mark.gpu
@pytest.mark.parametrize("up_k,down_k", [(128, 128), (512, 256), (1024, 512), (2048, 1024)])
@pytest.mark.parametrize("H,I", [(2048, 512), (1856, 544)], ids=["35B H and I", "tails"])
def test_fp8_moe_gemv_gpu_wide_steps(H, I, up_k, down_k):
    """The M = 1 GEMV compiled for the GPU (bf16 activations) with the sweep's BLOCK_K range, at the 35B H and I and
    with 16-aligned tails (H = 14.5 and I = 4.25 scale blocks: for BLOCK_K >= 256 the last step has sub-steps wholly
    past them), NaN scratch and NaN-tailed scales."""
    E, Is, K = 64, 512, 8
    gen = torch.Generator(device="cuda").manual_seed(H + up_k)
    x = torch.randn(1, H, device="cuda", generator=gen).bfloat16()
    w13, s13 = quantize_rows(torch.randn(E, 2 * I, H, device="cuda", generator=gen) / H**0.5)
    w2, s2 = quantize_rows(torch.randn(E, H, I, device="cuda", generator=gen) / I**0.5)
    shared, s_shared = quantize_rows(torch.randn(H, Is, device="cuda", generator=gen) / Is**0.5)
    proj = torch.randn(1, E + 2 * Is + 1, device="cuda", generator=gen).bfloat16()
    proj[:, E - 1] = 10.0  # the last expert is routed: its last rows' scale reads end the scale tensors
    args, scales = (x, proj, w13, w2, shared), tuple(nan_tailed(s) for s in (s13, s2, s_shared))
    config = gemv_config(up_k, down_k)
    out = moe.moe_block_decode(*args, K, config, decode_poisoned(x, I, K, config), *scales)
    f32 = torch.float32
    ref = naive.moe_block(
        x.float(), proj.float(), dequantize(w13, s13, f32), dequantize(w2, s2, f32), dequantize(shared, s_shared), K
    )
    assert rel_err(out, ref) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("sub", [0, 2], ids=["tiles", "sub-tiles"])
@pytest.mark.parametrize("M", [4096, 300])
def test_fp8_sorted_prefill_gpu_35b(M, sub):
    """The FP8 x FP8 sorted kernels compiled for the GPU at the 35B shape (E 256, H 2048, I 512, top-8) in bf16, on the
    table's tiles (with SUB_TILES 2: tail blocks on 16- and 32-row tiles), NaN scratch: h against fp32 on the
    quantized activations, the partials against fp32 on the quantization of the kernel's own h (the pre-pass's
    quantization is bit-identical to quantize_rows, so only accumulation order and bf16 rounding differ);
    bit-reproducible (the rows in a tail block are the same in every run: align_pairs keeps pair order)."""
    torch.manual_seed(M)
    E, H, I, K = 256, 2048, 512, 8
    config = {**moe.get_config(M, E, H, I, torch.float8_e4m3fn), "SUB_TILES": sub}
    x = torch.randn(M, H, device="cuda").bfloat16()
    w13, s13 = quantize_rows(torch.randn(E, 2 * I, H, device="cuda") / H**0.5)
    w2, s2 = quantize_rows(torch.randn(E, H, I, device="cuda") / I**0.5)
    weights, ids = moe.route(torch.randn(M, E, device="cuda"), K)
    h, partials = (
        poisoned(M * K, I, dtype=torch.bfloat16, device="cuda"),
        poisoned(M * K, H, dtype=torch.bfloat16, device="cuda"),
    )
    moe.routed_partials_into(x, w13, w2, weights, ids, h, partials, config, s13, s2)
    f32 = torch.float32
    e = ids.flatten()
    a = quantized_activations(x.float()).float().repeat_interleave(K, 0)
    gate_up = torch.cat([torch.bmm(a[e == j][None], dequantize(w13[j], s13[j], f32).T[None])[0] for j in range(E)])
    order = torch.cat([torch.nonzero(e == j).flatten() for j in range(E)])
    ref_h = torch.empty(M * K, 2 * I, device="cuda")
    ref_h[order] = gate_up
    ref_h = torch.nn.functional.silu(ref_h[:, :I]) * ref_h[:, I:]
    assert rel_err(h, ref_h) < 1e-2
    h_q = quantized_activations(h.float()).float()
    down = torch.cat([h_q[e == j] @ dequantize(w2[j], s2[j], f32).T for j in range(E)])
    ref_p = torch.empty(M * K, H, device="cuda")
    ref_p[order] = down
    assert rel_err(partials, ref_p * weights.flatten()[:, None]) < 1e-2
    again = poisoned(M * K, H, dtype=torch.bfloat16, device="cuda")
    moe.routed_partials_into(x, w13, w2, weights, ids, h.clone(), again, config, s13, s2)
    assert torch.equal(again, partials)


@pytest.mark.parametrize("rank", [0, 1])
def test_fp8_moe_block_gemv_expert_parallel(rank):
    # M = 1 on the FP8 GEMV kernels under expert parallel (2 ranks): a rank's experts and their scales are a slice
    # along E, its shared expert 128 of the 256 intermediate columns (one scale block); against the reference of
    # that share on the dequantized weights, with scratch poisoned and the scales NaN-tailed
    H, E, I, Is, K = 300, 8, 136, 256, 3
    (x, proj, w13, w2, shared_down), (s13, s2, s_shared) = fp8_block_args(1, H, E, I, Is, F32, True, seed=rank)
    El, Isl = E // 2, Is // 2
    first, cols = rank * El, slice(rank * Isl, (rank + 1) * Isl)
    router, gate, up, gate_logit = naive.split_projection(proj, E, Is)
    proj = torch.cat([router, gate[:, cols], up[:, cols], gate_logit], 1)
    experts = slice(first, first + El)
    args = (x, proj, w13[experts], w2[experts], shared_down[:, cols].contiguous())
    scales = (nan_tailed(s13[experts]), nan_tailed(s2[experts]), nan_tailed(s_shared[:, rank : rank + 1]))
    config = gemv_config(128, 64)
    scratch = decode_poisoned(x, I, K, config)
    out = moe.moe_block_decode(*args, K, config, scratch, *scales, first=first)
    f64 = torch.float64
    ref = naive.ep_moe_block(
        x.double(), proj.double(), dequantize(args[2], scales[0], f64), dequantize(args[3], scales[1], f64),
        dequantize(args[4], scales[2], f64), K, first,
    )  # fmt: skip
    assert rel_err(out, ref) < TOL[F32]
    assert rel_err(moe.moe_block_ep(*args, K, first, *scales), ref) < TOL[F32]  # the default GEMV config
