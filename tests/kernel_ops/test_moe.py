"""Triton MoE block (kernels/moe/triton.py) against the PyTorch reference (kernels/moe/naive.py) in float64."""

import pytest
import torch

from kernels.fp8 import FP8
from kernels.moe import naive
from kernels.moe import triton as moe
from qmoe.model import build_model
from tests.helpers import captured, poisoned, rel_err, tiny_config

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
    (1, 64, 8, 32, 2, None, "one token: M < BLOCK_M, 15 idle rows in the tile"),
    (37, 47, 13, 23, 3, None, "M, H, I odd and prime E: every tail masked, no size a multiple of a block"),
    (9, 32, 5, 16, 5, None, "K = E: every token uses every expert"),
    (24, 32, 16, 16, 2, [0, 3, 11], "13 of 16 experts get zero tokens"),
    (40, 32, 6, 16, 1, [4], "all 40 tokens on expert 4: more than BLOCK_M rows in one group"),
    (70, 48, 8, 32, 2, None, "prefill-sized M, several blocks per expert"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M,H,E,I,K,experts,reason", CASES, ids=[c[-1].split(":")[0] for c in CASES])
def test_fused_moe_sorted(M, H, E, I, K, experts, reason, dtype):
    """The prefill path on every shape. Its scratch (h [P, I], partials [P, H]) is NaN-filled, and every output
    row is a sum of partials, so a pair row either kernel fails to write reaches the output as NaN."""
    x, w13, w2 = make_experts(M, H, E, I, dtype)
    weights, ids = make_routing(M, E, K, experts)
    h, partials = poisoned(M * K, I, dtype=dtype), poisoned(M * K, H, dtype=dtype)
    out = moe.fused_moe_into(x, w13, w2, weights, ids, h, partials, config=SMALL)
    assert out.dtype == dtype and out.shape == (M, H)
    assert rel_err(out, reference(x, w13, w2, weights, ids)) < TOL[dtype], reason


# (M, E, K, BLOCK_M, duplicate ids per token, reason)
ALIGN_CASES = [
    (1, 8, 2, 16, False, "one token: two groups of one pair, one chunk"),
    (300, 13, 3, 64, False, "prime E, 900 pairs: 8 chunks, ranks carried across chunks"),
    (1000, 256, 8, 128, False, "the 35B router: 63 chunks, 256 groups in four 64-expert steps"),
    (200, 257, 8, 64, True, "expert parallel's extra group (id E - 1 four times per token), E past a power of 2"),
]


@pytest.mark.parametrize("M,E,K,block_m,dup,reason", ALIGN_CASES, ids=[c[-1].split(":")[0] for c in ALIGN_CASES])
def test_align_pairs_groups_in_pair_order(M, E, K, block_m, dup, reason):
    """align_pairs: each expert's group holds its pairs in pair order (deterministic: no atomics), then P in its
    padding to a multiple of BLOCK_M; ends are the padded groups' running ends."""
    gen = torch.Generator().manual_seed(M)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(M)])
    if dup:
        ids[:, :4] = E - 1
    sorted_pairs, ends = moe.align_pairs(ids, E, block_m)
    counts = torch.bincount(ids.flatten(), minlength=E)
    padded = (counts + block_m - 1) // block_m * block_m
    assert ends.tolist() == padded.cumsum(0).tolist(), reason
    starts = (padded.cumsum(0) - padded).tolist()
    for e in range(E):
        group = sorted_pairs[starts[e] : starts[e] + padded[e]]
        assert group[: counts[e]].tolist() == torch.nonzero(ids.flatten() == e).flatten().tolist(), (reason, e)
        assert (group[counts[e] :] == M * K).all(), (reason, e)


# BLOCK_M 64 with SUB_TILES 2: a block runs 16, 32 or 64 rows by how many of its rows are real
SUB_TILED = {**SMALL, "BLOCK_M": 64, "SUB_TILES": 2}
# top-1 expert of each token, by group size: 5 (a 16-row quarter tile), 16 (exactly a quarter), 17 and 32 (half
# tiles, the first one row past a quarter), 40 (whole), 70 (a whole block, then a 6-row quarter tail)
GROUPS = {0: 5, 1: 16, 2: 17, 3: 32, 5: 40, 6: 70}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_moe_sub_tiles(dtype):
    """SUB_TILES: each block's real rows run a tile of a quarter, half or all of BLOCK_M rows (tl.dot shapes of
    16, 32 and 64 rows in one kernel), every group size at each boundary, tokens in shuffled order; NaN scratch,
    so a row no tile writes reaches the output."""
    ids = torch.cat([torch.full((n,), e) for e, n in GROUPS.items()])
    ids = ids[torch.randperm(len(ids), generator=torch.Generator().manual_seed(0))][:, None]
    M, H, E, I = len(ids), 48, 8, 32
    x, w13, w2 = make_experts(M, H, E, I, dtype)
    weights = torch.ones(M, 1)
    h, partials = poisoned(M, I, dtype=dtype), poisoned(M, H, dtype=dtype)
    out = moe.fused_moe_into(x, w13, w2, weights, ids, h, partials, config=SUB_TILED)
    assert rel_err(out, reference(x, w13, w2, weights, ids)) < TOL[dtype]
    for bad in (3, -1):
        with pytest.raises(ValueError, match="SUB_TILES is 0, 1 or 2"):
            moe.fused_moe_into(x, w13, w2, weights, ids, h, partials, config={**SUB_TILED, "SUB_TILES": bad})
    with pytest.raises(ValueError, match="BLOCK_M >> SUB_TILES >= 16"):
        moe.fused_moe_into(x, w13, w2, weights, ids, h, partials, config={**SMALL, "SUB_TILES": 1})


def test_fused_moe_is_deterministic():
    """The prefill combine sums the K partials in a fixed order: two runs are bit-identical."""
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


def test_route_ties_and_strided_logits():
    """Many equal logits, read as a strided column slice: the picked probabilities, the weights and the
    distinctness of the ids match torch.topk (which of the tied experts is picked may differ)."""
    wide = torch.randint(0, 3, (16, 20), generator=torch.Generator().manual_seed(0)).float()
    logits = wide[:, 3:15]  # row stride 20, offset 3
    weights, ids = moe.route(logits, 4)
    ref_w, _ = naive.route(logits, 4)
    probs = torch.softmax(logits, -1)
    torch.testing.assert_close(probs.gather(1, ids), probs.topk(4, -1).values)
    torch.testing.assert_close(weights, ref_w)
    assert all(len(set(row.tolist())) == 4 for row in ids)


def ranked(row: torch.Tensor, top_k: int) -> list[int]:
    """The kernels' order of one row of logits: descending by the fp32 bits' order key (-0.0 below +0.0, NaN
    above +inf), ties to the lower id."""
    bits = row.float().view(torch.int32).tolist()
    key = [b if b >= 0 else b ^ 0x7FFFFFFF for b in bits]
    return sorted(range(len(key)), key=lambda e: (-key[e], e))[:top_k]


def awkward_logits(M: int, E: int, seed: int) -> torch.Tensor:
    """Logits whose order needs every part of the key: exact ties (values rounded to halves), -0.0 and +0.0,
    +-inf and NaN (in some rows), exactly representable in bf16."""
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(M, E, generator=gen) * 2).round() / 2
    logits[:, 1], logits[:, 2] = -0.0, 0.0
    logits[1::2, 4], logits[1::2, E - 1] = float("inf"), float("-inf")
    logits[2::3, 6] = float("nan")
    return logits


@pytest.mark.parametrize("E,reason", [(256, "35B: BLOCK_E = E"), (200, "padding lanes"), (37, "prime E")])
def test_route_bf16_keys_order_like_fp32(E, reason):
    """bf16 logits rank on 16-bit keys packed with the id in an int32 (_packed_keys); fp32 ones on 32-bit keys in
    an int64. On the same values (bf16 -> fp32 is exact) both give the same experts in the same order, ties and
    signed zeros and NaN included (torch's CPU cast makes NaN 0xFFFF in bf16: below -inf in the order), and the
    same weights."""
    logits = awkward_logits(9, E, seed=E).to(torch.bfloat16)
    weights, ids = moe.route(logits, 8)
    ref_w, ref_ids = moe.route(logits.float(), 8)
    assert ids.tolist() == ref_ids.tolist() == [ranked(row, 8) for row in logits], reason
    torch.testing.assert_close(weights, ref_w, rtol=0, atol=0, equal_nan=True)


def block_args(M, H, E, I, Is, dtype, seed=0, router=None):
    """(x, proj, w13, w2, shared_down): proj is the fused input projection the model's SparseMoE computes, as the
    model hands it over (row length E + 2 Is + 1, odd, so rows are unaligned), or a column slice of a wider
    buffer. router(M, E) -> logits overrides the router columns (skewed routing)."""
    gen = torch.Generator().manual_seed(seed)
    x, w13, w2 = make_experts(M, H, E, I, dtype, seed)
    in_proj = torch.randn(E + 2 * Is + 1, H, generator=gen).to(dtype) / H**0.5  # router | gate | up | shared gate
    shared_down = torch.randn(H, Is, generator=gen).to(dtype) / Is**0.5
    proj = x @ in_proj.T
    if router is not None:
        proj[:, :E] = router(M, E).to(dtype)
    return x, proj, w13, w2, shared_down


def block_reference(args, top_k):
    return naive.moe_block(*[a.double() for a in args], top_k=top_k)


def decode_poisoned(x, I, top_k, config):
    """decode_scratch with every buffer poisoned: NaN floats, int32 ids/counters at 12345 (the up kernel must
    zero the counters, or no program is the last to arrive and the output stays NaN)."""
    scratch = moe.decode_scratch(x, I, top_k, config)
    for name, buf in scratch.items():
        buf.fill_(12345 if name == "i32" else float("nan"))
    return scratch


def same_experts(experts):
    """Router logits that send every token to `experts` (in a random order per token)."""
    return lambda M, E: torch.randn(M, E).where(
        ~torch.isin(torch.arange(E), torch.tensor(experts)), torch.rand(M, E) + 10.0
    )


# (M, H, E, I, Is, K, router, reason): decode path, poisoned scratch, small tiles
DECODE_CASES = [
    (1, 64, 8, 32, 24, 2, None, "one token: M < BLOCK_M, the shared expert Is != I"),
    (5, 47, 13, 23, 17, 3, None, "odd H, I, Is and prime E: every tail masked"),
    (6, 32, 5, 16, 16, 5, None, "K = E: every token uses every expert, one pair group per expert"),
    (20, 32, 6, 16, 16, 1, same_experts([4]), "all 20 tokens on expert 4: more than BLOCK_M rows in one group"),
    (12, 32, 16, 16, 16, 2, same_experts([0, 3]), "14 of 16 experts get no token"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M,H,E,I,Is,K,router,reason", DECODE_CASES, ids=[c[-1].split(":")[0] for c in DECODE_CASES])
def test_moe_block_decode(M, H, E, I, Is, K, router, reason, dtype):
    args = block_args(M, H, E, I, Is, dtype, router=router)
    scratch = decode_poisoned(args[0], I, K, SMALL)
    out = moe.moe_block_decode(*args, K, config=SMALL, scratch=scratch)
    assert out.data_ptr() == scratch["out"].data_ptr() and out.shape == (M, H) and out.dtype == dtype
    assert rel_err(out, block_reference(args, K)) < TOL[dtype], reason


# The GEMV path (a config with BLOCK_M = 1) with tiles below H and I, so its K loops and N tiles both run.
GEMV_SMALL = {
    "BLOCK_M": 1,
    "up": {"BLOCK_N": 4, "BLOCK_K": 16, "num_warps": 4, "num_stages": 1},
    "down": {"BLOCK_N": 2, "BLOCK_K": 8, "num_warps": 4, "num_stages": 1},
}
# (H, E, I, Is, K, reason)
GEMV_CASES = [
    (64, 8, 32, 24, 2, "even H: the unmasked K loop; Is < I"),
    (47, 13, 23, 17, 3, "odd H, I, Is, prime E, K not a power of two: every tail masked, rows past I and H"),
    (32, 5, 16, 40, 5, "K = E and Is > I: the down loop runs past I for the shared expert"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M", [1, 3], ids=["one token", "3 tokens: each token's pairs and output row apart"])
@pytest.mark.parametrize("H,E,I,Is,K,reason", GEMV_CASES, ids=[c[-1].split(":")[0] for c in GEMV_CASES])
def test_moe_block_gemv(H, E, I, Is, K, reason, M, dtype):
    """M tokens on the GEMV kernels, every scratch buffer poisoned; the routing they hand over is the reference's.
    At M = 3 tokens share experts (E <= 13, K >= 2; K = E in one case: all of them), and a token that read
    another's x, proj row, routing or h rows, or wrote another's output row, differs from the reference."""
    args = block_args(M, H, E, I, Is, dtype, seed=H)
    scratch = decode_poisoned(args[0], I, K, GEMV_SMALL)
    out = moe.moe_block_decode(*args, K, config=GEMV_SMALL, scratch=scratch)
    assert out.data_ptr() == scratch["out"].data_ptr() and out.shape == (M, H) and out.dtype == dtype
    assert rel_err(out, block_reference(args, K)) < TOL[dtype], reason
    ref_w, ref_ids = naive.route(args[1][:, :E].float(), K)
    assert torch.equal(scratch["i32"].long(), ref_ids.flatten())
    torch.testing.assert_close(scratch["f32"], ref_w.flatten())


def rank_share(args, ep, rank):
    """Rank `rank`'s inputs under expert parallel over ep ranks: its El = E / ep experts (views into copies of the
    weights whose other experts are NaN, so a kernel that reads another rank's expert poisons the output), the
    whole router and its slice of the shared expert (Is / ep columns of gate, up and down) -> (args, first)."""
    x, proj, w13, w2, shared_down = args
    E, Is = w13.shape[0], shared_down.shape[1]
    El, Isl = E // ep, Is // ep
    first, cols = rank * El, slice(rank * Isl, (rank + 1) * Isl)
    mine = torch.zeros(E, dtype=torch.bool)
    mine[first : first + El] = True
    w13p, w2p = w13.where(mine[:, None, None], float("nan")), w2.where(mine[:, None, None], float("nan"))
    router, gate, up, gate_logit = naive.split_projection(proj, E, Is)
    proj_r = torch.cat([router, gate[:, cols], up[:, cols], gate_logit], 1)
    return (x, proj_r, w13p[first : first + El], w2p[first : first + El], shared_down[:, cols].contiguous()), first


# (M, ep, router, small config, reason): each rank's share against the reference's, and the shares' sum against
# the whole block; the small config (M <= 64) runs the decode path named in the reason on poisoned scratch
EP_CASES = [
    (1, 2, None, GEMV_SMALL, "one token: the GEMV kernels, the other rank's expert programs load and store nothing"),
    (1, 4, None, GEMV_SMALL, "one token, 4 ranks: most of a token's experts are elsewhere"),
    (3, 2, None, GEMV_SMALL, "3 tokens on the GEMV kernels: each token's experts of the other rank masked apart"),
    (5, 2, None, SMALL, "M <= 64: the tiled decode kernels, the other rank's pairs marked by the grid's extra column"),
    (20, 2, same_experts([0, 1, 2]), SMALL, "every token on rank 0's experts: rank 1 computes nothing but zeros"),
    (70, 4, None, None, "prefill-sized M on 4 ranks: the aligned path, the other ranks' pairs grouped and skipped"),
]


@pytest.mark.parametrize("M,ep,router,config,reason", EP_CASES, ids=[c[-1].split(":")[0] for c in EP_CASES])
def test_moe_block_expert_parallel(M, ep, router, config, reason):
    H, E, I, Is, K = 47, 12, 23, 16, 3
    args = block_args(M, H, E, I, Is, torch.float32, seed=M, router=router)
    total = torch.zeros(M, H, dtype=torch.float64)
    for rank in range(ep):
        share_args, first = rank_share(args, ep, rank)
        x, proj, w13, w2, shared_down = share_args
        ref = naive.ep_moe_block(x.double(), proj.double(), w13.double(), w2.double(), shared_down.double(), K, first)
        if config is not None:  # small tiles and poisoned scratch: ids, weights and partials of every pair set
            scratch = decode_poisoned(args[0], I, K, config)
            small = moe.moe_block_decode(*share_args, K, config=config, scratch=scratch, first=first)
            assert rel_err(small, ref) < TOL[torch.float32], (reason, rank)
        out = moe.moe_block_ep(*share_args, K, first)  # the default configs
        assert rel_err(out, ref) < TOL[torch.float32], (reason, rank)
        total += out.double()
    assert rel_err(total, block_reference(args, K)) < TOL[torch.float32], reason


def test_moe_block_gemv_takes_a_register_cap():
    """A config part's maxnreg (Triton's register cap, as the H200 table's MoE up entry has) is a launch option
    the GEMV kernels take; the block stays right."""
    capped = {**GEMV_SMALL, "up": {**GEMV_SMALL["up"], "maxnreg": 128}, "down": {**GEMV_SMALL["down"], "maxnreg": 96}}
    args = block_args(1, 47, 13, 23, 17, torch.float32, seed=4)
    out = moe.moe_block_decode(*args, 3, config=capped, scratch=decode_poisoned(args[0], 23, 3, capped))
    assert rel_err(out, block_reference(args, 3)) < TOL[torch.float32]


def slot_h(args, ids, I):
    """h [K, I] in fp64 of one token's pairs: silu(x @ gate_e^T) * (x @ up_e^T), e = ids[k]."""
    x, w13 = args[0].double(), args[2].double()
    return torch.cat([torch.nn.functional.silu(x @ w13[e, :I].T) * (x @ w13[e, I:].T) for e in ids])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["int64 keys", "bf16: int32 keys"])
def test_moe_block_gemv_routes_ties_like_the_reference(dtype):
    """Exact ties inside the top k: the k-th slot must hold the same expert in the up kernel (each program ranks
    only up to its slot, _kth_expert: its h row), in the routing it hands over (one program ranks all K) and in
    the reference (lower id first), or the down kernel applies one expert's rows to another's h. (The block's
    output is checked in fp32: the interpreter's bf16 down kernel gives garbage, also before _kth_expert; the
    GPU tests run it in bf16.)"""
    tied = lambda M, E: torch.tensor([[1.0, 3.0, 3.0, 0.5, 3.0, 2.0, -2.0, -1.0]]).expand(M, E)  # noqa: E731
    args = block_args(1, 32, 8, 16, 16, dtype, router=tied)
    scratch = decode_poisoned(args[0], 16, 4, GEMV_SMALL)
    out = moe.moe_block_decode(*args, 4, config=GEMV_SMALL, scratch=scratch)
    assert scratch["i32"].tolist() == [1, 2, 4, 5]
    assert rel_err(scratch["h"], slot_h(args, [1, 2, 4, 5], 16)) < TOL[dtype]
    if dtype == torch.float32:
        assert rel_err(out, block_reference(args, 4)) < TOL[dtype]


@pytest.mark.parametrize("K", [1, 3, 8])
def test_moe_block_gemv_each_slot_takes_its_rank(K):
    """bf16 logits with ties, signed zeros, infinities and NaN on the M = 1 up kernel: every slot's program finds
    its expert after k + 1 rounds (its h row is that expert's), and the routing handed over is the whole order.
    K = 1: the one slot is the last, the program that hands over."""
    E = 37
    logits = awkward_logits(1, E, seed=K)
    logits[0, 4], logits[0, 6], logits[0, E - 1] = float("inf"), float("nan"), float("-inf")
    logits = logits.to(torch.bfloat16)
    args = block_args(1, 32, E, 16, 16, torch.bfloat16, router=lambda M, E: logits)
    scratch = decode_poisoned(args[0], 16, K, GEMV_SMALL)
    moe.moe_block_decode(*args, K, config=GEMV_SMALL, scratch=scratch)
    assert scratch["i32"].tolist() == ranked(logits[0], K)
    assert rel_err(scratch["h"], slot_h(args, ranked(logits[0], K), 16)) < TOL[torch.bfloat16]


def test_moe_block_gemv_is_deterministic_and_default():
    """moe_block at M = 1 takes the GEMV path by default (no config passed) and is bit-reproducible."""
    args = block_args(1, 40, 6, 24, 24, torch.float32)
    assert moe.get_config(1, 6, 40, 24, torch.float32)["BLOCK_M"] == 1
    out = moe.moe_block(*args, top_k=3)
    assert rel_err(out, block_reference(args, 3)) < 1e-5
    assert torch.equal(moe.moe_block(*args, top_k=3), out)


def test_get_config_is_cached():
    """The table lookup formats a key: it runs once per shape, not per call (host time of every eager MoE call),
    and tune_decode_loop clears the cache when it swaps tables."""
    assert moe.get_config(1, 6, 40, 24, torch.float32) is moe.get_config(1, 6, 40, 24, torch.float32)
    moe.get_config.cache_clear()


def test_moe_block_gemv_config_serves_few_tokens():
    args = block_args(moe.DECODE_MAX_M + 1, 32, 8, 16, 16, torch.float32)
    with pytest.raises(ValueError, match=f"serves M <= {moe.DECODE_MAX_M} tokens"):
        moe.moe_block_decode(*args, 2, config=GEMV_SMALL)


def test_get_config_takes_a_gemv_entry_in_decode_buckets(monkeypatch):
    """A table entry's kind decides the kernels: a GEMV entry (BLOCK_M = 1) serves its decode bucket's M (tune_moe
    picks it there when it beats the tiles) and no prefill bucket, a tiled entry never serves M = 1, and M = 1
    without an entry runs the default GEMV."""
    gemv, tiled = {**GEMV_SMALL}, {**SMALL}
    past = moe.m_bucket(moe.DECODE_MAX_M + 1)  # the first prefill bucket: a GEMV entry must not serve it
    table = {moe.shape_key(8, 32, 16, torch.float32): {"1": tiled, "2": tiled, "4": gemv, str(past): gemv}}
    monkeypatch.setattr(moe, "CONFIG_TABLE", table)
    moe.get_config.cache_clear()
    try:
        assert moe.get_config(3, 8, 32, 16, torch.float32) is gemv  # bucket 4
        assert moe.get_config(4, 8, 32, 16, torch.float32) is gemv
        assert moe.get_config(2, 8, 32, 16, torch.float32) is tiled
        assert moe.get_config(1, 8, 32, 16, torch.float32) == moe.DEFAULT_CONFIGS["gemv"]
        assert moe.get_config(past, 8, 32, 16, torch.float32)["BLOCK_M"] > 1
    finally:
        moe.get_config.cache_clear()


def test_moe_block_decode_hands_over_routing():
    """The ids and weights the up kernel writes for the down kernel (softmax numerators, normalised over each
    token's K) are the reference routing, and the counters it zeroed were all used up by the down kernel (one
    arrival per program: P + 1 on each N tile)."""
    M, K, E = 3, 2, 8
    args = block_args(M, 32, E, 16, 16, torch.float32)
    scratch = decode_poisoned(args[0], 16, K, SMALL)
    moe.moe_block_decode(*args, K, config=SMALL, scratch=scratch)
    ref_w, ref_ids = naive.route(args[1][:, :E], K)
    P = M * K
    assert torch.equal(scratch["i32"][:P].long(), ref_ids.flatten())
    nums = scratch["f32"][:P].view(M, K)
    torch.testing.assert_close(nums / nums.sum(-1, keepdim=True), ref_w)
    assert scratch["i32"][P:].tolist() == [P + 1] * (32 // SMALL["down"]["BLOCK_N"])


def test_moe_block_strided_proj():
    """proj as a column slice of a wider buffer (row stride 3 + E + 2 Is + 1 + 2, offset 3): nothing assumes
    contiguous or aligned rows."""
    x, proj, w13, w2, shared_down = block_args(4, 32, 8, 16, 24, torch.float32)
    wide = torch.full((4, proj.shape[1] + 5), float("nan"))
    wide[:, 3 : 3 + proj.shape[1]] = proj
    view = wide[:, 3 : 3 + proj.shape[1]]
    out = moe.moe_block_decode(x, view, w13, w2, shared_down, 2, config=SMALL)
    assert rel_err(out, block_reference((x, proj, w13, w2, shared_down), 2)) < 1e-5
    assert (
        rel_err(
            moe.moe_block(x[:1].expand(70, -1).contiguous(), view[:1].expand(70, -1), w13, w2, shared_down, 2),
            block_reference((x[:1].expand(70, -1), proj[:1].expand(70, -1), w13, w2, shared_down), 2),
        )
        < 1e-5
    )


@pytest.mark.parametrize("M", [16, 17, 64, 65], ids=["dense-decode-limit", "dense-grouped-first", "decode-limit",
                                                   "prefill-first"])  # fmt: skip
def test_moe_block_handover(M):
    """Dense experts: M = 16 is the last size on the decode kernels, 17 the first on the grouped path; M = 64 is the
    decode kernels' own limit (P = 128 pair slots, 4 rank chunks: moe_block_decode serves it), 65 a prefill size."""
    args = block_args(M, 32, 8, 16, 16, torch.float32, seed=M)
    out = moe.moe_block(*args, top_k=2)
    assert rel_err(out, block_reference(args, 2)) < 1e-5
    if M <= moe.DECODE_MAX_M:
        assert rel_err(moe.moe_block_decode(*args, 2), block_reference(args, 2)) < 1e-5


@pytest.mark.parametrize("dtype,last", [(torch.float32, 16), (torch.bfloat16, 16), (FP8, 64)])
def test_moe_block_path_by_tokens_and_experts_dtype(monkeypatch, dtype, last):
    """moe_block and moe_block_ep run the decode kernels up to decode_max_m tokens (dense experts 16: above it the
    grouped path is faster on the H200; fp8 experts 64: their grouped path quantizes the activations) and the
    grouped path from the next token on."""
    taken = []
    monkeypatch.setattr(moe, "moe_block_decode", lambda x, *a, **k: taken.append("decode") or x)
    monkeypatch.setattr(moe, "moe_block_prefill", lambda x, *a, **k: taken.append("grouped") or x)
    for M in (1, last, last + 1):
        x, proj = torch.zeros(M, 8), torch.zeros(M, 4 + 2 * 2 + 1)
        w13, w2, sd = torch.zeros(4, 4, 8, dtype=dtype), torch.zeros(4, 8, 2, dtype=dtype), torch.zeros(8, 2)
        moe.moe_block(x, proj, w13, w2, sd, 2)
        moe.moe_block_ep(x, proj, w13, w2, sd, 2, 0)
    assert taken == ["decode"] * 4 + ["grouped"] * 2


def test_moe_block_decode_is_deterministic():
    """The combine sums partials in k order whatever program arrives last: runs are bit-identical."""
    args = block_args(7, 32, 6, 16, 16, torch.float32)
    assert torch.equal(moe.moe_block(*args, top_k=3), moe.moe_block(*args, top_k=3))


@pytest.mark.parametrize(
    "B,T,reason",
    [(1, 1, "one decode token: the GEMV kernels"), (3, 2, "6 tokens: the decode tiles"), (2, 9, "18: prefill path")],
)
def test_moe_block_takes_the_models_leading_dims(B, T, reason):
    """x [B, T, H] and proj [B, T, N] as the model hands them over (no flatten per call) give the rows' result in
    x's shape, on every path, for the Triton block and the torch reference alike; a non-contiguous [B, T, N] proj
    (a column slice of a wider buffer) is read right."""
    args = block_args(B * T, 32, 8, 16, 16, torch.float32, seed=B + T)
    x, proj, rest = args[0], args[1], args[2:]
    flat = moe.moe_block(*args, top_k=2)
    wide = torch.full((B, T, proj.shape[-1] + 5), float("nan"))
    wide[..., 3 : 3 + proj.shape[-1]] = proj.view(B, T, -1)
    sliced = wide[..., 3 : 3 + proj.shape[-1]]
    assert B * T == 1 or not sliced.is_contiguous(), reason  # one row: contiguous, 3 elements in
    for p in (proj.view(B, T, -1), sliced):
        out = moe.moe_block(x.view(B, T, -1), p, *rest, top_k=2)
        assert out.shape == (B, T, 32) and torch.equal(out.view(B * T, 32), flat), reason
    ref = naive.moe_block(x.view(B, T, -1).double(), proj.view(B, T, -1).double(), *[a.double() for a in rest], 2)
    assert ref.shape == (B, T, 32) and rel_err(flat, ref.view(B * T, 32)) < 1e-5, reason


@pytest.mark.parametrize(
    "M,expected",
    [(1, ["_moe_up_gemv_kernel", "_moe_down_gemv_kernel"]), (3, ["_moe_up_decode_kernel", "_moe_down_decode_kernel"])],
    ids=["gemv", "decode"],
)
def test_moe_block_decode_launches(monkeypatch, M, expected):
    """The decode block (M = 1: the GEMV kernels) is two kernel launches and nothing else: every @triton.jit
    kernel of the module is counted, and the only torch ops it runs are allocations and views (no sum, zeros,
    copy or cast launches)."""
    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

    launches = []

    class Counted:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append(self.name)
                with _disable_current_modes():  # the interpreter's own tensor handling is not the op's
                    return self.kernel[grid](*args, **kwargs)

            return launch

    for name, value in vars(moe).items():
        if name.endswith("_kernel") and hasattr(value, "__getitem__"):
            monkeypatch.setattr(moe, name, Counted(name, value))

    class Ops(TorchDispatchMode):
        seen = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    args = block_args(M, 32, 8, 16, 16, torch.float32)
    with Ops():
        out = moe.moe_block(*args, top_k=2)
    assert launches == expected
    assert Ops.seen <= {
        "empty",
        "new_empty",
        "empty_strided",
        "view",
        "as_strided",
        "slice",
        "split",
        "split_with_sizes",
    }, Ops.seen
    assert rel_err(out, block_reference(args, 2)) < 1e-5


@pytest.mark.parametrize(
    "M,H",
    [(4, 48), (70, 48), (70, moe.COMBINE_BLOCK_H + 6)],
    ids=["decode", "prefill", "prefill, the combine's second column block a 6-column tail"],
)
def test_moe_block(M, H):
    args = block_args(M, H, 8, 32, 24, torch.float32)
    out = moe.moe_block(*args, top_k=2)
    assert rel_err(out, block_reference(args, 2)) < 1e-5


def test_moe_block_export():
    """moe_block is one custom op with a fake kernel: the block traces under torch.export, the graph holds the op,
    and the exported program runs the Triton kernels."""

    class Block(torch.nn.Module):
        def forward(self, x, proj, w13, w2, shared_down):
            return moe.moe_block(x, proj, w13, w2, shared_down, 2)

    args = block_args(6, 32, 5, 16, 16, torch.float32)
    program = torch.export.export(Block(), args)
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert "qmoe.moe_block.default" in targets
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


def gpu_block(M, s, dtype, seed=0, router=None):
    """35B/122B block inputs drawn on the GPU (the expert weights are GBs); Is = I as in both configs."""
    E, H, I = s["E"], s["H"], s["I"]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x, w13, w2 = make_experts(M, H, E, I, dtype, seed, device="cuda")
    in_proj = torch.randn(E + 2 * I + 1, H, generator=gen, device="cuda", dtype=dtype) / H**0.5
    shared_down = torch.randn(H, I, generator=gen, device="cuda", dtype=dtype) / I**0.5
    proj = x @ in_proj.T
    if router is not None:
        proj[:, :E] = router(M, E).to(device="cuda", dtype=dtype)
    return x, proj, w13, w2, shared_down


def gpu_reference(args, top_k, rows=None):
    x, proj = args[0], args[1]
    if rows is not None:
        x, proj = x[rows], proj[rows]
    return naive.moe_block(x.double(), proj.double(), *[a.double() for a in args[2:]], top_k=top_k)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M", [1, 7, 16, 17, 64, 65, 512], ids=lambda m: f"M{m}")
def test_moe_block_35b_gpu(M, dtype):
    """35B-A3B shapes, both regimes (the decode kernels up to 16 tokens, 17 and 64 on the grouped path), with the
    tuned table when present; the decode path with poisoned scratch."""
    s = QWEN35B
    args = gpu_block(M, s, dtype)
    out = moe.moe_block(*args, s["K"])
    assert rel_err(out, gpu_reference(args, s["K"])) < TOL[dtype]
    if M <= moe.decode_max_m(dtype):
        config = moe.get_config(M, s["E"], s["H"], s["I"], dtype)
        scratch = decode_poisoned(args[0], s["I"], s["K"], config)
        assert torch.equal(moe.moe_block_decode(*args, s["K"], scratch=scratch), out)  # bit-reproducible


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 8], ids=["GEMV", "decode tiles"])
def test_decode_workspace_shared_by_a_graph_and_eager_calls_gpu(M):
    """A captured decode block and eager calls of the block at the same shape share its workspace (h, routing
    weights, ids: kernels/counters.Workspaces). Graph replays and eager calls on other inputs, interleaved on one
    stream with PDL and no synchronization between them, each give their own input's result: every launch touches
    the workspace only after its PDL wait, so the calls are ordered by the stream."""
    s = QWEN35B
    x, proj, *weights = gpu_block(M, s, torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(1)
    x2 = torch.randn(x.shape, generator=gen, device="cuda").to(x.dtype)
    proj2 = torch.randn(proj.shape, generator=gen, device="cuda").to(proj.dtype)
    refs = gpu_reference((x, proj, *weights), s["K"]), gpu_reference((x2, proj2, *weights), s["K"])
    graph, out = captured(lambda: moe.moe_block(x, proj, *weights, s["K"]))
    results = []
    for _ in range(10):
        graph.replay()
        results.append((out.clone(), moe.moe_block(x2, proj2, *weights, s["K"])))
    torch.cuda.synchronize()
    for pair in results:
        assert all(rel_err(o, ref) < TOL[torch.bfloat16] for o, ref in zip(pair, refs))


@pytest.mark.gpu
@pytest.mark.parametrize("M", [8, 64])
@pytest.mark.parametrize("experts", [list(range(8)), [5]], ids=["same-8", "one-hot"])
def test_moe_block_skewed_gpu(M, experts):
    """Every token on the same 8 experts (M rows per group), or one expert shared by all; repeated runs are
    bit-identical (the last-arriver combine sums in k order whatever order the programs finish in)."""
    s = QWEN35B
    args = gpu_block(M, s, torch.bfloat16, router=same_experts(experts))
    out = moe.moe_block(*args, s["K"])
    assert rel_err(out, gpu_reference(args, s["K"])) < TOL[torch.bfloat16]
    assert all(torch.equal(moe.moe_block(*args, s["K"]), out) for _ in range(20))


@pytest.mark.gpu
@pytest.mark.parametrize("sub", [1, 2])
def test_fused_moe_sub_tiles_35b_gpu(sub):
    """The 4096-token table entry with SUB_TILES at 35B shapes, 512 tokens (~16 pairs per expert: most blocks run
    the half or quarter tile, on wgmma and mma tiles of 64 and 32 rows) against float64; NaN scratch."""
    s, M = QWEN35B, 512
    x, w13, w2 = make_experts(M, s["H"], s["E"], s["I"], torch.bfloat16, device="cuda")
    weights, ids = moe.route(torch.randn(M, s["E"], device="cuda"), s["K"])
    config = {**moe.get_config(4096, s["E"], s["H"], s["I"], torch.bfloat16), "SUB_TILES": sub}
    h = poisoned(M * s["K"], s["I"], dtype=torch.bfloat16, device="cuda")
    partials = poisoned(M * s["K"], s["H"], dtype=torch.bfloat16, device="cuda")
    out = moe.fused_moe_into(x, w13, w2, weights, ids, h, partials, config=config)
    assert rel_err(out, reference(x, w13, w2, weights, ids)) < TOL[torch.bfloat16]
    assert all(torch.equal(moe.fused_moe_into(x, w13, w2, weights, ids, h, partials, config=config), out)
               for _ in range(5))  # fmt: skip


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
@pytest.mark.parametrize("M", [1, 16, 512])
def test_moe_block_cuda_graph_gpu(M):
    """Captured once, replayed on new inputs copied into the static buffers: bit-identical to eager."""
    s = QWEN35B
    args = gpu_block(M, s, torch.bfloat16)
    x, proj = args[0], args[1]
    run = lambda: moe.moe_block(*args, s["K"])
    graph, static_out = captured(run)
    for seed in range(3):
        fresh = gpu_block(M, s, torch.bfloat16, seed=seed + 1)
        x.copy_(fresh[0])
        proj.copy_(fresh[1])
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, run())
