"""What the sorted prefill MoE pays for padding (35B-A3B experts, 4096 tokens, bf16): the up + down kernels
(`routed_partials_into`) on uniform random routing, where each expert's ~128 pairs are padded to BLOCK_M-row
blocks (about half the experts then run a second block of ~10 real rows), against a perfectly packed routing
(every expert exactly 128 pairs, one full 128-row block each), for the H200 table's config and BLOCK_M 64 / 128
tiles. Same x, weights and routing weights in every row; CUDA-graph timing; weights (1.6 GB) past L2.

    PYTHONPATH=. python experiments/probe_moe_packing.py [--out results/probe_moe_packing.json]
"""

import argparse
import time

import torch
from benchlib import time_calls, write_json

from kernels.moe import triton as tri

E, H, I, K, M = 256, 2048, 512, 8, 4096  # 4096 x 8 = 32,768 pairs = 256 experts x 128


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/probe_moe_packing.json")
    args = parser.parse_args()
    t0, dev = time.time(), "cuda"
    torch.manual_seed(0)
    w13 = (torch.randn(E, 2 * I, H, device=dev) / H**0.5).bfloat16()
    w2 = (torch.randn(E, H, I, device=dev) / I**0.5).bfloat16()
    x = torch.randn(M, H, device=dev).bfloat16()
    weights = torch.rand(M, K, device=dev)
    routings = {
        "uniform": torch.stack([torch.randperm(E, device=dev)[:K] for _ in range(M)]),
        "packed": (torch.arange(M, device=dev)[:, None] * K + torch.arange(K, device=dev)[None, :]) % E,
    }
    h, partials = x.new_empty(M * K, I), x.new_empty(M * K, H)
    table = tri.get_config(M, E, H, I, torch.bfloat16)
    configs = {"table": table}
    for bm in (64, 128):
        for up_n, warps in ((64, 4), (64, 8), (128, 8)):
            tile = lambda n, w=warps: dict(BLOCK_N=n, BLOCK_K=64, num_warps=w, num_stages=3)  # noqa: E731
            configs[f"BLOCK_M {bm}, up {up_n}, down 128, {warps} warps"] = {
                "BLOCK_M": bm, "up": tile(up_n), "down": tile(128)}  # fmt: skip
    rows = []
    for name, config in configs.items():
        for routing, ids in routings.items():
            counts = torch.bincount(ids.flatten(), minlength=E)
            computed = int(((counts + config["BLOCK_M"] - 1) // config["BLOCK_M"] * config["BLOCK_M"]).sum())
            fn = lambda i, ids=ids, c=config: tri.routed_partials_into(x, w13, w2, weights, ids, h, partials, c)  # noqa: E731
            us = time_calls(fn, 2, dev, reps=5)[0]
            rows.append(dict(config=name, tiles=config, routing=routing, us=us, computed_rows=computed, pairs=M * K))
            print(f"{name:<38} {routing:<8} {us:8.1f} us  rows computed {computed} ({M * K / computed:.2f} real)")
            write_json(args.out, "probe_moe_packing", dev, shape=dict(E=E, H=H, I=I, K=K, M=M), rows=rows,
                       seconds=time.time() - t0)  # fmt: skip


if __name__ == "__main__":
    main()
