"""Launch-option sweep of the gated-attention decode kernel at 35B-A3B dims (batch 1, bf16): splits of the key
range x keys per tile x warps x pipeline stages, at contexts 256 / 1k / 8k / 32k in a 32k-slot cache, each config
checked against the default's output first and timed inside a CUDA graph over caches rotated past L2. Prints the
best per context next to the default; JSON to results/tune_attention.json.

    PYTHONPATH=. python experiments/tune_attention.py
"""

import itertools
import time

import torch
from bench_attention import HKV, HQ, D, layer_inputs
from benchlib import L2_FLUSH_BYTES, time_calls, write_json

from kernels.attention import triton as tri

CACHE = 32768
CONTEXTS = (256, 1024, 8192, 32768)


def call(x, splits, options):
    out = torch.empty(1, 1, HQ * D, device="cuda", dtype=x["q"].dtype)
    o_part = torch.empty(1, HQ, splits, D, device="cuda", dtype=torch.float32)
    lse = torch.empty(1, HQ, splits, device="cuda", dtype=torch.float32)
    args = [x[k] for k in ("q", "gate", "k", "v", "q_weight", "k_weight", "k_cache", "v_cache", "positions")]
    tri.decode_attention_into(*args, x["inv_freq"], 1e-6, D**-0.5, out, o_part, lse, options=options)
    return out


def measure(layers, splits, options, ref) -> dict:
    """Error against the default config's output, then µs per call over the rotated caches."""
    err = ((call(layers[0], splits, options).float() - ref).abs().max() / ref.abs().max()).item()
    us, _ = time_calls(lambda i: call(layers[i % len(layers)], splits, options), len(layers), "cuda")
    return dict(us=us, err=err)


def main():
    dtype, t0, rows = torch.bfloat16, time.time(), []
    default_splits = tri.num_splits(1, HKV, CACHE, torch.device("cuda"))
    for context in CONTEXTS:
        kv_read = 2 * HKV * context * D * dtype.itemsize
        layers = [layer_inputs(1, CACHE, "cuda", dtype) for _ in range(max(2, -(-L2_FLUSH_BYTES // kv_read)))]
        for x in layers:
            x["k_cache"].normal_()
            x["v_cache"].normal_()
            x["positions"].fill_(context - 1)
        ref = call(layers[0], default_splits, None).float()
        rows.append(
            dict(context=context, splits=default_splits, default=True, **measure(layers, default_splits, None, ref))
        )
        for splits, bn, warps, stages in itertools.product((4, 8, 16, 32, 64, 128), (32, 64), (4, 8), (1, 2)):
            opts = dict(BLOCK_N=bn, num_warps=warps, num_stages=stages)
            try:
                rows.append(dict(context=context, splits=splits, **opts, **measure(layers, splits, opts, ref)))
            except Exception as e:  # noqa: BLE001 - a config that does not compile (shared memory) is recorded
                rows.append(dict(context=context, splits=splits, **opts, error=str(e)[:200]))
        write_json("results/tune_attention.json", "tune_attention", "cuda", rows=rows, seconds=time.time() - t0)
    for context in CONTEXTS:
        ok = [r for r in rows if r["context"] == context and "us" in r and r["err"] < 1e-2]
        best, dflt = min(ok, key=lambda r: r["us"]), next(r for r in ok if r.get("default"))
        print(
            f"context {context:>6}: default {dflt['us']:.1f} us (splits {dflt['splits']}); best {best['us']:.1f} us "
            f"splits {best['splits']} BLOCK_N {best['BLOCK_N']} warps {best['num_warps']} stages {best['num_stages']}"
        )


if __name__ == "__main__":
    main()
