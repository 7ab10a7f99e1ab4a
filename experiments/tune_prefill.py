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
from bench_gdn import DIMS_35B
from benchlib import time_calls, write_json

from kernels.attention import triton as attention
from kernels.gdn import chunk, conv

HQ, HKV, HEAD_DIM, ROTARY_HALF = 16, 2, 256, 32  # 35B-A3B attention


def gdn_inputs(T: int, device) -> dict:
    nk, nv, dk, dv, kw = (DIMS_35B[k] for k in ("nk", "nv", "dk", "dv", "kw"))
    C = 2 * nk * dk + nv * dv
    gen = torch.Generator(device=device).manual_seed(0)
    proj = torch.randn(1, T, C + nv * dv + 2 * nv, generator=gen, device=device, dtype=torch.bfloat16)
    mixed, z, b, a = proj.split([C, nv * dv, nv, nv], dim=-1)
    return dict(
        mixed=mixed, z=z, a=a, b=b,
        conv_weight=torch.randn(C, 1, kw, generator=gen, device=device, dtype=torch.bfloat16) / kw**0.5,
        conv_state=torch.randn(1, C, kw - 1, generator=gen, device=device, dtype=torch.bfloat16),
        A_log=torch.empty(nv, device=device).uniform_(0.01, 16.0, generator=gen).log().to(torch.bfloat16),
        dt_bias=torch.empty(nv, device=device).uniform_(0.5, 1.5, generator=gen).to(torch.bfloat16),
        state=0.1 * torch.randn(1, nv, dk, dv, generator=gen, device=device),
        norm_weight=1 + 0.1 * torch.randn(dv, generator=gen, device=device, dtype=torch.bfloat16),
        nk=nk, dk=dk, dv=dv,
    )  # fmt: skip


def attention_inputs(T: int, device) -> dict:
    gen = torch.Generator(device=device).manual_seed(1)
    D = HEAD_DIM
    proj = torch.randn(1, T, HQ * 2 * D + 2 * HKV * D, generator=gen, device=device, dtype=torch.bfloat16)
    q, k, v = proj.split([HQ * 2 * D, HKV * D, HKV * D], dim=-1)
    q, gate = q.view(1, T, HQ, 2 * D).chunk(2, dim=-1)
    cache = lambda: torch.zeros(1, HKV, T + 16, D, device=device, dtype=torch.bfloat16)
    return dict(
        q=q, gate=gate, k=k.view(1, T, HKV, D), v=v.view(1, T, HKV, D),
        out=torch.empty(1, T, HQ * D, device=device, dtype=torch.bfloat16),
        q_weight=0.1 * torch.randn(D, generator=gen, device=device, dtype=torch.bfloat16),
        k_weight=0.1 * torch.randn(D, generator=gen, device=device, dtype=torch.bfloat16),
        k_cache=cache(), v_cache=cache(),
        positions=torch.arange(T, device=device)[None],
        inv_freq=1.0 / 1e7 ** (torch.arange(ROTARY_HALF, device=device) / ROTARY_HALF),
        q_normed=torch.empty(1, T, HQ, D, device=device, dtype=torch.bfloat16),
    )  # fmt: skip


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
    state0, conv0 = g["state"].clone(), g["conv_state"].clone()
    qkv = conv.causal_conv1d(g["mixed"], g["conv_state"].clone(), g["conv_weight"])
    wy = chunk.wy_transform(qkv, g["a"], g["b"], g["A_log"], g["dt_bias"], g["nk"], g["dk"], g["dv"])
    o = chunk.chunk_delta_rule(qkv, wy, g["state"].clone(), g["nk"])

    def run_conv():
        g["conv_state"].copy_(conv0)  # the same start every call (the conv updates its state)
        return (conv.causal_conv1d(g["mixed"], g["conv_state"], g["conv_weight"]),)

    def run_wy():
        return tuple(
            chunk.wy_transform(qkv, g["a"], g["b"], g["A_log"], g["dt_bias"], g["nk"], g["dk"], g["dv"]).values()
        )

    def run_state():
        g["state"].copy_(state0)  # the same start every call (a 2 MiB copy, inside the timing)
        return chunk.chunk_delta_rule(qkv, wy, g["state"], g["nk"]), g["state"]

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
