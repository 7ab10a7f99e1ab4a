"""Where the 35B-A3B's time goes outside the graph-captured decode step (H200, random bf16 weights, Triton ops):

  host     the eager reference runner (runtime=reference kernels=triton, batch 1, prompt 128): wall ms per decode
           step with kernels/launch.py's fast launches off and on, then cProfile over the same steps -> the
           functions with the most own (tottime) and inclusive (cumtime) host time. The GPU needs ~2.4 ms of the
           step; the rest is Python and launch overhead.
  prefill  one 4096-token prefill forward: CUDA-event ms (median of 3, tokens/s) and a profiled forward's GPU time
           per part (dense GEMMs, MoE, GDN, attention, norms; bench_e2e.kernel_parts) and per kernel name.

Writes results/profile_model.json and results/profile_model_{host,prefill}.txt (named after --out).

    PYTHONPATH=. python experiments/profile_model.py [--sections host prefill] [--steps 20]
    PYTHONPATH=. python experiments/profile_model.py --weights fp8 --sections prefill \
        --out results/profile_model_fp8.json
"""

import argparse
import cProfile
import io
import json
import pstats
import time
from collections import defaultdict
from pathlib import Path

import torch
from bench_e2e import PARTS, TRITON_GROUPS, Metered, config, kernel_parts
from benchlib import GREEDY, event_median_us, write_json

from kernels.launch import FastLaunch
from qmoe.app import get_model
from qmoe.runtime.generate import ReferenceRunner
from qmoe.runtime.ledger import TransferLedger
from qmoe.settings import validate

HOST_PROMPT = 128  # the eager steps decode after a prompt of this many tokens, as bench_e2e's reference rows


def host_section(model, steps: int, out_dir: Path, name: str) -> dict:
    """Eager reference-runner decode steps: wall ms per step, then a cProfile of as many steps."""
    model.setup_caches(1, HOST_PROMPT + 3 + 3 * steps + 1)  # prompt, warm-up, the two timed loops, the profiled one
    runner = ReferenceRunner(model, GREEDY, 1, TransferLedger())
    prompt = torch.randint(0, model.config.vocab_size, (1, HOST_PROMPT), generator=torch.Generator().manual_seed(0))
    print("prefill token", runner.start(prompt).tolist(), flush=True)
    for _ in range(3):  # compile and allocate
        print("warm-up token", runner.step(None).tolist(), flush=True)

    def wall_ms_per_step() -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(steps):
            ids = runner.step(None)  # reads the token back: one sync per step
            if not ((ids >= 0) & (ids < model.config.vocab_size)).all():
                raise RuntimeError(f"step {i} (fast launch {FastLaunch.enabled}) sampled token ids {ids.tolist()}")
        return (time.perf_counter() - t0) * 1e3 / steps

    FastLaunch.enabled = False
    try:
        triton_ms = wall_ms_per_step()  # every kernel launched through Triton's own launch
    finally:
        FastLaunch.enabled = True
    wall_ms = wall_ms_per_step()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        runner.step(None)
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    for key in ("tottime", "cumtime"):
        text.write(f"\n==== sorted by {key}, {steps} steps\n")
        stats.sort_stats(key).print_stats(45)
    (out_dir / f"{name}_host.txt").write_text(text.getvalue())
    top = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:30]  # (file, line, fn) -> (cc, nc, tt, ct, ..)
    return {
        "ms_per_step": wall_ms,
        "tokens_per_s": 1e3 / wall_ms,
        "ms_per_step_triton_launch": triton_ms,  # the same steps with kernels/launch.py's fast path off
        "top_tottime_us_per_step": {
            f"{Path(f).name}:{line}:{fn}": {"calls": nc / steps, "us": tt * 1e6 / steps}
            for (f, line, fn), (cc, nc, tt, ct, _) in top
        },
    }


@torch.no_grad()
def prefill_section(model, length: int, out_dir: Path, name: str) -> dict:
    """One prefill of `length` tokens: event-timed ms and a profiled forward by part and by kernel."""
    from torch.profiler import ProfilerActivity, profile

    model.setup_caches(1, length + 8)
    tokens = torch.randint(0, model.config.vocab_size, (1, length), device=model.device)
    pos = torch.zeros(1, dtype=torch.int64, device=model.device)

    def forward():
        model.reset_caches()
        return model(tokens, pos)

    forward()  # compiles the prefill kernels
    ms = event_median_us(forward, 3) / 1e3
    saved = dict(model.ops)
    model.ops = {g: Metered(g, m, defaultdict(lambda: defaultdict(float))) for g, m in model.ops.items()}
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        forward()
        torch.cuda.synchronize()
    model.ops = saved
    trace = out_dir / "profile_model_trace.json"
    prof.export_chrome_trace(str(trace))
    parts = kernel_parts(trace)
    trace.unlink()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40)
    by_part = {p: {"kernels": len(d), "ms": sum(d) / 1e3} for p, d in sorted(parts.items(), key=lambda kv: -sum(kv[1]))}
    lines = [f"prefill {length} tokens: {ms:.2f} ms, {length / ms * 1e3:,.0f} tokens/s", ""]
    lines += [f"{p:<30} {v['kernels']:>6} {v['ms']:>9.3f} ms" for p, v in by_part.items()]
    (out_dir / f"{name}_prefill.txt").write_text("\n".join(lines) + "\n\n" + table)
    return {"tokens": length, "ms": ms, "tokens_per_s": length / ms * 1e3, "gpu_ms_by_part": by_part}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/profile_model.json")
    parser.add_argument("--sections", nargs="+", default=["host", "prefill"], choices=("host", "prefill"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prefill-tokens", type=int, default=4096)
    parser.add_argument("--weights", default="auto", choices=("auto", "fp8"), help="fp8: model.weights=fp8")
    args = parser.parse_args()
    t0 = time.time()
    cfg = config("model=qwen35_moe", f"model.weights={args.weights}")
    model = get_model(cfg, validate(cfg), progress=False).model
    model.set_kernels({g: "triton" for g in TRITON_GROUPS})
    out_dir = Path(args.out).parent
    out = {"weights": args.weights}
    for section in args.sections:
        if section == "host":
            out[section] = host_section(model, args.steps, out_dir, Path(args.out).stem)
        else:
            out[section] = prefill_section(model, args.prefill_tokens, out_dir, Path(args.out).stem)
        write_json(args.out, "profile_model", "cuda", parts=PARTS, **out, seconds=time.time() - t0)
        print(json.dumps(out[section], indent=1)[:3000], flush=True)


if __name__ == "__main__":
    main()
