"""Device buffers that outlive a launch: the arrival counters of kernels whose last program to arrive finishes the
work (no program ever waits), and the workspaces of ops whose launches pass partial results through memory."""

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


class Workspaces:
    """`workspace(shape, dtype, device)` -> one buffer per (shape, dtype, device), never freed, its contents left
    by the last call: scratch that an op's launches write before they read it (split partials, routing ids), so
    an eager decode call allocates only its result (each torch.empty is ~3.5 us of host time on the H200 host,
    results/host_overhead.json; a 35B eager step made ~170 for scratch). Invariants:
    - ArrivalCounters' last two: never freed (the first call at a shape comes before any capture) and
      stream-ordered use;
    - one instance per op, never shared between ops: two calls of one op have other launches between them, and
      its kernels touch the workspace only after their PDL wait (every earlier launch has completed by then);
    - written before read in every call: tests poison a workspace between calls, so a forgotten write shows."""

    def __init__(self):
        self.buffers: dict[tuple, torch.Tensor] = {}

    def __call__(self, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (shape, dtype, device)
        buf = self.buffers.get(key)
        if buf is None:
            assert device.type != "cuda" or not torch.cuda.is_current_stream_capturing(), "warm up before capture"
            buf = self.buffers[key] = torch.empty(shape, dtype=dtype, device=device)
        return buf
