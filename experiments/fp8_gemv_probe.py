"""Probe for the FP8 GEMV's next design (issue 16): is it the one memory round trip per 128-column step that holds
the production kernel (kernels/linear, SCALED, BLOCK_K <= 128) at 7-29 % of copy bandwidth?

The probe kernel streams U sub-steps of 128 columns per loop iteration, unrolled (tl.static_range), each with its
own [BLOCK_N] row scale: U independent weight loads are issued before the first is used, without the per-column
scale tiles that measured slower (5b06a0a). M = 1, 35B shapes, fp8 weights rotated past L2, CUDA-graph timing;
each variant is checked against fp32 on the dequantized weights first. Prints the table; JSON to
results/fp8_gemv_probe.json.

    PYTHONPATH=. python experiments/fp8_gemv_probe.py
"""

import time

import torch
import triton
import triton.language as tl
from benchlib import L2_FLUSH_BYTES, copy_bandwidth_gbs, time_calls, write_json

from kernels.fp8 import dequantize, quantize_rows
from kernels.linear import triton as lin

SHAPES = {"gdn_in": (12352, 2048), "gdn_out": (2048, 4096), "attn_qkv": (9216, 2048), "lm_head": (248320, 2048)}


@triton.jit
def _probe_kernel(x_ptr, w_ptr, s_ptr, out_ptr, N, K, KB, BLOCK_N: tl.constexpr, U: tl.constexpr):
    """out[n] = sum_k x[k] w[n, k] s[n, k // 128], U sub-steps of 128 columns per iteration (K % (128 U) == 0)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    c = tl.arange(0, 128)
    acc = tl.zeros((BLOCK_N, 128), tl.float32)
    for k in range(0, K, 128 * U):
        for u in tl.static_range(U):
            kk = k + u * 128
            w = tl.load(w_ptr + rows[:, None] * K + (kk + c)[None, :])
            x = tl.load(x_ptr + kk + c)
            s = tl.load(s_ptr + rows * KB + kk // 128)
            acc += (w.to(tl.float32) * x.to(tl.float32)[None, :]) * s[:, None]
    tl.store(out_ptr + offs_n, tl.sum(acc, 1).to(out_ptr.dtype.element_ty), mask=offs_n < N)


def probe(x, q, s, out, block_n, u):
    N, K = q.shape
    _probe_kernel[(triton.cdiv(N, block_n),)](x, q, s, out, N, K, s.shape[1], BLOCK_N=block_n, U=u, num_warps=4)
    return out


def measure_shape(name: str, N: int, K: int, copy: float) -> list[dict]:
    """Every variant on one projection shape: checked against fp32 on the dequantized weight, then timed."""
    w = torch.randn(N, K, device="cuda") / K**0.5
    q, s = quantize_rows(w)
    copies = max(2, -(-L2_FLUSH_BYTES // q.numel()))
    weights = [(q.clone(), s.clone()) for _ in range(copies)]
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    ref = (x.double() @ dequantize(q, s, torch.float64).T).float()
    out = torch.empty(1, N, device="cuda", dtype=torch.bfloat16)
    variants = {"production": lambda i: lin.linear(x, *weights[i % copies])}
    for bn in (4, 8, 16):
        for u in (4, 8, 16):
            if K % (128 * u) == 0:
                variants[f"probe BLOCK_N={bn} U={u}"] = lambda i, bn=bn, u=u: probe(x, *weights[i % copies], out, bn, u)
    nbytes, rows = q.numel() + s.numel() * 4, []
    for label, fn in variants.items():
        err = ((fn(0).float() - ref).abs().max() / ref.abs().max()).item()
        us, _ = time_calls(fn, copies, "cuda")
        gbs = nbytes / us / 1e3
        rows.append(dict(shape=name, N=N, K=K, variant=label, us=us, gbs=gbs, pct_copy=100 * gbs / copy, err=err))
        print(f"{name:<9} {label:<24} {us:8.2f} us {gbs:7.0f} GB/s {100 * gbs / copy:5.1f} % err {err:.1e}")
    return rows


def main():
    t0, rows = time.time(), []
    copy = copy_bandwidth_gbs("cuda")
    for name, (N, K) in SHAPES.items():
        rows += measure_shape(name, N, K, copy)
        write_json("results/fp8_gemv_probe.json", "fp8_gemv_probe", "cuda", copy_gbs=copy, rows=rows,
                   seconds=time.time() - t0)  # fmt: skip


if __name__ == "__main__":
    main()
