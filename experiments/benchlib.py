"""Shared benchmark plumbing: timing (CUDA graph / events / wall clock), the two ceilings, target rows, JSON.

Every benchmark measures its ceilings in the same run (device copy bandwidth: a 1 GiB copy counting read +
write bytes; bf16 GEMM at 8192^3 on random data) and writes one JSON under results/ with the environment.
"""

import json
import statistics
import time
from pathlib import Path

import torch

from qmoe.metrics import measure
from qmoe.metrics.measure import environment
from qmoe.settings import SamplingSettings

GREEDY = SamplingSettings(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0)  # the decode benchmarks' mode
L2_FLUSH_BYTES = 200 * 2**20  # > 3x the H200's 50 MB L2: inputs rotated over this many bytes come from HBM


def time_calls(fn, n: int, device: str, reps: int = 10) -> tuple[float, str]:
    """Median µs per call of fn(0..n-1): replayed as one CUDA graph on the GPU (eager events if capture
    fails), wall clock on CPU (smoke runs). Returns (µs, how it was timed)."""
    for i in range(n):
        fn(i)  # compile and warm up
    if device != "cuda":
        start = time.perf_counter()
        for i in range(n):
            fn(i)
        return (time.perf_counter() - start) * 1e6 / n, "cpu wall clock"
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(n):
                fn(i)
        run, method = graph.replay, "cuda graph"
    except Exception:  # noqa: BLE001 - a path that cannot be captured is timed eagerly, and the row says so
        torch.cuda.synchronize()
        run, method = (lambda: [fn(i) for i in range(n)]), "eager"
    run()
    return event_median_us(run, reps) / n, method


HOST_CALLS = 2000  # calls per host-timing loop


def host_us_per_call(fn, n: int = HOST_CALLS, repeats: int = 1) -> float:
    """Wall-clock µs per call of fn() over loops of n calls after a warm-up, the median of `repeats` loops: the
    host's time when the host is the bound (eager op calls). With CUDA, each loop ends in a synchronize."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(20):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        for _ in range(n):
            fn()
        sync()
        times.append((time.perf_counter() - start) * 1e6 / n)
    return statistics.median(times)


def event_median_us(run, reps: int) -> float:
    """Median µs of run() between CUDA events (after one warm-up call)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def copy_bandwidth_gbs(device: str) -> float:
    """Device copy ceiling: a 1 GiB copy (16 MiB on CPU smoke runs), read + write bytes (qmoe.metrics.measure)."""
    return measure.copy_bandwidth_gbs(torch.device(device), 2**30 if device == "cuda" else 2**24, reps=20)


def gemm_tflops(device: str) -> float:
    """bf16 GEMM ceiling at 8192^3 on random data (fp32 256^3 on CPU smoke runs)."""
    n = 8192 if device == "cuda" else 256
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    us, _ = time_calls(lambda i: a @ b, 3, device, reps=5)
    return 2 * n**3 / us / 1e6


def ceilings(device: str) -> dict:
    return {"copy_gbs": copy_bandwidth_gbs(device), "bf16_gemm_tflops": gemm_tflops(device)}


def target(what: str, value: float, limit: float, at_most: bool) -> dict:
    """A target row: met or not, and when missed, by what factor."""
    met = value <= limit if at_most else value >= limit
    missed_by = None if met else (value / limit if at_most else limit / value)
    return {
        "what": what,
        "value": value,
        "target": f"{'<=' if at_most else '>='} {limit:.4g}",
        "met": met,
        "missed_by_x": missed_by,
    }


def print_targets(targets: list[dict]) -> None:
    for t in targets:
        miss = "" if t["met"] else f", missed {t['missed_by_x']:.2f}x"
        print(f"{'met ' if t['met'] else 'MISS'} {t['what']}: {t['value']:.3g} (target {t['target']}{miss})")


def write_json(path: str | Path, benchmark: str, device: str, **sections) -> dict:
    doc = {**environment(torch.device(device)), "benchmark": benchmark, **sections}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(doc, indent=2, default=str))
    return doc
