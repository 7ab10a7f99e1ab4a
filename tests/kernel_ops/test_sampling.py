"""Fused sampling kernel vs the float64 filtered distribution and the torch sampler (kernels/sampling/naive.py).

Distribution tests draw one token per row from many rows that share the logits but not `step` (one launch),
and compare the counts with the exact filtered distribution by a chi-square test with fixed seeds; the same
test must reject deliberately wrong samplers. Exact tests: greedy / top-k 1 / tiny top-p = argmax, kept set,
reproducibility, NaN and inf rows, torch.export. GPU tests: V = 248320 in fp32 and bf16, CUDA graph replay.
"""

import pytest
import torch
from scipy.stats import chi2

from kernels.sampling import naive
from kernels.sampling import triton as fused
from tests.helpers import captured, poisoned

# (temperature, top_k, top_p, min_p): each filter alone, combined, at their edges
COMBOS = [
    (1.0, 0, 1.0, 0.0),  # plain softmax, no filter: the race over the whole row
    (0.7, 5, 1.0, 0.0),  # top-k only, below 1 temperature
    (1.0, 0, 0.8, 0.0),  # top-p only
    (1.5, 0, 1.0, 0.1),  # min-p only, above 1 temperature
    (1.0, 10, 0.9, 0.0),  # top-k then top-p renormalised after top-k
    (0.8, 12, 0.95, 0.05),  # all three
    (2.0, 3, 1.0, 0.0),  # small k, flat distribution
    (1.0, 0, 0.5, 0.2),  # top-p and min-p without top-k
    (0.6, 30, 1.0, 0.0),  # large k on a peaked row: the kernel's first gather misses part of the top-k set
]


def params(n, temperature, top_k, top_p, min_p):
    return (
        torch.full((n,), temperature),
        torch.full((n,), top_k, dtype=torch.int64),
        torch.full((n,), top_p),
        torch.full((n,), min_p),
    )


def filtered_distribution(logits, temperature, top_k, top_p, min_p) -> torch.Tensor:
    """Exact float64 distribution of one row after temperature, top-k, top-p, min-p and renormalisation."""
    probs = torch.softmax(logits.double()[None] / temperature, -1)
    keep = naive.filter_probs(probs, *(torch.tensor([v], dtype=torch.float64) for v in (top_k, top_p, min_p)))
    kept = torch.where(keep, probs, 0)[0]
    return kept / kept.sum()


def chi_square_pvalue(tokens, expected_probs) -> float:
    """p-value of the counts of `tokens` under `expected_probs` (bins with expected < 5 merged); 0 if a token
    outside the support was drawn."""
    n, V = tokens.numel(), expected_probs.numel()
    counts = torch.bincount(tokens.cpu(), minlength=V).double()
    if counts[expected_probs == 0].sum() > 0:
        return 0.0
    expected = expected_probs * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    obs, exp = obs[exp > 0], exp[exp > 0]
    stat = ((obs - exp) ** 2 / exp).sum().item()
    return float(chi2.sf(stat, max(len(exp) - 1, 1)))


def draw_combos(sampler, logits, combos, draws, seed=1234):
    """One call: rows = combos x draws sharing `logits`, step = draw index. -> tokens [len(combos), draws]."""
    n = len(combos) * draws
    cols = [torch.tensor([c[i] for c in combos]).repeat_interleave(draws) for i in range(4)]
    temperature, top_k, top_p, min_p = cols[0].float(), cols[1].long(), cols[2].float(), cols[3].float()
    step = torch.arange(draws).repeat(len(combos))
    tokens = sampler(logits.expand(n, -1), temperature, top_k, top_p, min_p, torch.full((n,), seed), step)
    return tokens.view(len(combos), draws)


def test_filtered_distribution_matches_its_definition():
    # the oracle itself, on a case worked by hand: p = [.5, .25, .125, .125], top-k 3 keeps {0, 1, 2 and 3
    # (tie)}, top-p 0.7 of that keeps {0, 1}, renormalised to [2/3, 1/3]
    logits = torch.tensor([3.0, 2.0, 1.0, 1.0]) * torch.log(torch.tensor(2.0))
    ref = filtered_distribution(logits, 1.0, 3, 0.7, 0.0)
    torch.testing.assert_close(ref, torch.tensor([2 / 3, 1 / 3, 0, 0], dtype=torch.float64))
    # min-p 0.3 keeps p >= 0.15: {0, 1}
    torch.testing.assert_close(filtered_distribution(logits, 1.0, 0, 1.0, 0.3), ref)


@pytest.mark.parametrize(
    "V, draws, cap",
    [
        (16, 11_200, None),  # power of two: 9 combos x 11.2k = 100k draws
        (43, 4_000, None),  # prime V: a masked tail in every block (the interpreter is slow: fewer draws)
        (40, 1_500, 8),  # a buffer of 8 slots: most rows take the radix rounds and the race
    ],
)
def test_distribution_chi_square(V, draws, cap):
    torch.manual_seed(V)
    logits = torch.randn(V) * 1.5
    tokens = draw_combos(lambda *a: fused.launch(*a, cap=cap, nt=4), logits, COMBOS, draws)
    for combo, row in zip(COMBOS, tokens):
        pvalue = chi_square_pvalue(row, filtered_distribution(logits, *combo))
        assert pvalue > 1e-3, f"combo {combo}: chi-square p = {pvalue:.2e}"


@pytest.mark.parametrize("tiles", [True, False])
def test_distribution_with_top_k_at_or_above_the_finite_logits(tiles):
    # top-k with k >= the row's finite logits keeps them all (top-k off), so top-p's mass is the row's. From tiles
    # (launch 2a: top-k on with k' = min(k, finite), the stats write no sum of p for such rows) top-p must still
    # renormalise over every finite logit: a top-p reference of 0 (k' not applied) would keep only the max
    torch.manual_seed(3)
    logits = torch.full((64,), float("-inf"))
    logits[[2, 9, 17, 30, 41, 63]] = torch.randn(6) * 0.7  # 6 finite logits, spread over the row's tiles
    combos = [
        (1.0, 10, 0.8, 0.0),  # k above the 6 finite logits
        (1.0, 6, 0.8, 0.0),  # k equal to them
        (0.9, 50, 0.95, 0.1),  # with min-p
    ]
    tokens = draw_combos(lambda *a: fused.launch(*a, tiles=tiles), logits, combos, 3_000)
    for combo, row in zip(combos, tokens):
        pvalue = chi_square_pvalue(row, filtered_distribution(logits, *combo))
        assert pvalue > 1e-3, f"combo {combo}: chi-square p = {pvalue:.2e}"


def test_torch_sampler_distribution_chi_square():
    # the torch sampler (own hash instead of Philox) must pass the same test
    torch.manual_seed(1)
    logits = torch.randn(64) * 1.5
    tokens = draw_combos(naive.sample, logits, COMBOS, 11_200)
    for combo, row in zip(COMBOS, tokens):
        assert chi_square_pvalue(row, filtered_distribution(logits, *combo)) > 1e-3, combo


def wrong_no_renormalise(logits, temperature, top_k, top_p, min_p, seed, step):
    """Inverse-CDF draw over the filtered probabilities without renormalising: the missing mass falls on the
    last kept token."""
    probs = torch.softmax(logits.double() / temperature[:, None].double(), -1)
    keep = naive.filter_probs(probs, top_k, top_p.double(), min_p.double())
    kept = torch.where(keep, probs, 0)
    u = torch.rand(len(logits), 1, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    last = keep.shape[1] - 1 - keep.flip(-1).int().argmax(-1)
    token = (kept.cumsum(-1) <= u).sum(-1)
    return torch.minimum(token, last)


def wrong_ignores_top_p(logits, temperature, top_k, top_p, min_p, seed, step):
    return naive.sample(logits, temperature, top_k, torch.ones_like(top_p), min_p, seed, step)


@pytest.mark.parametrize("wrong", [wrong_no_renormalise, wrong_ignores_top_p])
def test_chi_square_rejects_wrong_samplers(wrong):
    # the same test, same draws, on filtered combos: a sampler that gets the filtering wrong must fail it
    torch.manual_seed(1)
    logits = torch.randn(64) * 1.5
    combos = [c for c in COMBOS if c[2] < 1.0]
    tokens = draw_combos(wrong, logits, combos, 12_500)
    pvalues = [chi_square_pvalue(row, filtered_distribution(logits, *c)) for c, row in zip(combos, tokens)]
    assert min(pvalues) < 1e-6, pvalues


@pytest.mark.parametrize(
    "B, V, block, dtype",
    [
        (3, 1, None, torch.float32),  # a single token
        (7, 1000, 64, torch.float32),  # 16 blocks with a tail of 40
        (5, 77, 16, torch.float16),  # half logits, prime V
        (4, 100, 32, torch.bfloat16),  # bf16 logits (no tl.dot: fine in the interpreter)
    ],
)
def test_greedy_is_argmax_lowest_index(B, V, block, dtype):
    torch.manual_seed(0)
    logits = (torch.randn(B, V) * 2).round().to(dtype)  # rounded: many ties, also across blocks
    temperature = torch.tensor([0.0, -1.0] * B)[:B]  # <= 0 is greedy
    out = poisoned(B, dtype=torch.float64)
    out[:] = fused.launch(
        logits, temperature, *params(B, 0, 0, 1.0, 0.0)[1:], torch.arange(B), torch.zeros(B, dtype=torch.long), block
    )
    ref = torch.stack([(row == row.max()).nonzero()[0, 0] for row in logits.float()])
    assert torch.equal(out.long(), ref)
    assert torch.equal(naive.sample(logits, temperature, 0, 1.0, 0.0, 0, 0), ref)


@pytest.mark.parametrize(
    "B, V, block, split, dtype",
    [
        (3, 1, None, None, torch.float32),  # a single token
        (7, 1000, 64, 5, torch.float32),  # 5 chunks of 4 blocks, ties across chunks, a tail of 40
        (5, 77, 16, 8, torch.float16),  # 8 chunks of one block: the last ones wholly past V
        (4, 100, 32, 3, torch.bfloat16),  # bf16 logits (no tl.dot: fine in the interpreter)
    ],
)
def test_greedy_entry_point_is_argmax_lowest_index(B, V, block, split, dtype):
    torch.manual_seed(1)
    logits = (torch.randn(B, V) * 2).round().to(dtype)  # many ties, also across chunks
    if V > 1:
        logits[0, -1] = logits[0].max()  # the max also at the last token: the first one must win
    out = poisoned(B, dtype=torch.float64)
    out[:] = fused.launch_greedy(logits, block=block, split=split)
    ref = torch.stack([(row == row.max()).nonzero()[0, 0] for row in logits.float()])
    assert torch.equal(out.long(), ref)
    assert torch.equal(fused.greedy(logits), ref)


@pytest.mark.parametrize("split", [1, 4])
def test_greedy_entry_point_special_rows(split):
    V = 40
    logits = torch.randn(6, V)
    logits[0, 33] = float("nan")  # NaN in a later chunk than the max -> INVALID_TOKEN
    logits[1, :] = float("-inf")  # nothing drawable -> INVALID_TOKEN
    logits[2, [25, 9]] = float("inf")  # first +inf wins, across chunks
    logits[3, 7] = float("inf")
    logits[3, 2] = float("nan")  # NaN beats +inf: still invalid
    logits[4, : V - 1] = float("-inf")  # only the last token is finite
    out = fused.launch_greedy(logits, block=8, split=split)
    assert not fused.greedy_arrivals(6, logits.device).any()  # each row's last chunk reset its counter
    assert torch.equal(out, naive.greedy(logits))
    assert out.tolist()[:5] == [naive.INVALID_TOKEN, naive.INVALID_TOKEN, 9, naive.INVALID_TOKEN, V - 1]


@pytest.mark.parametrize("split", [1, 3, 8])  # one chunk; chunks with a tail; chunks wholly past a slice's end
@pytest.mark.parametrize("top_k, min_p", [(0, 0.0), (9, 0.0), (0, 0.2)], ids=["race", "cut", "min_p"])
def test_shard_candidates_are_what_one_sampler_sees(split, top_k, min_p):
    # a vocab-parallel rank's launch (qmoe/parallel/sampling.py) on 3 slices of 77 tokens (26 + 26 + 25, tails):
    # each slice's max (NaN if it holds one) and its lowest global index, and its best race key among the tokens at
    # or above a cut key with p >= min_p; the best over the slices (lowest index on ties) is the one-launch
    # sampler's token: its race over the row, its top-k cut (the k-th largest logit's key), its min-p
    from qmoe.parallel.sampling import choose

    torch.manual_seed(3)
    B, V, W = 6, 77, 3
    logits = (torch.randn(B, V) * 2).round()  # ties, also across slices
    logits[1, [5, 60]] = logits[1].max() + 1  # the max tied on the first and last slice
    logits[2, 40] = float("nan")
    logits[3] = float("-inf")
    logits[4, [70, 30]] = float("inf")
    temperature = torch.tensor([1.0, 0.8, 1.0, 1.0, 1.0, 2.0])
    seed, step = torch.arange(B) + 7, torch.arange(B) * 3
    finite = torch.where(logits.isfinite(), logits, float("-inf"))
    kth = finite.topk(top_k, -1).values[:, -1] if top_k else torch.full((B,), float("-inf"))
    cut = fused.ordered_keys(torch.where(kth > float("-inf"), kth, -3.0e38)).int()
    m = torch.where(logits.isnan(), float("-inf"), logits).amax(-1)
    race = (m, temperature, cut, torch.full((B,), min_p), seed, step)
    bounds = [0, 26, 52, V]
    mine = []
    for w in range(W):
        piece = logits[:, bounds[w] : bounds[w + 1]].contiguous()
        got = fused.launch_shard_candidates(piece, bounds[w], race, block=8, split=split)
        assert not fused.shard_arrivals(B, logits.device).any()  # each row's last chunk reset its counter
        value, index = piece.max(-1)
        assert torch.equal(got[:, 0].isnan(), value.isnan())
        ok = ~value.isnan()
        assert torch.equal(got[ok, 0], value[ok].double())
        ok &= value > float("-inf")  # a slice of only -inf names no token (start + its length)
        assert torch.equal(got[ok, 1], (index[ok] + bounds[w]).double())
        greedy = fused.launch_shard_candidates(piece, bounds[w], block=8, split=split)  # the greedy form
        torch.testing.assert_close(greedy, got[:, :2], rtol=0, atol=0, equal_nan=True)
        mine.append(got)
    tokens = choose(torch.stack(mine), temperature > 0)
    assert torch.equal(tokens, fused.sample(logits, temperature, top_k, 1.0, min_p, seed, step))


def test_mixed_greedy_and_sampled_rows():
    # sample() stays the general path: greedy rows of a mixed batch give the greedy entry point's tokens, the
    # sampled rows stay in their kept sets and are not all the argmax
    B, V = 64, 50
    logits, _, top_k, top_p, min_p = random_rows(B, V, seed=4)
    temperature = torch.where(torch.arange(B) % 2 == 0, 0.0, 3.0)
    out = fused.sample(logits, temperature, top_k, top_p, min_p, 9, torch.arange(B))
    greedy = temperature == 0
    assert torch.equal(out[greedy], fused.greedy(logits)[greedy])
    probs = torch.softmax(logits.double() / 3.0, -1)
    keep = naive.filter_probs(probs, top_k, top_p.double(), min_p.double())
    assert keep[~greedy, out[~greedy]].all()
    assert (out[~greedy] != logits[~greedy].argmax(-1)).any()


def test_greedy_torch_export():
    class Greedy(torch.nn.Module):
        def forward(self, logits):
            return fused.greedy(logits)

    logits = torch.randn(3, 70)
    ep = torch.export.export(Greedy(), (logits,))
    assert any("qmoe.greedy" in str(node.target) for node in ep.graph.nodes)
    assert torch.equal(ep.module()(logits), logits.argmax(-1))


@pytest.mark.parametrize("top_k, top_p, min_p", [(1, 1.0, 0.0), (0, 1e-6, 0.0), (0, 1.0, 1.0), (1, 0.5, 0.5)])
def test_cut_to_the_max_is_argmax(top_k, top_p, min_p):
    torch.manual_seed(0)
    B, V = 64, 50
    logits = torch.randn(B, V)
    out = fused.sample(logits, 1.0, top_k, top_p, min_p, 7, torch.arange(B))
    assert torch.equal(out, logits.argmax(-1))


def random_rows(B, V, seed):
    """Rows with ties, -inf logits and per-row parameters drawn over their whole range."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, V, generator=g) * 3).round(decimals=1)
    logits[torch.rand(B, V, generator=g) < 0.1] = float("-inf")
    logits[:, 0] = 0.0  # at least one finite logit per row
    temperature = torch.rand(B, generator=g) * 2 + 0.05
    top_k = torch.randint(-1, V + 2, (B,), generator=g)
    top_p = torch.where(torch.rand(B, generator=g) < 0.3, 1.0, torch.rand(B, generator=g))
    min_p = torch.where(torch.rand(B, generator=g) < 0.5, 0.0, torch.rand(B, generator=g) * 0.5)
    return logits, temperature, top_k, top_p, min_p


@pytest.mark.parametrize("cap", [None, 4])  # everything in the buffer / mostly the radix rounds
def test_sampled_token_in_kept_set(cap):
    B, V = 2048, 37
    logits, temperature, top_k, top_p, min_p = random_rows(B, V, seed=cap or 0)
    step = torch.arange(B)
    probs = torch.softmax(logits.double() / temperature[:, None].double(), -1)
    keep = naive.filter_probs(probs, top_k, top_p.double(), min_p.double())
    for tokens in (
        fused.launch(logits, temperature, top_k, top_p, min_p, torch.full((B,), 5), step, cap=cap, nt=4),
        naive.sample(logits, temperature, top_k, top_p, min_p, 5, step),
    ):
        assert keep[torch.arange(B), tokens].all()


@pytest.mark.parametrize(
    "split, B, V, block, cap",
    [
        (3, 96, 300, 32, None),  # the GPU's small-batch layout: 10 blocks of 32 over 3 chunks, the last one partial
        (8, 96, 300, 32, None),  # chunks wholly past V; gathered lists spread over up to 8 chunks
        (5, 96, 300, 32, 16),  # small buffer: gathers and radix rounds over split chunks (5: SPLIT 8)
        (4, 12, 2100, None, None),  # default blocks: 2048 for the stats, 1024 for the threshold tiles
    ],
)
def test_split_passes_give_the_same_tokens(split, B, V, block, cap):
    logits, temperature, top_k, top_p, min_p = random_rows(B, V, seed=1)
    logits[3, 7], logits[4], logits[5, 250] = float("nan"), float("-inf"), float("inf")
    temperature[::4] = 0.0  # greedy rows
    args = (logits, temperature, top_k, top_p, min_p, torch.full((B,), 5), torch.arange(B))
    out = poisoned(B, dtype=torch.float64)
    out[:] = fused.launch(*args, block=block, cap=cap, split=split)
    assert torch.equal(out.long(), fused.launch(*args, block=block, cap=cap, split=1))
    probs = torch.softmax(logits.double() / temperature.clamp(min=1e-3)[:, None].double(), -1)
    keep = naive.filter_probs(probs, top_k, top_p.double(), min_p.double())
    finite = logits.isfinite()
    sampled = (temperature > 0) & finite.any(-1) & (finite | (logits == float("-inf"))).all(-1)
    assert keep[sampled, out.long()[sampled]].all()
    greedy = temperature == 0
    assert torch.equal(out.long()[greedy], naive.sample(*args)[greedy])


def test_reproducible_across_calls_and_batch_positions():
    B, V = 256, 33
    logits, temperature, top_k, top_p, min_p = random_rows(B, V, seed=3)
    seed, step = torch.randint(0, 2**40, (B,)), torch.randint(0, 2**33, (B,))
    first = fused.sample(logits, temperature, top_k, top_p, min_p, seed, step)
    assert torch.equal(first, fused.sample(logits, temperature, top_k, top_p, min_p, seed, step))
    perm = torch.randperm(B)
    shuffled = fused.sample(
        logits[perm], temperature[perm], top_k[perm], top_p[perm], min_p[perm], seed[perm], step[perm]
    )
    assert torch.equal(shuffled, first[perm])
    # a single row alone gives the same token as inside the batch
    assert fused.sample(logits[5:6], temperature[5], top_k[5], top_p[5], min_p[5], seed[5], step[5]).item() == first[5]


def test_equal_rows_equal_tokens_and_seeds_give_streams():
    V, steps = 32, 2000
    logits = torch.zeros(steps, V)  # uniform: every token equally likely
    step = torch.arange(steps)
    a = fused.sample(logits, 1.0, 0, 1.0, 0.0, 1, step)
    b = fused.sample(logits, 1.0, 0, 1.0, 0.0, 1, step)
    c = fused.sample(logits, 1.0, 0, 1.0, 0.0, 2, step)
    assert torch.equal(a, b)
    assert (a != c).float().mean() > 0.9  # independent streams agree 1/32 of the time
    assert (a[1:] != a[:-1]).float().mean() > 0.9  # steps differ too
    # two equal rows (same logits, seed, step) inside one batch
    rows = torch.randn(2, V)
    twin = fused.sample(rows[[0, 1, 0]], 1.0, 0, 1.0, 0.0, torch.tensor([9, 9, 9]), torch.tensor([4, 4, 4]))
    assert twin[0] == twin[2]


def test_scalar_and_tensor_parameters_agree():
    B, V = 16, 24
    logits = torch.randn(B, V)
    scalars = fused.sample(logits, 0.9, 4, 0.8, 0.05, 11, 3)
    tensors = fused.sample(logits, *params(B, 0.9, 4, 0.8, 0.05), torch.full((B,), 11), torch.full((B,), 3))
    assert torch.equal(scalars, tensors)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_nan_and_inf_rows(temperature):
    V = 20
    logits = torch.randn(6, V)
    logits[0, 3] = float("nan")  # -> INVALID_TOKEN
    logits[1, :] = float("-inf")  # nothing drawable -> INVALID_TOKEN
    logits[2, [5, 9]] = float("inf")  # first +inf wins
    logits[3, 7] = float("inf")
    logits[3, 2] = float("nan")  # NaN beats +inf: still invalid
    logits[4, : V - 1] = float("-inf")  # only the last token is finite
    for sampler in (fused.sample, naive.sample):
        out = sampler(logits, temperature, 0, 1.0, 0.0, 0, 0)
        assert out.tolist()[:5] == [naive.INVALID_TOKEN, naive.INVALID_TOKEN, 5, naive.INVALID_TOKEN, V - 1]
        if temperature == 0:
            assert out[5] == logits[5].argmax()


def test_minus_inf_never_drawn():
    B, V = 4096, 16
    logits = torch.zeros(B, V)
    logits[:, 1::2] = float("-inf")
    out = fused.sample(logits, 100.0, 0, 1.0, 0.0, 0, torch.arange(B))
    assert (out % 2 == 0).all() and len(out.unique()) == V // 2


def test_torch_export():
    class Sampler(torch.nn.Module):
        def forward(self, logits, temperature, top_k, top_p, min_p, seed, step):
            return fused.sample(logits, temperature, top_k, top_p, min_p, seed, step)

    B, V = 4, 32
    args = (torch.randn(B, V), *params(B, 0.8, 5, 0.9, 0.0), torch.arange(B), torch.arange(B))
    ep = torch.export.export(Sampler(), args)
    assert any("qmoe.sample" in str(node.target) for node in ep.graph.nodes)
    assert torch.equal(ep.module()(*args), Sampler()(*args))


# ---------------------------------------------------------------- radix rounds (rows whose kept set may exceed CAP)

FAMILIES = ["flat", "llm", "peaked", "zipf", "ties", "masked", "llm_T0.05", "llm_T5"]  # the benchmark's shapes


def family_logits(shape, B, V, seed=0, device="cpu"):
    """The benchmark's logit shapes (experiments/bench_sampling.py) at any V -> (logits [B, V], temperature)."""
    g = torch.Generator(device=device).manual_seed(seed)
    kind = shape.split("_")[0]
    x = torch.randn(B, V, generator=g, device=device)
    if kind in ("llm", "masked"):  # a few tokens carry most of the mass
        n = min(64, V // 8)
        x = x * 2
        cand = torch.randint(0, V, (B, n), generator=g, device=device)
        x.scatter_add_(1, cand, torch.linspace(20, 6, n, device=device).expand(B, -1))
        if kind == "masked":  # most of the vocabulary at -inf
            keep = torch.rand(B, V, generator=g, device=device) < 0.3
            x = x.masked_fill(~keep.scatter(1, cand, True), float("-inf"))
    elif kind == "peaked":  # 3 tokens 40 above N(0, 1): the k-th largest in the flat tail
        peaks = torch.randint(0, V, (B, 3), generator=g, device=device)
        x.scatter_add_(1, peaks, torch.full((B, 3), 40.0, device=device))
    elif kind == "zipf":
        x = -1.1 * (torch.rand(B, V, generator=g, device=device).argsort(-1).float() + 1).log()
    elif kind == "ties":  # many exact ties at every cut
        x = (x * 2).round()
    temperature = float(shape.split("_T")[1]) if "_T" in shape else 1.0
    return x, temperature


def radix_modes(V):
    """(top_k, top_p, min_p): top-k 1 / 50 / 1000 / V (1000 -> V // 2 at small V), top-p 0.5 / 0.95 / 0.999,
    min-p alone, top-k + top-p, all three."""
    return [(1, 1.0, 0.0), (50, 1.0, 0.0), (V // 2, 1.0, 0.0), (V, 1.0, 0.0), (0, 0.5, 0.0), (0, 0.95, 0.0),
            (0, 0.999, 0.0), (0, 1.0, 0.05), (50, 0.9, 0.0), (V // 2, 0.95, 0.02)]  # fmt: skip


def run_with_state(logits, temperature, modes, **knobs):
    """One launch over rows = modes x (rows of logits) -> (tokens, radix state, per-row parameters)."""
    n = len(modes)
    rows = logits.repeat_interleave(n, 0)
    B = rows.shape[0]
    top_k, top_p, min_p = (torch.tensor([m[i] for m in modes] * len(logits), device=logits.device) for i in range(3))
    temperature = torch.full((B,), temperature, device=logits.device)
    state = torch.full((B, fused.N_STATE.value), -7, dtype=torch.int64, device=logits.device)
    step = torch.arange(B, device=logits.device)
    out = fused.launch(rows, temperature, top_k.long(), top_p.float(), min_p.float(), step, step, state=state, **knobs)
    return out, state, rows, temperature, top_k, top_p, min_p


def check_radix_rows(out, state, rows, temperature, top_k, top_p, min_p, bins, exact=True, slack=0.0):
    """Tokens in the float64 kept set; rows the rounds finished keep the reference's top-k / top-p set (key >=
    cut; `slack`: the fraction of it that may differ, fp32 sums over a large V against float64); no phase ran
    more rounds than the bound. -> how many rows took the radix rounds."""
    B = rows.shape[0]
    probs = torch.softmax(rows.double() / temperature[:, None].double(), -1)
    keep = naive.filter_probs(probs, top_k, top_p.double(), min_p.double())
    in_keep = keep[torch.arange(B, device=out.device), out.clamp(min=0)]
    assert in_keep.all() and (out >= 0).all(), "a token outside the kept set"
    phase = state[:, fused.S_PHASE.value]
    assert not ((phase == fused.PHASE_TOP_K.value) | (phase == fused.PHASE_TOP_P.value)).any(), "unfinished rows"
    bound = fused.rounds_per_phase(bins)
    assert state[:, fused.S_ROUNDS_K.value].max() <= bound and state[:, fused.S_ROUNDS_P.value].max() <= bound
    radix = state[:, fused.S_PATH.value] == fused.PATH_RADIX.value
    if exact:
        # tokens whose float64 p underflows to 0 (T = 0.05) are in no reference set, and never win a race
        kept = (fused.ordered_keys(rows) >= state[:, fused.S_CUT.value, None]) & (probs > 0)
        ref = naive.filter_probs(probs, top_k, top_p.double(), torch.zeros_like(min_p).double())
        bad = (kept != ref)[radix].sum(-1) > slack * ref[radix].sum(-1)
        assert not bad.any(), f"kept set differs from the reference in {int(bad.sum())} radix rows"
    return int(radix.sum())


@pytest.mark.parametrize(
    "shape, dtype",
    [(f, torch.float32) for f in FAMILIES] + [("peaked", torch.float16), ("ties", torch.float16)],  # half logits
)
def test_radix_rounds_give_the_reference_kept_set(shape, dtype):
    # a buffer of 8 slots sends nearly every filtered row to the radix rounds; 3 chunks of 4 blocks of 32 (the
    # last one partial) so that the partials of several programs are combined
    V = 300
    logits, temperature = family_logits(shape, 3, V, seed=FAMILIES.index(shape))
    logits = logits.to(dtype)
    modes = radix_modes(V)
    got = run_with_state(logits, temperature, modes, cap=8, block=32, split=3)
    n_radix = check_radix_rows(*got, bins=16)
    assert n_radix >= 3  # the test reaches the rounds on every shape


def top_k_rounds(keys: torch.Tensor, k: int, bins: int, cap: int) -> tuple[int, str]:
    """The radix schedule of _round_step for top-k from the bracket [min key, max key], in Python -> (rounds, how
    the phase ends: "one key" or "gather", a bracket of <= cap tokens)."""
    lo, hi, rounds = int(keys.min()), int(keys.max()), 0
    while True:
        rounds += 1
        thr = [lo + (hi - lo + 1) * j // bins for j in range(bins)] + [hi + 1]
        cnt = [int((keys >= t).sum()) for t in thr]
        j = max([i for i in range(bins) if cnt[i] >= k], default=0)
        lo, hi = thr[j], max(thr[j + 1] - 1, thr[j])
        if lo == hi:
            return rounds, "one key"
        if cnt[j] - cnt[j + 1] <= cap:
            return rounds, "gather"


@pytest.mark.parametrize("bins", [16, 4])
def test_radix_rounds_never_exceed_the_bound(bins):
    # worst shapes for the rounds: the keys span the whole int32 range (x_min = -3e38, max = +3e38) and the cut
    # sits among values near 0, so top-k runs every round of its phase, then top-p again over [cut, max]. No
    # tiles (tiles=False): top-k's rounds start from launch 2's thresholds, here the whole key range
    V, B = 96, 4
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(B, V, generator=g) * torch.logspace(-30, 1, V)[torch.randperm(V, generator=g)]
    logits[:, 0], logits[:, 1] = -3e38, 3e38
    logits[1, 2:] = logits[1, 2:].round()  # exact ties at the cut
    modes = [(40, 1.0, 0.0), (40, 0.9, 0.0), (0, 0.8, 0.0)]
    temperature = 1e37  # keeps the mass spread over the row: top-p's cut lands inside it
    got = run_with_state(logits, temperature, modes, cap=4, block=32, split=3, bins=bins, tiles=False)
    out, state, rows = got[:3]
    check_radix_rows(*got, bins=bins, exact=False)
    # the exact number of top-k rounds, from the whole key range: a bracket of w keys shrinks to ceil(w / bins) a
    # round, until it is one key or holds <= cap tokens (then a gather lists it)
    keys = fused.ordered_keys(rows)
    bound = fused.rounds_per_phase(bins)
    top_k = torch.tensor([m[0] for m in modes] * B)
    for r in range(len(rows)):
        if top_k[r] > 0:
            rounds, ends = top_k_rounds(keys[r], int(top_k[r]), bins, cap=4)
            assert state[r, fused.S_ROUNDS_K.value] == rounds, r
            assert ends == "one key" or state[r, fused.S_PHASE.value] == fused.PHASE_NONE.value, r
    assert state[:, fused.S_ROUNDS_K.value].max() == bound  # the worst row (ties at the cut) needs every round
    # both phases end in one key: 45 tokens tied at -1.5e38 (more than cap) hold both cuts, top-k's (k = 60: 51
    # tokens above them) and top-p's (at T = 5e37 they carry 3 % of the mass, the 51 above 97 %; fp32 holds x -
    # max); top-p's bracket, [top-k's cut, max], is nearly the whole key range: every round of its phase. Then the
    # race: a schedule of exactly the rounds run finishes the row, one round fewer leaves it invalid.
    tight = torch.cat([torch.tensor([1.5e38]), torch.randn(50, generator=g), torch.full((45,), -1.5e38)])[None]
    knobs = {"cap": 4, "block": 32, "split": 3, "bins": bins, "tiles": False}
    got = run_with_state(tight, 5e37, [(60, 0.99, 0.0)], **knobs)
    check_radix_rows(*got, bins=bins)
    assert got[1][0, fused.S_ROUNDS_P.value] == bound
    ran = int(got[1][0, fused.S_ROUNDS_K.value] + got[1][0, fused.S_ROUNDS_P.value])
    seed, step = torch.zeros(1, dtype=torch.long), torch.arange(1)
    assert fused.launch(tight, *got[3:], seed, step, **knobs, rounds=ran).item() == got[0].item()
    assert fused.launch(tight, *got[3:], seed, step, **knobs, rounds=ran - 1).item() == naive.INVALID_TOKEN


@pytest.mark.parametrize("bins", [2, 16])
def test_waiting_launch_matches_a_launch_per_step(bins):
    # launch 3 as one launch that loops over its steps (the GPU's path up to B = 16) against one launch per step:
    # the same tokens and states on rows that take launch 3's gather, the rounds of both phases and the race. One
    # program per row (split = 1): the interpreter runs a program to its end, so no program may wait for another.
    V, B = 96, 4
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(B, V, generator=g) * torch.logspace(-30, 1, V)[torch.randperm(V, generator=g)]
    logits[1, 2:] = logits[1, 2:].round()  # exact ties at the cut
    modes = [(40, 1.0, 0.0), (40, 0.9, 0.0), (0, 0.8, 0.0), (0, 1.0, 0.3), (5, 1.0, 0.0)]
    knobs = {"cap": 4, "block": 32, "split": 1, "bins": bins}
    runs = [run_with_state(logits, 1e37, modes, **knobs, persistent=p) for p in (False, True)]
    runs.append(run_with_state(logits, 1e37, modes, **knobs, grid_steps=True))
    (out_a, state_a), (out_b, state_b), (out_c, state_c) = (r[:2] for r in runs)
    assert torch.equal(out_a, out_b) and torch.equal(state_a, state_b)
    assert torch.equal(out_a, out_c) and torch.equal(state_a, state_c)
    paths = set(state_a[:, fused.S_PATH.value].tolist())
    assert fused.PATH_RADIX.value in paths  # the loop ran rounds, not only the first step
    assert check_radix_rows(*runs[1], bins=bins, exact=False) > 0


@pytest.mark.parametrize("split", [1, 3])
def test_grid_steps_match_a_launch_per_step(split):
    # launch 3 as one grid (one program here: it runs every (row, chunk) item of a step, then the barrier) against
    # one launch per step, over rows that take the gather, both phases of the rounds and the race, and rows that
    # launch 2 finished (no row open: the grid must leave at once and change nothing)
    V, B = 96, 4
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(B, V, generator=g) * torch.logspace(-30, 1, V)[torch.randperm(V, generator=g)]
    logits[1, 2:] = logits[1, 2:].round()
    modes = [(40, 1.0, 0.0), (40, 0.9, 0.0), (0, 0.8, 0.0), (0, 1.0, 0.3), (5, 1.0, 0.0)]
    for cap in (4, 256):  # mostly the rounds / every row finished by launch 2
        knobs = {"cap": cap, "block": 32, "split": split, "bins": 4}
        (out_a, state_a), (out_b, state_b) = (
            run_with_state(logits, 1e37, modes, **knobs, grid_steps=g)[:2] for g in (False, True)
        )
        assert torch.equal(out_a, out_b) and torch.equal(state_a, state_b), cap
        assert (out_a >= 0).all()


@pytest.mark.parametrize(
    "blocks, split, sms, plan",
    [
        (1, 122, 132, (True, 122)),  # B = 1 on the H200: the whole grid resident, one launch
        (8, 128, 132, (True, 16)),  # fewer programs per row, still one launch
        (16, 128, 132, (True, 8)),  # the last batch with MIN_SPLIT_R programs per row
        (17, 121, 132, (False, 32)),  # a launch per step, ~4 programs per SM: 32 per row (a chunk of 4 blocks)
        (256, 8, 132, (False, 3)),  # B = 256: 768 programs a step, not 2048
        (2048, 1, 132, (False, 1)),  # never fewer than one per row
        (4, 1, 132, (True, 1)),  # a row of one chunk needs no program to wait for another
        (1, 3, 0, (False, 3)),  # the CPU interpreter runs programs one after another: never wait
    ],
)
def test_resolve_plan(blocks, split, sms, plan):
    assert fused.resolve_plan(blocks, split, sms) == plan


def test_rounds_per_phase():
    assert [fused.rounds_per_phase(b) for b in (2, 4, 16, 256, 2**16)] == [32, 16, 8, 4, 2]


def test_radix_distribution_chi_square():
    # the rounds and the race draw from the exact filtered law on the hard shapes (peaked: the k-th value
    # in the tail; ties at the cut; zipf), 2k draws per combo through an 4-slot buffer
    V, draws = 48, 2_000
    combos = [(1.0, 20, 0.9, 0.0), (1.0, 0, 0.95, 0.0), (1.0, 10, 1.0, 0.05)]
    for shape in ("peaked", "ties", "zipf"):
        logits = family_logits(shape, 1, V, seed=3)[0][0]
        tokens = draw_combos(lambda *a: fused.launch(*a, cap=4, block=16, split=2), logits, combos, draws)
        for combo, row in zip(combos, tokens):
            pvalue = chi_square_pvalue(row, filtered_distribution(logits, *combo))
            assert pvalue > 1e-3, f"{shape} {combo}: chi-square p = {pvalue:.2e}"


# ---------------------------------------------------------------- GPU (V of Qwen3.5-MoE)

V_FULL = 248320


def llm_like_logits(B, V, device, dtype, seed=0):
    """Rows like a language model's (background N(0, 2^2), 64 candidates lifted by 20 .. 6: a few tokens carry
    most of the mass), the last row flat (N(0, 0.1^2): top-p keeps ~V tokens, the radix rounds)."""
    g = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(B, V, device=device, generator=g) * 2
    cand = torch.randint(0, V, (B, 64), device=device, generator=g)
    logits.scatter_add_(1, cand, torch.linspace(20, 6, 64, device=device).expand(B, -1))
    logits[-1] = torch.randn(V, device=device, generator=g) * 0.1
    return logits.to(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_full_vocab_greedy_and_kept_set(dtype):
    B = 8
    logits = llm_like_logits(B, V_FULL, "cuda", dtype)
    assert torch.equal(fused.sample(logits, 0.0, 0, 1.0, 0.0, 0, 0), logits.float().argmax(-1))
    step = torch.arange(B, device="cuda")
    for top_k, top_p, min_p in [(50, 0.9, 0.0), (0, 0.9, 0.0), (0, 1.0, 0.05), (0, 1.0, 0.0), (5000, 0.99, 0.0)]:
        for temperature in (0.3, 1.0, 1.7):
            out = fused.sample(logits, temperature, top_k, top_p, min_p, 3, step)
            probs = torch.softmax(logits.double() / temperature, -1)
            keep = naive.filter_probs(probs, *(torch.full((B,), v, device="cuda") for v in (top_k, top_p, min_p)))
            assert keep[torch.arange(B), out].all(), (top_k, top_p, min_p, temperature)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_full_vocab_distribution(dtype):
    # 50k draws per combo from one row read through a stride-0 view (no copy of the 50k rows)
    logits = llm_like_logits(2, V_FULL, "cuda", dtype)[0]
    combos = [(1.0, 50, 0.9, 0.0), (1.0, 0, 0.9, 0.0), (0.7, 0, 1.0, 0.05), (1.0, 20, 1.0, 0.0)]
    tokens = draw_combos(fused.sample, logits, combos, 50_000)
    for combo, row in zip(combos, tokens):
        assert chi_square_pvalue(row, filtered_distribution(logits.float().cpu(), *combo)) > 1e-3, combo


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_with_new_parameters():
    B = 16
    logits = llm_like_logits(B, V_FULL, "cuda", torch.float32)
    temperature, top_k, top_p, min_p = (t.cuda() for t in params(B, 1.0, 50, 0.9, 0.0))
    seed, step = torch.full((B,), 7, device="cuda"), torch.zeros(B, dtype=torch.int64, device="cuda")
    args = (logits, temperature, top_k, top_p, min_p, seed, step)
    graph, out = captured(lambda: fused.sample(*args))
    for i in range(4):
        logits.copy_(llm_like_logits(B, V_FULL, "cuda", torch.float32, seed=i + 1))
        temperature.fill_([0.0, 0.5, 1.0, 1.5][i])
        top_k.fill_([0, 10, 50, 0][i])
        top_p.fill_([1.0, 0.5, 0.9, 0.95][i])
        min_p.fill_([0.0, 0.0, 0.1, 0.02][i])
        step += 1
        graph.replay()
        assert torch.equal(out, fused.sample(*args))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B", [1, 3, 256])
def test_gpu_greedy_entry_point(B, dtype):
    logits = (llm_like_logits(B, V_FULL, "cuda", dtype) * 4).round()  # exact ties across chunks
    assert torch.equal(fused.greedy(logits), naive.greedy(logits))
    graph, out = captured(lambda: fused.greedy(logits))
    logits.copy_(llm_like_logits(B, V_FULL, "cuda", dtype, seed=5))
    logits[0, 7] = float("nan")
    graph.replay()
    assert torch.equal(out, naive.greedy(logits)) and out[0] == naive.INVALID_TOKEN


def test_naive_greedy_equals_sample_at_temperature_zero():
    """naive.greedy (the host runner's fast path) is sample() with every temperature 0, special rows included."""
    logits = torch.randn(6, 50)
    logits[1, 7] = float("nan")
    logits[2, :] = float("-inf")
    logits[3, 9] = logits[3, 30] = float("inf")
    logits[4, 11] = logits[4, 3] = logits[4].max() + 1  # tie: lowest index
    zeros = torch.zeros(6)
    ints = torch.zeros(6, dtype=torch.int64)
    expected = naive.sample(logits, zeros, ints, torch.ones(6), zeros, ints, ints)
    assert torch.equal(naive.greedy(logits), expected)
    assert expected.tolist()[1:5] == [naive.INVALID_TOKEN, naive.INVALID_TOKEN, 9, 3]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", FAMILIES)
def test_gpu_full_vocab_radix_rows(shape):
    # every mode on 2 rows of each benchmark shape at V = 248320: tokens in the kept set, the rounds' cut keeps
    # the reference's set (up to 1e-4 of it: fp32 sums of 248k terms against float64), rounds within the bound
    logits, temperature = family_logits(shape, 2, V_FULL, seed=1, device="cuda")
    got = run_with_state(logits, temperature, radix_modes(V_FULL))
    check_radix_rows(*got, bins=16, slack=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["flat", "zipf"])
def test_gpu_full_vocab_radix_rows_grid_steps(shape):
    # launch 3 as one grid (launch(grid_steps=True): one program per SM, a grid barrier between steps) on every
    # mode at V = 248320: 2 rows of the shape (20 rows in all), then 14 (140 rows: more than the SMs)
    for n in (2, 14):
        logits, temperature = family_logits(shape, n, V_FULL, seed=1, device="cuda")
        got = run_with_state(logits, temperature, radix_modes(V_FULL), grid_steps=True, bins=4)
        assert check_radix_rows(*got, bins=4, slack=1e-4) > 0


def gpu_draws(logits, combos, draws, **knobs):
    """combos x draws rows of one logits row (stride-0 view), step = draw index -> tokens [len(combos), draws]."""
    n = len(combos) * draws
    cols = [torch.tensor([c[i] for c in combos], device="cuda").repeat_interleave(draws) for i in range(4)]
    step = torch.arange(draws, device="cuda").repeat(len(combos))
    seed = torch.full((n,), 1234, device="cuda")
    rows = 8192  # per launch: the sampler's per-row workspace (gather slots, partials) stays a few GB
    out = [
        fused.launch(logits.expand(min(rows, n - r), -1), cols[0][r : r + rows].float(), cols[1][r : r + rows].long(),
                     cols[2][r : r + rows].float(), cols[3][r : r + rows].float(), seed[r : r + rows],
                     step[r : r + rows], **knobs)
        for r in range(0, n, rows)
    ]  # fmt: skip
    return torch.cat(out).view(len(combos), draws)


@pytest.mark.gpu
@pytest.mark.parametrize("cap", [None, 16])  # the default buffer / nearly every row through the radix rounds
@pytest.mark.parametrize("shape", FAMILIES)
def test_gpu_families_chi_square(shape, cap):
    # 100k draws per combination from one row of each shape (V = 16384: the expected law stays cheap to compute)
    logits, temperature = family_logits(shape, 1, 16384, seed=2, device="cuda")
    combos = [(temperature, 50, 0.9, 0.0), (temperature, 0, 0.95, 0.0), (temperature, 0, 1.0, 0.05),
              (temperature, 1000, 1.0, 0.0)]  # fmt: skip
    tokens = gpu_draws(logits[0], combos, 100_000, cap=cap).cpu()
    for combo, row in zip(combos, tokens):
        expected = filtered_distribution(logits[0].cpu(), *combo)
        # a token at a top-p cut within fp32 rounding of the float64 one may be kept: rare, and only there
        outside = expected[row] == 0
        assert outside.float().mean() < 1e-3, f"{shape} {combo}: {int(outside.sum())} draws outside the kept set"
        pvalue = chi_square_pvalue(row[~outside], expected)
        assert pvalue > 1e-3, f"{shape} {combo}: chi-square p = {pvalue:.2e}"


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_radix_rows():
    # rows that take the rounds (peaked, ties, flat) in one captured graph; logits and parameters change between
    # replays, the counters and the radix state are rewritten by every call
    B = 12
    shapes = ["peaked", "ties", "flat"]
    logits = torch.cat([family_logits(s, B // 3, V_FULL, device="cuda")[0] for s in shapes])
    temperature, top_k, top_p, min_p = (t.cuda() for t in params(B, 1.0, 50, 0.9, 0.0))
    seed, step = torch.full((B,), 7, device="cuda"), torch.zeros(B, dtype=torch.int64, device="cuda")
    args = (logits, temperature, top_k, top_p, min_p, seed, step)
    graph, out = captured(lambda: fused.sample(*args))
    for i in range(4):
        logits.copy_(torch.cat([family_logits(s, B // 3, V_FULL, seed=i + 1, device="cuda")[0] for s in shapes]))
        temperature.fill_([0.7, 1.0, 1.3, 1.0][i])
        top_k.fill_([50, 1000, 0, 5000][i])
        top_p.fill_([0.9, 1.0, 0.95, 0.99][i])
        min_p.fill_([0.0, 0.0, 0.02, 0.0][i])
        step += 1
        graph.replay()
        assert torch.equal(out, fused.sample(*args)), i
        probs = torch.softmax(logits.double() / temperature[:, None].double(), -1)
        keep = naive.filter_probs(probs, top_k, top_p.double(), min_p.double())
        assert keep[torch.arange(B, device="cuda"), out].all(), i


def test_race_uniform_stays_below_one():
    """U = (k + 0.5) / 2^24 rounds to 1.0 in fp32 at k = 2^24 - 1, and E = -ln U = 0 would let that token win
    whatever its probability (the GPU chi-square tests caught it at top-k 1000): U stays in (0, 1)."""
    import triton
    import triton.language as tl

    @triton.jit
    def uniform_kernel(bits_ptr, out_ptr, N: tl.constexpr):
        offs = tl.arange(0, N)
        tl.store(out_ptr + offs, fused._open_uniform(tl.load(bits_ptr + offs).to(tl.uint32, bitcast=True)))

    k = torch.tensor([0, 1, 2**23, 2**24 - 2, 2**24 - 1, 2**24 - 1, 2**24 - 1, 2**24 - 1], dtype=torch.int64)
    bits = ((k << 8) | 0xFF).to(torch.int64).to(torch.int32)  # low bits set: they must not matter
    out = torch.full((8,), float("nan"))
    uniform_kernel[(1,)](bits, out, N=8)
    assert (out > 0).all() and (out < 1).all()
    assert out[3] < out[4] and out[0] == 0.5 / 2**24


# ---------------------------------------------------------------- the passes of launch 2 / 3 and the finish, one by one


def test_normal_threshold_matches_the_normal_quantile():
    # the Abramowitz-Stegun quantile that places launch 2's thresholds (a guide only, but a wrong sign or
    # coefficient would send the benchmark's rows to the radix rounds): within 1e-3 sigma of scipy's
    import triton
    import triton.language as tl
    from scipy.stats import norm

    @triton.jit
    def kernel(want_ptr, out_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        want = tl.load(want_ptr + i)
        tl.store(
            out_ptr + i, fused._normal_threshold(want * 0 + 1.5, want * 0 + 2.0, (i * 0 + 100_000).to(tl.int64), want)
        )

    want = torch.tensor([1.0, 3, 50, 256, 1024, 8192, 40_000, 50_000, 60_000, 99_000, 99_999, 2.5, 10, 500, 4e4, 7e4])
    out = torch.empty(16)
    kernel[(1,)](want, out, N=16)
    ref = 1.5 + 2.0 * torch.from_numpy(norm.isf(want.double().numpy() / 100_000)).float()
    assert (out - ref).abs().max() < 2e-3, (out, ref)


def test_count_thresholds_are_sorted_and_bracket_the_row():
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(out_ptr, R: tl.constexpr, NT: tl.constexpr):
        r = tl.arange(0, R)
        m = 10.0 + r.to(tl.float32)
        x_min = -5.0 - r.to(tl.float32)
        n = (r * 0 + 5000).to(tl.int64)
        k_on = r % 4 == 0  # rows 0: top-k; 1 and 3: top-p alone (the cut the fit predicts); 2: neither
        p_on = r % 2 == 1
        c = m * 0 + 1.4426950408889634  # T = 1
        thr = fused._count_thresholds(m, x_min, n, m * 0.1, m * 0 + 2.0, c, (r * 0 + 50).to(tl.int64), m * 0 + 0.9,
                                      k_on, p_on, r >= 0, 256, NT, 4)  # fmt: skip
        tl.store(out_ptr + r[:, None] * NT + tl.arange(0, NT)[None, :], thr)

    out = torch.empty(4, 16)
    kernel[(1,)](out, R=4, NT=16)
    m, x_min = 10.0 + torch.arange(4.0), -5.0 - torch.arange(4.0)
    assert (out[:, 1:] <= out[:, :-1]).all(), "thresholds must decrease (launch 2's buckets count on it)"
    assert (out <= m[:, None]).all() and (out >= x_min[:, None]).all()
    assert (out == x_min[:, None]).any(-1).all()  # the geometric half ends at the smallest logit
    assert (out.unique(dim=-1).shape[-1] > 8) and (out[0].unique().numel() > 12)  # spread, not collapsed


def test_flat_top_p_rows_gather_between_launch_2s_thresholds():
    # normal rows at top-p 0.95 keep ~3/4 of the vocabulary: launch 2's thresholds around the cut that the normal fit
    # predicts bracket it within CAP tokens, so launch 3 gathers the bracket and finishes in one pass (no rounds);
    # with top-k the thresholds stay where they were (count-spaced), and those rows take another path
    B, V = 3, 16_384
    logits = torch.randn(B, V, generator=torch.Generator().manual_seed(11))
    got = run_with_state(logits, 1.0, [(0, 0.95, 0.0), (0, 0.5, 0.0), (0, 0.95, 0.05)], split=4)
    check_radix_rows(*got, bins=16)
    state = got[1]
    assert (state[:, fused.S_PATH.value] == fused.PATH_REGATHER.value).all(), paths_of(state)
    assert (state[:, fused.S_ROUNDS_P.value] == 0).all()


@pytest.mark.parametrize("top_k, top_p, min_p", [(5, 1.0, 0.0), (0, 0.6, 0.0), (8, 0.7, 0.0), (0, 1.0, 0.3),
                                                 (12, 0.9, 0.1), (1, 1.0, 0.0), (0, 1e-6, 0.0)])  # fmt: skip
def test_finish_from_list_draws_from_the_kept_set_whatever_the_list_order(top_k, top_p, min_p):
    # the finish sorts the list in registers: the same tokens for any order of the list (launches 2 and 3 fill it
    # through an atomic counter), every token in the reference's kept set, ties at the cuts kept (a cut one
    # position off drops or adds a tie group: the draws over 512 steps reach it)
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(val_ptr, idx_ptr, out_ptr, n, m, c, total, top_k, top_p, min_p, R: tl.constexpr, CAP: tl.constexpr):
        rows = tl.arange(0, R)
        zero = rows * 0
        fin = rows >= 0
        step = rows.to(tl.int64)
        k, seed = zero.to(tl.int64) + top_k, zero.to(tl.int64) + 3
        on_k, on_p = fin & (top_k > 0), fin & (top_p < 1.0)
        tok = fused._finish_launch2(val_ptr, idx_ptr, rows, fin, zero + n, zero + m, zero + c, zero + total, k,
                                    zero + top_p, zero + min_p, on_k, on_p, seed, step, CAP, 5)  # fmt: skip
        tl.store(out_ptr + rows, tok)

    g = torch.Generator().manual_seed(top_k)
    V, n, R, CAP = 40, 24, 512, 32
    logits = (torch.randn(V, generator=g) * 1.5).round(decimals=0)  # ties at every cut
    listed = logits.argsort(descending=True)[:n]  # the list: every token above the 24th largest
    listed = listed[torch.isin(logits[listed], logits[listed].unique()[1:])]  # whole tie groups only
    m = logits.max().item()
    probs = torch.softmax(logits.double(), -1)
    total = (probs / probs.max()).sum().item()  # sum of p relative to the max: what the stats give
    keep = naive.filter_probs(probs[None], *(torch.tensor([v], dtype=torch.float64) for v in (top_k, top_p, min_p)))[0]
    assert keep[listed].sum() == keep.sum(), "the test's list must hold the kept set"
    outs = []
    for perm in (torch.arange(len(listed)), torch.randperm(len(listed), generator=g)):
        order = listed[perm]
        val = torch.full((R, CAP), float("nan"))
        idx = torch.full((R, CAP), -5, dtype=torch.int32)
        val[:, : len(order)] = logits[order]
        idx[:, : len(order)] = order.int()
        out = torch.empty(R, dtype=torch.int64)
        kernel[(1,)](val, idx, out, len(order), m, 1.4426950408889634, total, top_k, top_p, min_p, R=R, CAP=CAP)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    assert keep[outs[0]].all()
    assert set(outs[0].tolist()) == set(keep.nonzero()[:, 0].tolist()) or keep.sum() > 12  # every kept token drawn


def paths_of(state):
    return {int(p): int((state[:, fused.S_PATH.value] == p).sum()) for p in state[:, fused.S_PATH.value].unique()}


@pytest.mark.parametrize("tiles", [True, False])
def test_benchmark_shapes_never_need_the_radix_rounds(tiles):
    # top-k 50 + top-p 0.9 (the benchmark's target mode) on every shape. From tiles (the CPU's default) the list
    # at the k-th largest group maximum holds the cut on every row: no regather, no rounds. Without (tiles=False,
    # B = 1 on the H200), launch 2's list or its regather at a counted threshold holds it (the normal-fit
    # thresholds place one in the k-th value's tail for peaked, flat and ties rows; the geometric ones for zipf):
    # both paths run, no row takes the rounds
    V = 4096
    logits = torch.cat([family_logits(f, 2, V, seed=i)[0] for i, f in enumerate(FAMILIES)])
    temperature = torch.tensor([family_logits(f, 1, 8)[1] for f in FAMILIES]).repeat_interleave(2)
    B = len(logits)
    state = torch.zeros(B, fused.N_STATE.value, dtype=torch.int64)
    out = fused.launch(logits, temperature, torch.full((B,), 50), torch.full((B,), 0.9), torch.zeros(B),
                       torch.zeros(B, dtype=torch.long), torch.arange(B), cap=256, block=512, state=state,
                       tiles=tiles)  # fmt: skip
    probs = torch.softmax(logits.double() / temperature[:, None].double(), -1)
    keep = naive.filter_probs(probs, torch.full((B,), 50), torch.full((B,), 0.9, dtype=torch.float64), torch.zeros(B))
    assert keep[torch.arange(B), out].all()
    paths = paths_of(state)
    if tiles:
        assert paths == {fused.PATH_LIST.value: B}, paths
    else:
        assert set(paths) <= {fused.PATH_LIST.value, fused.PATH_REGATHER.value}, paths
        assert paths.get(fused.PATH_LIST.value, 0) > 0 and paths.get(fused.PATH_REGATHER.value, 0) > 0, paths


@pytest.mark.parametrize(
    "V, block, split, exact",
    [
        (96, 32, 3, True),  # one block per chunk: every group is one token, the bound is the k-th logit itself
        (1000, 64, 2, False),  # 8 blocks per chunk, groups of 4 tokens, the last chunk partial
    ],
)
def test_group_bound_is_at_or_below_the_kth_logit(V, block, split, exact):
    # launch 2's list threshold for top-k (k <= the row's group maxima): the k-th largest group maximum, never
    # above the k-th largest logit (else the list would miss tokens of the kept set); with one token per group
    # it is that logit. Rows with ties at the cut, and k = the number of groups: the smallest group maximum
    g = torch.Generator().manual_seed(11)
    B = 4
    logits = torch.randn(B, V, generator=g)
    logits[1] = logits[1].round()  # ties
    n_groups = split * fused.group_count(split, block)
    ks = [1, 7, 50, min(n_groups, V - 1)]  # (k = V turns top-k off)
    rows = logits.repeat_interleave(len(ks), 0)
    top_k = torch.tensor(ks * B)
    n = len(rows)
    state = torch.zeros(n, fused.N_STATE.value, dtype=torch.int64)
    out = fused.launch(rows, torch.ones(n), top_k, torch.ones(n), torch.zeros(n), torch.zeros(n, dtype=torch.long),
                       torch.arange(n), block=block, split=split, state=state)  # fmt: skip
    kth = fused.ordered_keys(rows.sort(-1, descending=True).values[torch.arange(n), top_k - 1])
    spec = state[:, fused.S_SPEC.value]
    assert (spec <= kth).all()
    if exact:
        assert torch.equal(spec, kth)
    probs = torch.softmax(rows.double(), -1)
    keep = naive.filter_probs(probs, top_k, torch.ones(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64))
    assert keep[torch.arange(n), out].all()


@pytest.mark.parametrize(
    "V, block, split, k",
    [
        (8192, 512, 1, 100),  # 64 tiles of 128 in one chunk, most of them reach the threshold: two loads of 32
        (1000, 64, 3, 7),  # tiles of 64 over 3 chunks, the row's last tile cut at V
    ],
)
def test_list_from_tiles_holds_every_logit_at_or_above_its_threshold(V, block, split, k):
    # launch 2 finishes a sampled top-k row (k <= its group maxima) in one program from the tiles whose max reaches
    # its list threshold: the list must hold every x >= it (S_LISTED counts the appends), no more (no tile twice,
    # nothing past V: the next row's tokens) and no fewer (a tile whose max equals the threshold; the row's last
    # tile, lifted here). The last row has fewer finite logits than k (top-k off): its list is every one of them
    g = torch.Generator().manual_seed(5)
    B = 6
    logits = torch.randn(B, V, generator=g)
    logits[1] = logits[1].round()  # ties: many tiles whose max equals the threshold
    logits[2, -1] = 10.0  # the max in the row's last tile
    logits[3, : V // 2] = float("-inf")  # half the row masked: tiles with no finite x
    logits[5, 3:] = float("-inf")  # 3 finite logits < k: top-k off, top-p 0.9 keeps its share of them
    top_p = torch.tensor([1.0] * (B - 1) + [0.9])
    state = torch.zeros(B, fused.N_STATE.value, dtype=torch.int64)
    ones, zeros = torch.ones(B), torch.zeros(B)
    out = fused.launch(logits, ones, torch.full((B,), k), top_p, zeros, zeros.long(), torch.arange(B), block=block,
                       split=split, state=state)  # fmt: skip
    assert (state[:, fused.S_PATH.value] == fused.PATH_LIST.value).all()
    spec = state[:, fused.S_SPEC.value]
    at_or_above = (fused.ordered_keys(logits) >= spec[:, None]) & (logits > float("-inf"))
    listed = state[:, fused.S_LISTED.value]
    assert torch.equal(listed, at_or_above.sum(1)), (listed, at_or_above.sum(1))
    assert listed[:-1].min() >= k and listed[-1] == 3
    probs = torch.softmax(logits.double(), -1)
    keep = naive.filter_probs(probs, torch.full((B,), k), top_p.double(), torch.zeros(B, dtype=torch.float64))
    assert keep[torch.arange(B), out].all()


def test_tile_maxima_pass_gives_the_tokens_of_every_statistic():
    # rows from tiles take the stats launch's tile-maxima pass (split 8 x G 16 groups of whole 128-token tiles in a
    # 2048-token block) and must draw what the rows draw without tiles. A chunk with a NaN or a +inf takes the full
    # pass after it (row 1: INVALID; row 2: the first +inf). Rows 3.. have 3 finite logits, fewer than k, in chunks
    # of the tile pass: their list threshold is that pass's lower bound -FLT_MAX (the tile pass ran; its count of
    # finite logits is the chunks' length) and their list all 3, which top-p 0.9 keeps; one row per step, so that
    # the draws cover the 3 tokens
    g = torch.Generator().manual_seed(13)
    B, V, k = 40, 15_000, 50  # 8 chunks of one block, the last one 664 tokens: a cut tile
    logits = torch.randn(B, V, generator=g) * 2
    logits[0, 14_990] = 9.0  # the max in the cut tile
    logits[1, 3000] = float("nan")  # its own chunk: a program holds every row here, and +inf is in chunk 0
    logits[2, [900, 1500]] = float("inf")
    logits[3:] = float("-inf")
    logits[3:, [5000, 9001, 14_999]] = torch.tensor([1.0, 0.9, 0.8])  # top-p 0.9 keeps all 3
    state = torch.zeros(B, fused.N_STATE.value, dtype=torch.int64)
    args = (logits, torch.ones(B), torch.full((B,), k), torch.full((B,), 0.9), torch.zeros(B), torch.zeros(B).long(),
            torch.arange(B))  # fmt: skip
    tiled = fused.launch(*args, block=2048, split=8, tiles=True, state=state)
    assert tiled.tolist()[1:3] == [fused.INVALID_TOKEN, 900]
    assert torch.equal(tiled, fused.launch(*args, block=2048, split=8, tiles=False))
    assert (state[3:, fused.S_SPEC.value] == fused.ordered_keys(torch.tensor(-3.4028234663852886e38))).all()
    assert (state[3:, fused.S_LISTED.value] == 3).all() and set(tiled[3:].tolist()) == {5000, 9001, 14_999}
    assert (state[[0, *range(3, B)], fused.S_PATH.value] == fused.PATH_LIST.value).all()


def test_list_appends_stop_once_the_list_overflows():
    # top-p 0.95 on flat rows: the speculative threshold passes almost every token, far more than the list's CAP
    # slots. Each (row, chunk) program stops appending after the block in which its slot reached CAP, so the row's
    # appends (S_LISTED) stay within CAP + split * block; appending every token (4,096 a row here, 247k at V =
    # 248,320) contended for one counter: 33 ms at B = 256 on the H200. The rows still end right, in launch 3.
    g = torch.Generator().manual_seed(11)
    B, V, block, split, cap = 3, 4096, 64, 4, 16
    logits = torch.randn(B, V, generator=g)
    state = torch.zeros(B, fused.N_STATE.value, dtype=torch.int64)
    ones, zeros = torch.ones(B), torch.zeros(B)
    top_p = torch.full((B,), 0.95)
    out = fused.launch(logits, ones, zeros.long(), top_p, zeros, zeros.long(), torch.arange(B), block=block,
                       split=split, cap=cap, state=state)  # fmt: skip
    listed = state[:, fused.S_LISTED.value]
    assert (listed > cap).all() and (listed <= cap + split * block).all(), listed
    assert (state[:, fused.S_PATH.value] != fused.PATH_LIST.value).all()
    probs = torch.softmax(logits.double(), -1)
    keep = naive.filter_probs(probs, torch.zeros(B, dtype=torch.long), top_p.double(), torch.zeros(B).double())
    assert keep[torch.arange(B), out].all()


@pytest.mark.parametrize(
    "B, split, sms, tiles",
    [
        (1, 122, 132, False),  # H200, B = 1: launch 2's 122 programs in one wave, each row's pass spread over them
        (2, 122, 132, True),  # two waves
        (256, 8, 132, True),
        (1, 122, 0, True),  # the CPU interpreter
    ],
)
def test_tiles_pay_off(B, split, sms, tiles):
    assert fused.tiles_pay_off(B, split, sms) is tiles


def tiered_logits(n_up, V, seed):
    """A row whose n_up highest logits (rounded: ties; one unique max) lie ~40 above the others: any threshold
    between the two tiers, as launch 2's speculative one is, lists exactly those n_up tokens."""
    g = torch.Generator().manual_seed(seed)
    x = -40 + 0.1 * torch.randn(V, generator=g)
    up = torch.randperm(V, generator=g)[:n_up]
    x[up] = torch.randn(n_up, generator=g).round(decimals=1).clamp(-3, 3)
    x[up[0]] = 4.0
    return x


@pytest.mark.parametrize("top_k", [1, 50])
def test_small_top_k_list_fits_the_quarter_sort(top_k):
    # below k = 64 the speculative gather aims at CAP / 8 tokens (the normal fit's guess): a normal row's list then
    # holds >= k tokens (finished by launch 2) and fits the finish's CAP / 4 sort. Aiming at CAP / 4 listed 264 of
    # 256 slots on the H200's flat rows, whose sort of CAP / 2 cost 1.5-2.6 us at B = 1 (ab_sampling_want.json)
    g = torch.Generator().manual_seed(7)
    B, V = 4, 8192  # CAP = 1024
    logits = torch.randn(B, V, generator=g)
    state = torch.zeros(B, fused.N_STATE.value, dtype=torch.int64)
    fused.launch(logits, torch.ones(B), torch.full((B,), top_k), torch.full((B,), 0.9), torch.zeros(B),
                 torch.full((B,), 3), torch.arange(B), state=state, tiles=False)  # fmt: skip
    listed = state[:, fused.S_LISTED.value]
    assert paths_of(state) == {fused.PATH_LIST.value: B}
    assert (listed >= top_k).all() and (listed <= 1024 // 4).all(), listed


def test_finish_sorts_the_filled_prefix():
    # the finish sorts the fewest of the first CAP / 4, CAP / 2, CAP slots that hold every list of the program's
    # rows: lists of 40, 100 and 200 of 256 slots (one prefix each; one list per program) give tokens in the
    # reference's kept set (top-k 1 and tiny top-p: the argmax), and the same tokens with the rows interleaved, so
    # that every program's fullest list takes the sort of all CAP slots
    V, cap, draws = 2048, 256, 32
    modes = [(1, 1.0, 0.0), (12, 1.0, 0.0), (30, 1e-6, 0.0), (30, 0.8, 0.05)]
    cases = [(tiered_logits(n_up, V, seed=n_up), *mode) for n_up in (40, 100, 200) for mode in modes]
    logits = torch.stack([case[0] for case in cases]).repeat_interleave(draws, 0)  # [case, draw]
    top_k, top_p, min_p = (torch.tensor([case[i] for case in cases]).repeat_interleave(draws) for i in (1, 2, 3))
    B = len(logits)
    args = (logits, torch.full((B,), 2.0), top_k, top_p.float(), min_p.float(), torch.full((B,), 3),
            torch.arange(draws).repeat(len(cases)))  # fmt: skip
    state = torch.zeros(B, fused.N_STATE.value, dtype=torch.int64)
    # tiles=False: no group bound, whose threshold for top-k would list fewer than the upper tier
    out = fused.launch(*args, cap=cap, block=256, split=2, rows=draws, state=state, tiles=False)
    assert paths_of(state) == {fused.PATH_LIST.value: B}
    probs = torch.softmax(logits.double() / 2.0, -1)
    keep = naive.filter_probs(probs, top_k, top_p.double(), min_p.double())
    assert keep[torch.arange(B), out].all()
    argmax = (top_k == 1) | (top_p < 1e-3)
    assert torch.equal(out[argmax], logits[argmax].argmax(-1))
    mixed = torch.arange(B).view(len(cases), draws).T.reshape(-1)  # [draw, case]: 200-token lists in every program
    again = fused.launch(*(a[mixed] for a in args), cap=cap, block=256, split=2, rows=draws, tiles=False)
    assert torch.equal(again, out[mixed])


@pytest.mark.parametrize("dtype", [torch.int32, torch.float32])
def test_sort_network_is_tl_sort(dtype):
    # the finish and launch 2's thresholds sort with tl.sort on the GPU and with a reshape / sum network in the CPU
    # interpreter (SORT_NETWORK): both give the same order, ties and negative keys included
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(x_ptr, net_ptr, ref_ptr, R: tl.constexpr, N: tl.constexpr, LOG_N: tl.constexpr):
        at = tl.arange(0, R)[:, None] * N + tl.arange(0, N)[None, :]
        x = tl.load(x_ptr + at)
        tl.store(net_ptr + at, fused._sort_descending(x, R, N, LOG_N))
        tl.store(ref_ptr + at, tl.sort(x, 1, descending=True))

    g = torch.Generator().manual_seed(0)
    x = torch.randint(-(2**31), 2**31 - 1, (4, 64), generator=g, dtype=torch.int64)
    x[1] = torch.randint(-3, 3, (64,), generator=g)  # ties
    x = x.to(torch.int32) if dtype == torch.int32 else (x.double() / 2**20).float()
    net, ref = torch.empty_like(x), torch.empty_like(x)
    kernel[(1,)](x, net, ref, R=4, N=64, LOG_N=6)
    assert fused.SORT_NETWORK.value  # the CPU tests run the network
    assert torch.equal(net, ref) and torch.equal(net, x.sort(-1, descending=True).values)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", FAMILIES)
def test_gpu_vocab_parallel_form_is_the_samplers_token(shape):
    # the vocab-parallel form (qmoe/parallel/sampling.py) in one process at V = 248,320, the GPU's chunking and PDL:
    # its token is sample()'s under top-k 50 + top-p 0.9, top-p alone, min-p alone; the candidates of two halves,
    # combined, are the whole row's; captured in a CUDA graph, replays give the eager tokens
    from qmoe.parallel import sampling as vocab_parallel

    B = 8
    logits, temperature = family_logits(shape, B, V_FULL, seed=3, device="cuda")
    seed, step = torch.arange(B, device="cuda") + 11, torch.arange(B, device="cuda") * 5
    for top_k, top_p, min_p in ((50, 0.9, 0.0), (0, 0.95, 0.0), (0, 1.0, 0.05)):
        args = (temperature, top_k, top_p, min_p, seed, step)
        want = fused.sample(logits, *args)
        got = vocab_parallel.sample(logits, 0, *args, triton=True)
        assert torch.equal(got, want), (shape, top_k, top_p, min_p)
        # the config's filters: the cuts from the rank's 50 best logits, or none to find
        filters = vocab_parallel.Filters(top_k, top_p < 1)
        got = vocab_parallel.sample(logits, 0, *args, triton=True, filters=filters)
        assert torch.equal(got, want), (shape, filters)
    assert torch.equal(vocab_parallel.greedy(logits, 0, triton=True), fused.greedy(logits))
    m = logits.float().amax(-1)
    cut = torch.full((B,), -(2**31), dtype=torch.int32, device="cuda")  # the race over every finite token
    race = (m, torch.full((B,), temperature, device="cuda"), cut, torch.zeros(B, device="cuda"), seed, step)
    whole = fused.launch_shard_candidates(logits, 0, race)
    half = V_FULL // 2
    halves = [fused.launch_shard_candidates(logits[:, :half], 0, race),
              fused.launch_shard_candidates(logits[:, half:].contiguous(), half, race)]  # fmt: skip
    sampled = torch.ones(B, dtype=torch.bool, device="cuda")
    assert torch.equal(vocab_parallel.choose(torch.stack(halves), sampled), vocab_parallel.choose(whole[None], sampled))
    for filters in (None, vocab_parallel.Filters(50, True)):  # the search, the candidates
        args = (temperature, 50, 0.9, 0.0, seed, step)
        graph, out = captured(lambda: vocab_parallel.sample(logits, 0, *args, triton=True, filters=filters))  # noqa: B023
        for i in range(3):
            step += 1
            graph.replay()
            assert torch.equal(out, fused.sample(logits, temperature, 50, 0.9, 0.0, seed, step)), (i, filters)
