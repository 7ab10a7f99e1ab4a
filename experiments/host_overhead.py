"""Where an eager Triton op call's host time goes (35B-A3B decode shapes, M = 1, bf16): the whole op as the model
calls it, then its pieces -- the wrapper's Python before the launch, the PDL switch, one output allocation, the
Triton launch of the already-compiled kernel through `kernel[grid](...)`, and the compiled kernel's own launcher
given tensors and given their data pointers (ints, as the fast path passes them).
`kernel[grid](...)` is kernels/launch.py's fast path when enabled; Triton's own launch is timed beside it.
Host-bound loops of 2,000 calls (benchlib.host_us_per_call), wall clock per call after a warm-up (the GPU work is
a few µs per call, so the host is the bound); each piece alone, so the sum need not equal the whole.

    PYTHONPATH=. python experiments/host_overhead.py [--out results/host_overhead.json]
"""

import argparse
import time

import torch
from benchlib import HOST_CALLS, write_json
from benchlib import host_us_per_call as per_call_us

from kernels.linear import triton as linear_triton
from kernels.moe import triton as moe_triton
from kernels.pdl import pdl


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/host_overhead.json")
    args = parser.parse_args()
    t0 = time.time()
    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(1, 2048, device=dev, dtype=dt)
    w = torch.randn(2048, 4096, device=dev, dtype=dt)  # out_proj: N = 2048, K = 4096
    h = torch.randn(1, 4096, device=dev, dtype=dt)
    out = torch.empty(1, 2048, device=dev, dtype=dt)
    grid, split, k_per_split, meta = linear_triton.cached_plan(1, 2048, 4096, dt, h.device)
    on = pdl(h)
    assert not meta.get("PERSISTENT"), "out_proj's table entry is expected on _linear_kernel"
    # _linear_kernel's arguments in order, as linear_into passes them (no scales, no norm, no fp8 x)
    launch_args = (h, w, out, w, 1, 2048, 4096, h.stride(0), w.stride(0), 0, k_per_split, split,
                   h, h, h, h, h.stride(0), 0.0, w, 0)  # fmt: skip
    flags = dict(NORM=False, PDL=on, ROUND_X=False)  # the constexprs that are not in the plan's meta
    assert len(launch_args) == len([n for n in linear_triton._linear_kernel.arg_names if n not in meta]) - len(flags)
    compiled = linear_triton._linear_kernel[grid](*launch_args, **flags, launch_pdl=on, **meta)
    rows = {
        "linear (the op, eager)": per_call_us(lambda: linear_triton.linear(h, w)),
        "linear_into (preallocated out)": per_call_us(lambda: linear_triton.linear_into(h, w, out)),
        "cached_plan lookup": per_call_us(lambda: linear_triton.cached_plan(1, 2048, 4096, dt, h.device)),
        "pdl(x) switch": per_call_us(lambda: pdl(h)),
        "torch.empty(1, 2048)": per_call_us(lambda: torch.empty((1, 2048), dtype=dt, device=dev)),
        "kernel[grid](...) launch": per_call_us(
            lambda: linear_triton._linear_kernel[grid](*launch_args, **flags, launch_pdl=on, **meta)
        ),
    }
    triton_launch = getattr(linear_triton._linear_kernel, "fn", None)  # kernels/launch.py: Triton's own launch
    if triton_launch is not None:
        rows["Triton's own launch (no fast path)"] = per_call_us(
            lambda: triton_launch[grid](*launch_args, **flags, launch_pdl=on, **meta)
        )
    names = linear_triton._linear_kernel.arg_names  # every argument in order, constexprs included
    values = dict(zip(names, launch_args)) | dict(meta, **flags)
    try:
        ordered = [values[n] for n in names]
        grid3 = (*grid, 1, 1)[:3]  # the compiled launcher reads grid[0], grid[1], grid[2]
        rows["compiled kernel launcher"] = per_call_us(lambda: compiled[grid3](*ordered))
        pointers = [v.data_ptr() if isinstance(v, torch.Tensor) else v for v in ordered]  # as the fast path passes
        rows["compiled kernel launcher, tensors as pointers"] = per_call_us(lambda: compiled[grid3](*pointers))
    except Exception as e:  # noqa: BLE001 - the launcher's calling convention differs between Triton versions
        print(f"compiled kernel launcher: {type(e).__name__}: {e}")
    E, H, I, IS = 256, 2048, 512, 512
    w13 = torch.randn(E, 2 * I, H, device=dev, dtype=dt) / H**0.5
    w2 = torch.randn(E, H, I, device=dev, dtype=dt) / I**0.5
    sd = torch.randn(H, IS, device=dev, dtype=dt)
    proj = torch.randn(1, E + 2 * IS + 1, device=dev, dtype=dt)
    rows["moe_block (the op, eager)"] = per_call_us(lambda: moe_triton.moe_block(x, proj, w13, w2, sd, 8))
    rows["torch.add (one aten op, reference)"] = per_call_us(lambda: torch.add(x, x))
    write_json(args.out, "host_overhead", "cuda", us_per_call=rows, calls=HOST_CALLS, seconds=time.time() - t0)
    for name, us in rows.items():
        print(f"{name:<40} {us:8.1f} us")


if __name__ == "__main__":
    main()
