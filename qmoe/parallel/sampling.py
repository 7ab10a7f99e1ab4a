"""Sampling vocab-parallel logits without gathering them: the semantics of the sampler one process runs, exactly.

Each rank holds logits [B, V / world] of the tokens start .. start + V / world - 1. It reduces them to a few
numbers per row and small collectives over the world combine those: the row's max (all-reduce), the filters'
global cuts (a search over the cut value, each round one all-reduce of a few counts or masses per row), and one
all-gather of each rank's candidates: its max with its lowest index (NaN if its slice holds one) and, when
sampling, its race winner and race key. Every rank then picks the same token (`choose`). The race's noise is keyed
by the global token index, so every token is what one process draws.

Two implementations, each equal to its one-process sampler (`kernels.sampling`):
- torch (kernels/sampling/naive.py): float64 softmax, its hash noise; the local reductions in torch;
- triton (kernels/sampling/triton.py): the race key `sample` draws (Philox, fp32) over the kept tokens of the
  rank's slice in one launch (`shard_candidates`, also the whole greedy path), the cuts found in torch over the
  logits' ordered keys (`sample`'s cut is a key) with float64 masses: a top-p cut can differ from one process's
  fp32 sums only where those sums round across the target.

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

LOG2E = 1.4426950408889634  # as kernels/sampling/triton.py: p = 2^((x - max) * log2(e) / T)

SEARCH_PIVOTS = 15  # per round: the 2^63 keys shrink 16-fold
SEARCH_ROUNDS = 17  # 16^16 >= 2^63 keys, plus the round that pins the last one
POS_INF_KEY = 0x7FF0000000000000  # the bits of +inf as int64: the largest key of a non-negative double


def global_cut(values: torch.Tensor, weights: torch.Tensor, target: torch.Tensor, ordered=None) -> torch.Tensor:
    """values [B, Vl] >= 0 (a rank's slice), weights [B, Vl], target [B] > 0 -> t* [B] fp64: the smallest value t
    with sum over every rank of weights where values > t below target. `ordered`: values.sort(-1), when the
    caller cuts the same values twice."""
    B = values.shape[0]
    # once per call: each pivot is then a binary search, not a pass over Vl
    ascending, order = values.sort(-1) if ordered is None else ordered
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
    """(max [B], NaN where the row holds one; its global index [B] as fp64, the lowest one on ties) of a slice."""
    value, index = x.max(-1)
    return value, (index + start).double()


def pick(value: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """value, index [W, B] (each rank's candidate) -> the global index [B] int64 of the largest value, the lowest
    index on ties, as one process's argmax picks it."""
    best = value.max(0).values
    return torch.where(value == best, index, float("inf")).min(0).values.clamp(max=2**62).long()  # NaN rows: any


def choose(gathered: torch.Tensor, sampled: torch.Tensor | None) -> torch.Tensor:
    """The token [B] from every rank's candidates [W, B, 2 | 4] (max, its index[, race key, its index]): the race
    winner where `sampled`, else the argmax; then one process's special rows: an +inf logit wins (the lowest such
    index: the argmax), a row with a NaN or with only -inf is INVALID_TOKEN."""
    value, index = gathered[..., 0], gathered[..., 1]  # each [W, B]
    best = value.max(0).values  # NaN where any rank saw one
    token = pick(value, index)
    if sampled is not None:
        token = torch.where(sampled & (best < float("inf")), pick(gathered[..., 2], gathered[..., 3]), token)
    return torch.where(best.isnan() | (best == float("-inf")), INVALID_TOKEN, token)


def greedy(logits: torch.Tensor, start: int, triton: bool = False) -> torch.Tensor:
    """Argmax over every rank's slice -> int64 [B] (one process's greedy of the gathered logits)."""
    if triton:
        mine = triton_sampling().shard_candidates(logits, start)
    else:
        mine = torch.stack(first_argmax(logits.double(), start), -1)
    return choose(all_gather(mine, "world"), None)


def sample(logits, start: int, temperature, top_k, top_p, min_p, seed, step, triton: bool = False) -> torch.Tensor:
    """One process's `sample` of the gathered logits, from this rank's slice logits [B, V / world] -> int64 [B]."""
    if triton:
        return sample_triton(logits, start, temperature, top_k, top_p, min_p, seed, step)
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
    mine = torch.cat([torch.stack(first_argmax(logits, start), -1), torch.stack(first_argmax(race, start), -1)], -1)
    return choose(all_gather(mine, "world"), temperature > 0)


def ordered_keys(x: torch.Tensor) -> torch.Tensor:
    """fp32 x (not NaN, -0.0 folded into +0.0) -> fp64 >= 0 in x's order: the Triton sampler's int32 key + 2^31."""
    bits = x.view(torch.int32)
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).double() + 2**31


def sample_triton(logits, start: int, temperature, top_k, top_p, min_p, seed, step) -> torch.Tensor:
    """The Triton sampler's `sample` of the gathered logits, from this rank's slice: the cuts as keys, the race
    in `shard_candidates`."""
    B = logits.shape[0]

    def per_row(v, dtype):
        return torch.as_tensor(v, device=logits.device).to(dtype).expand(B).contiguous()

    temperature, top_p, min_p = (per_row(v, torch.float32) for v in (temperature, top_p, min_p))
    top_k, seed, step = (per_row(v, torch.int64) for v in (top_k, seed, step))
    sampled = temperature > 0
    x = logits.float() + 0.0  # [B, Vl] the kernel's values (-0.0 as +0.0)
    finite = x.isfinite()
    m = all_reduce(torch.where(x.isnan(), float("-inf"), x).amax(-1), "world", "max")  # [B] the row's max
    c = torch.where(sampled, LOG2E / temperature.clamp(min=1e-30), LOG2E)  # fp32, as the kernel's
    mass = torch.where(finite, torch.exp2((x.double() - m.double()[:, None]) * c.double()[:, None]), 0.0)
    keys = ordered_keys(torch.where(finite, x, 0.0))  # [B, Vl]; non-finite x weigh nothing below
    ordered = keys.sort(-1)
    kth = global_cut(keys, finite.double(), top_k.clamp(min=1).double(), ordered)  # fewer than k finite above
    cut = torch.where(top_k > 0, kth, 0.0)  # k >= the finite tokens: cut 0, every finite token kept
    kept = torch.where(keys >= cut[:, None], mass, 0.0)
    target = top_p.double() * all_reduce(kept.sum(-1), "world")  # top_p of the top-k set's mass
    cut = torch.where(top_p < 1, torch.maximum(cut, global_cut(keys, kept, target, ordered)), cut)
    race = (m, temperature, (cut - 2**31).long().int(), torch.where(sampled, min_p.clamp(max=1), 0.0), seed, step)
    mine = triton_sampling().shard_candidates(logits, start, race)
    return choose(all_gather(mine, "world"), sampled)


def triton_sampling():
    from kernels.sampling import triton as fused  # not at import: the torch path runs without Triton

    return fused
