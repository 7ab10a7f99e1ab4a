"""Fused norms (Triton) vs the model's torch path at 35B-A3B dims, bf16: decode (M = 1..64 rows) and
prefill (M = 4096) sizes.

add_rms_norm: residual add + zero-centred RMSNorm over hidden 2048 (reads x and residual, writes both
outputs). gated_rms_norm: DeltaNet's 32 value heads of 128 with the silu(z) gate (q/k norm + RoPE now runs
inside the attention kernels: experiments/bench_attention.py times the whole layer). Each call is timed
inside one CUDA graph of many calls on rotated inputs (launch overhead excluded, as in the captured decode
step); GB/s counts the bytes each op must read and write. The copy ceiling is measured in the same run.

    PYTHONPATH=. python experiments/bench_norm.py [--out results/bench_norm.json]
"""

import argparse
import json
import time
from pathlib import Path

import torch
from benchlib import L2_FLUSH_BYTES, copy_bandwidth_gbs, print_targets, target, time_calls

from kernels.norm import naive as norm_naive
from kernels.norm import triton as norm_tri
from qmoe.metrics.measure import environment

HIDDEN, HV, DV, EPS = 2048, 32, 128, 1e-6


def make_cases(M: int, device: str, dtype) -> dict:
    """op -> (bytes moved per call, make_inputs(), torch fn, triton fn)."""
    randn = lambda *shape: torch.randn(*shape, device=device, dtype=dtype)
    w_hidden, w_gate = 0.1 * randn(HIDDEN), 1 + 0.1 * randn(DV)
    size = dtype.itemsize
    return {
        "add_rms_norm": (
            4 * M * HIDDEN * size,
            lambda: (randn(M, 1, HIDDEN), randn(M, 1, HIDDEN)),
            lambda x, r: norm_naive.add_rms_norm(x, r, w_hidden, EPS),
            lambda x, r: norm_tri.add_rms_norm(x, r, w_hidden, EPS),
        ),
        "gated_rms_norm": (
            3 * M * HV * DV * size,
            lambda: (randn(M, 1, HV, DV), randn(M, 1, HV, DV)),
            lambda x, z: norm_naive.gated_rms_norm(x, z, w_gate, EPS),
            lambda x, z: norm_tri.gated_rms_norm(x, z, w_gate, EPS),
        ),
    }


def bench(op: str, M: int, device: str, dtype) -> dict:
    nbytes, make_inputs, torch_fn, triton_fn = make_cases(M, device, dtype)[op]
    copies = min(64, max(2, -(-L2_FLUSH_BYTES // nbytes))) if device == "cuda" else 2
    inputs = [make_inputs() for _ in range(copies)]
    row = {"op": op, "M": M, "bytes": nbytes, "rotated_inputs": copies}
    for name, fn in (("triton", triton_fn), ("torch", torch_fn)):
        us, method = time_calls(lambda i, fn=fn: fn(*inputs[i]), copies, device)
        row[f"{name}_us"], row[f"{name}_gbs"], row[f"{name}_timing"] = us, nbytes / us / 1e3, method
    row["speedup_vs_torch"] = row["torch_us"] / row["triton_us"]
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/bench_norm.json")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on CPU (checks the script only)")
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda"
    dtype = torch.float32 if args.smoke else torch.bfloat16
    sizes = [1, 4] if args.smoke else [1, 8, 64, 4096]
    t0 = time.time()
    copy_gbs = copy_bandwidth_gbs(device)
    rows = [bench(op, M, device, dtype) for op in ("add_rms_norm", "gated_rms_norm") for M in sizes]

    # Targets: at prefill size the fused ops stream at >= 70% of the copy ceiling; at decode sizes they are
    # latency-bound: one launch, <= 4 us inside a graph, and never slower than the torch path.
    targets = []
    for r in rows:
        what = f"{r['op']} M={r['M']}"
        if r["M"] == sizes[-1]:
            targets.append(target(f"{what} GB/s", r["triton_gbs"], 0.7 * copy_gbs, at_most=False))
        else:
            targets.append(target(f"{what} us", r["triton_us"], 4.0, at_most=True))
        targets.append(target(f"{what} speedup vs torch", r["speedup_vs_torch"], 1.0, at_most=False))

    result = {
        **environment(torch.device(device)),
        "benchmark": "norm",
        "dims": {"hidden": HIDDEN,
                 "value_heads": HV, "value_head_dim": DV, "dtype": str(dtype)},
        "ceilings": {"copy_gbs": copy_gbs},
        "rows": rows,
        "targets": targets,
        "seconds": time.time() - t0,
    }  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))

    print(f"copy ceiling {copy_gbs:.0f} GB/s")
    print(f"{'op':>15} {'M':>5} {'triton us':>10} {'GB/s':>7} {'torch us':>9} {'GB/s':>7} {'speedup':>8}")
    for r in rows:
        cols = f"{r['triton_us']:>10.2f} {r['triton_gbs']:>7.0f} {r['torch_us']:>9.2f} {r['torch_gbs']:>7.0f}"
        print(f"{r['op']:>15} {r['M']:>5} {cols} {r['speedup_vs_torch']:>7.1f}x")
    print_targets(targets)
    print(f"-> {args.out} ({result['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
