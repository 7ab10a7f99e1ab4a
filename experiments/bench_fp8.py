"""FP8 weights on the H200: the FP8 GEMV / skinny GEMM and the FP8 MoE block against their bf16 twins, and the
memory of whole models built with model.weights=fp8.

Every row first checks the FP8 kernel against the fp32 math on the same dequantized weights (kernels/fp8.py: the
fp8 values times their per-(row, 128-K block) scales, so the weights are exact and the bound is the bf16
activations' and output's rounding: 1e-2 relative for a projection, 2e-2 for the MoE block), and exits 1 if any
check fails. Then:
  gemv   every fused dense projection of the 35B-A3B and 122B-A10B configs at M = 1, 8, 64; CUDA-graph replays of
         one call per weight copy, copies rotated past L2; GB/s on the bytes read (fp8 weight + scales +
         activation + output), % of a 1 GiB device copy (read + write) timed in the same run; the bf16 Triton
         kernel on the same shape beside it (M = 1). Prefill, M = 4096 (not the lm_head, which prefill runs on
         the last token only): the FP8 x FP8 path (activations quantized per token and 128-K group) against cuBLAS
         bf16 on the dequantized weight, TFLOP/s; its error against the quantized activations' product (bf16
         rounding only) is checked, the error against the unquantized activations reported.
  moe    the MoE block (2 launches at M <= 64) at 35B / 122B shapes, M = 1, 8, 64, uniform routing, each replay
         on its own routing; GB/s on the fp8 bytes of the distinct selected experts + the shared down projection;
         the bf16 block beside it.
  moe_prefill  the routed experts' sorted kernels at M = 4096 (route, align, the activations' pre-passes, up,
         down; uniform routing): FP8 x FP8 on the fp8 table's tile and on PREFILL_FP8_TILES, each checked against
         the fp32 experts on the dequantized weights, and the dense kernels on those weights (bf16 table) beside.
  build  build_model(..., fp8=fp8_weight_names(cfg, "fp8")) at 35B and 122B dims on the GPU (random weights,
         quantized tensor by tensor): seconds, parameter bytes, peak allocated (the bf16 122B does not fit).
  sweep  M = 1 launch configs for the FP8 GEMV (per projection shape) and the FP8 MoE GEMV pair (per model shape):
         each candidate checked like the rows above, then timed; the winners go to results/bench_fp8_configs.json
         in the kernels/*/configs table format (keys with float8_e4m3fn), ready to merge into the GPU's table.
         MoE: 7 up x 7 down tiles (BLOCK_K 128-2048), each pair's error and µs in the JSON, the old 128-column
         default beside the winner; a wrong candidate fails the run.

    python experiments/bench_fp8.py [--out results/bench_fp8.json] [--sections gemv moe build] [--smoke]
"""

import argparse
import contextlib
import functools
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # --smoke on a CPU-only machine (set before triton's import)
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import triton  # noqa: E402
from bench_gemv import model_config, model_shapes  # noqa: E402
from bench_moe import make_inputs  # noqa: E402
from benchlib import copy_bandwidth_gbs, print_targets, target, time_calls, write_json  # noqa: E402
from tune_moe import launch  # noqa: E402

from kernels.fp8 import FP8, dequantize, k_blocks, quantize_into, quantize_rows  # noqa: E402
from kernels.linear import triton as lin  # noqa: E402
from kernels.moe import naive as moe_naive  # noqa: E402
from kernels.moe import triton as moe  # noqa: E402
from qmoe.model import build_model, fp8_weight_names, weight_nbytes  # noqa: E402

MODELS = {"35B": "qwen35_moe", "122B": "qwen35_moe_122b"}
MOE_SHAPES = {"35B": dict(E=256, H=2048, I=512, K=8), "122B": dict(E=256, H=3072, I=1024, K=8)}
M_VALUES = (1, 8, 64)
SECTIONS = ["gemv", "moe", "moe_prefill", "sweep", "build"]
PREFILL_M = 4096
SMOKE_GEMV = {(70, 300): ["smoke a"], (33, 136): ["smoke b"]}
SMOKE_MOE = {"smoke": dict(E=8, H=160, I=136, K=2)}
SMOKE_M = (1, 5)
SMOKE_PREFILL_M = 70
ROTATE_BYTES = 240 * 2**20  # bytes touched per graph replay: 4x the 60 MB L2
MAX_ROTATE_BYTES = 4 * 2**30
GEMV_TOL, MOE_TOL = 1e-2, 2e-2
TARGET_PCT_COPY = 85.0
MOE_M1_TARGET_US = 10.0


def rel_err(out, ref) -> float:
    out, ref = out.double(), ref.double()
    return float("inf") if not torch.isfinite(out).all() else ((out - ref).norm() / ref.norm()).item()


def quantized(shape, device, seed) -> tuple[torch.Tensor, torch.Tensor]:
    """Random N(0, 1/K) weights of `shape` [..., N, K] as fp8 + scales, drawn in bf16 and quantized in place."""
    gen = torch.Generator(device=device).manual_seed(seed)
    dense = torch.randn(shape, device=device, dtype=torch.bfloat16, generator=gen) * shape[-1] ** -0.5
    q = torch.empty(shape, device=device, dtype=FP8)
    scale = torch.empty((*shape[:-1], k_blocks(shape[-1])), device=device, dtype=torch.float32)
    quantize_into(q, scale, dense)
    return q, scale


def copies(nbytes: int, device: str) -> int:
    if device != "cuda":
        return 2
    return max(1, min(math.ceil(ROTATE_BYTES / nbytes), MAX_ROTATE_BYTES // nbytes))


@contextlib.contextmanager
def fp8_prefill(mode: str):
    """linear's QMOE_FP8_PREFILL switch set to mode inside."""
    default, lin.FP8_PREFILL = lin.FP8_PREFILL, mode
    try:
        yield
    finally:
        lin.FP8_PREFILL = default


def bench_prefill(x, weights, dtype, device) -> dict:
    """One FP8 x FP8 projection of x [M, K] (M > 64; QMOE_FP8_PREFILL=fp8) against cuBLAS bf16 on the dequantized
    weight."""
    q, scale = weights[0]
    M, N, K = x.shape[0], q.shape[0], q.shape[1]
    ref = x.float() @ dequantize(q, scale).T
    xq, xs = quantize_rows(x)
    act_ref = dequantize(xq, xs) @ dequantize(q, scale).T
    with fp8_prefill("fp8"):
        out = lin.linear(x, q, scale)
        row = {"M": M, "N": N, "K": K, "flops": 2 * M * N * K, "rel_err_vs_fp32": rel_err(out, act_ref)}
        row["fp8_us"], row["timing"] = time_calls(lambda i: lin.linear(x, *weights[i]), len(weights), device, reps=5)
    row["rel_err_vs_unquantized_activations"] = rel_err(out, ref)
    # (the interpreter's fp32 -> e4m3 rounding is inexact: --smoke reports the errors unchecked)
    checked = row["rel_err_vs_fp32"] < GEMV_TOL and row["rel_err_vs_unquantized_activations"] < 0.06
    row["check_ok"] = checked or device != "cuda"
    dense = dequantize(q, scale, dtype)
    row["bf16_cublas_us"], _ = time_calls(lambda i: torch.nn.functional.linear(x, dense), 2, device, reps=5)
    row["fp8_tflops"] = row["flops"] / row["fp8_us"] / 1e6
    row["bf16_cublas_tflops"] = row["flops"] / row["bf16_cublas_us"] / 1e6
    return row


def bench_gemv(shapes, m_values, device, dtype, copy_gbs, prefill_m) -> list[dict]:
    rows = []
    for (N, K), names in shapes.items():
        q, scale = quantized((N, K), device, seed=N + K)
        n = copies(N * K, device)
        weights = [(q, scale)] + [(q.clone(), scale.clone()) for _ in range(n - 1)]
        x_all = torch.randn(max(m_values), K, device=device, generator=torch.Generator(device=device).manual_seed(1))
        x_all = x_all.to(dtype)
        for M in m_values:
            x = x_all[:M]
            ref = torch.cat(
                [x.float() @ dequantize(q[i : i + 32768], scale[i : i + 32768]).T for i in range(0, N, 32768)], -1
            )
            nbytes = N * K + N * k_blocks(K) * 4 + (M * K + M * N) * dtype.itemsize
            row = {"shapes": names, "N": N, "K": K, "M": M, "bytes": nbytes, "rotated_weights": n}
            row["rel_err_vs_fp32"] = rel_err(lin.linear(x, q, scale), ref)
            row["check_ok"] = row["rel_err_vs_fp32"] < GEMV_TOL
            grid, split, _, meta = lin.cached_plan(M, N, K, FP8, x.device)
            row["config"] = {"grid": grid[0], "splits": split, **{k: v for k, v in meta.items() if k.isupper()}}
            row["fp8_us"], row["timing"] = time_calls(
                lambda i, x=x, weights=weights: lin.linear(x, *weights[i]), n, device
            )
            row["fp8_gbs"] = nbytes / row["fp8_us"] / 1e3
            row["fp8_pct_copy"] = 100 * row["fp8_gbs"] / copy_gbs
            if M == 1:  # the bf16 kernel on the same shape (its own copies, rotated the same way)
                dense = [dequantize(q, scale, dtype) for _ in range(copies(2 * N * K, device))]
                row["bf16_us"], _ = time_calls(lambda i, x=x, dense=dense: lin.linear(x, dense[i]), len(dense), device)
                row["speedup_vs_bf16"] = row["bf16_us"] / row["fp8_us"]
                del dense
            rows.append(row)
            print(
                f"gemv {'|'.join(names):>32} M={M:<3} fp8 {row['fp8_us']:8.1f} us {row['fp8_pct_copy']:5.1f} % copy"
                f"  err {row['rel_err_vs_fp32']:.1e}{'' if row['check_ok'] else '  CHECK FAILED'}",
                flush=True,
            )
        if not any("lm_head" in name for name in names):
            gen = torch.Generator(device=device).manual_seed(2)
            x = torch.randn(prefill_m, K, device=device, generator=gen).to(dtype)
            row = {"shapes": names, **bench_prefill(x, weights[:2], dtype, device)}
            row["bytes"] = N * K + (prefill_m * K + prefill_m * N) * dtype.itemsize
            row["fp8_gbs"] = row["bytes"] / row["fp8_us"] / 1e3
            row["fp8_pct_copy"] = 100 * row["fp8_gbs"] / copy_gbs
            rows.append(row)
            print(
                f"gemv {'|'.join(names):>32} M={prefill_m} fp8xfp8 {row['fp8_tflops']:6.1f} TFLOP/s, cuBLAS bf16 "
                f"{row['bf16_cublas_tflops']:6.1f}  err {row['rel_err_vs_fp32']:.1e} "
                f"(vs unquantized x {row['rel_err_vs_unquantized_activations']:.1e})"
                f"{'' if row['check_ok'] else '  CHECK FAILED'}",
                flush=True,
            )
        del weights, q, scale
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def bench_moe(shapes, m_values, device, dtype, copy_gbs) -> list[dict]:
    rows = []
    for name, s in shapes.items():
        E, H, I, K = s["E"], s["H"], s["I"], s["K"]
        w13, s13 = quantized((E, 2 * I, H), device, seed=1)
        w2, s2 = quantized((E, H, I), device, seed=2)
        sd, ssd = quantized((H, I), device, seed=3)
        fp8 = (w13, w2, sd)
        scales = (s13, s2, ssd)
        expert_bytes = 3 * H * I + (2 * I * k_blocks(H) + H * k_blocks(I)) * 4
        shared_bytes = H * I + H * k_blocks(I) * 4
        for M in m_values:
            n = max(2, min(16, ROTATE_BYTES // (min(E, M * K) * expert_bytes))) if device == "cuda" else 2
            inputs = make_inputs(M, s, "uniform", n, dtype, device)
            unique = statistics.mean(moe_naive.route(p[:, :E], K)[1].unique().numel() for _, p in inputs)
            row = {"shape": name, "M": M, "rotated_inputs": n, "unique_experts": unique}
            row["bytes"] = unique * expert_bytes + shared_bytes
            x, proj = inputs[0]
            # the reference: the fp32 block on the selected experts' dequantized weights only
            _, ids = moe_naive.route(proj[:, :E].float(), K)
            used = ids.unique()
            remap = torch.full((E,), -1, dtype=torch.long, device=device)
            remap[used] = torch.arange(used.numel(), device=device)
            sub_proj = torch.cat([proj[:, used], proj[:, E:]], 1).float()  # the router columns of the used experts
            ref = moe_naive.moe_block(
                x.float(), sub_proj, dequantize(w13[used], s13[used]), dequantize(w2[used], s2[used]),
                dequantize(sd, ssd), K,
            )  # fmt: skip
            call = lambda i, inputs=inputs, w=fp8, sc=scales, K=K: moe.moe_block(*inputs[i], *w, K, *sc)
            out = call(0)
            row["rel_err_vs_fp32"] = rel_err(out, ref)
            row["bit_reproducible"] = all(torch.equal(call(0), out) for _ in range(3))
            row["check_ok"] = row["rel_err_vs_fp32"] < MOE_TOL and row["bit_reproducible"]
            row["fp8_us"], row["timing"] = time_calls(call, n, device)
            row["fp8_gbs"] = row["bytes"] / row["fp8_us"] / 1e3
            row["fp8_pct_copy"] = 100 * row["fp8_gbs"] / copy_gbs
            rows.append(row)
            print(
                f"moe {name:>5} M={M:<3} fp8 {row['fp8_us']:8.1f} us {row['fp8_pct_copy']:5.1f} % copy"
                f"  err {row['rel_err_vs_fp32']:.1e}{'' if row['check_ok'] else '  CHECK FAILED'}",
                flush=True,
            )
        # the bf16 block on the same (dequantized) weights, M = 1, for the speed-up
        dense = [dequantize(w, sc, dtype) for w, sc in zip(fp8, scales)]
        del fp8, scales, w13, w2, sd
        inputs = make_inputs(1, s, "uniform", 16 if device == "cuda" else 2, dtype, device)
        bf16_us, _ = time_calls(
            lambda i, inputs=inputs, dense=dense, K=K: moe.moe_block(*inputs[i], *dense, K), len(inputs), device
        )
        for row in rows:
            if row["shape"] == name and row["M"] == 1:
                row["bf16_us"], row["speedup_vs_bf16"] = bf16_us, bf16_us / row["fp8_us"]
        del dense
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


# FP8 x FP8 tile candidates at M = 4096: (BLOCK_M, SUB_TILES, up (BLOCK_N, BLOCK_K, warps, stages), down (...))
PREFILL_FP8_TILES = [
    (64, 2, (64, 128, 8, 3), (128, 128, 4, 3)),
    (128, 1, (64, 128, 8, 3), (128, 128, 8, 3)),
]


def tile_config(block_m, sub, up, down) -> dict:
    return {"BLOCK_M": block_m, "SUB_TILES": sub, "up": launch(up), "down": launch(down)}


def sorted_experts(i, routed, w, scales, scratch, config):
    """routed_partials_into on routed[i] = (x, topk weights, topk ids), into scratch = (h, partials)."""
    moe.routed_partials_into(routed[i][0], *w, *routed[i][1:], *scratch, config, *scales)


def bench_moe_prefill(shapes, M, device, dtype) -> list[dict]:
    """The sorted experts at M tokens, FP8 x FP8 and dense (the module docstring)."""
    rows = []
    for name, s in shapes.items():
        E, H, I, K = s["E"], s["H"], s["I"], s["K"]
        w13, s13 = quantized((E, 2 * I, H), device, seed=1)
        w2, s2 = quantized((E, H, I), device, seed=2)
        fp8, scales, dense = (w13, w2), (s13, s2), (dequantize(w13, s13, dtype), dequantize(w2, s2, dtype))
        routed = [(x, *moe_naive.route(p[:, :E], K)) for x, p in make_inputs(M, s, "uniform", 2, dtype, device)]
        scratch = (torch.empty(M * K, I, dtype=dtype, device=device), torch.empty(M * K, H, dtype=dtype, device=device))
        x, weights, ids = routed[0]
        ref = moe_naive.fused_moe(x.float(), dense[0].float(), dense[1].float(), weights, ids)
        candidates = [("dense", moe.get_config(M, E, H, I, dtype), dense, ())]
        candidates += [("fp8", moe.get_config(M, E, H, I, FP8), fp8, scales)]
        candidates += [("fp8", tile_config(*t), fp8, scales) for t in PREFILL_FP8_TILES]
        for kind, config, w, sc in candidates:
            call = functools.partial(sorted_experts, routed=routed, w=w, scales=sc, scratch=scratch, config=config)
            try:
                call(0)
            except triton.runtime.errors.OutOfResources as err:  # a tile too large for this GPU: dropped, said
                print(f"moe_prefill {name:>5} M={M} {kind:>5} {config}: {err}", flush=True)
                continue
            row = {"shape": name, "M": M, "kind": kind, "config": config}
            row["rel_err_vs_fp32"] = rel_err(scratch[1].view(M, K, H).float().sum(1), ref)
            row["us"], row["timing"] = time_calls(call, len(routed), device, reps=5)
            row["tflops"] = 2 * M * K * 3 * H * I / row["us"] / 1e6
            # FP8 x FP8: the activations' quantization (unchecked under the interpreter, as bench_prefill)
            bound = (0.08 if device == "cuda" else float("inf")) if kind == "fp8" else MOE_TOL
            row["check_ok"] = row["rel_err_vs_fp32"] < bound
            rows.append(row)
            print(
                f"moe_prefill {name:>5} M={M} {kind:>5} {row['us']:8.1f} us {row['tflops']:6.1f} TFLOP/s  err "
                f"{row['rel_err_vs_fp32']:.1e}{'' if row['check_ok'] else '  CHECK FAILED'}  {config}",
                flush=True,
            )
        del w13, w2, fp8, dense, routed, scratch
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


GEMV_NARROW = [(4, 128, 4), (8, 128, 4), (16, 128, 4), (32, 128, 4), (16, 128, 8), (32, 128, 8), (16, 64, 4)]
GEMV_WIDE = [(4, 512, 4), (8, 512, 4), (16, 512, 8), (4, 1024, 4), (8, 1024, 8), (2, 2048, 4), (8, 256, 4)]
GEMV_CANDIDATES = GEMV_NARROW + GEMV_WIDE  # (BLOCK_N, BLOCK_K, num_warps)
# M = 1 FP8 MoE GEMV tiles (BLOCK_N, BLOCK_K, num_warps): BLOCK_K > 128 loads a step's columns at once and scales
# each 128-column sub-step; around the default (the bf16 GEMV's bytes per program), half and double the bytes, the
# whole 35B H in one step, and the one-scale-block step that was the default before (16 x 128, 4 x 128)
MOE_UP_CANDIDATES = [(8, 1024, 4), (16, 512, 4), (4, 1024, 4), (8, 512, 4), (16, 1024, 4), (8, 2048, 8), (16, 128, 4)]
MOE_DOWN_CANDIDATES = [(4, 512, 4), (2, 512, 4), (4, 256, 4), (8, 256, 4), (2, 1024, 4), (8, 512, 8), (4, 128, 4)]
MOE_OLD_DEFAULT = ((16, 128, 4), (4, 128, 4))  # gemv_fp8 before the sub-steps: the speed-up is reported against it


def sweep_gemv_shape(N, K, device, dtype) -> tuple[dict | None, float, float]:
    """M = 1, one shape: every GEMV_CANDIDATES tile, checked then timed -> (best config, its µs, the default's µs)."""
    q, scale = quantized((N, K), device, seed=N + K)
    weights = [(q, scale)] + [(q.clone(), scale.clone()) for _ in range(copies(N * K, device) - 1)]
    x = torch.randn(1, K, device=device).to(dtype)
    ref = torch.cat([x.float() @ dequantize(q[i : i + 32768], scale[i : i + 32768]).T for i in range(0, N, 32768)], -1)
    out = torch.empty(1, N, device=device, dtype=dtype)
    timed = []
    for bn, bk, warps in GEMV_CANDIDATES:
        cfg = dict(BLOCK_M=1, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=1, num_warps=warps, num_stages=1)
        out.fill_(float("nan"))
        err = rel_err(lin.linear_into(x, q, out, config=cfg, scale=scale), ref)
        if not err < GEMV_TOL:
            print(f"sweep gemv N={N} K={K} {cfg}: WRONG (rel err {err:.1e})", flush=True)
            continue
        call = lambda i, cfg=cfg: lin.linear_into(x, weights[i][0], out, cfg, scale=weights[i][1])
        timed.append((time_calls(call, len(weights), device)[0], cfg))
    default_us, _ = time_calls(lambda i: lin.linear(x, *weights[i]), len(weights), device)
    us, best = min(timed, key=lambda t: t[0]) if timed else (float("inf"), None)
    return best, us, default_us


def sweep_moe_shape(s, device, dtype) -> tuple[dict | None, float, float, list[dict]]:
    """M = 1, one shape: every (up, down) candidate pair, checked then timed -> (best, its µs, the default's µs,
    every candidate's row)."""
    E, H, I, K = s["E"], s["H"], s["I"], s["K"]
    weights = [quantized((E, 2 * I, H), device, 1), quantized((E, H, I), device, 2), quantized((H, I), device, 3)]
    fp8, scales = [w for w, _ in weights], [sc for _, sc in weights]
    inputs = make_inputs(1, s, "uniform", 16 if device == "cuda" else 2, dtype, device)
    ref = moe_naive.moe_block(inputs[0][0].float(), inputs[0][1].float(), *(dequantize(*w) for w in weights), K)
    timed, candidates = [], []
    pairs = [(u, d) for u in MOE_UP_CANDIDATES for d in MOE_DOWN_CANDIDATES]
    if device != "cuda":  # smoke: every up and every down tile once, in 7 pairs rather than 49
        pairs = list(zip(MOE_UP_CANDIDATES, MOE_DOWN_CANDIDATES))
    for up, down in pairs:
        cfg = {
            "BLOCK_M": 1,
            "up": {"BLOCK_N": up[0], "BLOCK_K": up[1], "num_warps": up[2], "num_stages": 2},
            "down": {"BLOCK_N": down[0], "BLOCK_K": down[1], "num_warps": down[2], "num_stages": 2},
        }
        err = rel_err(moe.moe_block_decode(*inputs[0], *fp8, K, cfg, None, *scales), ref)
        row = {"up": up, "down": down, "rel_err_vs_fp32": err, "old_default": (up, down) == MOE_OLD_DEFAULT}
        candidates.append(row)
        if not err < MOE_TOL:
            print(f"sweep moe {cfg}: WRONG (rel err {err:.1e})", flush=True)
            continue
        call = lambda i, cfg=cfg: moe.moe_block_decode(*inputs[i], *fp8, K, cfg, None, *scales)
        row["us"] = time_calls(call, len(inputs), device)[0]
        timed.append((row["us"], cfg))
    default_us, _ = time_calls(lambda i: moe.moe_block(*inputs[i], *fp8, K, *scales), len(inputs), device)
    us, best = min(timed, key=lambda t: t[0]) if timed else (float("inf"), None)
    return best, us, default_us, candidates


def sweep(gemv_shapes, moe_shapes, device, dtype) -> tuple[list[dict], dict]:
    """M = 1 launch configs -> (rows, {"linear": table entries, "moe": table entries}) for the winners."""
    rows, table = [], {"linear": {}, "moe": {}}
    for (N, K), names in gemv_shapes.items():
        best, us, default_us = sweep_gemv_shape(N, K, device, dtype)
        rows.append(
            {"op": "gemv", "shapes": names, "N": N, "K": K, "best": best, "best_us": us, "default_us": default_us}
        )
        if best:
            table["linear"][lin.shape_key(N, K, FP8)] = {"1": best}
        print(f"sweep gemv {'|'.join(names):>32}: best {us:7.1f} us (default {default_us:7.1f}) {best}", flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()
    for name, s in moe_shapes.items():
        best, us, default_us, candidates = sweep_moe_shape(s, device, dtype)
        old_us = next((c.get("us", float("inf")) for c in candidates if c["old_default"]), float("nan"))
        row = {"op": "moe", "shape": name, "best": best, "best_us": us, "default_us": default_us}
        rows.append({**row, "old_default_us": old_us, "candidates": candidates})
        if best:
            table["moe"][moe.shape_key(s["E"], s["H"], s["I"], FP8)] = {"1": best}
        print(
            f"sweep moe {name}: best {us:7.1f} us (default {default_us:7.1f}, old 128-column default {old_us:7.1f})"
            f" {best}",
            flush=True,
        )
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows, table


def bench_build(models, device, dtype) -> list[dict]:
    rows = []
    for tag, model in models.items():
        cfg = model_config(model)
        fp8 = fp8_weight_names(cfg, "fp8")
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            start_bytes = torch.cuda.memory_allocated()
        t = time.perf_counter()
        m = build_model(cfg, dtype, device, seed=0, fp8=fp8)
        if device == "cuda":
            torch.cuda.synchronize()
        row = {"model": tag, "seconds": time.perf_counter() - t, "fp8_tensors": len(fp8)}
        row["param_bytes"] = weight_nbytes(cfg, dtype, fp8)
        row["bf16_param_bytes"] = weight_nbytes(cfg, dtype)
        row["fp8_param_bytes"] = sum(p.nbytes for p in m.parameters() if p.dtype == FP8)
        if device == "cuda":
            row["peak_allocated_bytes"] = torch.cuda.max_memory_allocated() - start_bytes
            row["peak_over_params_bytes"] = row["peak_allocated_bytes"] - row["param_bytes"]
            row["device_total_bytes"] = torch.cuda.get_device_properties(0).total_memory
        rows.append(row)
        print(
            f"build {tag}: {row['seconds']:.1f} s, {row['param_bytes'] / 1e9:.2f} GB of parameters "
            f"(bf16: {row['bf16_param_bytes'] / 1e9:.2f} GB), peak {row.get('peak_allocated_bytes', 0) / 1e9:.2f} GB",
            flush=True,
        )
        del m
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/bench_fp8.json")
    parser.add_argument("--sections", nargs="+", default=SECTIONS, choices=SECTIONS)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (checks the script only)")
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda"
    dtype = torch.float32 if args.smoke else torch.bfloat16
    m_values = SMOKE_M if args.smoke else M_VALUES
    t0 = time.time()
    copy_gbs = copy_bandwidth_gbs(device)
    sections = {}
    if "gemv" in args.sections:
        shapes = SMOKE_GEMV if args.smoke else model_shapes(MODELS)
        prefill_m = SMOKE_PREFILL_M if args.smoke else PREFILL_M
        sections["gemv"] = bench_gemv(shapes, m_values, device, dtype, copy_gbs, prefill_m)
    if "moe" in args.sections:
        sections["moe"] = bench_moe(SMOKE_MOE if args.smoke else MOE_SHAPES, m_values, device, dtype, copy_gbs)
    if "moe_prefill" in args.sections:
        moe_shapes = SMOKE_MOE if args.smoke else MOE_SHAPES
        sections["moe_prefill"] = bench_moe_prefill(
            moe_shapes, SMOKE_PREFILL_M if args.smoke else PREFILL_M, device, dtype
        )
    if "sweep" in args.sections:
        gemv_shapes = SMOKE_GEMV if args.smoke else model_shapes(MODELS)
        sections["sweep"], table = sweep(gemv_shapes, SMOKE_MOE if args.smoke else MOE_SHAPES, device, dtype)
        configs_out = Path(args.out).with_name(Path(args.out).stem + "_configs.json")
        configs_out.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
        print(f"sweep winners -> {configs_out}")
    if "build" in args.sections:
        sections["build"] = bench_build({"tiny": "qwen35_moe_tiny"} if args.smoke else MODELS, device, dtype)

    targets = []
    for r in sections.get("gemv", []):
        if r["M"] == 1:
            targets.append(
                target(f"gemv {'|'.join(r['shapes'])} M=1 % of copy", r["fp8_pct_copy"], TARGET_PCT_COPY, False)
            )
    for r in sections.get("moe", []):
        if r["shape"] == "35B" and r["M"] == 1:
            targets.append(target("moe 35B M=1 us", r["fp8_us"], MOE_M1_TARGET_US, at_most=True))
        if r["shape"] == "35B" and r["M"] == 64:
            targets.append(target("moe 35B M=64 % of copy", r["fp8_pct_copy"], TARGET_PCT_COPY, at_most=False))
    write_json(
        args.out, "fp8", device, dtype=str(dtype), rotate_bytes=ROTATE_BYTES, ceilings={"copy_gbs": copy_gbs},
        configs="fp8 defaults unless kernels/*/configs has float8_e4m3fn entries", **sections, targets=targets,
        seconds=time.time() - t0,
    )  # fmt: skip

    print(f"\ncopy ceiling {copy_gbs:.0f} GB/s (read + write)")
    print(f"{'what':>40} {'M':>3} {'fp8 us':>8} {'GB/s':>7} {'%copy':>6} {'bf16 us':>8} {'err':>8} ok")
    for r in sections.get("gemv", []) + sections.get("moe", []):
        what = f"gemv {'|'.join(r['shapes'])}" if "shapes" in r else f"moe {r['shape']}"
        bf16 = f"{r['bf16_us']:8.1f}" if "bf16_us" in r else f"{'-':>8}"
        print(
            f"{what[:40]:>40} {r['M']:>3} {r['fp8_us']:8.1f} {r['fp8_gbs']:7.0f} {r['fp8_pct_copy']:6.1f} {bf16} "
            f"{r['rel_err_vs_fp32']:8.1e} {r['check_ok']}"
        )
    for r in sections.get("sweep", []):
        if r["op"] == "moe":
            print(
                f"{'sweep moe ' + r['shape']:>40}   1 best {r['best_us']:8.1f}  default {r['default_us']:8.1f}  "
                f"old 128-column {r['old_default_us']:8.1f} us  best {r['best']}"
            )
    print_targets(targets)
    print(f"-> {args.out} ({time.time() - t0:.0f} s)")
    for r in sections.get("moe_prefill", []):
        print(f"{'moe_prefill ' + r['shape'] + ' ' + r['kind']:>40} {r['M']:>5} {r['us']:8.1f} us {r['tflops']:6.1f} "
              f"TFLOP/s {r['rel_err_vs_fp32']:8.1e} {r['check_ok']}  {r['config']}")  # fmt: skip
    groups = ("gemv", "moe", "moe_prefill")
    checks = [r["check_ok"] for rows in (sections.get(g, []) for g in groups) for r in rows]
    checks += [c["rel_err_vs_fp32"] < MOE_TOL for r in sections.get("sweep", []) for c in r.get("candidates", [])]
    if not all(checks):
        print("CORRECTNESS CHECK FAILED (see rows with ok=False)")
        sys.exit(1)


if __name__ == "__main__":
    main()
