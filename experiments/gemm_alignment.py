"""cuBLAS at the 35B MoE in-projection's prefill shape (M = 4096 tokens, K = 2048, N = 1281 = router 256 | shared
gate 512 | shared up 512 | gate logit 1), bf16: which layout of the odd N gets cuBLAS's sm90 kernels.

Rows: the product as the model ran it (N = 1281, contiguous output); into rows padded to 16 bytes; the first
1280 rows alone; a weight padded to 1288 rows; and 1280 rows + the last row as a second product, both into
padded rows. CUDA-event median of 20 calls each, kernel names from the profiler.

    PYTHONPATH=. python experiments/gemm_alignment.py [--out results/gemm_alignment.json]
"""

import argparse

import torch
from benchlib import event_median_us, write_json
from torch.profiler import ProfilerActivity, profile

from kernels.linear import triton as linear_triton

TRITON_TILES = [(128, 128, 64, 8, 3), (128, 128, 64, 4, 3), (128, 256, 64, 8, 3), (64, 128, 64, 4, 4),
                (128, 64, 64, 4, 4), (256, 128, 64, 8, 3)]  # fmt: skip


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/gemm_alignment.json")
    args = parser.parse_args()
    M, K, N = 4096, 2048, 1281
    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(M, K, device=dev, dtype=dt)
    fused = torch.randn(N, K, device=dev, dtype=dt) / K**0.5
    padded_w = torch.zeros(1288, K, device=dev, dtype=dt)
    padded_w[:N] = fused
    out_pad = torch.empty(M, 1288, device=dev, dtype=dt)
    out_c = torch.empty(M, N, device=dev, dtype=dt)
    ref = x.float() @ fused.float().t()

    def split():
        torch.mm(x, fused[:1280].t(), out=out_pad[:, :1280])
        torch.mm(x, fused[1280:].t(), out=out_pad[:, 1280:N])
        return out_pad[:, :N]

    cases = {
        "N 1281, contiguous output (as run)": lambda: torch.mm(x, fused.t()),
        "N 1281 into rows padded to 1288": lambda: torch.mm(x, fused.t(), out=out_pad[:, :N]),
        "N 1280 (rows 0..1279 only)": lambda: torch.mm(x, fused[:1280].t()),
        "weight padded to 1288 rows": lambda: torch.mm(x, padded_w.t(), out=out_pad)[:, :N],
        "1280 rows + 1 row, padded output": split,
        "F.linear N 1281": lambda: torch.nn.functional.linear(x, fused),
        "qmoe linear (M > 64: cuBLAS)": lambda: linear_triton.linear(x, fused),
        "cuBLAS 1280 rows into contiguous out [:, :1280]": lambda: torch.mm(x, fused[:1280].t(), out=out_c[:, :1280]),
    }
    for bm, bn, bk, warps, stages in TRITON_TILES:  # qmoe's dot path (tl.dot tiles), contiguous output
        cfg = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=1, num_warps=warps, num_stages=stages)
        cases[f"Triton dot {bm}x{bn}x{bk} w{warps} s{stages}"] = lambda c=cfg: linear_triton.linear_into(
            x, fused, out_c, config=c
        )
    rows = {}
    for name, fn in cases.items():
        out = fn()
        n = out.shape[1]  # the 1280-row case: its columns only
        err = ((out.float() - ref[:, :n]).abs().max() / ref.abs().max()).item() if out is not None else None
        us = event_median_us(lambda f=fn: [f() for _ in range(20)], 5) / 20
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        kernels = sorted({e.name[:80] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})
        rows[name] = dict(us=us, tflops=2 * M * K * N / us / 1e6, rel_err=err, kernels=kernels)
        print(f"{name:<40} {us:8.1f} us {rows[name]['tflops']:6.0f} TFLOP/s  {kernels}", flush=True)
    write_json(args.out, "gemm_alignment", "cuda", shape=dict(M=M, K=K, N=N), rows=rows)


if __name__ == "__main__":
    main()
