"""Sampling vocab-parallel logits without gathering them: the semantics of kernels/sampling/naive.py, exactly.

Each rank holds logits [B, V / world] of the tokens start .. start + V / world - 1. It reduces them to a few
numbers per row and small collectives over the world combine those: the softmax's max and sum (all-reduce), the
filters' global cuts (a search over the cut value, each round one all-reduce of a few counts or masses per row),
and one all-gather of each rank's candidates (its race winner and value, its argmax, its first +inf, NaN and
all -inf flags), from which every rank picks the same token. The race's noise is keyed by the global token index,
so every token is what one process draws.

Cuts: a token with value v survives top-k iff fewer than k tokens have p > v, and top-p iff the renormalised mass
of the tokens with p > v is below top_p (with ties at the cut kept, as the reference's sorted cumsum keeps them).
So each filter keeps v >= t*, t* the smallest value where that measure drops below its target; t* is found over
the ordered bit patterns of non-negative doubles, SEARCH_PIVOTS pivots per round, SEARCH_ROUNDS rounds (fixed, so
an exported method holds a fixed graph).
"""

import torch
import torch.nn.functional as F

from kernels.sampling import naive as naive_sampling
from kernels.sampling.naive import INVALID_TOKEN, uniform_noise
from qmoe.parallel.collectives import all_gather, all_reduce, size

SEARCH_PIVOTS = 15  # per round: the 2^63 keys shrink 16-fold
SEARCH_ROUNDS = 17  # 16^16 >= 2^63 keys, plus the round that pins the last one
POS_INF_KEY = 0x7FF0000000000000  # the bits of +inf as int64: the largest key of a non-negative double


def global_cut(values: torch.Tensor, weights: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """values [B, Vl] >= 0 (a rank's slice), weights [B, Vl], target [B] > 0 -> t* [B] fp64: the smallest value t
    with sum over every rank of weights where values > t below target."""
    B = values.shape[0]
    ascending, order = values.sort(-1)  # once per call: each pivot is then a binary search, not a pass over Vl
    prefix = F.pad(weights.gather(1, order).cumsum(-1), (1, 0))  # [B, Vl + 1]: weight of the k smallest
    lo = torch.full((B,), -1, dtype=torch.int64, device=values.device)  # measure(lo) >= target (or below 0)
    hi = torch.full((B,), POS_INF_KEY, dtype=torch.int64, device=values.device)  # measure(hi) < target
    j = torch.arange(1, SEARCH_PIVOTS + 1, device=values.device)
    for _ in range(SEARCH_ROUNDS):
        step = ((hi - lo) // (SEARCH_PIVOTS + 1)).clamp(min=1)
        pivots = torch.minimum(lo[:, None] + step[:, None] * j, hi[:, None])  # [B, P] ascending keys
        at_most = torch.searchsorted(ascending, pivots.view(torch.float64), right=True)  # [B, P]: values <= pivot
        measure = all_reduce(prefix[:, -1:] - prefix.gather(1, at_most), "world")  # [B, P]: weight above pivot
        below = measure < target[:, None]
        first = torch.where(below.any(-1), below.int().argmax(-1), SEARCH_PIVOTS)  # first pivot below target
        lo = torch.where(first > 0, pivots.gather(1, (first - 1).clamp(min=0)[:, None])[:, 0], lo)
        hi = torch.where(first < SEARCH_PIVOTS, pivots.gather(1, first.clamp(max=SEARCH_PIVOTS - 1)[:, None])[:, 0], hi)
    return hi.view(torch.float64)


def first_argmax(x: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(max [B], its global index [B] as fp64, the lowest one on ties) of a rank's slice."""
    value, index = x.max(-1)
    return value, (index + start).double()


def pick(value: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """value, index [W, B] (each rank's candidate) -> the global index [B] int64 of the largest value, the lowest
    index on ties, as one process's argmax picks it."""
    best = value.max(0).values
    return torch.where(value == best, index, float("inf")).min(0).values.clamp(max=2**62).long()  # NaN rows: any


def candidates(logits: torch.Tensor, start: int, race: torch.Tensor | None) -> torch.Tensor:
    """[W, B, 7] every rank's (race value, race index, logit max, its index, first +inf index, any NaN, all -inf)."""
    B, V = logits.shape
    race_value, race_index = first_argmax(race, start) if race is not None else first_argmax(logits, start)
    value, index = first_argmax(logits, start)
    pos_inf = logits == float("inf")
    first_inf = torch.where(pos_inf.any(-1), (pos_inf.int().argmax(-1) + start).double(), float("inf"))
    nan, neg_inf = logits.isnan().any(-1).double(), (logits == float("-inf")).all(-1).double()
    return all_gather(torch.stack([race_value, race_index, value, index, first_inf, nan, neg_inf], -1), "world")


def choose(gathered: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
    """The token [B] from the gathered candidates: the race winner where `sampled`, else the argmax; then the
    reference's special rows (+inf wins, NaN or all -inf is INVALID_TOKEN)."""
    race_value, race_index, value, index, first_inf, nan, neg_inf = gathered.unbind(-1)  # each [W, B]
    token = torch.where(sampled, pick(race_value, race_index), pick(value, index))
    inf = first_inf.min(0).values
    token = torch.where(inf < float("inf"), inf.clamp(max=2**62).long(), token)
    invalid = (nan.max(0).values > 0) | (neg_inf.min(0).values > 0)
    return torch.where(invalid, INVALID_TOKEN, token)


def greedy(logits: torch.Tensor, start: int) -> torch.Tensor:
    """Argmax over every rank's slice -> int64 [B] (naive.greedy of the gathered logits)."""
    logits = logits.double()
    sampled = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    return choose(candidates(logits, start, None), sampled)


def sample(logits, start: int, temperature, top_k, top_p, min_p, seed, step) -> torch.Tensor:
    """naive.sample of the gathered logits, from this rank's slice logits [B, V / world] -> int64 [B]."""
    Vl = logits.shape[1]
    V = Vl * size("world")
    logits, scaled, temperature, top_k, top_p, min_p, seed, step = naive_sampling.prepare(
        logits, temperature, top_k, top_p, min_p, seed, step
    )
    exp = (scaled - all_reduce(scaled.max(-1).values, "world", "max")[:, None]).exp()
    probs = exp / all_reduce(exp.sum(-1), "world")[:, None]  # softmax over the whole vocabulary
    keep = probs > 0
    k = top_k.clamp(max=V)
    kth = global_cut(probs, torch.ones_like(probs), k.clamp(min=1).double())  # fewer than k tokens above
    keep &= torch.where(k[:, None] > 0, probs >= kth[:, None], True)
    masked = torch.where(keep, probs, 0)
    renorm = masked / all_reduce(masked.sum(-1), "world")[:, None]
    cut = global_cut(renorm, renorm, top_p)  # less than top_p of the kept mass above
    keep &= torch.where(top_p[:, None] < 1, renorm >= cut[:, None], True)
    keep &= probs >= min_p[:, None] * all_reduce(probs.max(-1).values, "world", "max")[:, None]
    race = torch.where(keep, probs / -uniform_noise(seed, step, Vl, start).log(), -1.0)
    return choose(candidates(logits, start, race), temperature > 0)
