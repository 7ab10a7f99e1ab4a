"""Time the FP8 x FP8 prefill of the dense projections (kernels/linear/triton.py, M > 64 with fp8 weights): the
activation pre-pass (kernels/fp8.quantize_activations) and a small list of GEMM tiles (X_FP8, BLOCK_K = 128) at the
35B-A3B prefill shapes (M = 4096 tokens; N, K: every dense projection of ModelConfig.decode_projections() but
lm_head), against bf16 cuBLAS (torch.matmul) of the same shape. Each call is timed as one CUDA graph over input
copies rotated past L2 (benchlib.time_calls). Every candidate's output is checked against fp32 on the quantized
activations. Prints a table per shape (pre-pass, each tile, the whole default path, cuBLAS) and writes JSON.

    python experiments/tune_fp8_prefill.py [--out results/tune_fp8_prefill.json] [--m 4096]
    python experiments/tune_fp8_prefill.py --smoke --out /tmp/tune_fp8_prefill.json   (CPU interpreter, tiny)
"""

import argparse
import itertools
import math
import os
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # --smoke on a CPU-only machine (before triton is imported)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_gemv import MODELS, model_config, rel_err  # noqa: E402
from benchlib import L2_FLUSH_BYTES, time_calls, write_json  # noqa: E402

from kernels.fp8 import dequantize, quantize_activations, quantize_rows  # noqa: E402
from kernels.linear import triton as lin  # noqa: E402

# BLOCK_M x BLOCK_N x warps x stages (BLOCK_K = 128); sm_90 compiles (aot_sm90.py): 64x128/4 and 64x256/8 fit in
# registers, 128x128/8 spills 32 B, 128x128/4 and 64x256/4 a few hundred
CANDIDATES = [
    dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, SPLIT_K=1, num_warps=w, num_stages=s)
    for bm, bn, w, s in itertools.product((64, 128), (128, 256), (4, 8), (3, 4))
]
SMOKE_CANDIDATES = [CANDIDATES[0], CANDIDATES[5]]
SMOKE_SHAPES = {"smoke a": (70, 300), "smoke b": (40, 256)}
SHARED_MEMORY_BYTES = 227 * 1024
TOL = 0.02  # against fp32 on the same quantized activations: accumulation order and the bf16 output only


def tag(cfg: dict) -> str:
    return f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']} w{cfg['num_warps']} s{cfg['num_stages']}"


def run_shape(name, N, K, M, device, candidates, smoke, gen) -> dict:
    """Pre-pass, tiles, the default path and cuBLAS at one (M, N, K) -> the JSON row (and its printed table)."""
    dtype = torch.bfloat16
    x0 = torch.randn(M, K, device=device, dtype=dtype, generator=gen)
    w0 = torch.randn(N, K, device=device, generator=gen) * K**-0.5
    q0, s0 = quantize_rows(w0)
    per_copy = M * K * 3 + N * K * 3  # bf16 x + fp8 x, fp8 w + bf16 w (cuBLAS)
    n = 2 if smoke else max(2, min(16, math.ceil(L2_FLUSH_BYTES / per_copy)))
    xs = [x0] + [x0.clone() for _ in range(n - 1)]
    ws = [(q0, s0)] + [(q0.clone(), s0.clone()) for _ in range(n - 1)]
    wb = [dequantize(q, s, dtype) for q, s in ws]
    xq = [quantize_activations(x) for x in xs]
    out = torch.empty(M, N, device=device, dtype=dtype)
    ref = dequantize(*xq[0], torch.float32) @ dequantize(q0, s0).T
    row = {"name": name, "M": M, "N": N, "K": K, "copies": n}
    row["prepass_us"], _ = time_calls(lambda i: quantize_activations(xs[i]), n, device)
    row["cublas_bf16_us"], _ = time_calls(lambda i: torch.matmul(xs[i], wb[i].t(), out=out), n, device)
    row["default_path_us"], _ = time_calls(lambda i: lin.linear(xs[i], *ws[i]), n, device)
    row["default_tile"] = tag(lin.FP8_PREFILL_CONFIG)
    row["tiles"] = {}
    for cfg in candidates:
        try:
            lin.linear_into(xq[0][0], q0, out, config=cfg, scale=s0, x_scale=xq[0][1])
            err = rel_err(out, ref)
            call = lambda i: lin.linear_into(xq[i][0], ws[i][0], out, config=cfg, scale=ws[i][1], x_scale=xq[i][1])  # noqa: B023
            us = time_calls(call, n, device)[0] if err < TOL else float("inf")
            row["tiles"][tag(cfg)] = {"us": us, "rel_err": err, "config": cfg}
        except Exception as e:  # noqa: BLE001 - a tile that fails to compile or run is reported, not fatal
            row["tiles"][tag(cfg)] = {"us": float("inf"), "error": f"{type(e).__name__}: {e}"[:200], "config": cfg}
    best = min(row["tiles"], key=lambda t: row["tiles"][t]["us"])
    row["best_tile"], row["best_us"] = best, row["tiles"][best]["us"]
    flops = 2 * M * N * K
    print(f"\n{name}: M {M} N {N} K {K} ({n} input copies)")
    print(f"  {'pre-pass':<20} {row['prepass_us']:9.1f} us")
    for t, r in sorted(row["tiles"].items(), key=lambda kv: kv[1]["us"]):
        tf = flops / r["us"] / 1e6 if math.isfinite(r["us"]) else 0.0
        print(f"  {t:<20} {r['us']:9.1f} us  {tf:7.1f} TFLOP/s  rel_err {r.get('rel_err', float('nan')):.2e}")
    print(f"  {'default path':<20} {row['default_path_us']:9.1f} us  (pre-pass + {row['default_tile']})")
    print(f"  {'cuBLAS bf16':<20} {row['cublas_bf16_us']:9.1f} us  {flops / row['cublas_bf16_us'] / 1e6:7.1f} TFLOP/s")
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/tune_fp8_prefill.json")
    parser.add_argument("--m", type=int, default=4096, help="tokens (rows)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU interpreter (checks the script)")
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda"
    M = 80 if args.smoke else args.m
    if args.smoke:
        shapes, candidates = SMOKE_SHAPES, SMOKE_CANDIDATES
    else:
        cfg35 = model_config(MODELS["35B"])
        shapes = {k: v for k, v in cfg35.decode_projections().items() if k != "lm_head"}
        candidates = [
            c for c in CANDIDATES if (c["BLOCK_M"] + c["BLOCK_N"]) * 128 * c["num_stages"] <= SHARED_MEMORY_BYTES
        ]
    gen = torch.Generator(device=device).manual_seed(0)
    rows, t0 = [], time.time()
    for name, (N, K) in shapes.items():
        rows.append(run_shape(name, N, K, M, device, candidates, args.smoke, gen))
    print(f"\n{'shape':<12} {'pre-pass':>9} {'best tile':>18} {'best':>9} {'default':>9} {'cuBLAS':>9}  (us)")
    for r in rows:
        print(f"{r['name']:<12} {r['prepass_us']:9.1f} {r['best_tile']:>18} {r['best_us']:9.1f} "
              f"{r['default_path_us']:9.1f} {r['cublas_bf16_us']:9.1f}")  # fmt: skip
    gpu = "cpu (interpreter)" if args.smoke else torch.cuda.get_device_name()
    write_json(args.out, "tune_fp8_prefill", device, gpu=gpu, tokens=M, shapes=rows, seconds=time.time() - t0)
    print(f"\nwrote {args.out} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
