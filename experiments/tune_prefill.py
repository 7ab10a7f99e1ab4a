"""Launch configs of the prefill kernels that are not GEMMs, swept on the 35B-A3B shapes at 4096 tokens (bf16, H200):
the DeltaNet causal conv (kernels/gdn/conv.CONFIG), WY transform, chunk state and gated norm
(kernels/gdn/chunk.{WY,STATE,NORM}_CONFIG), attention's q/k norm + RoPE and its flash kernel
(kernels/attention/triton.{NORM_ROPE_CONFIG,PREFILL_OPTIONS}). Inputs are slices of fused-projection-shaped
buffers, as in the model (row strides included).

Each candidate's output is checked against the current config's (max |diff| relative to max |ref|; the per-element
kernels must agree exactly) and timed as one CUDA graph of a call (median of 10 replays; every input and output is
> 30 MB, most > L2). The table prints each kernel's current and best config; the JSON keeps every row.

    PYTHONPATH=. python experiments/tune_prefill.py [--out results/tune_prefill.json] [--tokens 4096] [--apply]
    (--apply: then set the winners and time the 35B model's 4096-token prefill with them, by part)
"""

import argparse
import itertools
import time

import torch
from bench_attention import HQ
from bench_attention import D as HEAD_DIM
from bench_attention import layer_inputs as attention_layer
from bench_gdn import DIMS_35B
from bench_gdn import layer_inputs as gdn_layer
from benchlib import time_calls, write_json

from kernels.attention import triton as attention
from kernels.gdn import chunk, conv


def gdn_inputs(T: int, device) -> dict:
    """bench_gdn's DeltaNet layer at 35B dims in bf16, with q|k|v, z, b, a as slices of one fused projection row
    (the model's row strides)."""
    x = gdn_layer(T, **DIMS_35B, dtype=torch.bfloat16, device=device, seed=0)
    parts = [x["mixed_qkv"], x["z"], x["b"], x["a"]]
    fused = torch.cat(parts, dim=-1).split([t.shape[-1] for t in parts], dim=-1)
    x["mixed_qkv"], x["z"], x["b"], x["a"] = fused
    return x


def attention_inputs(T: int, device) -> dict:
    """bench_attention's gated-attention layer (strided views of the fused q|k|v row) and the prefill's outputs."""
    x = attention_layer(T, T + 16, device, torch.bfloat16)
    x["out"] = torch.empty(1, T, HQ * HEAD_DIM, device=device, dtype=torch.bfloat16)
    x["q_normed"] = torch.empty(1, T, HQ, HEAD_DIM, device=device, dtype=torch.bfloat16)
    return x


# each kernel's module-level launch config (the sweep changes it in place)
CONFIGS = {
    "gdn causal_conv1d": conv.CONFIG,
    "gdn wy_transform": chunk.WY_CONFIG,
    "gdn chunk_delta_rule": chunk.STATE_CONFIG,
    "gdn gated_norm": chunk.NORM_CONFIG,
    "attention norm_rope": attention.NORM_ROPE_CONFIG,
    "attention prefill": attention.PREFILL_OPTIONS,  # over the kernel's defaults (64 x 64 tiles, 8 warps, 2 stages)
}


def kernels_under_test(T: int, device) -> dict:
    """{name: (config dict, candidates, run() -> outputs to compare)}."""
    g, at = gdn_inputs(T, device), attention_inputs(T, device)
    nk, dk, dv = DIMS_35B["nk"], DIMS_35B["dk"], DIMS_35B["dv"]
    state0, conv0 = g["recurrent_state"].clone(), g["conv_state"].clone()
    qkv = conv.causal_conv1d(g["mixed_qkv"], g["conv_state"].clone(), g["conv_weight"])
    wy = chunk.wy_transform(qkv, g["a"], g["b"], g["A_log"], g["dt_bias"], nk, dk, dv)
    o = chunk.chunk_delta_rule(qkv, wy, g["recurrent_state"].clone(), nk)

    def run_conv():
        g["conv_state"].copy_(conv0)  # the same start every call (the conv updates its state)
        return (conv.causal_conv1d(g["mixed_qkv"], g["conv_state"], g["conv_weight"]),)

    def run_wy():
        return tuple(chunk.wy_transform(qkv, g["a"], g["b"], g["A_log"], g["dt_bias"], nk, dk, dv).values())

    def run_state():
        g["recurrent_state"].copy_(state0)  # the same start every call (a 2 MiB copy, inside the timing)
        return chunk.chunk_delta_rule(qkv, wy, g["recurrent_state"], nk), g["recurrent_state"]

    def run_norm():
        return (chunk.gated_norm(o, g["z"], g["norm_weight"], 1e-6),)

    def run_attention():
        a = at
        attention.prefill_attention_into(a["q"], a["gate"], a["k"], a["v"], a["q_weight"], a["k_weight"], a["k_cache"],
                                         a["v_cache"], a["positions"], a["inv_freq"], 1e-6, HEAD_DIM**-0.5, a["out"],
                                         a["q_normed"])  # fmt: skip
        return (a["out"],)

    def run_norm_rope():
        a = at
        attention.prefill_norm_rope_into(a["q"], a["k"], a["v"], a["q_weight"], a["k_weight"], a["k_cache"],
                                         a["v_cache"], a["positions"], a["inv_freq"], 1e-6, a["q_normed"])  # fmt: skip
        return a["q_normed"], a["k_cache"], a["v_cache"]

    grid = lambda **axes: [dict(zip(axes, values)) for values in itertools.product(*axes.values())]
    candidates = {
        "gdn causal_conv1d": grid(BT=[16, 32, 64], BC=[64, 128, 256], num_warps=[4, 8]),
        "gdn wy_transform": grid(num_warps=[2, 4, 8, 16]),
        "gdn chunk_delta_rule": grid(BV=[16, 32, 64], num_warps=[4, 8]),
        "gdn gated_norm": grid(BR=[4, 8, 16, 32, 64], num_warps=[1, 2, 4, 8]),
        "attention norm_rope": grid(BLOCK_T=[1, 2, 4, 8, 16, 32], num_warps=[1, 2, 4, 8]),
        "attention prefill": [{}] + grid(BLOCK_M=[64, 128], BLOCK_N=[32, 64], num_warps=[4, 8], num_stages=[2, 3]),
    }  # fmt: skip
    runs = dict(zip(CONFIGS, (run_conv, run_wy, run_state, run_norm, run_norm_rope, run_attention)))
    return {name: (CONFIGS[name], candidates[name], runs[name]) for name in CONFIGS}


def rel_diff(outs, refs) -> float:
    return max(((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()
               for a, b in zip(outs, refs))  # fmt: skip


def sweep(name, config, candidates, run) -> dict:
    current = dict(config)
    ref = [t.clone() for t in run()]
    rows = []
    for cand in [current] + [c for c in candidates if c != current]:
        config.clear()
        config.update(cand)
        try:
            diff = rel_diff(run(), ref)
            us, method = time_calls(lambda i: run(), 1, "cuda", reps=10)
            rows.append(dict(config=cand, us=us, rel_diff=diff, timed_by=method))
        except Exception as e:  # noqa: BLE001 - a config that does not compile (shared memory) is a row too
            rows.append(dict(config=cand, error=f"{type(e).__name__}: {str(e)[:200]}"))
        print(f"{name:<22} {cand} {rows[-1].get('us', rows[-1].get('error'))}", flush=True)
    config.clear()
    config.update(current)
    ok = [r for r in rows if "us" in r and r["rel_diff"] < 1e-2]
    best = min(ok, key=lambda r: r["us"])
    return dict(current=current, current_us=rows[0].get("us"), best=best["config"], best_us=best["us"], rows=rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/tune_prefill.json")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--kernels", nargs="+", choices=list(CONFIGS), help="sweep only these (default: all)")
    parser.add_argument(
        "--apply",
        action="store_true",
        help="then set the winners and time the 35B model's prefill with them (profile_model)",
    )
    args = parser.parse_args()
    t0 = time.time()
    results = {}
    for name, (config, candidates, run) in kernels_under_test(args.tokens, torch.device("cuda")).items():
        if args.kernels and name not in args.kernels:
            continue
        results[name] = sweep(name, config, candidates, run)
        write_json(args.out, "tune_prefill", "cuda", tokens=args.tokens, kernels=results, seconds=time.time() - t0)
    print(f"\n{'kernel':<22} {'current us':>10} {'best us':>9}  best config")
    for name, r in results.items():
        print(f"{name:<22} {r['current_us']:>10.1f} {r['best_us']:>9.1f}  {r['best']}")
    if args.apply:  # the winners in the model: one 4096-token prefill forward, by part
        from pathlib import Path

        from bench_e2e import TRITON_GROUPS
        from bench_e2e import config as compose
        from profile_model import prefill_section

        from qmoe.app import get_model
        from qmoe.settings import validate

        for name, r in list(results.items()):
            CONFIGS[name].clear()
            CONFIGS[name].update(r["best"])
        cfg = compose("model=qwen35_moe")
        model = get_model(cfg, validate(cfg), progress=False).model
        model.set_kernels({g: "triton" for g in TRITON_GROUPS})
        out = Path(args.out)
        results["model prefill with the winners"] = prefill_section(model, args.tokens, out.parent, out.stem)
        write_json(args.out, "tune_prefill", "cuda", tokens=args.tokens, kernels=results, seconds=time.time() - t0)
        print(results["model prefill with the winners"])


if __name__ == "__main__":
    main()
