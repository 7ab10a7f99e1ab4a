"""L2 prefetch of the next kernel's weights (sm_90+), from a kernel that leaves HBM idle.

A decode step alternates kernels that stream weights (the projections, the experts) with kernels that wait on
latency (DeltaNet's recurrence, attention over the cache, the MoE up kernel's routing). While a latency-bound
kernel runs, HBM has bandwidth to spare; the projection that follows it then starts by waiting for its first bytes.
`l2_prefetch` lets the earlier kernel issue the later one's weights to L2 with one `cp.async.bulk.prefetch.L2`
per thread (asynchronous: no registers, no completion to wait for), so the later kernel reads them from L2:
  - DeltaNet decode -> its out_proj (16.8 MB at 35B), attention decode -> its o_proj (16.8 MB),
  - the MoE up kernel -> the down rows of the experts it has just routed to (8 x 2 MB).
A prefetch is a hint: it changes no value, only where the bytes come from. Off on the CPU interpreter, before sm_90
(with PDL: `pdl()`), and with QMOE_L2_PREFETCH=0; QMOE_L2_PREFETCH=gdn,attention,moe keeps only the sites named
(read per call, so one process can time each: experiments/tune_decode_loop.py).
"""

import os

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl

__all__ = ["prefetch_on", "prefetch_args", "l2_prefetch"]

CHUNKS = tl.constexpr(128)  # bulk prefetches per program: one per thread of a 4-warp program
ALIGN = tl.constexpr(16)  # the instruction's address and size granularity


def prefetch_on(like: torch.Tensor, site: str) -> bool:
    """Whether the kernel at `site` (gdn, attention, moe) working on `like` prefetches (pass as PREFETCH=)."""
    if not pdl(like):
        return False
    sites = os.environ.get("QMOE_L2_PREFETCH", "1")
    return sites == "1" or site in sites.split(",")


def prefetch_args(weight: torch.Tensor | None, like: torch.Tensor, site: str) -> tuple[torch.Tensor, int, bool]:
    """(pointer, bytes, PREFETCH) for the kernel at `site` working on `like` that may prefetch `weight` into L2.
    Without a weight, or where prefetching is off, the pointer is `like` (never read) and PREFETCH is False."""
    if weight is None or not prefetch_on(like, site) or weight.data_ptr() % 16 or not weight.is_contiguous():
        return like, 0, False
    return weight, weight.numel() * weight.element_size(), True


@triton.jit
def l2_prefetch(ptr, nbytes, part, parts, PREFETCH: tl.constexpr):
    """Start pulling program `part` of `parts`'s share of bytes [0, nbytes) at ptr (16-byte aligned) into L2 and
    return at once: the bytes are cut into parts * CHUNKS chunks of a multiple of 16 B, chunk i of this program
    is prefetched by one instruction (a tail under 16 B is left out)."""
    if PREFETCH:
        chunk = tl.cdiv(tl.cdiv(nbytes, parts * CHUNKS), ALIGN) * ALIGN
        start = (part * CHUNKS + tl.arange(0, CHUNKS)).to(tl.int64) * chunk
        size = (tl.minimum(tl.maximum(nbytes - start, 0), chunk) // ALIGN * ALIGN).to(tl.int32)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r",
            [ptr.to(tl.pointer_type(tl.int8)) + start, size],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
