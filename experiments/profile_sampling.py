"""Where the fused sampler's time goes, per launch: top-k 50 + top-p 0.9 over bench_sampling's shapes at B = 1 and
256 (V = 248,320, fp32), one call profiled after a warm-up (torch.profiler, eager), the CUDA time of each kernel.
Launches: `_stats_kernel`, `_tiles_kernel` (rows from tiles, where `tiles_pay_off`), `_gather_count_kernel` (its
last item finishes the rows whose list holds the cut), `_resolve_kernel` (gather, radix rounds and race: one
launch that waits inside for batches whose grid fits on the GPU, else one grid with barriers between steps).

    PYTHONPATH=. python experiments/profile_sampling.py [--out results/profile_sampling.json]
"""

import argparse
import time
from collections import defaultdict

import torch
from bench_sampling import VOCAB, make_logits
from benchlib import write_json

from kernels.sampling import triton as fused
from qmoe.runtime.generate import sampling_tensors
from qmoe.settings import SamplingSettings

SHAPES = ("llm", "flat", "peaked", "ties", "zipf", "masked")
TARGET = SamplingSettings(temperature=1.0, top_k=50, top_p=0.9, min_p=0.0, seed=0)  # bench_sampling's target mode


def profile_call(logits, params) -> dict:
    """{kernel name: (launches, total µs)} of one sample() call."""
    fused.sample(logits, *params)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fused.sample(logits, *params)
        torch.cuda.synchronize()
    kernels = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name][0] += 1
            kernels[e.name][1] += e.device_time
    return {k: tuple(v) for k, v in kernels.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/profile_sampling.json")
    args = parser.parse_args()
    t0 = time.time()
    rows = []
    for B in (1, 256):
        for shape in SHAPES:
            logits = make_logits(B, VOCAB, shape, torch.float32, "cuda", seed=0)
            step = torch.zeros(B, dtype=torch.long, device="cuda")
            params = (*sampling_tensors(TARGET, B, "cuda").values(), step)
            kernels = profile_call(logits, params)
            total = sum(us for _, us in kernels.values())
            rows.append({"B": B, "shape": shape, "total_us": total, "kernels": kernels})
            top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:4]
            heaviest = "  ".join(f"{k[:22]} x{n} {us:.0f}" for k, (n, us) in top)
            print(f"B={B:<4} {shape:<8} {total:>9.1f} us  {heaviest}")
    write_json(args.out, "profile_sampling", "cuda", rows=rows, seconds=time.time() - t0)


if __name__ == "__main__":
    main()
