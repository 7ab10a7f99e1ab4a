"""Triton Gated DeltaNet (kernels/gdn/triton.py) against the model's torch path (kernels/gdn/naive.py).

On CPU the kernels run in Triton's interpreter in fp32 (small heads); the `gpu` tests use the 35B-A3B
DeltaNet dims in fp32 (TF32 dots) and bf16. Every buffer the kernels allocate (outputs and scratch) is
NaN-filled by the `poison` fixture, so a value a kernel forgets to write shows up as an error.
"""

import pytest
import torch
from helpers import rel_err, tiny_config

from kernels.gdn import fused_recurrent, naive
from kernels.gdn import triton as gdn_triton
from kernels.gdn.conv import causal_conv1d

TINY = dict(nk=2, nv=4, dk=16, dv=16)  # the tiny test model: 2 value heads per key head
SMALL = dict(nk=1, nv=2, dk=16, dv=16)  # fewer heads for the slow interpreter runs (long T, batch 3)
B35 = dict(nk=16, nv=32, dk=128, dv=128)  # Qwen3.5-35B-A3B


@pytest.fixture
def poison(monkeypatch):
    """torch.empty / empty_like return NaN-filled floating tensors while the test runs."""
    empty, empty_like = torch.empty, torch.empty_like

    def nan(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: nan(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: nan(empty_like(*a, **k)))


def make_inputs(B, T, nk, nv, dk, dv, kw=4, dtype=torch.float32, device="cpu", seed=0):
    """Layer inputs as in the model (random projections, decay parameters in their published ranges) with
    nonzero conv and recurrent states, so the kernels must continue from them."""
    gen = torch.Generator().manual_seed(seed)
    C = 2 * nk * dk + nv * dv
    randn = lambda *shape: torch.randn(*shape, generator=gen)
    x = dict(
        mixed_qkv=randn(B, T, C),
        z=randn(B, T, nv * dv),
        a=randn(B, T, nv),
        b=randn(B, T, nv),
        conv_weight=randn(C, 1, kw) / kw**0.5,
        A_log=torch.empty(nv).uniform_(0.01, 16.0, generator=gen).log(),
        dt_bias=torch.empty(nv).uniform_(0.5, 1.5, generator=gen),
        norm_weight=1.0 + 0.1 * randn(dv),
        conv_state=randn(B, C, kw - 1),
    )
    x = {k: v.to(device=device, dtype=dtype) for k, v in x.items()}
    x["recurrent_state"] = (0.1 * randn(B, nv, dk, dv)).to(device)  # fp32 always
    return x


def run(module, x, nk, **new_tokens):
    """module.gated_delta_net on x (states updated in place in x) -> output."""
    x.update(new_tokens)
    return module.gated_delta_net(**x, num_k_heads=nk, eps=1e-6)


def clone(x):
    return {k: v.clone() for k, v in x.items()}


def check(out, ref, x, x_ref, tol, state_tol):
    assert rel_err(out, ref) < tol
    assert rel_err(x["conv_state"], x_ref["conv_state"]) < state_tol
    assert rel_err(x["recurrent_state"], x_ref["recurrent_state"]) < state_tol


@pytest.mark.parametrize(
    "B,T,C,kw",
    [
        (1, 2, 37, 4),  # T < K-1: part of the old state survives; C not a multiple of anything
        (3, 63, 200, 4),  # batch 3, channels cross a 128 block, T under one chunk
        (1, 65, 37, 3),  # T crosses the 32-token time block, kernel 3
        (2, 5, 16, 2),  # kernel 2: a one-slot state
    ],
)
def test_causal_conv1d(poison, B, T, C, kw):
    gen = torch.Generator().manual_seed(T)
    x, w = torch.randn(B, T, C, generator=gen), torch.randn(C, 1, kw, generator=gen)
    state = torch.randn(B, C, kw - 1, generator=gen)
    state_ref = state.clone()
    out = causal_conv1d(x, state, w)
    ref = naive.causal_conv1d(x, state_ref, w)
    assert rel_err(out, ref) < 1e-6
    assert torch.equal(state, state_ref)


@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize(
    "dims",
    [
        TINY,
        dict(nk=2, nv=2, dk=32, dv=16),  # one value head per key head, dk != dv
        dict(nk=2, nv=6, dk=8, dv=12),  # 3 value heads per key head, dims not powers of two
        dict(nk=1, nv=4, dk=16, dv=16),  # 4 programs read one key head's q/k conv channels, one writes them
    ],
)
@pytest.mark.parametrize(
    "splits",
    [
        1,  # one program per value head: the norm in registers
        2,  # two column blocks per head: the last to arrive normalises the row (dv = 12: the second block is short)
        None,  # value_splits' choice for the grid
    ],
)
def test_decode(poison, B, dims, splits):
    x = make_inputs(B, 1, **dims)
    x_ref = clone(x)
    out = fused_recurrent.gated_delta_net_decode(**x, num_k_heads=dims["nk"], eps=1e-6, splits=splits)
    ref = run(naive, x_ref, dims["nk"])
    check(out, ref, x, x_ref, 1e-5, 1e-6)
    # the last reader of each key head's q/k conv channels, and the last split of each value head, reset their
    # counters for the next call
    cpu = torch.device("cpu")
    assert not fused_recurrent.reader_counters.buffers[(cpu, B * dims["nk"])].any()
    if (cpu, B * dims["nv"]) in fused_recurrent.norm_arrivals.buffers:
        assert not fused_recurrent.norm_arrivals.buffers[(cpu, B * dims["nv"])].any()


@pytest.mark.parametrize(
    "options", [{"splits": 2}, {"splits": 4, "num_warps": 2}], ids=["2 splits", "4 splits, 2 warps"]
)
def test_decode_options_override_the_launch(poison, monkeypatch, options):
    """DECODE_OPTIONS (what tune_decode_loop tries in the step) replace value_splits()' choice (seen in the grid)
    and the warps; the step stays right."""
    dims = dict(nk=1, nv=4, dk=16, dv=16)
    x = make_inputs(1, 1, **dims)
    x_ref = clone(x)
    monkeypatch.setattr(fused_recurrent, "DECODE_OPTIONS", options)
    grids, real = [], fused_recurrent._decode_kernel

    class Recording:
        def __getitem__(self, grid):
            grids.append(grid)
            return real[grid]

    monkeypatch.setattr(fused_recurrent, "_decode_kernel", Recording())
    out = fused_recurrent.gated_delta_net_decode(**x, num_k_heads=1, eps=1e-6)
    assert grids == [(1, 4, options["splits"])]
    check(out, run(naive, x_ref, 1), x, x_ref, 1e-5, 1e-6)


@pytest.mark.parametrize(
    "B,T,dims",
    [
        (1, 2, TINY),  # shortest prefill: the conv state is half old, half new
        (1, 63, TINY),  # one partial chunk
        (1, 64, TINY),  # exactly one chunk
        (3, 65, SMALL),  # batch 3, one token into the second chunk
        (1, 65, dict(nk=2, nv=6, dk=8, dv=12)),  # 3 value heads per key head, dims padded to the dot's 16
        (1, 500, SMALL),  # 8 chunks, the last one partial (500 = 7 * 64 + 52)
        (1, 130, dict(nk=1, nv=1, dk=32, dv=128)),  # dv split over four 32-wide state tiles
    ],
)
def test_prefill(poison, B, T, dims):
    x = make_inputs(B, T, **dims, seed=T)
    x_ref = clone(x)
    out = run(gdn_triton, x, dims["nk"])
    ref = run(naive, x_ref, dims["nk"])
    check(out, ref, x, x_ref, 1e-5, 1e-5)


def as_fused_slices(x):
    """x with mixed_qkv, z, b, a replaced by views of one [B, T, C + nv*dv + 2*nv] tensor, as the model passes
    the fused in_proj's output: every row is the fused width apart, so a kernel that assumes contiguous rows
    reads the wrong token."""
    names = ("mixed_qkv", "z", "b", "a")
    fused = torch.cat([x[n] for n in names], dim=-1)
    return {**x, **dict(zip(names, fused.split([x[n].shape[-1] for n in names], dim=-1)))}


# fp16 rounds the activations and the conv state where fp32 does not: the error of the fp16 reference itself
STRIDED_TOL = {torch.float32: 1e-5, torch.float16: 3e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "B,T,dims",
    [
        (3, 1, TINY),  # decode, batch 3: rows one fused width apart
        (2, 65, SMALL),  # prefill across a chunk boundary: conv, gates and gated norm read (b, t)-strided rows
    ],
)
def test_reads_fused_projection_slices(poison, dtype, B, T, dims):
    x = as_fused_slices(make_inputs(B, T, **dims, dtype=dtype, seed=B + T))
    assert not x["mixed_qkv"].is_contiguous() and not x["z"].is_contiguous()
    x_ref = {k: v.float().contiguous().clone() for k, v in x.items()}  # the states are updated in place
    out = run(gdn_triton, x, dims["nk"])
    ref = run(naive, x_ref, dims["nk"])
    check(out, ref, x, x_ref, STRIDED_TOL[dtype], STRIDED_TOL[dtype])


def test_prefill_near_identical_keys(poison):
    """The hardest case for the triangular inverse: every key almost the same direction, beta near 1 and
    almost no decay, so A is close to the all-ones strictly lower matrix and its powers grow large."""
    dims = SMALL
    x = make_inputs(1, 128, **dims, seed=7)
    C_qk = dims["nk"] * dims["dk"]
    common = torch.randn(dims["dk"]).repeat(dims["nk"])  # [nk * dk]
    x["mixed_qkv"][..., C_qk : 2 * C_qk] = common + 0.05 * torch.randn(1, 128, C_qk)
    x["conv_weight"][C_qk : 2 * C_qk] = torch.tensor([0.0, 0.0, 0.0, 1.0]).view(1, 1, 4)  # k = silu(x): no mixing
    x["conv_state"][:, C_qk : 2 * C_qk] = common[:, None]
    x["b"].fill_(6.0)  # beta ~ 0.998
    x["A_log"].fill_(-8.0)  # exp(A_log) ~ 3e-4: decay ~ 1
    x_ref = clone(x)
    out = run(gdn_triton, x, dims["nk"])
    ref = run(naive, x_ref, dims["nk"])
    check(out, ref, x, x_ref, 1e-4, 1e-4)


def test_prefill_decode_decode_carries_state(poison):
    """Prefill 65 tokens, then two decode steps, each from the states the previous call left."""
    B, nk = 3, SMALL["nk"]
    x = make_inputs(B, 65, **SMALL)
    x_ref = clone(x)
    check(run(gdn_triton, x, nk), run(naive, x_ref, nk), x, x_ref, 1e-5, 1e-5)
    for step in range(2):
        new = make_inputs(B, 1, **SMALL, seed=100 + step)
        new = {k: new[k] for k in ("mixed_qkv", "z", "a", "b")}
        check(run(gdn_triton, x, nk, **new), run(naive, x_ref, nk, **new), x, x_ref, 1e-5, 1e-5)


def test_exports_with_state_mutation():
    """torch.export sees the custom op with its in-place states; the exported program matches eager."""

    class Layer(torch.nn.Module):
        def __init__(self, x):
            super().__init__()
            self.params = {k: x[k] for k in ("conv_weight", "A_log", "dt_bias", "norm_weight")}
            self.register_buffer("conv_state", x["conv_state"])
            self.register_buffer("recurrent_state", x["recurrent_state"])

        def forward(self, mixed_qkv, z, a, b):
            return gdn_triton.gated_delta_net(
                mixed_qkv, z, a, b, **self.params, conv_state=self.conv_state,
                recurrent_state=self.recurrent_state, num_k_heads=TINY["nk"], eps=1e-6,
            )  # fmt: skip

    x = make_inputs(2, 1, **TINY)
    x_ref = clone(x)
    layer = Layer(x)
    args = tuple(x[k] for k in ("mixed_qkv", "z", "a", "b"))
    ep = torch.export.export(layer, args, strict=False)
    assert any("qmoe_gdn.gated_delta_net" in str(n.target) for n in ep.graph.nodes)
    out = ep.module()(*args)
    ref = run(naive, x_ref, TINY["nk"])
    assert rel_err(out, ref) < 1e-5
    assert rel_err(layer.recurrent_state, x_ref["recurrent_state"]) < 1e-6
    assert rel_err(layer.conv_state, x_ref["conv_state"]) < 1e-6


@torch.no_grad()
def test_tiny_model_greedy_matches_torch():
    """The tiny model with kernels.gdn=triton generates the same greedy tokens as with torch (fp32)."""
    from qmoe.model import build_model

    cfg = tiny_config()
    model = build_model(cfg, torch.float32, "cpu", seed=1)
    T = 66  # the prefill crosses the 64-token chunk
    tokens = torch.randint(0, cfg.vocab_size, (1, T), generator=torch.Generator().manual_seed(2))

    def generate(impl, steps=4):
        model.set_kernels({"gdn": impl})
        model.setup_caches(1, T + steps)
        logits = [model(tokens, torch.zeros(1, dtype=torch.int64))]
        for s in range(steps):
            logits.append(model(logits[-1].argmax(-1)[:, None], torch.full((1,), T + s)))
        return torch.stack([x.argmax(-1) for x in logits], 1), torch.stack(logits, 1)

    ref_tokens, ref_logits = generate("torch")
    tokens_triton, logits_triton = generate("triton")
    assert torch.equal(tokens_triton, ref_tokens)
    assert rel_err(logits_triton, ref_logits) < 1e-4


# ---- GPU: 35B-A3B dims, fp32 (TF32 dots in the chunked prefill) and bf16 ----

# (prefill output, decode output, state): TF32 dots in the prefill; bf16 storage of u, w and activations
GPU_TOL = {torch.float32: (5e-3, 1e-4, 5e-3), torch.bfloat16: (2e-2, 1e-2, 2e-2)}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,T", [(1, 1), (3, 1), (1, 63), (1, 64), (3, 65), (1, 500), (1, 4096)])
def test_gpu_35b(poison, dtype, B, T):
    x = make_inputs(B, T, **B35, dtype=dtype, device="cuda", seed=T)
    x_ref = clone(x)
    out = run(gdn_triton, x, B35["nk"])
    ref = run(naive, x_ref, B35["nk"])
    prefill_tol, decode_tol, state_tol = GPU_TOL[dtype]
    check(out, ref, x, x_ref, prefill_tol if T > 1 else decode_tol, state_tol)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_prefill_then_decode(poison, dtype):
    B, nk = 2, B35["nk"]
    x = make_inputs(B, 300, **B35, dtype=dtype, device="cuda")
    x_ref = clone(x)
    prefill_tol, decode_tol, state_tol = GPU_TOL[dtype]
    check(run(gdn_triton, x, nk), run(naive, x_ref, nk), x, x_ref, prefill_tol, state_tol)
    # The decode steps read the state the prefill left, with its (TF32 in fp32) error: the prefill's tolerance.
    for step in range(3):
        new = make_inputs(B, 1, **B35, dtype=dtype, device="cuda", seed=50 + step)
        new = {k: new[k] for k in ("mixed_qkv", "z", "a", "b")}
        tol = max(decode_tol, prefill_tol)
        check(run(gdn_triton, x, nk, **new), run(naive, x_ref, nk, **new), x, x_ref, tol, state_tol)


@pytest.mark.gpu
def test_gpu_decode_cuda_graph():
    """The decode step captures in a CUDA graph; replays match eager steps from the same states."""
    B, nk = 1, B35["nk"]
    x = make_inputs(B, 1, **B35, dtype=torch.bfloat16, device="cuda")
    x_eager = clone(x)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # warm-up (compilation) outside the capture, on scratch copies
        run(gdn_triton, clone(x), nk)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(gdn_triton, x, nk)
    for step in range(3):
        new = make_inputs(B, 1, **B35, dtype=torch.bfloat16, device="cuda", seed=10 + step)
        for k in ("mixed_qkv", "z", "a", "b"):
            x[k].copy_(new[k])
        graph.replay()
        ref = run(gdn_triton, x_eager, nk, **{k: new[k] for k in ("mixed_qkv", "z", "a", "b")})
        assert torch.equal(out, ref)
        assert torch.equal(x["recurrent_state"], x_eager["recurrent_state"])
        assert torch.equal(x["conv_state"], x_eager["conv_state"])
