"""Pick the dense-projection launch configs on this GPU -> kernels/linear/configs/<gpu>.json (committed; read at
import by kernels/linear/triton.py).

Shapes: every (N, K) of ModelConfig.decode_projections() of the 35B and 122B configs, bf16. Tuned M: 1 (stored for
bucket 1), 8 (stored for buckets 2, 4, 8, 16: one BLOCK_M = 16 dot tile serves them all), 32, 64. Each candidate is
first checked against an fp32 reference (relative error < 1e-2; a failing candidate is dropped and reported), then
timed as one CUDA graph of one call per rotated weight copy (bench_gemv's rotation: >= 4x the L2 per replay, so
every call streams from HBM). The search is small on purpose, in two phases per (shape, M):
  tile: M = 1 GEMV tiles of 32 or 64 elements per thread (two to eight 16-byte loads) in BLOCK_N x BLOCK_K shapes
    from 2 x 2048 (few rows, one long stride: many programs for the small shapes) to 32 x 256, 4 or 8 warps, a few
    with num_stages 3 (whether the pipeliner stages loads that feed no dot); M > 1 dot tiles BLOCK_M = M rounded
    up (16, 32, 64) with BLOCK_N 32..128, BLOCK_K 64..256, stages that fit shared memory.
  split: the best tile with SPLIT_K 2, 4 (and 8 for M > 1), only where the tile leaves fewer than 4 programs per
    SM (lm_head never splits).
Compiles dominate (a few dozen kernel variants); about 2-3 minutes on an H200. --budget-s stops starting new
(shape, M) points and leaves them to the defaults. Entries already in the file for other shapes are kept.

    python experiments/tune_gemv.py [--budget-s 220] [--out kernels/linear/configs/<gpu>.json] [--smoke --out F]
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # --smoke on a CPU-only machine (before triton is imported)
import triton  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_gemv import SMOKE_SHAPES, fp32_reference, model_shapes, rel_err, rotated_weights  # noqa: E402
from benchlib import time_calls  # noqa: E402

from kernels.linear import triton as tri  # noqa: E402
from kernels.tuned import gpu_config_path  # noqa: E402

# tuned M -> the M buckets its config is stored for; M = 1 first (the headline), then by importance
TUNE_M = {1: (1,), 8: (2, 4, 8, 16), 64: (64,), 32: (32,)}
# (BLOCK_N, BLOCK_K, num_warps, num_stages); BLOCK_K is clamped to K rounded up to a power of two
GEMV_TILES = [
    (2, 2048, 4, 1), (4, 1024, 4, 1), (8, 512, 4, 1), (8, 1024, 4, 1), (16, 512, 4, 1), (4, 2048, 8, 1),
    (16, 512, 8, 1), (32, 256, 8, 1), (4, 1024, 4, 3), (8, 512, 4, 3), (16, 512, 4, 3),
]  # fmt: skip
DOT_TILES = [(32, 128, 4, 4), (64, 128, 4, 4), (32, 256, 4, 4), (64, 256, 4, 3), (128, 128, 4, 3), (128, 64, 8, 4)]
SHARED_MEMORY_BYTES = 200 * 1024  # leave headroom below the H200's 227 KB per block
MAX_REL_ERR = 1e-2


def config(block_m, tile, split=1) -> dict:
    n, k, warps, stages = tile
    return dict(BLOCK_M=block_m, BLOCK_N=n, BLOCK_K=k, SPLIT_K=split, num_warps=warps, num_stages=stages)


def tile_candidates(M, K) -> list[dict]:
    k_max = max(16, triton.next_power_of_2(K))
    if M == 1:
        tiles = {(n, min(k, k_max), w, s) for n, k, w, s in GEMV_TILES}
        return [config(1, t) for t in sorted(tiles)]
    block_m = min(64, max(16, triton.next_power_of_2(M)))
    tiles = {(n, min(k, k_max), w, s) for n, k, w, s in DOT_TILES}
    return [config(block_m, t) for t in sorted(tiles) if (block_m + t[0]) * t[1] * 2 * t[3] <= SHARED_MEMORY_BYTES]


def split_candidates(best: dict, M, N, K, num_sms) -> list[dict]:
    grid, *_ = tri.make_plan(M, N, K, best)
    if grid[0] >= 4 * num_sms:
        return []
    splits = (2, 4) if M == 1 else (2, 4, 8)
    k_blocks = triton.cdiv(K, best["BLOCK_K"])
    return [{**best, "SPLIT_K": s} for s in splits if s <= k_blocks]


def tune_point(M, N, K, weights, x, ref, num_sms, device) -> tuple[dict | None, float]:
    """Best config for (N, K) at M rows -> (config, µs); (None, inf) when no candidate ran."""
    x = x[:M]
    out = torch.empty(M, N, dtype=x.dtype, device=device)

    def measure(cfg):
        try:
            out.fill_(float("nan"))  # a tile this candidate does not write must not pass with the last one's values
            err = rel_err(tri.linear_into(x, weights[0], out, config=cfg), ref[:M])
            if not err < MAX_REL_ERR:
                print(f"  WRONG {cfg}: rel err {err:.2e}", flush=True)
                return float("inf")
            call = lambda i: tri.linear_into(x, weights[i], out, config=cfg)
            return time_calls(call, len(weights), device, reps=5)[0]
        except Exception as err:  # noqa: BLE001 -- e.g. out of shared memory: the candidate is dropped
            print(f"  skip {cfg}: {type(err).__name__}: {str(err).splitlines()[0][:120]}", flush=True)
            return float("inf")

    timed = [(measure(c), c) for c in tile_candidates(M, K)]
    us, best = min(timed, key=lambda t: t[0])
    if best is None or us == float("inf"):
        return None, us
    timed += [(measure(c), c) for c in split_candidates(best, M, N, K, num_sms)]
    us, best = min(timed, key=lambda t: t[0])
    return best, us


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-s", type=float, default=220.0, help="stop starting new (shape, M) after this long")
    parser.add_argument("--out", default=None, help="default: kernels/linear/configs/<gpu name>.json")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (checks the script); needs --out")
    args = parser.parse_args()
    if args.smoke and not args.out:
        parser.error("--smoke needs --out (the real table is written only on the GPU)")
    device, dtype = ("cpu", torch.float32) if args.smoke else ("cuda", torch.bfloat16)
    shapes = SMOKE_SHAPES if args.smoke else model_shapes()
    tune = {1: (1,), 5: (8,)} if args.smoke else TUNE_M
    gpu = "cpu" if args.smoke else torch.cuda.get_device_name()
    num_sms = 8 if args.smoke else torch.cuda.get_device_properties(0).multi_processor_count
    out = Path(args.out) if args.out else gpu_config_path(tri.CONFIG_DIR, gpu)
    table = json.loads(out.read_text()) if out.exists() else {}
    t0 = time.time()
    data = {}  # (N, K) -> (weight copies, x, fp32 reference of x @ w0^T)
    for N, K in shapes:
        weights = rotated_weights(N, K, dtype, device)
        x = torch.randn(
            max(tune), K, device=device, dtype=dtype, generator=torch.Generator(device=device).manual_seed(1)
        )
        data[N, K] = weights, x, fp32_reference(x, weights[0])
    print(f"{len(shapes)} shapes allocated ({time.time() - t0:.0f} s)", flush=True)
    for M, buckets in tune.items():
        for (N, K), names in shapes.items():
            if time.time() - t0 > args.budget_s:
                print(f"budget of {args.budget_s:.0f} s spent: N={N} K={K} M={M} keeps its previous/default config")
                continue
            best, us = tune_point(M, N, K, *data[N, K], num_sms, device)
            if best is None:
                print(f"N={N} K={K} M={M}: no candidate ran; left to the defaults", flush=True)
                continue
            entry = table.setdefault(tri.shape_key(N, K, dtype), {})
            entry.update({str(b): best for b in buckets})
            gbs = (N * K + M * K + M * N) * dtype.itemsize / us / 1e3
            print(f"{'|'.join(names):>32} M={M:<3} {us:8.1f} us {gbs:6.0f} GB/s  {best}  ({time.time() - t0:.0f} s)")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print(f"-> {out} for {gpu} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
