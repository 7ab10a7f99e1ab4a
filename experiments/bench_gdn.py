"""Gated DeltaNet (Triton vs the model's torch path) at Qwen3.5-35B-A3B dims, bf16, batch 1.

Decode: one layer's DeltaNet core per call (conv state update + SiLU, gates, q/k norm, fp32 delta-rule
state update, output, gated RMSNorm), timed inside one CUDA graph of 30 calls, each on its own layer's
inputs and states (30 x 2 MiB of fp32 state > L2), so the state comes from HBM as in the model. Floor: the
2 MiB state read + written once at the measured copy bandwidth. Target <= 8 µs per layer.
Prefill: T = 512 and 4096, the same core against the torch chunked reference (kernels/gdn/naive.py), inputs
rotated over > L2 bytes; target >= 10x faster. The Triton prefill is also split into its four launches.

    PYTHONPATH=. python experiments/bench_gdn.py [--out results/bench_gdn.json]
    PYTHONPATH=. python experiments/bench_gdn.py --smoke   # tiny dims on CPU (Triton interpreter)
"""

import argparse
import math
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel is imported (smoke runs)

from benchlib import L2_FLUSH_BYTES, ceilings, print_targets, target, time_calls, write_json  # noqa: E402

from kernels.gdn import naive  # noqa: E402
from kernels.gdn import triton as gdn_triton  # noqa: E402
from kernels.gdn.chunk import chunk_delta_rule, gated_norm, wy_transform  # noqa: E402
from kernels.gdn.conv import causal_conv1d  # noqa: E402

DIMS_35B = dict(nk=16, nv=32, dk=128, dv=128, kw=4)
DIMS_SMOKE = dict(nk=2, nv=4, dk=16, dv=16, kw=4)
DECODE_LAYERS = 30  # the 35B-A3B's DeltaNet layers
DECODE_TARGET_US, PREFILL_TARGET_X = 8.0, 10.0


def layer_inputs(T, nk, nv, dk, dv, kw, dtype, device, seed):
    """One layer's inputs at batch 1, decay parameters in their published ranges, nonzero states."""
    gen = torch.Generator(device=device).manual_seed(seed)
    C = 2 * nk * dk + nv * dv
    randn = lambda *shape, dt=dtype: torch.randn(*shape, generator=gen, device=device, dtype=dt)
    return dict(
        mixed_qkv=randn(1, T, C),
        z=randn(1, T, nv * dv),
        a=randn(1, T, nv),
        b=randn(1, T, nv),
        conv_weight=randn(C, 1, kw) / kw**0.5,
        A_log=torch.empty(nv, device=device).uniform_(0.01, 16.0, generator=gen).log().to(dtype),
        dt_bias=torch.empty(nv, device=device).uniform_(0.5, 1.5, generator=gen).to(dtype),
        norm_weight=1.0 + 0.1 * randn(dv),
        conv_state=randn(1, C, kw - 1),
        recurrent_state=0.1 * randn(1, nv, dk, dv, dt=torch.float32),
    )


def nbytes(x: dict) -> int:
    return sum(t.numel() * t.element_size() for t in x.values())


def bench_prefill(T, dims, dtype, device, smoke) -> tuple[list, float]:
    """Rows for the whole prefill core (triton, torch) and the four triton launches; the speedup."""
    nk, rows, prefill_us = dims["nk"], [], {}
    probe = layer_inputs(T, **dims, dtype=dtype, device=device, seed=0)
    n = 1 if smoke else max(2, math.ceil(L2_FLUSH_BYTES / nbytes(probe)))
    xs = [probe] + [layer_inputs(T, **dims, dtype=dtype, device=device, seed=i) for i in range(1, n)]
    for impl, module in (("triton", gdn_triton), ("torch", naive)):
        call = lambda i, m=module: m.gated_delta_net(**xs[i], num_k_heads=nk, eps=1e-6)
        us, method = time_calls(call, n, device, reps=5)
        prefill_us[impl] = us
        rows.append(dict(phase="prefill", impl=impl, T=T, us=us, timed_by=method, tokens_per_s=T / us * 1e6))
    speedup = prefill_us["torch"] / prefill_us["triton"]
    rows[0]["speedup_vs_torch"] = speedup

    # stage breakdown on the first layer's inputs (each stage fed by the previous one's output)
    x = xs[0]
    qkv = causal_conv1d(x["mixed_qkv"], x["conv_state"], x["conv_weight"])
    wy = wy_transform(qkv, x["a"], x["b"], x["A_log"], x["dt_bias"], nk, dims["dk"], dims["dv"])
    o = chunk_delta_rule(qkv, wy, x["recurrent_state"], nk)
    stages = {
        "causal_conv1d": lambda i: causal_conv1d(x["mixed_qkv"], x["conv_state"], x["conv_weight"]),
        "wy_transform": lambda i: wy_transform(
            qkv, x["a"], x["b"], x["A_log"], x["dt_bias"], nk, dims["dk"], dims["dv"]
        ),
        "chunk_delta_rule": lambda i: chunk_delta_rule(qkv, wy, x["recurrent_state"], nk),
        "gated_norm": lambda i: gated_norm(o, x["z"], x["norm_weight"], 1e-6),
    }
    for name, call in stages.items():
        us, method = time_calls(call, 1, device, reps=5)
        rows.append(dict(phase=f"prefill stage {name}", impl="triton", T=T, us=us, timed_by=method))
    return rows, speedup


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/bench_gdn.json")
    parser.add_argument("--smoke", action="store_true", help="tiny dims, short prompts (CPU interpreter check)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    smoke = args.smoke or device == "cpu"
    dims = DIMS_SMOKE if smoke else DIMS_35B
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    nk = dims["nk"]
    prompt_lens = (64, 130) if smoke else (512, 4096)
    ceil = ceilings(device)
    copy_gbs = ceil["copy_gbs"]
    rows, targets = [], []

    # ---- decode: one CUDA graph of DECODE_LAYERS calls, each on its own layer ----
    n = 3 if smoke else DECODE_LAYERS
    layers = [layer_inputs(1, **dims, dtype=dtype, device=device, seed=i) for i in range(n)]
    state_bytes = layers[0]["recurrent_state"].numel() * 4
    floor_us = 2 * state_bytes / copy_gbs / 1e3  # state read + written once
    decode_us = {}
    for impl, module in (("triton", gdn_triton), ("torch", naive)):
        call = lambda i, m=module: m.gated_delta_net(**layers[i], num_k_heads=nk, eps=1e-6)
        us, method = time_calls(call, n, device)
        decode_us[impl] = us
        rows.append(dict(phase="decode", impl=impl, T=1, us=us, timed_by=method, floor_us=floor_us,
                         state_gbs=2 * state_bytes / us / 1e3, bytes_per_call=nbytes(layers[0])))  # fmt: skip
    targets.append(target("decode µs per DeltaNet layer (triton)", decode_us["triton"], DECODE_TARGET_US, True))

    # ---- prefill: whole core, triton vs torch, and the triton launches one by one ----
    for T in prompt_lens:
        prefill_rows, speedup = bench_prefill(T, dims, dtype, device, smoke)
        rows += prefill_rows
        targets.append(target(f"prefill T={T} speedup vs torch chunked", speedup, PREFILL_TARGET_X, False))

    doc = write_json(args.out, "bench_gdn", device, dims=dims, dtype=str(dtype), ceilings=ceil, rows=rows,
                     targets=targets)  # fmt: skip
    print(f"{doc['device_name']}  copy {copy_gbs:.0f} GB/s  bf16 GEMM {ceil['bf16_gemm_tflops']:.0f} TFLOP/s")
    print(f"{'phase':<32}{'impl':<8}{'T':>6}{'µs':>12}  notes")
    for r in rows:
        note = ""
        if r["phase"] == "decode":
            note = f"floor {r['floor_us']:.2f} µs, state {r['state_gbs']:.0f} GB/s ({r['timed_by']})"
        elif "speedup_vs_torch" in r:
            note = f"{r['speedup_vs_torch']:.1f}x vs torch"
        print(f"{r['phase']:<32}{r['impl']:<8}{r['T']:>6}{r['us']:>12.1f}  {note}")
    print_targets(targets)


if __name__ == "__main__":
    main()
