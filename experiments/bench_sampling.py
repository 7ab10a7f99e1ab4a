"""Fused sampling (Triton, kernels/sampling/triton.py) vs the torch sort-based path and torch.argmax, V = 248320.

Modes: top-k 50 + top-p 0.9, top-p 0.9 only, min-p 0.05 only (temperature 1), and greedy; B in {1, 8, 64, 256};
fp32 and bf16 logits. Baselines in the same run: a sort + cumsum top-k / top-p / min-p sampler as in HF and vLLM
(`torch_sort_sample` below, exponential-race draw like vLLM's) for the sampled modes, torch.argmax for greedy.

Logits: "llm" rows are shaped like a language model's (background N(0, 2^2) over the vocabulary, 64 candidates
lifted by 20 .. 6: a few tokens carry most of the mass); "flat" rows (N(0, 1), every token plausible) are run
for the sampled modes to show the data dependence: there top-p keeps ~V tokens, more than the kernel's gather
buffer, and the kernel takes its exact multi-pass bisection fallback. Targets apply to "llm" rows.

Each call is timed inside one CUDA graph of many calls (the decode step is captured, so launch overhead is
excluded) on inputs rotated over > 200 MB so that the logits come from HBM, not L2. The copy ceiling is
measured in the same run: floor_us = logits bytes / copy bandwidth (read + write GB/s, so a read-only stream
could be up to 2x faster than this floor suggests).

    PYTHONPATH=. python experiments/bench_sampling.py [--out results/bench_sampling.json] [--quick]
    TRITON_INTERPRET=1 PYTHONPATH=. python experiments/bench_sampling.py --vocab 256 --quick --out /tmp/b.json
    (a CPU smoke run of the script itself: the interpreter's times mean nothing)
"""

import argparse
import math
import time

import torch
from benchlib import L2_FLUSH_BYTES, copy_bandwidth_gbs, print_targets, target, time_calls, write_json

from kernels.sampling import triton as fused

VOCAB = 248_320
BATCHES = (1, 8, 64, 256)
MODES = {  # name -> (temperature, top_k, top_p, min_p)
    "topk50_topp0.9": (1.0, 50, 0.9, 0.0),
    "topp0.9": (1.0, 0, 0.9, 0.0),
    "minp0.05": (1.0, 0, 1.0, 0.05),
    "greedy": (0.0, 0, 1.0, 0.0),
}
TARGET_US = {1: 20.0, 256: 150.0}  # top-k 50 + top-p 0.9 (torch sort path on this H200: 349 us / 6975 us)
GREEDY_VS_ARGMAX = 1.2


def make_logits(B: int, V: int, kind: str, dtype, device: str, seed: int) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    if kind == "flat":
        return torch.randn(B, V, device=device, generator=g).to(dtype)
    logits = torch.randn(B, V, device=device, generator=g) * 2
    lift = torch.linspace(20, 6, 64, device=device)
    cand = torch.randint(0, V, (B, 64), device=device, generator=g)
    return logits.scatter_add_(1, cand, lift.expand(B, -1)).to(dtype)


def torch_sort_sample(logits, temperature, top_k, top_p, min_p):
    """The usual torch sampler: sort, top-k by rank, top-p by cumulative mass, min-p, then an exponential race."""
    logits = logits.float() / temperature[:, None]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[1], device=logits.device)
    k = torch.where(top_k > 0, top_k, logits.shape[1])
    sorted_logits = sorted_logits.masked_fill(rank >= k[:, None], float("-inf"))
    probs = sorted_logits.softmax(-1)
    before = probs.cumsum(-1) - probs  # mass strictly above each sorted position
    drop = (before >= top_p[:, None]) | (probs < min_p[:, None] * probs[:, :1])
    probs = probs.masked_fill(drop, 0.0)
    drawn = (probs / torch.empty_like(probs).exponential_()).argmax(-1)
    return order.gather(1, drawn[:, None])[:, 0]


def baseline_us(rows: list[dict], row: dict) -> float | None:
    """The baseline's time for the case of `row` (torch.argmax for greedy, else the torch sort path)."""
    impl = "torch.argmax" if row["mode"] == "greedy" else "torch_sort"
    case = ("mode", "B", "dtype", "logits")
    return next((r["us"] for r in rows if r["impl"] == impl and all(r[k] == row[k] for k in case)), None)


def bench_row(mode: str, B: int, V: int, dtype, kind: str, device: str) -> list[dict]:
    temperature, top_k, top_p, min_p = MODES[mode]
    nbytes = B * V * dtype.itemsize
    copies = min(200, math.ceil(L2_FLUSH_BYTES / nbytes)) if device == "cuda" else 1
    n = max(copies, 4) if device == "cuda" else 1
    inputs = [make_logits(B, V, kind, dtype, device, seed=i) for i in range(copies)]
    full = lambda v, dt: torch.full((B,), v, dtype=dt, device=device)
    params = (full(temperature, torch.float32), full(top_k, torch.int64), full(top_p, torch.float32))
    params += (full(min_p, torch.float32),)
    seed, step = full(0, torch.int64), torch.arange(B, device=device)
    impls = {"triton": lambda x: fused.sample(x, *params, seed, step)}
    if mode == "greedy":
        impls["torch.argmax"] = lambda x: x.argmax(-1)
    else:
        impls["torch_sort"] = lambda x: torch_sort_sample(x, *params[:4])
    rows = []
    for impl, fn in impls.items():
        us, method = time_calls(lambda i, fn=fn: fn(inputs[i % copies]), n, device)
        rows.append(
            {"mode": mode, "B": B, "dtype": str(dtype).removeprefix("torch."), "logits": kind, "impl": impl}
            | {"us": us, "timing": method, "logits_MB": nbytes / 1e6}
        )
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/bench_sampling.json")
    parser.add_argument("--quick", action="store_true", help="B = 1 and 256 only")
    parser.add_argument("--vocab", type=int, default=VOCAB, help="smaller only for CPU smoke runs of the script")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    V = args.vocab
    start = time.perf_counter()
    copy_gbs = copy_bandwidth_gbs(device)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for B in (1, 256) if args.quick else BATCHES:
            for mode in MODES:
                rows += bench_row(mode, B, V, dtype, "llm", device)
                if mode != "greedy" and B in (1, 256):
                    rows += [r for r in bench_row(mode, B, V, dtype, "flat", device) if r["impl"] == "triton"]
    for r in rows:
        r["floor_us"] = r["logits_MB"] * 1e3 / copy_gbs  # one read of the logits at the copy rate
        baseline = baseline_us(rows, r)
        if r["impl"] == "triton" and baseline is not None:
            r["speedup_vs_baseline"] = baseline / r["us"]
    targets = []
    for r in rows:
        if r["logits"] != "llm" or r["impl"] != "triton":
            continue
        mode, B, dt, us, baseline = r["mode"], r["B"], r["dtype"], r["us"], baseline_us(rows, r)
        if mode == "greedy":
            targets.append(target(f"greedy B={B} {dt}: triton / torch.argmax", us / baseline, GREEDY_VS_ARGMAX, True))
        elif mode == "topk50_topp0.9" and B in TARGET_US:
            targets.append(target(f"top-k 50 + top-p 0.9 B={B} {dt}: triton us", us, TARGET_US[B], True))
    seconds = time.perf_counter() - start
    targets.append(target("benchmark runtime s", seconds, 60.0, True))
    write_json(args.out, "bench_sampling", device, V=V, copy_gbs=copy_gbs, rows=rows, targets=targets, seconds=seconds)

    print(f"V = {V} on {device}, copy ceiling {copy_gbs:.0f} GB/s; us per call (CUDA graph, logits from HBM)")
    print(f"{'mode':>15} {'B':>4} {'dtype':>9} {'logits':>6} {'triton':>9} {'baseline':>9} {'speedup':>8} {'floor':>7}")
    for r in (r for r in rows if r["impl"] == "triton"):
        base = baseline_us(rows, r)
        base_s, speed = (f"{base:9.1f}", f"{base / r['us']:7.1f}x") if base is not None else (f"{'-':>9}", f"{'-':>8}")
        head = f"{r['mode']:>15} {r['B']:>4} {r['dtype']:>9} {r['logits']:>6}"
        print(f"{head} {r['us']:9.1f} {base_s} {speed} {r['floor_us']:7.1f}")
    print_targets(targets)
    print(f"-> {args.out} ({seconds:.0f} s)")


if __name__ == "__main__":
    main()
