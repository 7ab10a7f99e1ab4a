"""What the sorted prefill MoE pays for padding (35B-A3B experts, 4096 tokens, bf16): the up + down kernels
(`routed_partials_into`) on uniform random routing, where each expert's ~128 pairs are padded to BLOCK_M-row
blocks (about half the experts then run a second block of ~10 real rows), against a perfectly packed routing
(every expert exactly 128 pairs, one full 128-row block each), for the H200 table's config and BLOCK_M 64 / 128
tiles, and the table's config with SUB_TILES 0 / 1 / 2 (a tail block on a tile of half / a quarter of the rows), for
bf16 and for fp8 experts (FP8 x FP8, the table's float8 entry). Same x, weights and routing weights in every
row; CUDA-graph timing; weights (1.6 GB bf16) past L2. Each SUB_TILES row also reports its largest difference
from SUB_TILES 0 relative to the output's largest value, and whether two runs of it are bit-identical (at b87aa79
the pairs' order inside an expert's group came from atomics, so which rows landed in a tail block could change
between runs; since ffac9b7 align_pairs keeps pair order, and the runs must agree).

    PYTHONPATH=. python experiments/probe_moe_packing.py [--out results/probe_moe_packing.json]
"""

import argparse
import time

import torch
from benchlib import time_calls, write_json

from kernels.fp8 import quantize_rows
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
    table = {**tri.get_config(M, E, H, I, torch.bfloat16), "SUB_TILES": 0}
    configs = {"table": table}
    for bm in (64, 128):
        for up_n, warps in ((64, 4), (64, 8), (128, 8)):
            tile = lambda n, w=warps: dict(BLOCK_N=n, BLOCK_K=64, num_warps=w, num_stages=3)  # noqa: E731
            configs[f"BLOCK_M {bm}, up {up_n}, down 128, {warps} warps"] = {
                "BLOCK_M": bm, "up": tile(up_n), "down": tile(128)}  # fmt: skip
    for sub in (1, 2):
        configs[f"table, SUB_TILES {sub}"] = {**table, "SUB_TILES": sub}
    rows = []

    def save():  # after every row: a run cut short keeps what it measured
        write_json(args.out, "probe_moe_packing", dev, shape=dict(E=E, H=H, I=I, K=K, M=M), rows=rows,
                   seconds=time.time() - t0)  # fmt: skip

    for name, config in configs.items():
        for routing, ids in routings.items():
            rows.append(measure(name, config, routing, ids, x, ((w13, None), (w2, None)), weights, h, partials))
            save()
    q13, q2 = quantize_rows(w13), quantize_rows(w2)  # (fp8, scale) each
    del w13, w2
    fp8_table = {**tri.get_config(M, E, H, I, torch.float8_e4m3fn), "SUB_TILES": 0}
    for sub in (0, 1, 2):
        name, config = f"fp8 table, SUB_TILES {sub}", {**fp8_table, "SUB_TILES": sub}
        if fp8_table["BLOCK_M"] >> sub < 16:
            continue
        rows.append(measure(name, config, "uniform", routings["uniform"], x, (q13, q2), weights, h, partials))
        save()


def measure(name, config, routing, ids, x, experts, weights, h, partials) -> dict:
    """One row: µs of up + down, rows computed, and for SUB_TILES configs the difference from SUB_TILES 0.
    experts: ((w13, its scale), (w2, its scale)), the scales None for bf16."""
    (w13, s13), (w2, s2) = experts
    run = lambda c: tri.routed_partials_into(x, w13, w2, weights, ids, h, partials, c, s13, s2).clone()  # noqa: E731
    us = time_calls(lambda i: tri.routed_partials_into(x, w13, w2, weights, ids, h, partials, config, s13, s2), 2,
                    "cuda", reps=5)[0]  # fmt: skip
    counts = torch.bincount(ids.flatten(), minlength=E)
    computed = int(((counts + config["BLOCK_M"] - 1) // config["BLOCK_M"] * config["BLOCK_M"]).sum())
    row = dict(config=name, tiles=config, routing=routing, us=us, computed_rows=computed, pairs=ids.numel())
    if config.get("SUB_TILES"):
        base, out, again = run({**config, "SUB_TILES": 0}), run(config), run(config)
        row["rel_diff_from_sub_tiles_0"] = ((out.float() - base.float()).abs().max() / base.float().abs().max()).item()
        row["bit_identical_runs"] = bool(torch.equal(out, again))
    print(f"{name:<38} {routing:<8} {us:8.1f} us  rows computed {computed} ({ids.numel() / computed:.2f} real)"
          + (f"  diff {row['rel_diff_from_sub_tiles_0']:.1e} same bits {row['bit_identical_runs']}"
             if "bit_identical_runs" in row else ""), flush=True)  # fmt: skip
    return row


if __name__ == "__main__":
    main()
