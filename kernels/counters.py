"""Persistent int32 buffers through which programs coordinate: the arrival counters of the kernels whose last
program to arrive finishes the work (no program ever waits), and the records one kernel publishes for the next."""

import torch


class ArrivalCounters:
    """`counters(n, device)` -> int32 [n]: one buffer per (device, n), zero between calls, never freed.
    Invariants (each user's tests check the first two):
    - zero between calls: the program that arrives last resets its counter, so no launch clears them;
    - never freed or reallocated: a CUDA graph captured at one size keeps a valid pointer after calls at another,
      so the first call at a size (it allocates) must come before any capture, like Triton's compile;
    - launches that share a buffer (same device and size) are stream-ordered: two streams running decode steps of
      the same shape at once would race on the counters (this process runs one decode loop at a time)."""

    def __init__(self):
        self.buffers: dict[tuple[torch.device, int], torch.Tensor] = {}

    def __call__(self, n: int, device: torch.device) -> torch.Tensor:
        buf = self.buffers.get((device, n))
        if buf is None:
            assert device.type != "cuda" or not torch.cuda.is_current_stream_capturing(), "warm up before capture"
            buf = self.buffers[(device, n)] = torch.zeros(n, dtype=torch.int32, device=device)
        return buf


class Handoffs(ArrivalCounters):
    """`handoffs(n, device)` -> int32 [n]: one record per (device, n), zero when made, never freed (as
    ArrivalCounters, whose second and third invariants hold), written by one kernel for a later one to read early:
    word 0 a tag naming the writer, the rest its payload. A reader that sees its tag may start work on the payload
    before its PDL wait but must check that work against the real input after the wait: a record is a hint that
    can be another call's (the same tag one call earlier, or a record read before it was overwritten)."""
