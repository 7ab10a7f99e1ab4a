"""Triton MoE block (kernels/moe/triton.py) against the PyTorch reference (kernels/moe/naive.py) in float64."""

import pytest
import torch

from kernels.moe import naive
from kernels.moe import triton as moe
from qmoe.model import build_model
from tests.helpers import poisoned, rel_err, tiny_config

TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
# Small tiles keep the CPU interpreter fast; BLOCK_K / BLOCK_N below H and I so the K loop and N tiles both run.
SMALL = {
    "BLOCK_M": 16,
    "up": {"BLOCK_N": 16, "BLOCK_K": 32, "num_warps": 4, "num_stages": 1},
    "down": {"BLOCK_N": 32, "BLOCK_K": 16, "num_warps": 4, "num_stages": 1},
}


def make_routing(M, E, K, experts=None, seed=0, device="cpu"):
    """Distinct experts per token drawn from `experts` (default: all), random positive weights summing to 1."""
    gen = torch.Generator().manual_seed(seed)
    allowed = torch.arange(E) if experts is None else torch.tensor(experts)
    picks = torch.rand(M, len(allowed), generator=gen).argsort(-1)[:, :K]
    weights = torch.rand(M, K, generator=gen) + 0.1
    return (weights / weights.sum(-1, keepdim=True)).to(device), allowed[picks].to(device)


def make_experts(M, H, E, I, dtype, seed=0, device="cpu"):
    """x [M, H], w13 [E, 2I, H], w2 [E, H, I] drawn on `device` (the 35B/122B weights are GBs)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(M, H, generator=gen, device=device, dtype=dtype)
    w13 = torch.randn(E, 2 * I, H, generator=gen, device=device, dtype=dtype) / H**0.5
    w2 = torch.randn(E, H, I, generator=gen, device=device, dtype=dtype) / I**0.5
    return x, w13, w2


def reference(x, w13, w2, weights, ids):
    return naive.fused_moe(x.double(), w13.double(), w2.double(), weights.double(), ids)


# (M, H, E, I, K, experts allowed, reason)
CASES = [
    (1, 64, 8, 32, 2, None, "one decode token: M < BLOCK_M, 15 idle rows in the tile"),
    (37, 47, 13, 23, 3, None, "M, H, I odd and prime E: every tail masked, no size a multiple of a block"),
    (20, 32, 4, 16, 1, None, "K = 1: one expert per token"),
    (9, 32, 5, 16, 5, None, "K = E: every token uses every expert"),
    (24, 32, 16, 16, 2, [0, 3, 11], "13 of 16 experts get zero tokens"),
    (40, 32, 6, 16, 1, [4], "all 40 tokens on expert 4: more than BLOCK_M rows in one group"),
    (70, 48, 8, 32, 2, None, "prefill-sized M above the decode limit, several blocks per expert"),
]


@pytest.mark.parametrize("decode", [True, False], ids=["decode", "sorted"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M,H,E,I,K,experts,reason", CASES, ids=[c[-1].split(":")[0] for c in CASES])
def test_fused_moe_paths(M, H, E, I, K, experts, reason, dtype, decode):
    """Both regimes on every shape. The op's scratch (h [P, I], partials [P, H]) is NaN-filled, and every output
    row is a sum of partials, so a pair row either kernel fails to write reaches the output as NaN."""
    x, w13, w2 = make_experts(M, H, E, I, dtype)
    weights, ids = make_routing(M, E, K, experts)
    h, partials = poisoned(M * K, I, dtype=dtype), poisoned(M * K, H, dtype=dtype)
    out = moe.fused_moe_into(x, w13, w2, weights, ids, h, partials, decode=decode, config=SMALL)
    assert out.dtype == dtype and out.shape == (M, H)
    assert rel_err(out, reference(x, w13, w2, weights, ids)) < TOL[dtype], reason


def test_fused_moe_op_default_configs():
    """The custom op itself, with the default launch configs of both regimes (BLOCK_K, BLOCK_N > H, I here)."""
    for M in (3, 65):
        x, w13, w2 = make_experts(M, 40, 6, 24, torch.float32, seed=M)
        weights, ids = make_routing(M, 6, 2, seed=M)
        out = moe.fused_moe(x, w13, w2, weights, ids)
        assert rel_err(out, reference(x, w13, w2, weights, ids)) < TOL[torch.float32]


def test_fused_moe_is_deterministic():
    """The combine sums the K partials in a fixed order: two runs are bit-identical."""
    x, w13, w2 = make_experts(70, 32, 5, 16, torch.float32)
    weights, ids = make_routing(70, 5, 2)
    assert torch.equal(moe.fused_moe(x, w13, w2, weights, ids), moe.fused_moe(x, w13, w2, weights, ids))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M,E,K", [(1, 8, 2), (33, 13, 3), (5, 7, 7)], ids=["decode", "prime-E", "K=E"])
def test_route(M, E, K, dtype):
    logits = torch.randn(M, E, generator=torch.Generator().manual_seed(M)).to(dtype)
    weights, ids = moe.route(logits, K)
    ref_w, ref_ids = naive.route(logits, K)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(ids, ref_ids)  # random logits: no ties, so the order must match torch.topk
    torch.testing.assert_close(weights, ref_w, rtol=1e-5, atol=1e-6)


def test_route_ties():
    """Many equal logits: any of the tied experts may be picked, but the picked probabilities, the weights and
    the distinctness of the ids must match torch.topk."""
    logits = torch.randint(0, 3, (16, 12), generator=torch.Generator().manual_seed(0)).float()
    weights, ids = moe.route(logits, 4)
    ref_w, _ = naive.route(logits, 4)
    probs = torch.softmax(logits, -1)
    ref_top = probs.topk(4, -1).values
    torch.testing.assert_close(probs.gather(1, ids), ref_top)
    torch.testing.assert_close(weights, ref_w)
    assert all(len(set(row.tolist())) == 4 for row in ids)


def block_args(M, H, E, I, Is, dtype, seed=0):
    """(x, proj, w13, w2, shared_down): proj is the fused input projection the model's SparseMoE computes."""
    gen = torch.Generator().manual_seed(seed)
    x, w13, w2 = make_experts(M, H, E, I, dtype, seed)
    in_proj = torch.randn(E + 2 * Is + 1, H, generator=gen).to(dtype) / H**0.5  # router | gate | up | shared gate
    shared_down = torch.randn(H, Is, generator=gen).to(dtype) / Is**0.5
    return x, x @ in_proj.T, w13, w2, shared_down


@pytest.mark.parametrize("M", [4, 70], ids=["decode", "prefill"])
def test_moe_block(M):
    args = block_args(M, 48, 8, 32, 24, torch.float32)
    out = moe.moe_block(*args, top_k=2)
    ref = naive.moe_block(*[a.double() for a in args], top_k=2)
    assert rel_err(out, ref) < 1e-5


def test_moe_block_export():
    """fused_moe and route are custom ops with fake kernels: the block traces under torch.export and the exported
    program runs the Triton kernels."""

    class Block(torch.nn.Module):
        def forward(self, x, proj, w13, w2, shared_down):
            return moe.moe_block(x, proj, w13, w2, shared_down, 2)

    args = block_args(6, 32, 5, 16, 16, torch.float32)
    program = torch.export.export(Block(), args)
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert {"qmoe.fused_moe.default", "qmoe.moe_route.default"} <= targets
    assert rel_err(program.module()(*args), naive.moe_block(*args, top_k=2)) < 1e-5


TINY = tiny_config()


@torch.no_grad()
def greedy(model, tokens, steps):
    model.setup_caches(1, tokens.shape[1] + steps + 1)
    logits = model(tokens, torch.zeros(1, dtype=torch.int64))
    out = [logits.argmax(-1)]
    for s in range(steps):
        out.append(model(out[-1][:, None], torch.full((1,), tokens.shape[1] + s)).argmax(-1))
    return torch.stack(out, 1), logits


def test_model_greedy_matches_torch():
    """Tiny model in fp32: a 70-token prefill (sorted path) and 6 decode steps (decode path) give the same greedy
    tokens with kernels.moe=triton as with kernels.moe=torch."""
    model = build_model(TINY, torch.float32, "cpu", seed=0)
    tokens = torch.randint(0, 512, (1, 70), generator=torch.Generator().manual_seed(0))
    ref_tokens, ref_logits = greedy(model, tokens, 6)
    model.set_kernels({"moe": "triton"})
    ours_tokens, ours_logits = greedy(model, tokens, 6)
    assert torch.equal(ours_tokens, ref_tokens)
    assert rel_err(ours_logits, ref_logits) < 1e-4


# ----------------------------------------------------------------------------------------------- GPU

QWEN35B = dict(E=256, H=2048, I=512, K=8)
QWEN122B = dict(E=256, H=3072, I=1024, K=8)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M", [1, 7, 64, 65, 512, 2000], ids=lambda m: f"M{m}")
def test_fused_moe_35b_gpu(M, dtype):
    """35B-A3B shapes, both regimes (M <= 64 decode, above sorted), with the tuned table when present."""
    s = QWEN35B
    x, w13, w2 = make_experts(M, s["H"], s["E"], s["I"], dtype, device="cuda")
    weights, ids = moe.route(torch.randn(M, s["E"], device="cuda"), s["K"])
    h = poisoned(M * s["K"], s["I"], dtype=dtype, device="cuda")
    partials = poisoned(M * s["K"], s["H"], dtype=dtype, device="cuda")
    out = moe.fused_moe_into(x, w13, w2, weights, ids, h, partials)
    assert rel_err(out, reference(x, w13, w2, weights, ids)) < TOL[dtype]
    assert rel_err(moe.fused_moe(x, w13, w2, weights, ids), out) == 0.0


@pytest.mark.gpu
def test_fused_moe_skewed_gpu():
    """All 64 decode tokens share experts 0..7 (64 rows per group, four BLOCK_M chunks)."""
    s = QWEN35B
    x, w13, w2 = make_experts(64, s["H"], s["E"], s["I"], torch.bfloat16, device="cuda")
    weights, ids = make_routing(64, s["E"], s["K"], experts=list(range(8)), device="cuda")
    assert rel_err(moe.fused_moe(x, w13, w2, weights, ids), reference(x, w13, w2, weights, ids)) < TOL[torch.bfloat16]


@pytest.mark.gpu
def test_fused_moe_64bit_offsets_gpu():
    """122B shapes at M = 16384 (P = 131072 pairs): the last tokens' rows sit at the largest offsets."""
    s, M = QWEN122B, 16384
    x, w13, w2 = make_experts(M, s["H"], s["E"], s["I"], torch.bfloat16, device="cuda")
    weights, ids = moe.route(torch.randn(M, s["E"], device="cuda"), s["K"])
    out = moe.fused_moe(x, w13, w2, weights, ids)
    rows = torch.cat([torch.arange(32), torch.arange(M - 32, M)]).cuda()
    ref = reference(x[rows], w13, w2, weights[rows], ids[rows])
    assert rel_err(out[rows], ref) < TOL[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("M", [4, 512])
def test_fused_moe_cuda_graph_gpu(M):
    """Captured once, replayed on new inputs copied into the static buffers: same result as eager."""
    s, dtype = QWEN35B, torch.bfloat16
    x, w13, w2 = make_experts(M, s["H"], s["E"], s["I"], dtype, device="cuda")
    logits = torch.randn(M, s["E"], device="cuda")
    run = lambda: moe.fused_moe(x, w13, w2, *moe.route(logits, s["K"]))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        run()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = run()
    for seed in range(3):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        x.copy_(torch.randn(x.shape, generator=gen, device="cuda"))
        logits.copy_(torch.randn(logits.shape, generator=gen, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, run())
