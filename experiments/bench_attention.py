"""The gated attention layer (q/k norm + RoPE, KV cache write, attention, output gate; Triton vs the model's torch
path) at 35B-A3B dims, decode and prefill.

Decode: batch 1, bf16, 16 q / 2 kv heads of 256, static cache of --cache-len slots, context 1k / 8k / 32k.
Each call is timed inside one CUDA graph of many calls (the decode step is graph-captured, so launch
overhead is not part of it), every call on its own cache so the KV read comes from HBM, not L2.
GB/s counts the K and V bytes of keys 0..pos. Prefill at T = 4096: the Triton kernel and the torch path
(masked GQA SDPA) against the rest of the attention layer and a lower bound of the rest of the 35B-A3B
prefill step (its active-parameter GEMM FLOPs at the measured bf16 GEMM rate).

    PYTHONPATH=. python experiments/bench_attention.py [--out results/bench_attention.json]
"""

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from benchlib import L2_FLUSH_BYTES, copy_bandwidth_gbs, gemm_tflops, print_targets, target, time_calls

from kernels.attention import naive
from kernels.attention import triton as tri
from qmoe.metrics.measure import environment

HQ, HKV, D, HIDDEN, ROT = 16, 2, 256, 2048, 64  # 35B-A3B attention layer
# 35B-A3B parameters touched per token in prefill, without lm_head: 10 attention layers (q+gate, k, v, o),
# 30 DeltaNet layers (qkv, z, a, b, out), 40 MoE layers (8 routed + 1 shared expert of 3 x 2048 x 512, router)
ACTIVE_PARAMS = (
    10 * (2048 * 8192 + 2 * 2048 * 512 + 4096 * 2048)
    + 30 * (2048 * 8192 + 2048 * 4096 + 2 * 2048 * 32 + 4096 * 2048)
    + 40 * (9 * 3 * 2048 * 512 + 2048 * 256)
)


def layer_inputs(T: int, cache_len: int, device: str, dtype) -> dict:
    """gated_attention's arguments as the model passes them: q, gate, k, v strided views of one fused q|k|v
    projection output, norm weights, the caches, positions 0..T-1 (prefill) or [context - 1] (set by callers)."""
    fused = torch.randn(1, T, 2 * HQ * D + 2 * HKV * D, device=device, dtype=dtype)
    qg, k, v = fused.split([2 * HQ * D, HKV * D, HKV * D], dim=-1)
    q, gate = qg.view(1, T, HQ, 2 * D).chunk(2, dim=-1)
    k_cache, v_cache = torch.zeros(2, 1, HKV, cache_len, D, device=device, dtype=dtype)
    return dict(
        q=q, gate=gate, k=k.view(1, T, HKV, D), v=v.view(1, T, HKV, D),
        q_weight=torch.zeros(D, device=device, dtype=dtype), k_weight=torch.zeros(D, device=device, dtype=dtype),
        k_cache=k_cache, v_cache=v_cache, positions=torch.arange(T, device=device)[None],
        inv_freq=1.0 / (1e7 ** (torch.arange(0, ROT, 2, dtype=torch.float32, device=device) / ROT)),
    )  # fmt: skip


def bench_decode(context: int, cache_len: int, device: str, dtype) -> dict:
    """The whole gated attention layer of one decode token (q/k norm + RoPE, cache write, attention, gate)."""
    kv_read = 2 * HKV * context * D * dtype.itemsize  # K and V of keys 0..pos
    copies = max(2, -(-L2_FLUSH_BYTES // kv_read)) if device == "cuda" else 2
    layers = [layer_inputs(1, cache_len, device, dtype) for _ in range(copies)]
    for x in layers:
        x["k_cache"].normal_()
        x["v_cache"].normal_()
        x["positions"].fill_(context - 1)
    row = {"context": context, "cache_len": cache_len, "kv_bytes_read": kv_read, "rotated_caches": copies}
    for name, attn in (("triton", tri.gated_attention), ("torch", naive.gated_attention)):
        call = lambda i, attn=attn: attn(**layers[i], eps=1e-6, scale=D**-0.5)
        us, method = time_calls(call, copies, device)
        row[f"{name}_us"], row[f"{name}_gbs"], row[f"{name}_timing"] = us, kv_read / us / 1e3, method
    row["speedup_vs_torch"] = row["torch_us"] / row["triton_us"]
    row["splits"] = tri.num_splits(1, HKV, cache_len, torch.device(device))
    return row


def bench_prefill(T: int, cache_len: int, device: str, dtype) -> dict:
    """Prefill of T tokens from position 0: the gated attention layer (Triton: norm + RoPE + cache write, then
    flash attention with the gate; torch: the reference) against the rest of the attention layer (the q|k|v and
    o projections)."""
    x = torch.randn(1, T, HIDDEN, device=device, dtype=dtype)
    w_qkv = torch.randn(2 * HQ * D + 2 * HKV * D, HIDDEN, device=device, dtype=dtype) * HIDDEN**-0.5
    w_o = torch.randn(HIDDEN, HQ * D, device=device, dtype=dtype) * (HQ * D) ** -0.5
    attn_out = torch.randn(1, T, HQ * D, device=device, dtype=dtype)
    layer = layer_inputs(T, cache_len, device, dtype)

    def rest(i):  # the attention layer without its attention core
        return F.linear(x, w_qkv), F.linear(attn_out, w_o)

    row = {"T": T, "cache_len": cache_len}
    for name, attn in (("triton", tri.gated_attention), ("torch", naive.gated_attention)):
        call = lambda i, attn=attn: attn(**layer, eps=1e-6, scale=D**-0.5)
        us, _ = time_calls(call, 2, device, reps=3)
        row[f"{name}_attention_us"] = us
        row[f"{name}_attention_tflops"] = 4 * T * (T + 1) / 2 * D * HQ / us / 1e6  # causal FLOPs actually needed
    row["rest_of_layer_us"], _ = time_calls(rest, 2, device, reps=3)
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/bench_attention.json")
    parser.add_argument("--cache-len", type=int, default=32768, help="static KV cache slots (max_seq_len)")
    parser.add_argument("--smoke", action="store_true", help="tiny contexts on CPU (checks the script only)")
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda"
    dtype = torch.float32 if args.smoke else torch.bfloat16
    contexts, prefill_T, cache_len = ([64, 200], 64, 256) if args.smoke else ([1024, 8192, 32768], 4096, args.cache_len)
    t0 = time.time()
    copy_gbs, tflops = copy_bandwidth_gbs(device), gemm_tflops(device)

    decode = [bench_decode(c, cache_len, device, dtype) for c in contexts]
    prefill = [bench_prefill(prefill_T, s, device, dtype) for s in sorted({prefill_T, cache_len})]
    rest_of_step_us = 2 * ACTIVE_PARAMS * prefill_T / tflops / 1e6  # lower bound: GEMM FLOPs at the ceiling
    for row in prefill:
        row["rest_of_step_lower_bound_us"] = rest_of_step_us
        for name in ("triton", "torch"):  # share of the step taken by the 10 attention layers' attention
            attn = 10 * row[f"{name}_attention_us"]
            row[f"{name}_attention_share_of_step"] = attn / (attn + rest_of_step_us)

    # Targets: short contexts are latency-bound; the 32k context streams KV at >= 60% of the copy ceiling;
    # prefill attention is not the bottleneck when it is < 25% of (attention + a lower bound of the rest).
    targets = [
        target("decode 1k latency us", decode[0]["triton_us"], 8, at_most=True),
        target("decode 8k latency us", decode[1]["triton_us"], 12, at_most=True),
        target("decode 32k KV GB/s", decode[-1]["triton_gbs"], 0.6 * copy_gbs, at_most=False),
    ]
    for row in prefill:
        what = f"prefill T={prefill_T} attention share of step, cache {row['cache_len']}"
        targets.append(target(what, row["triton_attention_share_of_step"], 0.25, at_most=True))

    result = {
        **environment(torch.device(device)),
        "benchmark": "attention",
        "dims": {"q_heads": HQ, "kv_heads": HKV, "head_dim": D, "batch": 1, "dtype": str(dtype)},
        "ceilings": {"copy_gbs": copy_gbs, "bf16_gemm_tflops": tflops},
        "decode": decode,
        "prefill": prefill,
        "targets": targets,
        "seconds": time.time() - t0,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))

    print(f"copy {copy_gbs:.0f} GB/s, bf16 GEMM {tflops:.0f} TFLOP/s, cache {cache_len} slots")
    print(f"{'context':>8} {'triton us':>10} {'GB/s':>7} {'torch us':>9} {'GB/s':>7} {'speedup':>8} {'splits':>6}")
    for r in decode:
        tri_cols = f"{r['triton_us']:>10.1f} {r['triton_gbs']:>7.0f}"
        torch_cols = f"{r['torch_us']:>9.1f} {r['torch_gbs']:>7.0f}"
        print(f"{r['context']:>8} {tri_cols} {torch_cols} {r['speedup_vs_torch']:>7.1f}x {r['splits']:>6}")
    for r in prefill:
        ms = {key: r[key] / 1e3 for key in ("triton_attention_us", "torch_attention_us", "rest_of_layer_us")}
        print(
            f"prefill T={r['T']} cache {r['cache_len']}: attention triton {ms['triton_attention_us']:.2f} ms "
            f"({r['triton_attention_tflops']:.0f} TFLOP/s), torch {ms['torch_attention_us']:.2f} ms; "
            f"rest of layer {ms['rest_of_layer_us']:.2f} ms; 10 layers' attention = "
            f"{r['triton_attention_share_of_step']:.0%} (triton) / {r['torch_attention_share_of_step']:.0%} (torch) "
            f"of the step (rest >= {rest_of_step_us / 1e3:.1f} ms)"
        )
    print_targets(targets)
    print(f"-> {args.out} ({result['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
