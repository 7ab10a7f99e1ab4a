"""Pick moe_block launch configs on this GPU -> kernels/moe/configs/<gpu>.json (committed; read at import).

Per shape (E, H, I), dtype and tuned M, a small hand-picked search: the up-kernel candidates with the down kernel at
its default, then the down candidates with the best up (the two kernels are independent apart from BLOCK_M). Each
candidate is timed on the whole block inside one CUDA graph of rotated inputs (benchlib.time_calls; uniform routing
from random router logits). The winner of a tuned M is stored for every M bucket it stands for. By default only the
decode buckets (M <= 64: the two-launch path) are tuned, for the 35B and 122B shapes, in about two minutes on an
H200 with compiles; --prefill also re-tunes the grouped prefill path. --budget-s stops early and leaves the untuned
buckets as they are (default configs if absent). Entries already in the file for other shapes, dtypes or buckets
are kept.

--weights fp8 tunes the table's float8_e4m3fn entries instead: the experts quantized (kernels/fp8.quantize_rows of
the same random weights), every candidate run with their scales. Its prefill candidates are the FP8 x FP8 tiles
(BLOCK_K fixed at 128: one activation and one weight scale group per step); its decode candidates keep BLOCK_K <= 128
on the tiled path and a multiple of 128 on the GEMV (experiments/bench_fp8.py --sections sweep owns the fp8 GEMVs).

    python experiments/tune_moe.py [--shapes 35B 122B] [--prefill] [--m 4096] [--weights fp8] [--budget-s 210]
        [--out PATH]
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_moe import SHAPES, SMOKE_SHAPES, make_inputs, time_eager  # noqa: E402
from benchlib import time_calls  # noqa: E402

from kernels.fp8 import BLOCK_K as SCALE_BLOCK_K  # noqa: E402
from kernels.fp8 import FP8, quantize_rows  # noqa: E402
from kernels.moe import triton as tri  # noqa: E402
from kernels.tuned import gpu_config_path  # noqa: E402

# tuned M -> the M buckets its config is stored for, most important first (the budget may cut the tail). Decode
# kernels compile per M bucket (the pair and token blocks are powers of two >= M K and M).
# M = 1 runs the GEMV kernels (BLOCK_M = 1), so its config serves only bucket 1.
# M = 2 .. 64 each apart: the GEMV kernels race the tiles at each (the tile that M = 8 picks left the GPU
# idle at M = 2: 35B 65 us against the grouped path's 53, results/probe_moe_batch_path.json at eebd04f)
TUNE_DECODE = {1: (1,), 2: (2,), 4: (4,), 8: (8,), 16: (16,), 32: (32,), 64: (64,)}
TUNE_PREFILL = {8192: (8192, 16384), 4096: (4096,), 2048: (2048,), 512: (128, 256, 512, 1024)}
# (BLOCK_N, BLOCK_K, num_warps, num_stages)
DECODE_UP = [(16, 128, 4, 4), (32, 128, 4, 3), (64, 128, 4, 3), (128, 64, 4, 3), (32, 256, 8, 3)]
DECODE_DOWN = [(32, 128, 4, 4), (64, 128, 4, 3), (64, 256, 4, 3), (128, 64, 4, 4), (128, 128, 8, 3)]
GEMV_UP = [(2, 1024, 4, 2), (4, 1024, 4, 2), (8, 512, 4, 2), (16, 256, 4, 3), (8, 1024, 8, 2), (16, 512, 8, 2)]
GEMV_DOWN = [(1, 512, 4, 2), (2, 512, 4, 2), (4, 512, 4, 2), (2, 256, 4, 3), (4, 256, 4, 3), (8, 256, 8, 2)]
PREFILL_BLOCK_M = (64, 128)
PREFILL_UP = [(64, 64, 4, 3), (64, 64, 8, 4), (128, 64, 8, 3), (128, 64, 4, 4), (64, 128, 4, 3), (128, 128, 8, 3),
              (256, 64, 8, 3), (128, 64, 8, 4), (128, 32, 8, 4), (64, 64, 8, 3), (128, 32, 8, 6),
              (256, 32, 8, 4)]  # fmt: skip
PREFILL_DOWN = [(128, 64, 4, 3), (128, 64, 8, 4), (64, 64, 4, 4), (256, 64, 8, 3), (128, 128, 8, 3), (64, 128, 4, 3),
                (256, 64, 8, 4), (256, 32, 8, 4), (128, 64, 8, 3), (256, 32, 8, 5), (128, 32, 8, 6)]  # fmt: skip
# fp8 experts on the prefill path: FP8 x FP8 on pre-quantized activations, BLOCK_K = 128 always. The up tile holds two
# accumulators and their two dot results: on sm_90 (aot_sm90.py) 64 x 64 on 8 warps fits (142 registers), 64 x 128 on
# 8 warps spills 20 B, 128 x 128 1.7 KB; the down tiles do not spill, except 128 x 128 on 8 warps (64 B)
PREFILL_FP8_BLOCK_M = (64, 128)
PREFILL_FP8_UP = [(128, 128, 8, 3), (64, 128, 8, 3), (128, 128, 8, 2), (64, 128, 4, 3), (64, 128, 4, 4),
                  (128, 128, 8, 4), (256, 128, 8, 3)]  # fmt: skip
PREFILL_FP8_DOWN = [(128, 128, 8, 3), (64, 128, 8, 3), (64, 128, 4, 3), (128, 128, 4, 3), (256, 128, 8, 3),
                    (128, 128, 8, 4), (64, 128, 4, 4)]  # fmt: skip


def launch(c):
    return dict(zip(("BLOCK_N", "BLOCK_K", "num_warps", "num_stages"), c))


def fp8_candidates(kind: str, ups: list, downs: list) -> tuple[list, list]:
    """The candidates fp8 experts can run: the tiled decode path steps at most one scale group (BLOCK_K <= 128), the
    GEMV whole groups or divisors of one, the prefill FP8 x FP8 tiles exactly one (its own lists)."""
    if kind == "prefill":
        return PREFILL_FP8_UP, PREFILL_FP8_DOWN
    fits = (lambda k: k <= SCALE_BLOCK_K) if kind == "decode" else (lambda k: k % SCALE_BLOCK_K == 0)
    return [c for c in ups if fits(c[1])], [c for c in downs if fits(c[1])]


def tune_m(M, s, weights, device, dtype, scales=(None, None, None)):
    """Best config for M tokens -> (config, µs). scales: those of fp8 weights (w13, w2, shared_down)."""
    decode = M <= tri.DECODE_MAX_M
    n = 8 if decode else 2
    inputs = make_inputs(M, s, "uniform", n, dtype, device)
    w13, w2, shared_down = weights
    fp8 = scales[0] is not None

    def measure(config):
        if decode:
            call = lambda i: tri.moe_block_decode(*inputs[i], w13, w2, shared_down, s["K"], config, None, *scales)
        else:
            routed = [tri.route(p[:, : s["E"]], s["K"]) for _, p in inputs]
            call = lambda i: tri.fused_moe_into(
                inputs[i][0], w13, w2, *routed[i], inputs[i][0].new_empty(M * s["K"], s["I"]),
                inputs[i][0].new_empty(M * s["K"], s["H"]), config, *scales[:2],
            )  # fmt: skip
        try:
            if device == "cuda":
                return time_calls(call, n, device, reps=5 if M <= 512 else 3)[0]
            return time_eager(call, n, 1)  # --smoke on CPU
        except Exception as err:  # noqa: BLE001 -- e.g. out of shared memory: the candidate is just dropped
            print(f"  skip {config}: {type(err).__name__}", flush=True)
            return float("inf")

    # the kinds of kernels that can serve M: at decode sizes the GEMV kernels race the tiled ones
    kinds = ["gemv"] if M == 1 else ["gemv", "decode"] if decode else ["prefill"]
    best = []
    for kind in kinds:
        default = tri.DEFAULT_CONFIGS[{"gemv": "gemv_fp8", "prefill": "prefill_fp8"}.get(kind, kind) if fp8 else kind]
        ups, downs, block_ms = {
            "gemv": (GEMV_UP, GEMV_DOWN, (1,)),
            "decode": (DECODE_UP, DECODE_DOWN, (16,)),
            "prefill": (PREFILL_UP, PREFILL_DOWN, PREFILL_FP8_BLOCK_M if fp8 else PREFILL_BLOCK_M),
        }[kind]
        if fp8:
            ups, downs = fp8_candidates(kind, ups, downs)
        candidates = [(bm, launch(u)) for bm in block_ms for u in ups]
        timed = [(measure({"BLOCK_M": bm, "up": up, "down": default["down"]}), bm, up) for bm, up in candidates]
        _, block_m, up = min(timed, key=lambda t: t[0])
        timed = [(measure({"BLOCK_M": block_m, "up": up, "down": launch(d)}), launch(d)) for d in downs]
        us, down = min(timed, key=lambda t: t[0])
        config = {"BLOCK_M": block_m, "up": up, "down": down}
        if kind == "prefill":  # then tail blocks on half / quarter tiles (SUB_TILES), where tl.dot allows them
            subs = [sub for sub in (1, 2) if block_m >> sub >= 16]
            timed = [(us, config)] + [
                (measure({**config, "SUB_TILES": sub}), {**config, "SUB_TILES": sub}) for sub in subs
            ]
            us, config = min(timed, key=lambda t: t[0])
        best.append((us, config))
        if len(kinds) > 1:
            print(f"  M={M} best {kind}: {us:.1f} us", flush=True)
    us, config = min(best, key=lambda b: b[0])
    return config, us


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["35B", "122B"], choices=list(SHAPES))
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--weights", default="dense", choices=["dense", "fp8"],
                        help="fp8: quantized experts, the table's float8_e4m3fn entries")  # fmt: skip
    parser.add_argument("--prefill", action="store_true", help="also re-tune the prefill buckets (M > 64)")
    parser.add_argument("--m", type=int, nargs="+", help="tune only these M values (keys of the tuned-M tables)")
    parser.add_argument("--budget-s", type=float, default=210.0, help="stop tuning new M values after this long")
    parser.add_argument("--out", default=None, help="default: kernels/moe/configs/<gpu name>.json")
    parser.add_argument("--smoke", action="store_true", help="tiny shape on CPU (checks the script); needs --out")
    args = parser.parse_args()
    if args.smoke and not args.out:
        print("--smoke needs --out (it must not overwrite the GPU table)")
        sys.exit(2)
    device, dtype = ("cpu", torch.float32) if args.smoke else ("cuda", getattr(torch, args.dtype))
    if args.smoke:
        shapes, tune = SMOKE_SHAPES, {1: (1,), 5: (8,), 70: (128,)}
    else:
        shapes, tune = {n: SHAPES[n] for n in args.shapes}, {**TUNE_DECODE, **(TUNE_PREFILL if args.prefill else {})}
    if args.m:
        tune = {m: b for m, b in tune.items() if m in args.m}
    # dense experts take the grouped path above decode_max_m tokens (with the M > 64 buckets' configs): no decode
    # entries of theirs to tune there
    limit = tri.decode_max_m(FP8 if args.weights == "fp8" else dtype)
    tune = {m: b for m, b in tune.items() if not limit < m <= tri.DECODE_MAX_M}
    gpu = "cpu" if args.smoke else torch.cuda.get_device_name()
    out = Path(args.out) if args.out else gpu_config_path(tri.CONFIG_DIR, gpu)
    table = json.loads(out.read_text()) if out.exists() else {}
    t0 = time.time()
    for name, s in shapes.items():
        E, H, I = s["E"], s["H"], s["I"]
        gen = torch.Generator(device=device).manual_seed(0)
        weights = (
            torch.randn(E, 2 * I, H, device=device, dtype=dtype, generator=gen) * H**-0.5,
            torch.randn(E, H, I, device=device, dtype=dtype, generator=gen) * I**-0.5,
            torch.randn(H, I, device=device, dtype=dtype, generator=gen) * I**-0.5,
        )
        scales = (None, None, None)
        if args.weights == "fp8":  # expert by expert: quantize_rows' fp32 temporaries stay small at 122B
            pairs = [[quantize_rows(w[e]) for e in range(E)] for w in weights[:2]]
            pairs = [(torch.stack([q for q, _ in p]), torch.stack([sc for _, sc in p])) for p in pairs]
            pairs.append(quantize_rows(weights[2]))
            weights, scales = tuple(q for q, _ in pairs), tuple(sc for _, sc in pairs)
            del pairs
        entry = table.setdefault(tri.shape_key(E, H, I, FP8 if args.weights == "fp8" else dtype), {})
        for M, buckets in tune.items():
            if time.time() - t0 > args.budget_s:
                print(f"budget of {args.budget_s:.0f} s spent: {name} M={M} keeps its previous/default config")
                continue
            config, us = tune_m(M, s, weights, device, dtype, scales)
            entry.update({str(b): config for b in buckets})
            print(f"{name} M={M:<5} {us:9.1f} us  {config}  ({time.time() - t0:.0f} s)", flush=True)
        del weights
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print(f"-> {out} for {gpu} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
