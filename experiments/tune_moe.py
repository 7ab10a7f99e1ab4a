"""Pick fused_moe launch configs on this GPU -> kernels/moe/configs/<gpu>.json (committed; read at import).

Per shape (E, H, I), dtype and tuned M, a small hand-picked search: the up-kernel candidates with the down kernel at
its default, then the down candidates with the best up (the two kernels are independent apart from BLOCK_M). Each
candidate is timed on the whole op inside one CUDA graph of rotated routings (bench_moe.time_graph). The winner of a
tuned M is stored for every M bucket it stands for. Small on purpose: about a minute on an H200 for the 35B shapes,
compiles included; --budget-s stops early and leaves the untuned buckets to the defaults. Entries already in the file
for other shapes or dtypes are kept.

    python experiments/tune_moe.py [--shapes 35B 122B] [--budget-s 75] [--out kernels/moe/configs/<gpu>.json]
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_moe import SHAPES, SMOKE_SHAPES, make_routing, time_eager, time_graph  # noqa: E402

from kernels.moe import triton as tri  # noqa: E402

# tuned M -> the M buckets its config is stored for, most important first (the budget may cut the tail). Decode
# kernels compile per M (the id block is a power of two >= M * K); prefill kernels do not, so the prefill Ms after
# the first cost only their timing.
TUNE_M = {
    1: (1, 2, 4),
    64: (64,),
    8192: (8192, 16384),
    2048: (2048, 4096),
    512: (128, 256, 512, 1024),
    8: (8, 16, 32),
}
# (BLOCK_N, BLOCK_K, num_warps, num_stages)
DECODE_UP = [(16, 128, 4, 4), (32, 128, 4, 3), (32, 256, 4, 3), (64, 128, 4, 3)]
DECODE_DOWN = [(32, 128, 4, 4), (64, 128, 4, 3), (64, 256, 4, 3), (128, 64, 4, 4)]
PREFILL_BLOCK_M = (64, 128)
PREFILL_UP = [(64, 64, 4, 3), (64, 64, 8, 4), (128, 64, 8, 3)]
PREFILL_DOWN = [(128, 64, 4, 3), (128, 64, 8, 4), (64, 64, 4, 4), (256, 64, 8, 3)]


def launch(c):
    return dict(zip(("BLOCK_N", "BLOCK_K", "num_warps", "num_stages"), c))


def tune_m(M, s, w13, w2, x):
    """Best config for M tokens -> (config, µs)."""
    E, K = s["E"], s["K"]
    n = 2 if M > tri.DECODE_MAX_M else 8
    routings = [make_routing(M, E, K, False, seed, x.device) for seed in range(n)]
    h, partials = x.new_empty(M * K, s["I"]), x.new_empty(M * K, s["H"])
    timer = time_graph if x.is_cuda else time_eager  # eager wall clock only for --smoke on CPU

    def measure(config):
        call = lambda i: tri.fused_moe_into(x[:M], w13, w2, *routings[i], h, partials, config=config)
        try:
            return timer(call, n, reps=5 if M <= 512 else 3)
        except Exception as err:  # noqa: BLE001 -- e.g. out of shared memory: the candidate is just dropped
            print(f"  skip {config}: {type(err).__name__}", flush=True)
            return float("inf")

    decode = M <= tri.DECODE_MAX_M
    default = tri.DEFAULT_CONFIGS["decode" if decode else "prefill"]
    ups, downs = (DECODE_UP, DECODE_DOWN) if decode else (PREFILL_UP, PREFILL_DOWN)
    candidates = [(bm, launch(u)) for bm in ((16,) if decode else PREFILL_BLOCK_M) for u in ups]
    timed = [(measure({"BLOCK_M": bm, "up": up, "down": default["down"]}), bm, up) for bm, up in candidates]
    _, block_m, up = min(timed, key=lambda t: t[0])
    timed = [(measure({"BLOCK_M": block_m, "up": up, "down": launch(d)}), launch(d)) for d in downs]
    us, down = min(timed, key=lambda t: t[0])
    return {"BLOCK_M": block_m, "up": up, "down": down}, us


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["35B"], choices=list(SHAPES))
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--budget-s", type=float, default=75.0, help="stop tuning new M values after this long")
    parser.add_argument("--out", default=None, help="default: kernels/moe/configs/<gpu name>.json")
    parser.add_argument("--smoke", action="store_true", help="tiny shape on CPU (checks the script); needs --out")
    args = parser.parse_args()
    device, dtype = ("cpu", torch.float32) if args.smoke else ("cuda", getattr(torch, args.dtype))
    shapes, tune = (
        (SMOKE_SHAPES, {1: (1,), 70: (128,)}) if args.smoke else ({n: SHAPES[n] for n in args.shapes}, TUNE_M)
    )
    gpu = "cpu" if args.smoke else torch.cuda.get_device_name()
    out = Path(args.out) if args.out else tri.gpu_config_path(gpu)
    table = json.loads(out.read_text()) if out.exists() else {}
    t0 = time.time()
    for name, s in shapes.items():
        gen = torch.Generator(device=device).manual_seed(0)
        w13 = torch.randn(s["E"], 2 * s["I"], s["H"], device=device, dtype=dtype, generator=gen) * s["H"] ** -0.5
        w2 = torch.randn(s["E"], s["H"], s["I"], device=device, dtype=dtype, generator=gen) * s["I"] ** -0.5
        x = torch.randn(max(tune), s["H"], device=device, dtype=dtype, generator=gen)
        entry = table.setdefault(tri.shape_key(s["E"], s["H"], s["I"], dtype), {})
        for M, buckets in tune.items():
            if time.time() - t0 > args.budget_s:
                print(f"budget of {args.budget_s:.0f} s spent: {name} M={M} keeps its previous/default config")
                continue
            config, us = tune_m(M, s, w13, w2, x)
            entry.update({str(b): config for b in buckets})
            print(f"{name} M={M:<5} {us:9.1f} us  {config}  ({time.time() - t0:.0f} s)", flush=True)
        del w13, w2
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print(f"-> {out} for {gpu} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
