"""Which MoE path is faster for a small batch of tokens (M = 2..64) on this GPU: the two-launch decode kernels
(moe_block_decode) or the aligned grouped path (moe_block_prefill: route, align, grouped up/down tiles, combine)?
For fp8 experts the grouped path runs two ways: FP8 x FP8 on pre-quantized activations (its default) and
weight-only (fp8_x=False: the activations in bf16, each weight tile converted, the decode kernels' tile math).

All are timed on the same inputs (uniform routing, CUDA-graph replays of rotated inputs: benchlib.time_calls),
bf16 and fp8 experts at the 35B and 122B shapes, and checked against the decode kernels first (relative error;
the FP8 x FP8 path quantizes the activations, so its bound is looser).

    PYTHONPATH=. python experiments/probe_moe_batch_path.py [--out results/probe_moe_batch_path.json]
"""

import argparse
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fp8 import MOE_SHAPES, quantized  # noqa: E402
from bench_moe import make_inputs  # noqa: E402
from benchlib import copy_bandwidth_gbs, time_calls, write_json  # noqa: E402

from kernels.fp8 import dequantize  # noqa: E402
from kernels.moe import triton as moe  # noqa: E402

M_VALUES = (2, 8, 16, 32, 64)
TOL = {"grouped": 2e-2, "grouped_fp8_x": 6e-2}  # FP8 x FP8 quantizes the activations per 128-wide group


def block(path: str, inputs: list, w: tuple, K: int, sc: tuple, i: int) -> torch.Tensor:
    """The MoE block on inputs[i] by `path`: decode, grouped (weight-only for fp8 experts), grouped_fp8_x."""
    if path == "decode":
        return moe.moe_block_decode(*inputs[i], *w, K, None, None, *sc)
    return moe.moe_block_prefill(*inputs[i], *w, K, *sc, fp8_x=path == "grouped_fp8_x")


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
                names = ["decode", "grouped"] + (["grouped_fp8_x"] if kind == "fp8" else [])
                paths = {p: functools.partial(block, p, inputs, w, K, sc) for p in names}
                decode = paths["decode"](0)
                row = {"shape": name, "weights": kind, "M": M}
                for path, call in paths.items():
                    if path != "decode":
                        row[f"rel_err_{path}_vs_decode"] = rel_err(call(0), decode)
                        row["check_ok"] = row.get("check_ok", True) and row[f"rel_err_{path}_vs_decode"] < TOL[path]
                    row[f"{path}_us"], _ = time_calls(call, len(inputs), "cuda")
                rows.append(row)
                print(f"{name:>5} {kind:<5} M={M:<3} " + "  ".join(f"{p} {row[f'{p}_us']:8.1f} us" for p in paths)
                      + ("" if row["check_ok"] else "  CHECK FAILED"), flush=True)  # fmt: skip
    write_json(args.out, "probe_moe_batch_path", "cuda", copy_gbs=copy_gbs, rows=rows)
    if not all(r["check_ok"] for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
