"""Triton dense projection (kernels/linear/triton.py) against the PyTorch reference (kernels/linear/naive.py) in
float64. Configs are forced through linear_into(config=...) so both kernel paths (GEMV at BLOCK_M = 1, tl.dot at
BLOCK_M >= 16), with and without split-K, run at interpreter-sized shapes."""

import pytest
import torch

from kernels.linear import naive
from kernels.linear import triton as lin
from tests.helpers import captured, poisoned, rel_err
from tests.helpers import linear_config as config
from tests.helpers import persistent_config as persistent

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def make(M, N, K, dtype, seed=0, device="cpu"):
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(M, K, generator=gen, device=device, dtype=dtype)
    w = torch.randn(N, K, generator=gen, device=device, dtype=dtype) / K**0.5
    return x, w


def reference(x, w):
    return naive.linear(x.double(), w.double())


# (M, N, K, config, reason)
CASES = [
    (1, 48, 64, config(1, 16, 32), "GEMV, every size a multiple of its block"),
    (1, 37, 53, config(1, 8, 16), "GEMV, primes: N tail (37 = 4 * 8 + 5) and K tail (53 = 3 * 16 + 5)"),
    (1, 29, 100, config(1, 4, 16, SPLIT_K=3), "GEMV split-K: 7 K blocks over 3 splits (3, 3, 1), short last block"),
    (1, 16, 64, config(1, 1, 64, SPLIT_K=4), "GEMV, one row per program, split > K blocks (1 block: no split)"),
    (3, 37, 53, config(1, 16, 32), "GEMV path at M = 3: one program row per token"),
    (1, 40, 48, config(16, 16, 16), "dot path at M = 1: 15 masked rows in the tile"),
    (7, 33, 80, config(16, 32, 16, SPLIT_K=2), "dot split-K: M < BLOCK_M, N tail, 5 K blocks over 2 splits"),
    (37, 23, 41, config(16, 16, 16, SPLIT_K=3), "dot, primes: three M tiles, N and K tails, 3 K blocks, 3 splits"),
    (64, 32, 48, config(64, 16, 16), "dot at the hand-over size M = 64, one M tile"),
    (20, 48, 96, config(16, 32, 32, SPLIT_K=8), "dot, SPLIT_K 8 over 3 K blocks: clamped to 3 splits"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M,N,K,cfg,reason", CASES, ids=[c[-1].split(":")[0] for c in CASES])
def test_linear_into(M, N, K, cfg, reason, dtype):
    """Output and split-K workspace NaN-poisoned: an output tile or a partial the kernels skip reaches the result."""
    x, w = make(M, N, K, dtype, seed=M + N + K)
    _, split, _, _ = lin.make_plan(M, N, K, cfg)
    out = poisoned(M, N, dtype=dtype)
    ws = poisoned(split, M, N) if split > 1 else None
    lin.linear_into(x, w, out, config=cfg, workspace=ws)
    assert rel_err(out, reference(x, w)) < TOL[dtype], reason


# (N, K, config, reason); the interpreter's grid is programs_per_sm * 8 "SMs" (lin.sm_count on the CPU)
PERSISTENT_CASES = [
    (100, 64, persistent(4, 64, 1), "25 row blocks over 8 programs: program 0 takes 4, the others 3"),
    (37, 53, persistent(4, 64, 1), "primes: N tail (37 = 9 * 4 + 1), K = 53 under a 64-wide tile"),
    (12, 32, persistent(4, 32, 2), "fewer blocks (3) than 16 programs: the grid shrinks to 3, no prefetch used"),
    (67, 40, persistent(1, 64, 1), "one row per block, 67 blocks over 8 programs: every prefetch distance used"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("N,K,cfg,reason", PERSISTENT_CASES, ids=[c[-1].split(":")[0] for c in PERSISTENT_CASES])
def test_persistent_gemv(N, K, cfg, reason, dtype):
    """The persistent GEMV (row blocks strided over the programs, two blocks prefetched) writes every row block:
    output NaN-poisoned; with the fused add + RMSNorm, normed and hidden too (written by program 0 alone)."""
    grid, *_ = lin.make_plan(1, N, K, cfg)
    assert grid[0] == min(-(-N // cfg["BLOCK_N"]), 8 * cfg["PERSISTENT"]), reason
    x, w = make(1, N, K, dtype, seed=N + K)
    out = poisoned(1, N, dtype=dtype)
    lin.linear_into(x, w, out, config=cfg)
    assert rel_err(out, reference(x, w)) < TOL[dtype], reason
    x, residual, nw = norm_inputs(1, K, dtype, seed=K)
    out, normed, hidden = poisoned(1, N, dtype=dtype), poisoned(1, K, dtype=dtype), poisoned(1, K, dtype=dtype)
    lin.linear_into(x, w, out, config=cfg, norm=(residual, nw, 1e-6, normed, hidden))
    ref_out, ref_normed, _ = norm_reference(x, residual, nw, w)
    assert rel_err(out, ref_out) < TOL[dtype], reason
    assert rel_err(normed, ref_normed) < TOL[dtype], reason
    assert torch.equal(hidden, x + residual), reason


def test_persistent_launch_keeps_the_cached_plan(monkeypatch):
    """The op's cached persistent plan (the H200 table's in-projections) launches again and again: the launch takes
    BLOCK_M and PERSISTENT off a copy of its kernel arguments, never off the cached plan."""
    N, K = 37, 53
    plan = lin.make_plan(1, N, K, persistent(4, 64, 1))
    monkeypatch.setitem(lin._PLANS, (N, K, torch.float32, 1), plan)
    x, w = make(1, N, K, torch.float32, seed=3)
    for _ in range(2):
        assert rel_err(lin.linear(x, w), reference(x, w)) < TOL[torch.float32]
    assert plan[3]["PERSISTENT"] and plan[3]["BLOCK_M"] == 1


def test_persistent_gemv_bad_configs():
    """What the persistent GEMV cannot run is refused by name: a row that does not fit one tile, M > 1, split-K,
    the dot path, a negative count (fp8 weights it runs: test_linear_fp8)."""
    with pytest.raises(ValueError, match="BLOCK_K >= K"):
        lin.make_plan(1, 8, 100, persistent(4, 64, 1))
    with pytest.raises(ValueError, match="M = 1"):
        lin.make_plan(2, 8, 64, persistent(4, 64, 1))
    with pytest.raises(ValueError, match="runs the GEMV"):
        lin.make_plan(1, 8, 64, {**persistent(4, 64, 1), "SPLIT_K": 2})
    with pytest.raises(ValueError, match="runs the GEMV"):
        lin.make_plan(1, 8, 64, {**config(16, 16, 64), "PERSISTENT": 1})
    with pytest.raises(ValueError, match="programs per SM"):
        lin.make_plan(1, 8, 64, persistent(4, 64, -1))


def test_register_cap_is_a_launch_option():
    """A config's maxnreg reaches the launch (make_plan's options, beside num_warps) on both GEMV kernels, the
    result stays right, and caps Triton cannot take are refused by name."""
    capped = {**config(1, 8, 16), "maxnreg": 128}
    assert lin.make_plan(1, 37, 53, capped)[3]["maxnreg"] == 128
    assert lin.make_plan(1, 37, 64, {**persistent(4, 64, 1), "maxnreg": 64})[3]["maxnreg"] == 64
    assert "maxnreg" not in lin.make_plan(1, 37, 53, config(1, 8, 16))[3]
    x, w = make(1, 37, 53, torch.float32, seed=3)
    out = poisoned(1, 37, dtype=torch.float32)
    lin.linear_into(x, w, out, config=capped)
    assert rel_err(out, reference(x, w)) < TOL[torch.float32]
    for bad in (-1, 256, 1.5):
        with pytest.raises(ValueError, match="register cap"):
            lin.make_plan(1, 37, 53, {**config(1, 8, 16), "maxnreg": bad})


@pytest.mark.parametrize("M,K,SPLIT_K,splits", [(1, 48, 4, 3), (1, 96, 4, 3), (1, 100, 2, 2), (1, 16, 5, 1)])
def test_split_plan(M, K, SPLIT_K, splits):
    """Splits cover whole BLOCK_K blocks and none is empty: 3 blocks / 4 -> 3; 6 / 4 -> 3 (of 2); 7 / 2 -> 2."""
    grid, split, k_per_split, _ = lin.make_plan(M, 20, K, config(1, 4, 16, SPLIT_K))
    assert split == splits and k_per_split % 16 == 0
    assert (split - 1) * k_per_split < K <= split * k_per_split
    assert grid == (5 * split,)


@pytest.mark.parametrize("M", [1, 5, 64, 65], ids=["M1", "M5", "M64 last triton", "M65 cuBLAS"])
def test_linear_default_configs(M):
    """The public op with the default configs (no table on CPU), across the M = 64 / 65 hand-over to F.linear
    (N = 68: 16-byte rows, so cuBLAS; test_unaligned_n_above_max_m has the other case)."""
    x, w = make(M, 68, 96, torch.float32, seed=M)
    out = lin.linear(x, w)
    assert out.shape == (M, 68) and out.dtype == torch.float32
    assert rel_err(out, reference(x, w)) < TOL[torch.float32]
    if M > lin.MAX_M:
        assert torch.equal(out, naive.linear(x, w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("N", [13, 16], ids=["unaligned N: Triton tile", "aligned: cuBLAS"])
def test_unaligned_n_above_max_m(N, dtype):
    """Above MAX_M, N = 13 is not a multiple of 16 bytes of elements (the 35B MoE in-projection, N = 1281): the
    Triton dot tile computes it (tails in M, N and K), into a fresh result or into `out`."""
    M, K = 130, 80
    x, w = make(M, N, K, dtype)
    want = naive.linear(x.double(), w.double())
    out = lin.linear(x.view(2, 65, K), w)
    assert out.shape == (2, 65, N) and out.is_contiguous() and out.dtype == dtype
    assert rel_err(out.view(M, N), want) < TOL[dtype]
    given = poisoned(M, N, dtype=dtype)
    assert lin.linear_out(x, w, given) is given and rel_err(given, want) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "first", [0, 3], ids=["the storage's padding (fuse_rows_)", "a middle slice: another tensor's rows"]
)
def test_unaligned_n_above_max_m_over_padded_rows(first, dtype):
    """Above MAX_M an unaligned N = 13 whose storage holds the rows up to the next multiple of 16 bytes runs as one
    GEMM over those rows (padded_rows: cuBLAS's aligned kernels) and returns the first N columns, rows N_pad apart:
    the rows past N (zero padding, or the next tensor's rows) never reach the result."""
    (M, K), N = (130, 80), 13
    n_pad = -(-N // (16 // dtype.itemsize)) * (16 // dtype.itemsize)
    storage = torch.randn(first + n_pad, K, generator=torch.Generator().manual_seed(1)).to(dtype)
    if first == 0:
        storage[N:] = 0  # as fuse_rows_ pads
    w = storage[first : first + N]
    x = make(M, N, K, dtype)[0]
    assert lin.padded_rows(w).shape == (n_pad, K)
    out = lin.linear(x.view(2, 65, K), w)
    assert out.shape == (2, 65, N) and out.stride(-2) == n_pad and out.dtype == dtype
    assert rel_err(out.reshape(M, N), naive.linear(x.double(), w.double())) < TOL[dtype]
    assert lin.padded_rows(storage[first + 1 : first + 1 + N]) is None  # its storage ends before N_pad rows
    assert lin.padded_rows(torch.randn(N, 2 * K, dtype=dtype)[:, :K]) is None  # rows not contiguous


def test_non_contiguous_inputs():
    """x as a column-sliced view (row stride > K), as a K-strided view (copied), as a 3-D view whose rows do not
    collapse to one stride; weight as a row slice of a fused buffer (the model's layout) and as [N, K] with a row
    stride > K."""
    gen = torch.Generator().manual_seed(0)
    fused = torch.randn(50, 40, generator=gen) / 40**0.5
    w = fused[13:40]  # rows 13..39 of a fused weight: stride(0) == K, offset start
    base = torch.randn(6, 90, generator=gen)
    for x in (base[:3, 10:50], base[:2, ::2][:, :40], base.view(6, 2, 45)[:, :, :40].transpose(0, 1)):
        assert x.shape[-1] == 40 and not x.is_contiguous()
        assert rel_err(lin.linear(x, w), reference(x, w)) < TOL[torch.float32]
    wide = torch.randn(27, 64, generator=gen)[:, :40]  # row stride 64 > K
    x = base[:1, :40]
    assert rel_err(lin.linear(x, wide), reference(x, wide)) < TOL[torch.float32]


def test_bad_inputs():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="GEMV path"):
        norm = (x, torch.zeros(8), 1e-6, torch.empty(2, 8), torch.empty(2, 8))
        lin.linear_into(x, torch.randn(5, 8), torch.empty(2, 5), config=config(16, 16, 16), norm=norm)
    with pytest.raises(ValueError, match=r"stride\(1\) == 1"):
        lin.linear(x, torch.randn(8, 5).t())
    with pytest.raises(ValueError, match="same dtype"):
        lin.linear(x, torch.randn(5, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"weight must be \[N, K\]"):
        lin.linear(x, torch.randn(5, 9))
    with pytest.raises(ValueError, match="dot path"):
        lin.make_plan(2, 8, 8, config(8, 16, 16))


def test_config_table_lookup(monkeypatch):
    """Tuned entries are found by (N, K, dtype, M bucket); a shape or bucket without one gets the defaults."""
    tuned = config(16, 32, 64, SPLIT_K=2)
    monkeypatch.setattr(lin, "CONFIG_TABLE", {lin.shape_key(96, 128, torch.bfloat16): {"4": tuned}})
    assert [lin.m_bucket(m) for m in (1, 2, 3, 4, 5, 33, 64)] == [1, 2, 4, 4, 8, 64, 64]
    assert lin.get_config(3, 96, 128, torch.bfloat16, 132) == tuned
    assert lin.get_config(5, 96, 128, torch.bfloat16, 132) == lin.default_config(5, 96, 128, 132)
    assert lin.get_config(3, 96, 128, torch.float16, 132) == lin.default_config(3, 96, 128, 132)


@pytest.mark.parametrize("M,N,K", [(1, 2048, 4096), (1, 248320, 2048), (8, 2048, 512), (64, 12352, 2048)])
def test_default_config_shapes(M, N, K):
    """Defaults at model shapes: valid, >= 2 programs per SM of a 132-SM GPU, 16-byte vectors at M = 1."""
    cfg = lin.default_config(M, N, K, 132)
    grid, *_ = lin.make_plan(M, N, K, cfg)
    assert grid[0] >= 2 * 132
    if M == 1:
        assert cfg["BLOCK_M"] == 1 and cfg["BLOCK_K"] >= 8 * 32


def test_export():
    """Under torch.export the op traces as the custom op qmoe::linear (with its fake) and the program runs it."""

    class Proj(torch.nn.Module):
        def __init__(self, w):
            super().__init__()
            self.w = torch.nn.Parameter(w, requires_grad=False)

        def forward(self, x):
            return lin.linear(x, self.w)

    x, w = make(1, 24, 40, torch.float32)
    program = torch.export.export(Proj(w), (x[None],))
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert "qmoe.linear.default" in targets
    out = program.module()(x[None])
    assert out.shape == (1, 1, 24) and rel_err(out, reference(x[None], w)) < TOL[torch.float32]


# ----------------------------------------------------------------------------------------------- add + RMSNorm


def norm_inputs(M, K, dtype, seed=0, device="cpu"):
    gen = torch.Generator(device=device).manual_seed(seed)
    x, residual = (torch.randn(M, K, generator=gen, device=device, dtype=dtype) for _ in range(2))
    return x, residual, 0.1 * torch.randn(K, generator=gen, device=device, dtype=dtype)


def norm_reference(x, residual, norm_weight, w):
    return naive.add_rms_norm_linear(x.double(), residual.double(), norm_weight.double(), 1e-6, w.double())


# (M, N, K, config, reason): the prologue reads whole rows for the rstd, then normalises each program's K range
NORM_CASES = [
    (1, 37, 53, config(1, 8, 16), "GEMV, primes: the rstd loop and every K block end in a tail"),
    (1, 29, 100, config(1, 4, 16, SPLIT_K=3), "GEMV split-K: each split writes its K range of normed and hidden"),
    (3, 24, 64, config(1, 8, 32), "GEMV path at M = 3: every row its own rstd"),
    (1, 5, lin.MAX_NORM_BLOCK + 52, config(1, 4, 128), "K > MAX_NORM_BLOCK: the rstd in two steps, one a tail"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M,N,K,cfg,reason", NORM_CASES, ids=[c[-1].split(":")[0] for c in NORM_CASES])
def test_add_rms_norm_linear_into(M, N, K, cfg, reason, dtype):
    """The projection of rms_norm(x + residual), and normed and hidden written by the first N tile's programs:
    all three outputs NaN-poisoned, so a K range or a row nobody writes reaches the result."""
    x, residual, nw = norm_inputs(M, K, dtype, seed=M + K)
    w = make(1, N, K, dtype, seed=N)[1]
    out, normed, hidden = poisoned(M, N, dtype=dtype), poisoned(M, K, dtype=dtype), poisoned(M, K, dtype=dtype)
    _, split, _, _ = lin.make_plan(M, N, K, cfg)
    ws = poisoned(split, M, N) if split > 1 else None
    lin.linear_into(x, w, out, config=cfg, workspace=ws, norm=(residual, nw, 1e-6, normed, hidden))
    ref_out, ref_normed, ref_hidden = norm_reference(x, residual, nw, w)
    assert rel_err(out, ref_out) < TOL[dtype], reason
    assert rel_err(normed, ref_normed) < TOL[dtype], reason
    assert torch.equal(hidden, x + residual), reason  # one rounding of the sum, as the norm kernel


def test_leading_dims_read_in_place():
    """linear_into reads x, residual and out with their leading dimensions as they are (the model's [B, T, K]
    activations: no view per call): a contiguous [2, 3, K] x, a residual whose rows do not collapse to one stride
    (copied), [2, 3, ...] outputs; all NaN-poisoned. out must be contiguous with M x N elements."""
    M, N, K = 6, 37, 53
    x, residual, nw = norm_inputs(M, K, torch.float32, seed=3)
    w = make(1, N, K, torch.float32, seed=4)[1]
    wide = torch.full((3, 2, K + 7), float("nan"))
    wide[..., :K] = residual.view(2, 3, K).transpose(0, 1)
    residual_view = wide[..., :K].transpose(0, 1)  # [2, 3, K], rows 2 (K + 7) and K + 7 apart
    assert residual_view.shape == (2, 3, K) and not residual_view.is_contiguous()
    out, normed, hidden = poisoned(2, 3, N), poisoned(2, 3, K), poisoned(2, 3, K)
    norm = (residual_view, nw, 1e-6, normed, hidden)
    lin.linear_into(x.view(2, 3, K), w, out, config=config(1, 8, 16), norm=norm)
    for got, ref in zip((out, normed, hidden), norm_reference(x, residual, nw, w)):
        assert got.shape[:2] == (2, 3) and rel_err(got.reshape(M, -1), ref) < TOL[torch.float32]
    with pytest.raises(ValueError, match="out must be contiguous"):
        lin.linear_into(x, w, poisoned(N, M).t(), config=config(1, 8, 16))
    with pytest.raises(ValueError, match="out must be contiguous"):
        lin.linear_into(x, w, poisoned(M, N + 1), config=config(1, 8, 16))


@pytest.mark.parametrize("M", [1, 5, 65], ids=["M1 GEMV", "M5 norm kernel + dot", "M65 norm kernel + cuBLAS"])
def test_add_rms_norm_linear(M):
    """The public op with default configs on every path; the torch path is the reference composed of the two ops."""
    x, residual, nw = norm_inputs(M, 96, torch.float32, seed=M)
    w = make(1, 70, 96, torch.float32, seed=1)[1]
    outs = lin.add_rms_norm_linear(x[None], residual[None], nw, 1e-6, w)
    refs = norm_reference(x[None], residual[None], nw, w)
    assert [o.shape for o in outs] == [(1, M, 70), (1, M, 96), (1, M, 96)]
    for o, r in zip(outs, refs):
        assert rel_err(o, r) < TOL[torch.float32]


def test_add_rms_norm_linear_export():
    """Traces as the custom op qmoe::add_rms_norm_linear (three outputs, with its fake) and the program runs it."""

    class Block(torch.nn.Module):
        def __init__(self, nw, w):
            super().__init__()
            self.nw, self.w = (torch.nn.Parameter(t, requires_grad=False) for t in (nw, w))

        def forward(self, x, residual):
            return lin.add_rms_norm_linear(x, residual, self.nw, 1e-6, self.w)

    x, residual, nw = norm_inputs(1, 40, torch.float32)
    w = make(1, 24, 40, torch.float32)[1]
    program = torch.export.export(Block(nw, w), (x[None], residual[None]))
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert "qmoe.add_rms_norm_linear.default" in targets
    for o, r in zip(program.module()(x[None], residual[None]), norm_reference(x[None], residual[None], nw, w)):
        assert rel_err(o, r) < TOL[torch.float32]


# ----------------------------------------------------------------------------------------------- GPU

SHAPES_35B = {"gdn_in": (12352, 2048), "gdn_out": (2048, 4096), "moe_in": (1281, 2048), "lm_head": (248320, 2048)}


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 3, 8, 64], ids=lambda m: f"M{m}")
@pytest.mark.parametrize("shape", list(SHAPES_35B), ids=str)
def test_linear_35b_gpu(shape, M):
    """bf16 at 35B shapes with the table's configs: error vs fp64 no worse than cuBLAS's (within 10 %), and two
    calls bit-identical (no atomics; split-K sums in split order)."""
    N, K = SHAPES_35B[shape]
    x, w = make(M, N, K, torch.bfloat16, device="cuda")
    ref = reference(x, w)
    out = lin.linear(x, w)
    assert rel_err(out, ref) <= 1.1 * rel_err(naive.linear(x, w), ref) + 1e-4
    assert torch.equal(out, lin.linear(x, w))


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [config(1, 4, 512, SPLIT_K=4), config(16, 64, 128, SPLIT_K=4)], ids=["gemv", "dot"])
def test_split_k_cuda_graph_gpu(cfg):
    """A split-K launch (per-call workspace from the caching allocator) captured in a CUDA graph and replayed on
    new inputs copied into the static x: bit-identical to eager, every replay."""
    x, w = make(8 if cfg["BLOCK_M"] > 1 else 1, 2048, 4096, torch.bfloat16, device="cuda")
    run = lambda: lin.linear_into(x, w, torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device="cuda"), cfg)
    graph, static_out = captured(run)
    for seed in range(3):
        x.copy_(torch.randn(x.shape, generator=torch.Generator(device="cuda").manual_seed(seed), device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, run())
        assert rel_err(static_out, reference(x, w)) < TOL[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 8, 64], ids=lambda m: f"M{m}")
@pytest.mark.parametrize("shape", ["gdn_in", "moe_in"], ids=str)
def test_add_rms_norm_linear_35b_gpu(shape, M):
    """bf16 at 35B shapes: the fused prologue's projection as accurate as the norm kernel + cuBLAS (vs fp64),
    normed within one bf16 rounding of the reference, and bit-reproducible."""
    N, K = SHAPES_35B[shape]
    x, residual, nw = norm_inputs(M, K, torch.bfloat16, device="cuda")
    w = make(1, N, K, torch.bfloat16, device="cuda")[1]
    ref = norm_reference(x, residual, nw, w)
    out, normed, hidden = lin.add_rms_norm_linear(x, residual, nw, 1e-6, w)
    torch_out, torch_normed, _ = naive.add_rms_norm_linear(x, residual, nw, 1e-6, w)
    assert rel_err(out, ref[0]) <= 1.1 * rel_err(torch_out, ref[0]) + 1e-4
    assert rel_err(normed, ref[1]) <= 1.1 * rel_err(torch_normed, ref[1]) + 1e-4
    assert torch.equal(hidden, x + residual)
    assert all(
        torch.equal(a, b) for a, b in zip((out, normed, hidden), lin.add_rms_norm_linear(x, residual, nw, 1e-6, w))
    )


@pytest.mark.gpu
@pytest.mark.parametrize("norm", [False, True], ids=["plain", "add+rmsnorm"])
@pytest.mark.parametrize(
    "shape,cfg",
    [("gdn_in", persistent(4, 2048, 3)), ("gdn_out", persistent(2, 4096, 3)), ("lm_head", persistent(2, 2048, 4)),
     ("moe_in", persistent(8, 2048, 2))],
    ids=["gdn_in", "gdn_out", "lm_head", "moe_in 1281 rows: a short last block"],
)  # fmt: skip
def test_persistent_gemv_35b_gpu(shape, cfg, norm):
    """The persistent GEMV in bf16 at 35B shapes, forced whatever the table holds: as accurate as cuBLAS (vs
    fp64), normed within the norm kernel's error, bit-identical when replayed in a CUDA graph (PDL on)."""
    N, K = SHAPES_35B[shape]
    x, residual, nw = norm_inputs(1, K, torch.bfloat16, device="cuda")
    w = make(1, N, K, torch.bfloat16, device="cuda")[1]
    normed, hidden = torch.empty_like(x), torch.empty_like(x)
    args = dict(config=cfg, norm=(residual, nw, 1e-6, normed, hidden) if norm else None)
    run = lambda: lin.linear_into(x, w, torch.empty(1, N, dtype=x.dtype, device="cuda"), **args)
    graph, static_out = captured(run)
    graph.replay()
    torch.cuda.synchronize()
    if norm:
        ref = norm_reference(x, residual, nw, w)
        torch_out, torch_normed, _ = naive.add_rms_norm_linear(x, residual, nw, 1e-6, w)
        assert rel_err(normed, ref[1]) <= 1.1 * rel_err(torch_normed, ref[1]) + 1e-4
        assert torch.equal(hidden, x + residual)
        ref = ref[0]
    else:
        ref, torch_out = reference(x, w), naive.linear(x, w)
    assert rel_err(static_out, ref) <= 1.1 * rel_err(torch_out, ref) + 1e-4
    assert torch.equal(static_out, run())


# (M, N, K, config, reason): every path that stores the kernel's own result (no split-K)
LOGITS_CASES = [
    (1, 37, 53, config(1, 8, 16), "GEMV, primes: N and K tails"),
    (1, 37, 53, persistent(4, 64, 1), "persistent GEMV, N tail"),
    (7, 33, 80, config(16, 32, 16), "dot path, M < BLOCK_M, N tail"),
]


@pytest.mark.parametrize("M,N,K,cfg,reason", LOGITS_CASES, ids=[c[-1].split(",")[0] for c in LOGITS_CASES])
def test_round_x_stores_the_rounded_result_as_fp32(M, N, K, cfg, reason):
    """round_x (the logits' lm_head): the kernel rounds to x's dtype (fp16 here), then stores fp32, so an fp32 out
    holds exactly linear(...).float(): bit for bit the fp16 result, which fp32 storage alone would not be."""
    x, w = make(M, N, K, torch.float16, seed=N + K)
    want = poisoned(M, N, dtype=torch.float16)
    lin.linear_into(x, w, want, config=cfg)
    out = poisoned(M, N)
    lin.linear_into(x, w, out, config=cfg, round_x=True)
    assert torch.equal(out, want.float()), reason
    unrounded = poisoned(M, N)
    lin.linear_into(x, w, unrounded, config=cfg)  # the fp32 accumulator as it is: not what the model computes
    assert not torch.equal(unrounded, out), reason


def test_round_x_refuses_split_k():
    x, w = make(1, 29, 100, torch.float16)
    with pytest.raises(ValueError, match="round_x"):
        lin.linear_into(x, w, poisoned(1, 29), config=config(1, 4, 16, SPLIT_K=3), round_x=True)


@pytest.mark.parametrize("M", [1, 3, 65], ids=["M1 GEMV", "M3", "M65 cuBLAS, then the cast"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_logits(M, dtype, monkeypatch):
    """The model's logits op: fp32 [..., N] equal to linear(x, w).float() at every M (the GEMV's own store up to
    MAX_M; a split-K plan and cuBLAS above take the cast), into a fresh tensor or the planned buffer
    (logits_out), and naive.logits is the same contract on the torch path."""
    x, w = make(2 * M, 40, 96, dtype, seed=M)
    x = x.view(2, M, 96)
    want = lin.linear(x, w).float()
    out = lin.logits(x, w)
    assert out.dtype == torch.float32 and out.shape == (2, M, 40) and torch.equal(out, want)
    given = poisoned(2, M, 40)
    assert lin.logits_out(x, w, given) is given and torch.equal(given, want)
    assert torch.equal(naive.logits(x, w), naive.linear(x, w).float())
    monkeypatch.setitem(lin._PLANS, (40, 96, dtype, 2 * M), lin.make_plan(2 * M, 40, 96, config(1, 4, 16, SPLIT_K=3)))
    assert torch.equal(lin.logits(x, w), lin.linear(x, w).float())  # split-K: its reduce kernel rounds, then the cast


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", [(248320, 2048), (4099, 3072)], ids=["35B lm_head (table entry)", "odd N, default"])
@pytest.mark.parametrize("M", [1, 4])
def test_logits_gpu(N, K, M):
    """bf16 on the GPU with the H200 table's plans: the logits op's fp32 store equals linear(...).float() exactly."""
    x, w = make(M, N, K, torch.bfloat16, device="cuda")
    out = lin.logits(x, w)
    assert out.dtype == torch.float32 and torch.equal(out, lin.linear(x, w).float())
