"""Probe for the FP8 GEMV's next design (issue 16). The production M = 1 kernel (kernels/linear, SCALED) converts
every fp8 weight to fp32 on the CUDA cores (cvt e4m3x2 -> f16x2, then f16 -> f32: 1.5 conversions per weight, and
an FMA) and reaches ~60 % of copy bandwidth on the fp8 bytes. Two probes of other designs:

- `probe BLOCK_N U`: U sub-steps of 128 columns per loop iteration, unrolled, each with its own row scale (the
  first round's question: one memory round trip per 128-column step).
- `mode ...` (the production tile, no PDL, one kernel with three bodies): `math` the production step's math (w and
  x to fp32, products summed per 128-column scale block, times the rows' scales); `loads` the same loads with next
  to no math (the weight bytes as int32 words, XOR-reduced): the speed of this loop structure if the math were
  free; `thread` each thread's 16 contiguous products summed in the thread (a chain of FMAs) times their block's
  scale, the cross-thread sums once after the loop. If `loads` is no faster than `math`, cheaper conversions or
  sums cannot help; if it is, they can.
- `mma BLOCK_N U stages`: the tensor cores do the multiply-add. x [1, K] is padded to [16, 128] tiles, U per
  step, and rounded to fp16; the weight tile [U, 128, BLOCK_N] converts e4m3 -> f16 exactly (one cvt per two
  weights); one batched tl.dot over the step's U scale blocks, each [16, BLOCK_N] product times the rows' scales;
  one wide load per step (U > 1) or loads pipelined by num_stages. fp16 activations are a numerics change (bf16's
  range is wider: |x| > 65504 would overflow), so this only probes the speed.

M = 1, 35B shapes, fp8 weights rotated past L2, CUDA-graph timing; each variant is checked against fp32 on the
dequantized weights first. Prints the table; JSON to results/fp8_gemv_probe.json.

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


@triton.jit
def _mma_kernel(x_ptr, w_ptr, s_ptr, out_ptr, N, K, KB, BLOCK_N: tl.constexpr, U: tl.constexpr):
    """out[n] = sum_k x[k] w[n, k] s[n, k // 128] on the tensor cores. A step loads U scale blocks of 128 columns
    as one [U, 128, BLOCK_N] tile and runs one batched fp16 dot [U, 16, 128] x [U, 128, BLOCK_N] (row 0 of each x
    tile is x, the others zero); each block's [16, BLOCK_N] product times its rows' scales (K % (128 U) == 0)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    u = tl.arange(0, U)
    c = tl.arange(0, 128)
    first = (tl.arange(0, 16) == 0)[None, :, None]  # [1, 16, 1]
    acc = tl.zeros((U, 16, BLOCK_N), tl.float32)
    for k in range(0, K, 128 * U):
        cols = k + u[:, None] * 128 + c[None, :]  # [U, 128]
        w = tl.load(w_ptr + rows[None, None, :] * K + cols[:, :, None])  # [U, 128, BLOCK_N]
        x = tl.load(x_ptr + cols).to(tl.float16)  # [U, 128]
        xt = tl.where(first, x[:, None, :], 0.0).to(tl.float16)  # [U, 16, 128]
        s = tl.load(s_ptr + rows[None, :] * KB + (k // 128 + u)[:, None])  # [U, BLOCK_N]
        acc += tl.dot(xt, w.to(tl.float16)) * s[:, None, :]
    out = tl.sum(tl.sum(tl.where(first, acc, 0.0), 1), 0)
    tl.store(out_ptr + offs_n, out.to(out_ptr.dtype.element_ty), mask=offs_n < N)


@triton.jit
def _mode_kernel(x_ptr, w_ptr, s_ptr, out_ptr, N, K, KB, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 MODE: tl.constexpr):  # fmt: skip
    """out[n] = sum_k x[k] w[n, k] s[n, k // 128] in BLOCK_K steps (K % BLOCK_K == 0, BLOCK_K >= 128). MODE 0
    (`math`): the production step; 1 (`loads`): w_ptr / x_ptr are int32 views of the same bytes, XOR-reduced (a
    checksum, not the product); 2 (`thread`): products summed 16 contiguous columns per thread, times the scale."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    if MODE == 1:
        c = tl.arange(0, BLOCK_K // 4)  # int32 words of 4 fp8 weights
        cx = tl.arange(0, BLOCK_K // 2)  # int32 words of 2 bf16 activations
        acc = tl.zeros((BLOCK_N, BLOCK_K // 4), tl.int32)
        acc_x = tl.zeros((BLOCK_K // 2,), tl.int32)
        for k in range(0, K, BLOCK_K):
            acc ^= tl.load(w_ptr + rows[:, None] * (K // 4) + (k // 4 + c)[None, :])
            acc_x ^= tl.load(x_ptr + k // 2 + cx)
        out = (tl.xor_sum(acc, 1) ^ tl.xor_sum(acc_x, 0)).to(tl.float32)
    else:
        T: tl.constexpr = 16 if MODE == 2 else 128  # columns summed before the scale
        c = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_N, BLOCK_K // T), tl.float32)
        for k in range(0, K, BLOCK_K):
            w = tl.load(w_ptr + rows[:, None] * K + (k + c)[None, :])
            x = tl.load(x_ptr + k + c)
            blocks = (k + tl.arange(0, BLOCK_K // T) * T) // 128  # each T-column group's scale block
            s = tl.load(s_ptr + rows[:, None] * KB + blocks[None, :])  # [BLOCK_N, BLOCK_K / T]
            prod = w.to(tl.float32) * x.to(tl.float32)[None, :]
            acc += tl.sum(tl.reshape(prod, (BLOCK_N, BLOCK_K // T, T)), 2) * s
        out = tl.sum(acc, 1)
    tl.store(out_ptr + offs_n, out.to(out_ptr.dtype.element_ty), mask=offs_n < N)


MODES = {"math": 0, "loads": 1, "thread": 2}


def mode(x, q, s, out, body, config):
    N, K = q.shape
    code = MODES[body]
    w, xv = (q.view(torch.int32), x.view(torch.int32)) if code == 1 else (q, x)
    _mode_kernel[(triton.cdiv(N, config["BLOCK_N"]),)](xv, w, s, out, N, K, s.shape[1], BLOCK_N=config["BLOCK_N"],
                                                       BLOCK_K=config["BLOCK_K"], MODE=code,
                                                       num_warps=config["num_warps"])  # fmt: skip
    return out


def mma(x, q, s, out, block_n, u, stages):
    N, K = q.shape
    _mma_kernel[(triton.cdiv(N, block_n),)](x, q, s, out, N, K, s.shape[1], BLOCK_N=block_n, U=u, num_warps=4,
                                            num_stages=stages)  # fmt: skip
    return out


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
    config = lin.get_config(1, N, K, q.dtype, lin.sm_count(x.device))
    for body in MODES:  # the production tile, three loop bodies
        variants[f"mode {body} {config['BLOCK_N']}x{config['BLOCK_K']}"] = lambda i, m=body: mode(
            x, *weights[i % copies], out, m, config
        )
    xb = x[:, : K // 2].contiguous()  # bf16 weights of the same bytes: [N, K / 2]
    dense = [torch.randn(N, K // 2, device="cuda", dtype=torch.bfloat16) / K**0.5 for _ in range(copies)]
    variants["bf16 same bytes (production)"] = lambda i: lin.linear(xb, dense[i % copies])
    for bn in (4, 8):
        for u in (4, 16):
            if K % (128 * u) == 0:
                variants[f"probe BLOCK_N={bn} U={u}"] = lambda i, bn=bn, u=u: probe(x, *weights[i % copies], out, bn, u)
    for bn, u, stages in ((16, 1, 4), (32, 1, 4), (64, 1, 4), (16, 4, 1), (32, 4, 1), (64, 4, 1), (16, 8, 1),
                          (32, 2, 2), (64, 2, 2)):  # fmt: skip
        if K % (128 * u) == 0:
            variants[f"mma BLOCK_N={bn} U={u} stages={stages}"] = lambda i, bn=bn, u=u, st=stages: mma(
                x, *weights[i % copies], out, bn, u, st
            )
    nbytes, rows = q.numel() + s.numel() * 4, []
    for label, fn in variants.items():
        checked = not (label.startswith("mode loads") or label.startswith("bf16"))  # a checksum / other weights
        err = ((fn(0).float() - ref).abs().max() / ref.abs().max()).item() if checked else float("nan")
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
