"""PyTorch sampler with the semantics of the Triton one: the `host` runner's sampler and the tests' oracle.

Semantics (per row b; parameters are [B] tensors, scalars broadcast):
- temperature <= 0: greedy, argmax with the lowest index on ties.
- otherwise p = softmax(logits / temperature), then each filter keeps the tokens at or above a threshold
  (ties at a cut are all kept): top-k (k <= 0 or k >= V: off) keeps p >= the k-th largest p; top-p (>= 1: off)
  keeps the smallest set of highest tokens whose mass, renormalised after top-k, reaches top_p; min-p (0: off,
  clamped to <= 1) keeps p >= min_p * max(p). One token is drawn from the kept set in proportion to p by an
  exponential race: argmax p_i / E_i with E_i = -log(U_i), U_i uniform from (seed, step, token index) -- not
  the row, so equal inputs give equal tokens at any batch position, and nothing depends on a global generator.
- a row with a NaN logit, or with every logit -inf, gives INVALID_TOKEN (-1), never a real token id;
  an +inf logit wins (the lowest such index, also when sampling); a -inf logit is never drawn.

Randomness: this version hashes (seed, step, token index) with a 32-bit integer mixer; the Triton kernel
uses Philox, whose bits this one does not reproduce. The two agree exactly on greedy and in distribution
otherwise. This one computes in float64, the kernel in float32: a cut that falls within float32 rounding of
a token can differ, nothing else.
"""

import torch

INVALID_TOKEN = -1


def uniform_noise(seed: torch.Tensor, step: torch.Tensor, vocab: int, start: int = 0) -> torch.Tensor:
    """U in (0, 1) per (row, token), a stateless hash of (seed, step, token index) -> [B, vocab] fp64 for the
    tokens start .. start + vocab - 1 (a vocab-parallel rank's slice draws what one process draws there)."""
    idx = torch.arange(start, start + vocab, device=seed.device, dtype=torch.int64)[None, :]
    mask = 0xFFFFFFFF
    h = (seed[:, None] * 0x9E3779B1 + step[:, None] * 0x85EBCA77 + idx * 0xC2B2AE3D) & mask
    for mult in (0x7FEB352D, 0x846CA68B):  # two rounds of a 32-bit integer mixer
        h = ((h ^ (h >> 16)) * mult) & mask
    h = h ^ (h >> 16)
    return (h.double() + 0.5) / 4294967296.0


def filter_probs(probs: torch.Tensor, top_k, top_p, min_p) -> torch.Tensor:
    """Keep mask [B, V] of the top-k, then top-p, then min-p filters (ties at each cut kept)."""
    B, V = probs.shape
    keep = probs > 0
    sorted_p = probs.sort(dim=-1, descending=True).values
    k = top_k.long().clamp(max=V)
    kth = sorted_p.gather(1, (k - 1).clamp(min=0)[:, None])
    keep &= torch.where(k[:, None] > 0, probs >= kth, True)
    masked = torch.where(keep, probs, 0)
    renorm = masked / masked.sum(-1, keepdim=True)
    sorted_r = renorm.sort(dim=-1, descending=True).values
    before = sorted_r.cumsum(-1) - sorted_r  # mass strictly above each sorted position
    n = (before < top_p[:, None]).sum(-1).clamp(min=1)  # smallest prefix reaching top_p
    cut = sorted_r.gather(1, (n - 1)[:, None])
    keep &= torch.where(top_p[:, None] < 1, renorm >= cut, True)
    keep &= probs >= min_p[:, None] * probs.max(-1, keepdim=True).values
    return keep


def prepare(logits, temperature, top_k, top_p, min_p, seed, step) -> tuple:
    """The sampler's inputs as it computes with them -> (fp64 logits, logits / temperature (greedy rows: / 1),
    temperature, top_k, top_p, min_p (at most 1), seed, step as [B] tensors: scalars broadcast)."""
    B = logits.shape[0]

    def per_row(x, dtype):
        return torch.as_tensor(x, device=logits.device).to(dtype).expand(B)

    temperature, top_p, min_p = (per_row(x, torch.float64) for x in (temperature, top_p, min_p))
    top_k, seed, step = (per_row(x, torch.int64) for x in (top_k, seed, step))
    logits = logits.double()
    scaled = logits / torch.where(temperature > 0, temperature, 1.0)[:, None]
    return logits, scaled, temperature, top_k, top_p, min_p.clamp(max=1), seed, step


def sample(logits, temperature, top_k, top_p, min_p, seed, step) -> torch.Tensor:
    """logits [B, V] -> int64 [B]; parameters are [B] tensors (scalars broadcast)."""
    V = logits.shape[1]
    logits, scaled, temperature, top_k, top_p, min_p, seed, step = prepare(
        logits, temperature, top_k, top_p, min_p, seed, step
    )
    probs = torch.softmax(scaled, dim=-1)
    keep = filter_probs(probs, top_k, top_p, min_p)
    race = torch.where(keep, probs / -uniform_noise(seed, step, V).log(), -1.0)
    return with_special_rows(logits, torch.where(temperature > 0, race.argmax(-1), logits.argmax(-1)))


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """sample() when every row has temperature 0, without the filters (which sort the vocabulary twice)."""
    logits = logits.double()
    return with_special_rows(logits, logits.argmax(-1))


def with_special_rows(logits: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """A +inf logit wins (lowest such index); a row with a NaN, or with only -inf, is INVALID_TOKEN."""
    pos_inf = logits == float("inf")
    token = torch.where(pos_inf.any(-1), pos_inf.int().argmax(-1), token)
    invalid = logits.isnan().any(-1) | (logits == float("-inf")).all(-1)
    return torch.where(invalid, INVALID_TOKEN, token)
