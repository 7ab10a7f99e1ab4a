"""Dense projections at decode sizes: the Triton skinny GEMM (kernels/linear/triton.py) vs F.linear (cuBLAS).

Every fused dense projection of the 35B-A3B and 122B-A10B configs (ModelConfig.decode_projections(); shapes
that two projections share are measured once) at M = 1, 8, 32, 64 rows, bf16. Device time is the median of
CUDA-graph replays of one call per weight copy, with enough copies that the weights touched per replay are
>= 4x the 60 MB L2 (at most 4 GB): every call streams its weight from HBM, as in a decode step. GB/s counts
weight + activation + output bytes; % copy is against a 1 GiB device copy (read + write bytes) timed eagerly in
the same run. Host µs: eager wall clock per call, launches only (no sync inside the loop). Relative error of both
paths against an fp32 reference. Target: Triton >= 85 % of the copy ceiling at M = 1 on every shape. The
summary also adds up one decode step's dense projections per model (each shape times its count per step).

    python experiments/bench_gemv.py [--out results/bench_gemv.json] [--smoke]   (--smoke: tiny shapes on CPU)
"""

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # --smoke on a CPU-only machine
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchlib import copy_bandwidth_gbs, print_targets, target, time_calls, write_json  # noqa: E402

from kernels.linear import naive  # noqa: E402
from kernels.linear import triton as tri  # noqa: E402
from qmoe.model.config import ModelConfig  # noqa: E402

MODELS = {"35B": "qwen35_moe", "122B": "qwen35_moe_122b"}
M_VALUES = (1, 8, 32, 64)
SMOKE_SHAPES = {(70, 96): ["smoke a"], (33, 40): ["smoke b"]}
SMOKE_M = (1, 5)
L2_BYTES = 60 * 2**20
ROTATE_BYTES = 4 * L2_BYTES  # weight bytes touched per graph replay
MAX_ROTATE_BYTES = 4 * 2**30
HOST_CALLS = 50
TARGET_PCT_COPY = 85.0
HOST_US_TARGET = 30.0


def model_config(model: str) -> ModelConfig:
    return ModelConfig.from_dict(yaml.safe_load((ROOT / f"configs/model/{model}.yaml").read_text())["arch"])


def model_shapes(models=MODELS) -> dict[tuple[int, int], list[str]]:
    """(N, K) -> the projections with that shape, e.g. (2048, 4096): ['35B gdn_out', '35B attn_o']."""
    shapes: dict[tuple[int, int], list[str]] = {}
    for tag, model in models.items():
        for name, nk in model_config(model).decode_projections().items():
            shapes.setdefault(nk, []).append(f"{tag} {name}")
    return shapes


def calls_per_step(cfg: ModelConfig) -> dict[str, int]:
    """How many times each projection runs in one decode step."""
    gdn = sum(t == "linear_attention" for t in cfg.layer_types)
    attn, layers = cfg.num_hidden_layers - gdn, cfg.num_hidden_layers
    counts = {"gdn_in": gdn, "gdn_out": gdn, "attn_qkv": attn, "attn_o": attn, "moe_in": layers}
    return {**counts, "shared_down": layers, "lm_head": 1}


def rotated_weights(N, K, dtype, device, seed=0) -> list[torch.Tensor]:
    """Weight copies at distinct addresses, >= ROTATE_BYTES in all (capped at MAX_ROTATE_BYTES): a graph that
    calls each once reads every weight from HBM."""
    gen = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(N, K, device=device, dtype=dtype, generator=gen) * K**-0.5
    nbytes = w.numel() * w.element_size()
    n = max(1, min(math.ceil(ROTATE_BYTES / nbytes), MAX_ROTATE_BYTES // nbytes)) if device == "cuda" else 2
    return [w] + [w.clone() for _ in range(n - 1)]


def fp32_reference(x, w, rows=32768) -> torch.Tensor:
    """x @ w^T in fp32, a block of weight rows at a time (an fp32 copy of a 122B lm_head would be 3 GB)."""
    return torch.cat([F.linear(x.float(), w[i : i + rows].float()) for i in range(0, w.shape[0], rows)], -1)


def rel_err(out, ref) -> float:
    out, ref = out.double(), ref.double()
    return float("inf") if not torch.isfinite(out).all() else ((out - ref).norm() / ref.norm()).item()


def host_us(fn, n, calls) -> float:
    """Eager host time per call: `calls` launches timed on the wall clock, no sync inside the loop."""
    fn(0)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    for i in range(calls):
        fn(i % n)
    us = (time.perf_counter() - t) * 1e6 / calls
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return us


def config_source(M, N, K, dtype) -> str:
    return "tuned" if tri.CONFIG_TABLE.get(tri.shape_key(N, K, dtype), {}).get(str(tri.m_bucket(M))) else "default"


def bench_shape(N, K, names, m_values, device, dtype, copy_gbs) -> list[dict]:
    weights = rotated_weights(N, K, dtype, device)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count if device == "cuda" else 8  # as cached_plan
    n = len(weights)
    x_all = torch.randn(
        max(m_values), K, device=device, dtype=dtype, generator=torch.Generator(device=device).manual_seed(1)
    )
    ref_all = fp32_reference(x_all, weights[0])
    rows = []
    for M in m_values:
        x = x_all[:M]
        call = lambda fn, x=x: lambda i: fn(x, weights[i])
        size = dtype.itemsize
        nbytes = (N * K + M * K + M * N) * size
        grid, split, _, meta = tri.cached_plan(M, N, K, dtype, x.device)
        row = {"shapes": names, "N": N, "K": K, "M": M, "bytes": nbytes, "rotated_weights": n}
        row["config"] = {**tri.get_config(M, N, K, dtype, num_sms), "source": config_source(M, N, K, dtype)}
        row["grid"], row["splits"] = grid[0], split
        for impl, fn in (("triton", tri.linear), ("cublas", naive.linear)):
            row[f"{impl}_rel_err_vs_fp32"] = rel_err(fn(x, weights[0]), ref_all[:M])
            us, method = time_calls(call(fn), n, device)
            row[f"{impl}_us"], row[f"{impl}_timing"] = us, method
            row[f"{impl}_gbs"] = nbytes / us / 1e3
            row[f"{impl}_pct_copy"] = 100 * row[f"{impl}_gbs"] / copy_gbs
            row[f"{impl}_host_us"] = host_us(call(fn), n, HOST_CALLS if device == "cuda" else 2)
        row["speedup_vs_cublas"] = row["cublas_us"] / row["triton_us"]
        rows.append(row)
        print(f"{'|'.join(names):>32} M={M:<3} triton {row['triton_us']:8.1f} us  cublas {row['cublas_us']:8.1f} us")
    return rows


def step_summary(rows, m_values, models=MODELS) -> list[dict]:
    """Per model and M: the dense projections of one decode step added up, Triton vs cuBLAS (µs)."""
    by_shape = {(r["N"], r["K"], r["M"]): r for r in rows}
    out = []
    for tag, model in models.items():
        cfg = model_config(model)
        counts, shapes = calls_per_step(cfg), cfg.decode_projections()
        for M in m_values:
            parts = [(by_shape.get((*shapes[p], M)), c) for p, c in counts.items()]
            if any(r is None for r, _ in parts):
                continue
            t = {impl: sum(r[f"{impl}_us"] * c for r, c in parts) for impl in ("triton", "cublas")}
            nbytes = sum(r["bytes"] * c for r, c in parts)
            out.append({"model": tag, "M": M, "bytes": nbytes, "triton_us": t["triton"], "cublas_us": t["cublas"]})
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/bench_gemv.json")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (checks the script only)")
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda"
    dtype = torch.float32 if args.smoke else torch.bfloat16
    shapes, m_values = (SMOKE_SHAPES, SMOKE_M) if args.smoke else (model_shapes(), M_VALUES)
    t0 = time.time()
    copy_gbs = copy_bandwidth_gbs(device)
    rows = []
    for (N, K), names in shapes.items():
        rows += bench_shape(N, K, names, m_values, device, dtype, copy_gbs)
        if device == "cuda":
            torch.cuda.empty_cache()

    m1 = [r for r in rows if r["M"] == 1]
    targets = [
        target(f"{'|'.join(r['shapes'])} M=1 % of copy", r["triton_pct_copy"], TARGET_PCT_COPY, at_most=False)
        for r in m1
    ]
    worst_host = max(rows, key=lambda r: r["triton_host_us"])
    targets.append(target("eager host us per call (worst row)", worst_host["triton_host_us"], HOST_US_TARGET, True))
    worst = min(m1, key=lambda r: r["triton_pct_copy"])
    summary = {
        "m1_pct_copy_worst": {"shapes": worst["shapes"], "pct": worst["triton_pct_copy"]},
        "m1_pct_copy_median": statistics.median(r["triton_pct_copy"] for r in m1),
        "m1_shapes_meeting_target": sum(t["met"] for t in targets[: len(m1)]),
        "m1_shapes": len(m1),
        "decode_step_projections": [] if args.smoke else step_summary(rows, m_values),
    }
    write_json(
        args.out, "gemv", device, dtype=str(dtype), l2_bytes_assumed=L2_BYTES, rotate_bytes=ROTATE_BYTES,
        configs="tuned table" if tri.CONFIG_TABLE else "defaults (no table for this GPU, or QMOE_GEMV_DEFAULT_CONFIGS)",
        ceilings={"copy_gbs": copy_gbs}, rows=rows, summary=summary, targets=targets, seconds=time.time() - t0,
    )  # fmt: skip

    print(f"copy ceiling {copy_gbs:.0f} GB/s (read + write); configs: {'tuned' if tri.CONFIG_TABLE else 'defaults'}")
    head = f"{'shape':>26} {'M':>3} {'tri us':>8} {'%copy':>6} {'cub us':>8} {'%copy':>6} {'x cub':>6}"
    print(head + f" {'host us':>8} {'err tri':>8} {'err cub':>8} {'cfg':>7}")
    for r in rows:
        cols = (
            f"{r['triton_us']:>8.1f} {r['triton_pct_copy']:>6.1f} {r['cublas_us']:>8.1f} {r['cublas_pct_copy']:>6.1f}"
        )
        errs = f"{r['triton_rel_err_vs_fp32']:>8.1e} {r['cublas_rel_err_vs_fp32']:>8.1e}"
        name = "|".join(r["shapes"])[:26]
        print(f"{name:>26} {r['M']:>3} {cols} {r['speedup_vs_cublas']:>6.2f} {r['triton_host_us']:>8.1f} {errs}"
              f" {r['config']['source']:>7}")  # fmt: skip
    for s in summary["decode_step_projections"]:
        print(f"{s['model']} M={s['M']}: one decode step's dense projections {s['triton_us']:.0f} us triton vs "
              f"{s['cublas_us']:.0f} us cublas ({s['bytes'] / s['triton_us'] / 1e3:.0f} GB/s)")  # fmt: skip
    print(f"M=1 % of copy: median {summary['m1_pct_copy_median']:.1f}, worst {worst['triton_pct_copy']:.1f} "
          f"({'|'.join(worst['shapes'])})")  # fmt: skip
    print_targets(targets)
    print(f"-> {args.out} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
