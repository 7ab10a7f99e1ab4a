"""Sampling vocab-parallel logits without gathering them: the semantics of the sampler one process runs, exactly.

Each rank holds logits [B, V / world] of the tokens start .. start + V / world - 1. It reduces them to a few
numbers per row and small collectives over the world combine those: the row's max (all-reduce), the filters'
global cuts (a search over the cut value, each round one all-reduce of SEARCH_PIVOTS counts or masses per row; for
the Triton sampler under a top-k the config fixes for every row, one all-gather of each rank's k best logits:
`candidate_cuts`; none without a filter), and one all-gather of each rank's candidates: its max with its lowest
index (NaN if its slice holds one) and, when sampling, its race winner and race key. Every rank then picks the
same token (`choose`). The race's noise is keyed by the global token index, so every token is what one process
draws.

Two implementations, each equal to its one-process sampler (`kernels.sampling`):
- torch (kernels/sampling/naive.py): float64 softmax, its hash noise; the local reductions in torch;
- triton (kernels/sampling/triton.py): the race key `sample` draws (Philox, fp32) over the kept tokens of the
  rank's slice in one launch (`shard_candidates`, also the whole greedy path), the cuts found in torch over the
  logits' ordered keys (`sample`'s cut is a key) with float64 masses: a top-p cut can differ from one process's
  fp32 sums only where those sums round across the target.

Cuts: a token with value v survives top-k iff fewer than k tokens have p > v, and top-p iff the renormalised mass
of the tokens with p > v is below top_p (with ties at the cut kept, as the reference's sorted cumsum keeps them).
So each filter keeps v >= t*, t* the smallest value where that measure drops below its target; t* is found over
int64 keys in v's order (torch: the bit patterns of the non-negative float64 p; triton: the sampler's int32 keys
of the logits), SEARCH_PIVOTS pivots per round, one all-reduce of [B, SEARCH_PIVOTS] measures per round, as many
rounds as the key range needs (fixed per range, so an exported method holds a fixed graph): 9 for float64 bit
patterns, 4 for int32 keys.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.sampling import naive as naive_sampling
from kernels.sampling.naive import INVALID_TOKEN, uniform_noise
from qmoe.parallel.collectives import all_gather, all_reduce, size

LOG2E = 1.4426950408889634  # as kernels/sampling/triton.py: p = 2^((x - max) * log2(e) / T)

CANDIDATES_MAX = 1024  # a config's top-k up to this: each rank sends its k best logits (one all-gather, no search)
SEARCH_PIVOTS = 255  # per round: a bracket of keys shrinks 256-fold (one all-reduce costs its latency, not bytes)
POS_INF_KEY = 0x7FF0000000000000  # the bits of +inf as int64: the largest key of a non-negative double
INT32_KEYS = (-(2**31) - 1, 2**31 - 1)  # below every int32 key; the largest one


@dataclass(frozen=True)
class Filters:
    """The filters a run's config sets for every row, which its per-row parameters (device tensors) cannot say:
    top_k (0: off) and whether top-p is on. They let the vocab-parallel Triton sampler skip the cut search: no cut
    to find (`uncut`), or the cuts from each rank's top_k best logits (`candidate_cuts`, top_k <= CANDIDATES_MAX)."""

    top_k: int
    top_p: bool

    @property
    def cuts(self) -> str:
        """How the Triton sampler finds them: "none", "candidates" or "search"."""
        if self.top_k <= 0:
            return "search" if self.top_p else "none"
        return "candidates" if self.top_k <= CANDIDATES_MAX else "search"

    def __str__(self) -> str:  # what a sampler's name carries (exported methods bake the filters in)
        return ",".join([f"top_k={self.top_k}"] * (self.top_k > 0) + ["top_p"] * self.top_p) or "no filter"


def search_rounds(lo: int, hi: int) -> int:
    """Rounds of `global_cut` that narrow the bracket (lo, hi] to one key, whatever the data."""
    rounds = 0
    while hi - lo > 1:
        step = max(1, (hi - lo) // (SEARCH_PIVOTS + 1))
        lo, hi = 0, max(step, hi - lo - step * SEARCH_PIVOTS)  # the widest bracket a round can leave
        rounds += 1
    return rounds


def global_cut(keys: torch.Tensor, weights: torch.Tensor, target: torch.Tensor, lo: int, hi: int,
               ordered=None) -> torch.Tensor:  # fmt: skip
    """keys [B, Vl] int64 in (lo, hi] (a rank's slice), weights [B, Vl] >= 0, target [B] > 0 -> t* [B] int64: the
    smallest t in (lo, hi] whose measure, the sum over every rank of the weights where keys > t, is below target
    (the measure of hi is 0). `ordered`: keys.sort(-1), when the caller cuts the same keys twice."""
    B = keys.shape[0]
    # once per call: each pivot is then a binary search, not a pass over Vl
    ascending, order = keys.sort(-1) if ordered is None else ordered
    prefix = F.pad(weights.gather(1, order).cumsum(-1), (1, 0))  # [B, Vl + 1]: weight of the k smallest
    low = torch.full((B,), lo, dtype=torch.int64, device=keys.device)  # measure(low) >= target (or below all keys)
    high = torch.full((B,), hi, dtype=torch.int64, device=keys.device)  # measure(high) < target
    j = torch.arange(1, SEARCH_PIVOTS + 1, device=keys.device)
    for _ in range(search_rounds(lo, hi)):
        step = ((high - low) // (SEARCH_PIVOTS + 1)).clamp(min=1)
        pivots = torch.minimum(low[:, None] + step[:, None] * j, high[:, None])  # [B, P] ascending keys
        at_most = torch.searchsorted(ascending, pivots, right=True)  # [B, P]: keys <= pivot
        measure = all_reduce(prefix[:, -1:] - prefix.gather(1, at_most), "world")  # [B, P]: weight above pivot
        below = measure < target[:, None]
        first = torch.where(below.any(-1), below.int().argmax(-1), SEARCH_PIVOTS)  # first pivot below target
        low = torch.where(first > 0, pivots.gather(1, (first - 1).clamp(min=0)[:, None])[:, 0], low)
        high = torch.where(first < SEARCH_PIVOTS, pivots.gather(1, first.clamp(max=SEARCH_PIVOTS - 1)[:, None])[:, 0],
                           high)  # fmt: skip
    return high


def probability_cut(probs: torch.Tensor, weights: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """global_cut over float64 probs [B, Vl] >= 0 (their bit patterns are keys in their order) -> t* [B] fp64."""
    return global_cut(probs.view(torch.int64), weights, target, -1, POS_INF_KEY).view(torch.float64)


def first_argmax(x: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(max [B], NaN where the row holds one; its global index [B] as fp64, the lowest one on ties) of a slice."""
    value, index = x.max(-1)
    return value, (index + start).double()


def pick(value: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """value, index [W, B] (each rank's candidate, the lowest index of its slice's largest) -> (the largest value
    [B], NaN where a rank's is; its global index [B] int64, the lowest on ties, as one process's argmax picks it:
    rank r's slice precedes rank r + 1's, and torch.max takes the first rank of the largest)."""
    best, rank = value.max(0)
    return best, index.gather(0, rank[None])[0].long()  # NaN rows: any


def choose(gathered: torch.Tensor, sampled: torch.Tensor | None) -> torch.Tensor:
    """The token [B] from every rank's candidates [W, B, 2 | 4] (max, its index[, race key, its index]): the race
    winner where `sampled`, else the argmax; then one process's special rows: an +inf logit wins (the lowest such
    index: the argmax), a row with a NaN or with only -inf is INVALID_TOKEN."""
    best, token = pick(gathered[..., 0], gathered[..., 1])  # best [B]: NaN where any rank saw one
    if sampled is not None:
        token = torch.where(sampled & (best < float("inf")), pick(gathered[..., 2], gathered[..., 3])[1], token)
    return torch.where(best.isnan() | (best == float("-inf")), INVALID_TOKEN, token)


def greedy(logits: torch.Tensor, start: int, triton: bool = False) -> torch.Tensor:
    """Argmax over every rank's slice -> int64 [B] (one process's greedy of the gathered logits)."""
    if triton:
        mine = triton_sampling().shard_candidates(logits, start)
    else:
        mine = torch.stack(first_argmax(logits.double(), start), -1)
    return choose(all_gather(mine, "world"), None)


def sample(logits, start: int, temperature, top_k, top_p, min_p, seed, step, triton: bool = False,
           filters: Filters | None = None) -> torch.Tensor:  # fmt: skip
    """One process's `sample` of the gathered logits, from this rank's slice logits [B, V / world] -> int64 [B].
    filters (triton only): what every row's top_k and top_p are (the caller's config), None when not known."""
    if triton:
        return sample_triton(logits, start, temperature, top_k, top_p, min_p, seed, step, filters)
    Vl = logits.shape[1]
    V = Vl * size("world")
    logits, scaled, temperature, top_k, top_p, min_p, seed, step = naive_sampling.prepare(
        logits, temperature, top_k, top_p, min_p, seed, step
    )
    exp = (scaled - all_reduce(scaled.max(-1).values, "world", "max")[:, None]).exp()
    probs = exp / all_reduce(exp.sum(-1), "world")[:, None]  # softmax over the whole vocabulary
    keep = probs > 0
    k = top_k.clamp(max=V)
    kth = probability_cut(probs, torch.ones_like(probs), k.clamp(min=1).double())  # fewer than k tokens above
    keep &= torch.where(k[:, None] > 0, probs >= kth[:, None], True)
    masked = torch.where(keep, probs, 0)
    renorm = masked / all_reduce(masked.sum(-1), "world")[:, None]
    cut = probability_cut(renorm, renorm, top_p)  # less than top_p of the kept mass above
    keep &= torch.where(top_p[:, None] < 1, renorm >= cut[:, None], True)
    keep &= probs >= min_p[:, None] * all_reduce(probs.max(-1).values, "world", "max")[:, None]
    race = torch.where(keep, probs / -uniform_noise(seed, step, Vl, start).log(), -1.0)
    mine = torch.cat([torch.stack(first_argmax(logits, start), -1), torch.stack(first_argmax(race, start), -1)], -1)
    return choose(all_gather(mine, "world"), temperature > 0)


def sample_triton(logits, start: int, temperature, top_k, top_p, min_p, seed, step, filters: Filters | None = None):
    """The Triton sampler's `sample` of the gathered logits, from this rank's slice: the cuts as its keys (none
    without a filter, from each rank's best logits under a top-k up to CANDIDATES_MAX, else by the search), the
    race in `shard_candidates`."""
    B, fused = logits.shape[0], triton_sampling()

    def per_row(v, dtype):  # contiguous: shard_candidates reads row r's parameter at r
        return fused.per_row(v, dtype, B, logits.device).contiguous()

    temperature, top_p, min_p = (per_row(v, torch.float32) for v in (temperature, top_p, min_p))
    top_k, seed, step = (per_row(v, torch.int64) for v in (top_k, seed, step))
    sampled = temperature > 0
    x = logits.float()  # [B, Vl] the kernel's values
    c = exp2_scale(temperature)
    cuts = "search" if filters is None else filters.cuts
    if cuts == "none":
        m, cut = uncut(x)
    elif cuts == "candidates":
        m, cut = candidate_cuts(x, c, top_k, top_p, min(filters.top_k, x.shape[1]))
    else:
        m, cut = searched_cuts(x, c, top_k, top_p)
    race = (m, temperature, cut.int(), torch.where(sampled, min_p.clamp(max=1), 0.0), seed, step)
    mine = fused.shard_candidates(logits, start, race)
    return choose(all_gather(mine, "world"), sampled)


def exp2_scale(temperature: torch.Tensor) -> torch.Tensor:
    """c [B] fp32, as the kernel's: a token's mass is 2^((x - max) * c); rows at temperature 0 take T = 1."""
    return torch.where(temperature > 0, LOG2E / temperature.clamp(min=1e-30), LOG2E)


def slice_max(x: torch.Tensor) -> torch.Tensor:
    """The max [B] of this rank's slice x [B, Vl], NaN ignored."""
    return torch.where(x.isnan(), float("-inf"), x).amax(-1)


def row_max(x: torch.Tensor) -> torch.Tensor:
    """The row's max [B] over every rank's slice x [B, Vl], NaN ignored (an all-reduce)."""
    return all_reduce(slice_max(x), "world", "max")


def uncut(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`searched_cuts` of rows with neither top-k nor top-p: the row's max, and the lowest key (every token kept)."""
    m = row_max(x)
    return m, torch.full_like(m, INT32_KEYS[0] + 1, dtype=torch.int64)


def searched_cuts(x: torch.Tensor, c: torch.Tensor, top_k, top_p) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (the row's max m [B] fp32, NaN ignored; the kept tokens' lowest key [B] int64): the top-k cut, then the
    top-p cut within the top-k set, each by `global_cut` over the rank's int32 keys (a sort of the slice, then 4
    all-reduces per cut)."""
    finite = x.isfinite()
    m = row_max(x)
    mass = torch.where(finite, torch.exp2((x.double() - m.double()[:, None]) * c.double()[:, None]), 0.0)
    keys = triton_sampling().ordered_keys(torch.where(finite, x, 0.0))  # [B, Vl]; non-finite x weigh nothing
    ordered = keys.sort(-1)
    kth = global_cut(keys, finite.double(), top_k.clamp(min=1).double(), *INT32_KEYS, ordered)  # < k finite above
    cut = torch.where(top_k > 0, kth, INT32_KEYS[0] + 1)  # off: the lowest key (k >= the finite tokens cuts there)
    kept = torch.where(keys >= cut[:, None], mass, 0.0)
    target = top_p.double() * all_reduce(kept.sum(-1), "world")  # top_p of the top-k set's mass
    p_cut = global_cut(keys, kept, target, *INT32_KEYS, ordered)
    return m, torch.where(top_p < 1, torch.maximum(cut, p_cut), cut)


def candidate_cuts(x: torch.Tensor, c: torch.Tensor, top_k, top_p, C: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`searched_cuts` for rows whose top_k is in 1 .. C, from one all-gather of each rank's C largest finite logits
    (with its max, and how many of its logits equal its C-th); every rank then finds the same cuts from the W * C.
    They suffice: fewer than k tokens lie above the top-k cut (its definition), so each rank sent all of its own;
    the top-p cut is at or above the top-k cut and weighs only tokens above itself. The tokens tied at the top-k
    cut count in the top-k set's mass, and only they can outnumber what a rank sent: a rank whose C-th logit is at
    the cut counted all of its own; any other rank's C-th is below the cut (above it, the rank alone would hold C
    >= k tokens above the cut), so it sent every token at the cut."""
    B = x.shape[0]
    finite = x.isfinite()
    masked = torch.where(finite, x, float("-inf"))
    best = masked.topk(C, -1).values  # [B, C] descending; -inf past the rank's finite logits
    ties = ((masked == best[:, -1:]) & finite).sum(-1)  # [B] the rank's finite logits equal to its C-th
    mine = torch.cat([best.double(), ties.double()[:, None], slice_max(x).double()[:, None]], -1)  # [B, C + 2]
    every = all_gather(mine, "world")  # [W, B, C + 2]
    W = every.shape[0]
    m = every[..., C + 1].amax(0)  # [B] the row's max (fp32 values: exact in fp64)
    values = every[..., :C].permute(1, 0, 2).reshape(B, W * C)  # [B, W * C] each rank's C, in rank order
    valid = values.isfinite()
    keys = torch.where(valid, triton_sampling().ordered_keys(torch.where(valid, values, 0.0)), INT32_KEYS[0])
    sent_keys = keys.view(B, W, C)
    keys, order = keys.sort(-1, descending=True)
    values = values.gather(1, order)
    k = top_k.clamp(1, C)[:, None]  # [B, 1]
    kth = keys.gather(1, k - 1)[:, 0]
    cut = torch.where(valid.sum(-1) >= k[:, 0], kth, INT32_KEYS[0] + 1)  # fewer finite logits than k: all kept
    at_cut = torch.where(sent_keys[..., -1] == cut[:, None], every[..., C].t(),
                         (sent_keys == cut[:, None, None]).sum(-1)).sum(-1)  # fmt: skip  # [B] tokens tied at the cut
    cw = c.double()[:, None]
    above = keys > cut[:, None]
    mass = torch.where(above, torch.exp2((values - m[:, None]) * cw), 0.0)  # [B, W * C], descending keys
    cut_mass = torch.exp2((values.gather(1, k - 1) - m[:, None]) * cw)[:, 0]
    kept = mass.sum(-1) + torch.where(at_cut > 0, at_cut * cut_mass, 0.0)  # the top-k set's mass
    # the top-p cut: the key of the first token (by descending key) whose mass with the tokens above reaches
    # top_p of the kept mass (its measure, the mass above it, is then below the target; the one before's is not);
    # a target of 0 (no finite logit, or an +inf one: `choose` decides those rows) the search leaves at its top key
    target = top_p.double() * kept
    reached = above & (mass.cumsum(-1) >= target[:, None])
    p_cut = torch.where(reached.any(-1), keys.gather(1, reached.int().argmax(-1)[:, None])[:, 0], cut)
    p_cut = torch.where(target > 0, p_cut, INT32_KEYS[1])
    return m.float(), torch.where(top_p < 1, torch.maximum(cut, p_cut), cut)


def triton_sampling():
    from kernels.sampling import triton as fused  # not at import: the torch path runs without Triton

    return fused
