"""Where the runner's time to first token goes beyond the model's prefill kernels (35B-A3B, one 4096-token prompt,
the default runtime: cuda_native, copy_elided, Triton ops): the runner's `start` (prefill + first sample + the
token's read-back) timed against the model's own forward over the same prompt, then one `start` under the profiler:
GPU busy time (the union of kernel spans), the idle gaps between kernels, the longest gaps with the CPU op that
launched the kernel after each, and when the host returned from enqueueing relative to the GPU's end (host-bound
when the host finishes last). Then the host's side of `start`: when it queued the read-back (its last launch) against
when the token arrived, and the garbage collections that ran inside each `start` (gc.callbacks), with the
collector as run.py leaves it and after gc.freeze() (the model's objects moved out of the collector's sight).

    PYTHONPATH=. python experiments/profile_prefill_runner.py [--tokens 4096] [--out PATH]
"""

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_e2e import FAST, config  # noqa: E402
from benchlib import write_json  # noqa: E402

from qmoe.app import MODELS, prepare, runner_for  # noqa: E402
from qmoe.runtime.generate import generate  # noqa: E402
from qmoe.runtime.ledger import TransferLedger  # noqa: E402
from qmoe.settings import validate  # noqa: E402


def timed_ms(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def host_side(runner, prompt, reps: int) -> dict:
    """Per `start`: wall ms, ms until the read-back was queued (the host's last launch), and ms spent in garbage
    collections (with their generations) inside it."""
    collections, t_gc = [], {}

    def on_gc(phase, info):
        if phase == "start":
            t_gc["t"] = time.perf_counter()
        else:
            collections.append((info["generation"], (time.perf_counter() - t_gc["t"]) * 1e3))

    queued = {}
    read_back_later = runner.read_back_later

    def timed_read_back_later(*a, **k):
        queued["t"] = time.perf_counter()
        return read_back_later(*a, **k)

    runner.read_back_later = timed_read_back_later
    gc.callbacks.append(on_gc)
    rows = []
    try:
        for _ in range(reps):
            collections.clear()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            runner.start(prompt)
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            gc_ms, generations = sum(ms for _, ms in collections), [g for g, _ in collections]
            rows.append({"wall_ms": (t1 - t0) * 1e3, "queued_ms": (queued["t"] - t0) * 1e3, "gc_ms": gc_ms,
                         "gc_generations": generations})  # fmt: skip
    finally:
        gc.callbacks.remove(on_gc)
        del runner.read_back_later
    return {"rows": rows, "median_wall_ms": sorted(r["wall_ms"] for r in rows)[reps // 2]}


def gaps_of(trace: dict) -> dict:
    """GPU busy time, idle gaps and the ops after the longest gaps, from a Chrome trace."""
    events = trace["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    runtime = {e["args"]["correlation"]: e for e in events
               if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}  # fmt: skip
    cpu_ops = [e for e in events if e.get("cat") == "cpu_op"]
    busy, end, gaps = 0.0, kernels[0]["ts"], []
    for k in kernels:
        if k["ts"] > end:
            gaps.append((k["ts"] - end, k))
        busy += max(0.0, k["ts"] + k["dur"] - max(end, k["ts"]))
        end = max(end, k["ts"] + k["dur"])
    host_end = max(e["ts"] + e.get("dur", 0) for e in runtime.values())
    gaps.sort(key=lambda g: -g[0])

    def launched_in(k) -> str:  # the innermost CPU op around the launch of kernel k
        launch = runtime.get(k["args"].get("correlation"))
        around = [o for o in cpu_ops if launch and o["ts"] <= launch["ts"] <= o["ts"] + o["dur"]]
        return min(around, key=lambda o: o["dur"])["name"] if around else "?"

    longest = [(g, k["name"][:60], launched_in(k)) for g, k in gaps[:15]]
    return {
        "kernels": len(kernels),
        "gpu_span_ms": (end - kernels[0]["ts"]) / 1e3,
        "gpu_busy_ms": busy / 1e3,
        "idle_ms": sum(g for g, _ in gaps) / 1e3,
        "gaps_over_10us": sum(g > 10 for g, _ in gaps),
        "idle_in_gaps_over_10us_ms": sum(g for g, _ in gaps if g > 10) / 1e3,
        "longest_gaps": [{"us": g, "next_kernel": k, "launched_in": op} for g, k, op in longest],
        "host_last_launch_minus_gpu_end_ms": (host_end - end) / 1e3,
    }


@torch.no_grad()
def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--out", default="results/profile_prefill_runner.json")
    args = parser.parse_args()
    t0 = time.time()
    cfg = config("model=qwen35_moe", *FAST, f"prompt.length={args.tokens}", "generation.max_new_tokens=2")
    s = validate(cfg)
    loaded = MODELS.get(cfg, s, False)
    model = loaded.model
    prepare(model, s)
    runner = runner_for(s, cfg, loaded, TransferLedger())
    prompt = torch.randint(0, model.config.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    generate(runner, prompt.tolist(), 2)  # compiles, allocates, captures the decode graph
    start_ms = timed_ms(lambda: runner.start(prompt), 5)

    ids = prompt.to(model.device)
    pos = torch.zeros(1, dtype=torch.int64, device=model.device)
    forward_ms = timed_ms(lambda: model(ids, pos), 5)  # the model alone (its caches: the runner's, rewritten)
    print(f"runner start {sorted(start_ms)[2]:.2f} ms, model forward {sorted(forward_ms)[2]:.2f} ms (medians of 5)",
          flush=True)  # fmt: skip

    host = {"gc_as_run": host_side(runner, prompt, 10)}
    gc.collect()
    gc.freeze()
    host["gc_frozen"] = host_side(runner, prompt, 10)
    gc.unfreeze()
    for name, h in host.items():
        print(
            f"{name}: start median {h['median_wall_ms']:.2f} ms; per start (wall / queued / gc ms):",
            " ".join(f"{r['wall_ms']:.1f}/{r['queued_ms']:.1f}/{r['gc_ms']:.1f}" for r in h["rows"]),
            flush=True,
        )

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        runner.start(prompt)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        gaps = gaps_of(json.loads(path.read_text()))
    summary = {
        "tokens": args.tokens,
        "runner_start_ms": start_ms,
        "model_forward_ms": forward_ms,
        "runner_start_ms_median": sorted(start_ms)[2],
        "model_forward_ms_median": sorted(forward_ms)[2],
        "host_side": host,
        "profiled_start": gaps,
    }
    write_json(args.out, "profile_prefill_runner", "cuda", **summary, seconds=time.time() - t0)
    print(json.dumps({k: v for k, v in summary.items() if k not in ("profiled_start", "host_side")}, indent=1))
    print(json.dumps({k: v for k, v in gaps.items() if k != "longest_gaps"}, indent=1))
    for g in gaps["longest_gaps"]:
        print(f"{g['us']:9.1f} us before {g['next_kernel']:<60} launched in {g['launched_in']}")


if __name__ == "__main__":
    main()
