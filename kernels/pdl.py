"""Programmatic Dependent Launch (sm_90+) for the decode kernels.

A decode step is ~330 small kernels back to back. Without PDL each one is scheduled, and issues its first loads,
only after the previous kernel's last program has finished. With it, a kernel launched with `launch_pdl=pdl(x)`
and compiled with `PDL=pdl(x)`:
  1. calls `allow_dependents(PDL)` first: the next kernel in the stream may then be scheduled as soon as every
     program of this one has started (never before, so it cannot starve this kernel of SMs);
  2. may load what no kernel writes (weights) before `wait_for_producers(PDL)`;
  3. calls `wait_for_producers(PDL)`, in every program, before it reads anything an earlier kernel wrote and before
     it writes anything (its outputs may reuse memory an earlier kernel still reads). The wait returns once the
     previous kernel has completed and its writes are visible. Since every PDL kernel completes only after its
     wait, completion stays ordered along the whole stream, exactly as without PDL.
Kernels that are not launched with PDL (torch's, cuBLAS, the prefill kernels) start after the previous kernel ends,
as always. CUDA graphs capture the programmatic edges. Off on the CPU interpreter, before sm_90, and with QMOE_PDL=0
(read per call, so one process can time both).
"""

import functools
import os

import torch
import triton
import triton.language as tl

__all__ = ["pdl", "allow_dependents", "wait_for_producers"]


@functools.cache
def _device_supports(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


# Triton reads TRITON_INTERPRET when a kernel is defined, so at import; QMOE_PDL is read per call
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# os.environ.get costs ~0.5 µs a call (a str -> bytes encode, a KeyError when unset; ~1 µs on the H200 host) in
# every op's Python. On POSIX os.environ is a view of this bytes dict, which each of its writes updates.
_ENVIRON = os.environ._data


def pdl(t: torch.Tensor) -> bool:
    """Whether kernels working on tensor `t` launch with PDL (pass as both `PDL=` and `launch_pdl=`)."""
    if not t.is_cuda or _INTERPRET or _ENVIRON.get(b"QMOE_PDL") == b"0":
        return False
    return _device_supports(t.get_device())


@triton.jit
def allow_dependents(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def wait_for_producers(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
