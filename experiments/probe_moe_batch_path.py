"""Which MoE path is faster for a small batch of tokens (M = 2..64) on this GPU: the two-launch decode kernels
(moe_block_decode, the default up to DECODE_MAX_M) or the aligned grouped path (moe_block_prefill: route, align,
grouped up/down tiles, combine; FP8 x FP8 on pre-quantized activations for fp8 experts)?

Both are timed on the same inputs (uniform routing, CUDA-graph replays of rotated inputs: benchlib.time_calls),
bf16 and fp8 experts at the 35B and 122B shapes, and checked against each other first (relative error; fp8's
grouped path quantizes the activations, so its bound is looser).

    PYTHONPATH=. python experiments/probe_moe_batch_path.py [--out results/probe_moe_batch_path.json]
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fp8 import MOE_SHAPES, quantized  # noqa: E402
from bench_moe import make_inputs  # noqa: E402
from benchlib import copy_bandwidth_gbs, time_calls, write_json  # noqa: E402

from kernels.fp8 import dequantize  # noqa: E402
from kernels.moe import triton as moe  # noqa: E402

M_VALUES = (2, 4, 8, 16, 32, 64)
TOL = {"bf16": 2e-2, "fp8": 6e-2}  # the grouped fp8 path's activations are quantized per 128-wide group


def rel_err(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/probe_moe_batch_path.json")
    args = parser.parse_args()
    copy_gbs = copy_bandwidth_gbs("cuda")
    rows = []
    for name, s in MOE_SHAPES.items():
        E, H, I, K = s["E"], s["H"], s["I"], s["K"]
        w13, s13 = quantized((E, 2 * I, H), "cuda", seed=1)
        w2, s2 = quantized((E, H, I), "cuda", seed=2)
        sd, ssd = quantized((H, I), "cuda", seed=3)
        weights = {
            "fp8": ((w13, w2, sd), (s13, s2, ssd)),
            "bf16": (tuple(dequantize(w, sc, torch.bfloat16) for w, sc in ((w13, s13), (w2, s2), (sd, ssd))), ()),
        }
        for kind, (w, sc) in weights.items():
            for M in M_VALUES:
                inputs = make_inputs(M, s, "uniform", 8, torch.bfloat16, "cuda")
                paths = {
                    "decode": lambda i, x=inputs, w=w, K=K, sc=sc: moe.moe_block_decode(*x[i], *w, K, None, None, *sc),
                    "grouped": lambda i, x=inputs, w=w, K=K, sc=sc: moe.moe_block_prefill(*x[i], *w, K, *sc),
                }
                err = rel_err(paths["grouped"](0), paths["decode"](0))
                row = {"shape": name, "weights": kind, "M": M, "rel_err_grouped_vs_decode": err,
                       "check_ok": err < TOL[kind]}  # fmt: skip
                for path, call in paths.items():
                    row[f"{path}_us"], _ = time_calls(call, len(inputs), "cuda")
                rows.append(row)
                print(f"{name:>5} {kind:<5} M={M:<3} decode {row['decode_us']:8.1f} us  grouped "
                      f"{row['grouped_us']:8.1f} us  err {err:.1e}{'' if row['check_ok'] else '  CHECK FAILED'}",
                      flush=True)  # fmt: skip
    write_json(args.out, "probe_moe_batch_path", "cuda", copy_gbs=copy_gbs, rows=rows)
    if not all(r["check_ok"] for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
