"""The MoE block (routing + routed experts + shared expert + combine, from the fused projection `proj`): Triton
kernels vs the model's torch path.

35B-A3B (E=256, H=2048, I=Is=512, K=8) and 122B (E=256, H=3072, I=Is=1024, K=8) shapes in bf16, M tokens in
{1, 8, 64, 512, 8192}, three routings set through proj's router columns:
  uniform  random logits: K distinct experts per token, about min(E, M K) experts in use (the typical case);
  same-8   every token on the same 8 experts (M rows per group: the worst case for grouping and the combine);
  hot-1    one expert in every token's top-k, the other K - 1 at random.
Triton is timed inside one CUDA graph of R calls, each on its own routing (R different expert sets, the hot /
same experts moving with them, keep the weights out of L2); the torch path runs eagerly (its loop path syncs the
host). GB/s counts the unique bytes a call must read: the selected experts' w13 + w2 and the shared down
projection; TFLOP/s counts 2 M (K 3 H I + H Is). Ceilings from the same run (benchlib): a 1 GiB device copy and a
bf16 8192^3 GEMM. Before timing, every row checks the Triton output against the fp32 torch path (subset rows at
M = 8192) and against the bf16 torch path's own error; the script exits 1 if any check fails. Also measured:
eager host time per call and CUDA kernel launches per call (torch profiler) at decode sizes.

    python experiments/bench_moe.py [--out results/bench_moe.json] [--shapes 35B 122B] [--m 1 8 64 512 8192]
        [--routings uniform same-8 hot-1] [--smoke]   (--smoke: tiny shapes on CPU)
"""

import argparse
import functools
import os
import statistics
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # --smoke on a CPU-only machine
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchlib import ceilings as measure_ceilings  # noqa: E402
from benchlib import print_targets, target, time_calls, write_json  # noqa: E402

from kernels.moe import naive  # noqa: E402
from kernels.moe import triton as tri  # noqa: E402

SHAPES = {"35B": dict(E=256, H=2048, I=512, K=8), "122B": dict(E=256, H=3072, I=1024, K=8)}
M_VALUES = (1, 8, 64, 512, 8192)
ROUTINGS = ("uniform", "same-8", "hot-1")
SMOKE_SHAPES = {"smoke": dict(E=8, H=64, I=32, K=2)}
SMOKE_M = (1, 5, 70)
ROTATE_BYTES = 400 * 2**20  # expert bytes touched per graph replay: well above the H200's 50 MB L2
TORCH_SKIP_S = 1.0  # a torch call slower than this is not timed
CHECK_ROWS = 64  # rows checked against fp32 at the largest M
TOL = 2e-2  # bf16 relative error against fp32 (the torch path's own error is reported beside it)


def router_logits(M, E, K, routing, rotation, gen, device):
    """[M, E] fp32 logits for one rotation: random, plus +10 on the experts every token must pick."""
    logits = torch.randn(M, E, generator=gen, device=device)
    forced = {"uniform": [], "same-8": [(8 * rotation + j) % E for j in range(min(8, K))], "hot-1": [rotation % E]}
    for e in forced[routing]:
        logits[:, e] += 10.0 + torch.rand(M, generator=gen, device=device)
    return logits


def make_inputs(M, s, routing, n, dtype, device, seed=0):
    """n (x, proj) pairs; proj [M, E + 2 Is + 1] random with the routing's router columns."""
    E, H, I, K = s["E"], s["H"], s["I"], s["K"]
    gen = torch.Generator(device=device).manual_seed(seed)
    inputs = []
    for r in range(n):
        x = torch.randn(M, H, generator=gen, device=device).to(dtype)
        proj = torch.randn(M, E + 2 * I + 1, generator=gen, device=device)
        proj[:, :E] = router_logits(M, E, K, routing, r, gen, device)
        inputs.append((x, proj.to(dtype)))
    return inputs


def time_eager(fn, n, reps):
    """Median µs per call of fn(0..n-1) launched eagerly (syncing at the end); one warm-up pass."""
    for i in range(n):
        fn(i)
    times = []
    for _ in range(reps):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t = time.perf_counter()
        for i in range(n):
            fn(i)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e6 / n)
    return statistics.median(times)


def host_us(fn, calls=200):
    """Eager host time per call: the wall time of `calls` launches without a sync (the GPU queue absorbs them)."""
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    us = (time.perf_counter() - t) * 1e6 / calls
    torch.cuda.synchronize()
    return us


def launches_per_call(fn):
    """CUDA kernels (and memsets/copies) one call runs, from the torch profiler."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def bench_shape(name, s, m_values, routings, device, dtype, ceilings):
    E, H, I, K = s["E"], s["H"], s["I"], s["K"]
    gen = torch.Generator(device=device).manual_seed(0)
    w13 = torch.randn(E, 2 * I, H, device=device, dtype=dtype, generator=gen) * H**-0.5
    w2 = torch.randn(E, H, I, device=device, dtype=dtype, generator=gen) * I**-0.5
    shared_down = torch.randn(H, I, device=device, dtype=dtype, generator=gen) * I**-0.5
    fp32 = [w.float() for w in (w13, w2, shared_down)]  # the reference's weights
    expert_bytes, shared_bytes = 3 * H * I * dtype.itemsize, H * I * dtype.itemsize
    rows = []
    for M in m_values:
        flops = 2 * M * (K * 3 * H * I + H * I)
        for routing in routings:
            n = 2 if M > tri.DECODE_MAX_M else max(2, min(16, ROTATE_BYTES // (min(E, M * K) * expert_bytes)))
            inputs = make_inputs(M, s, routing, n, dtype, device)
            unique = statistics.mean(naive.route(p[:, :E], K)[1].unique().numel() for _, p in inputs)
            row = {"shape": name, "M": M, "routing": routing, "rotated_inputs": n, "unique_experts": unique}
            row["bytes"] = unique * expert_bytes + shared_bytes
            row["flops"] = flops
            triton_call = lambda i, inputs=inputs: tri.moe_block(*inputs[i], w13, w2, shared_down, K)
            torch_call = lambda i, inputs=inputs: naive.moe_block(*inputs[i], w13, w2, shared_down, K)

            x, proj = inputs[0]
            check = slice(None) if M <= CHECK_ROWS else slice(0, CHECK_ROWS)  # rows are independent
            ref = naive.moe_block(x[check].float(), proj[check].float(), *fp32, K)
            out = triton_call(0)
            row["triton_rel_err_vs_fp32"] = rel_err(out[check], ref)
            row["torch_rel_err_vs_fp32"] = rel_err(naive.moe_block(x[check], proj[check], w13, w2, shared_down, K), ref)
            row["bit_reproducible"] = all(torch.equal(triton_call(0), out) for _ in range(3))
            row["check_ok"] = row["triton_rel_err_vs_fp32"] < TOL and row["bit_reproducible"]

            row["triton_us"], row["triton_timing"] = time_calls(triton_call, n, device, reps=10 if M <= 512 else 5)
            row["torch_us"], row["torch_note"] = None, "eager"
            t = time.perf_counter()
            torch_call(0)
            if device == "cuda":
                torch.cuda.synchronize()
            if time.perf_counter() - t > TORCH_SKIP_S:
                row["torch_note"] = f"skipped: > {TORCH_SKIP_S} s per call"
            else:
                row["torch_us"] = time_eager(torch_call, n, 3)
            row["triton_gbs"] = row["bytes"] / row["triton_us"] / 1e3
            row["triton_pct_copy_bw"] = 100 * row["triton_gbs"] / ceilings["copy_gbs"]
            row["triton_tflops"] = flops / row["triton_us"] / 1e6
            row["triton_pct_gemm"] = 100 * row["triton_tflops"] / ceilings["bf16_gemm_tflops"]
            if device == "cuda" and M <= tri.DECODE_MAX_M and routing == "uniform":
                row["eager_host_us"] = host_us(functools.partial(triton_call, 0))
                row["launches_per_call"] = launches_per_call(functools.partial(triton_call, 0))
            rows.append(row)
            print(
                f"{name:>5} M={M:<5} {routing:>7}: triton {row['triton_us']:9.1f} us "
                f"err {row['triton_rel_err_vs_fp32']:.2e} (torch {row['torch_rel_err_vs_fp32']:.2e})"
                f"{'' if row['check_ok'] else '  CHECK FAILED'}",
                flush=True,
            )
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def targets_for(rows):
    """The issue's targets on the 35B uniform rows that were run (the 122B and skewed rows are reported beside)."""
    at = {r["M"]: r for r in rows if r["shape"] == "35B" and r["routing"] == "uniform"}
    targets = []
    if 1 in at:
        targets.append(target("35B M=1 moe_block us", at[1]["triton_us"], 15.0, at_most=True))
    for M, pct in ((8, 82.0), (64, 90.0)):
        if M in at:
            targets.append(target(f"35B M={M} % of copy bandwidth", at[M]["triton_pct_copy_bw"], pct, at_most=False))
    if 8192 in at:
        targets.append(target("35B M=8192 TFLOP/s", at[8192]["triton_tflops"], 350.0, at_most=False))
    if "eager_host_us" in at.get(1, {}):
        targets.append(target("35B M=1 eager host us per call", at[1]["eager_host_us"], 30.0, at_most=True))
        targets.append(target("35B M=1 launches per moe_block", at[1]["launches_per_call"], 2, at_most=True))
    return targets


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/bench_moe.json")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (on CPU without CUDA): checks the script")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--m", nargs="+", type=int, default=list(M_VALUES), help="token counts")
    parser.add_argument("--routings", nargs="+", default=list(ROUTINGS), choices=list(ROUTINGS))
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    shapes = SMOKE_SHAPES if args.smoke else {n: SHAPES[n] for n in args.shapes}
    m_values = SMOKE_M if args.smoke else tuple(args.m)
    t0 = time.time()
    ceilings = measure_ceilings(device)
    rows = [
        r for name, s in shapes.items() for r in bench_shape(name, s, m_values, args.routings, device, dtype, ceilings)
    ]
    targets = targets_for(rows)
    configs = "tuned table" if tri.CONFIG_TABLE else "defaults (no table for this GPU or QMOE_MOE_DEFAULT_CONFIGS=1)"
    write_json(
        args.out, "moe", device, dtype=str(dtype), shapes=shapes, configs=configs, ceilings=ceilings, rows=rows,
        targets=targets, seconds=time.time() - t0,
    )  # fmt: skip

    c = ceilings
    print(f"copy {c['copy_gbs']:.0f} GB/s, bf16 GEMM {c['bf16_gemm_tflops']:.0f} TFLOP/s, {configs}")
    cols = [("shape", "shape", "s"), ("M", "M", "d"), ("routing", "routing", "s"), ("triton_us", "triton us", ".1f")]
    cols += [("triton_gbs", "GB/s", ".0f"), ("triton_pct_copy_bw", "%copy", ".1f"), ("triton_tflops", "TFLOP/s", ".1f")]
    cols += [("torch_us", "torch us", ".1f"), ("triton_rel_err_vs_fp32", "err", ".1e"), ("check_ok", "ok", "")]
    print(" ".join(f"{title:>10}" for _, title, _ in cols))
    for r in rows:
        print(" ".join(f"{'-' if r[key] is None else format(r[key], spec):>10}" for key, _, spec in cols))
    print_targets(targets)
    print(f"-> {args.out} ({time.time() - t0:.0f} s)")
    if not all(r["check_ok"] for r in rows):
        print("CORRECTNESS CHECK FAILED (see rows with ok=False)")
        sys.exit(1)


if __name__ == "__main__":
    main()
