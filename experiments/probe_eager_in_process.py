"""Why bench_e2e's eager reference runner (kernels=triton) is slower than `python run.py runtime=reference
kernels=triton` on the same host: the same run, 35B-A3B, prompt 128, 32 new tokens, repeated in one process
around the rows bench_e2e runs before it, in its order, on one model.

    python experiments/probe_eager_in_process.py [--short] [--out results/probe_eager_in_process.json]
    python experiments/probe_eager_in_process.py --smoke  # the tiny model on the CPU (host runtime, 3 tokens)

Per row: decode p50 / p90, the launches per step that took Triton's own launch path (kernels/launch.py's fallback),
the process's CPU seconds against the wall (other threads busy, or the host waiting), its threads, the GPU's SM
clock, utilisation and power (nvidia-smi), the caching allocator's device calls and free memory, the gc state;
--short runs the first four rows (eager, eager again, the copy-free loop, eager) and profiles a short rerun of each
eager one (the 12 functions with the most own time).
At 10cf1ae on the H200 (the long sequence): eager 14.93, again 8.55, after the copy-free loop 15.21 ms/step, and
15.0-17.3 after every later row (results/probe_eager_in_process.json).
"""

import argparse
import cProfile
import gc
import io
import pstats
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from collections import Counter
from datetime import datetime

import torch
from bench_e2e import FAST, config
from benchlib import write_json
from triton.runtime.jit import KernelInterface

from kernels.launch import FastLaunch
from qmoe.app import get_model, run_experiment
from qmoe.settings import validate

LAUNCHES = Counter()  # "triton": launches through Triton's own path (kernels/launch.py's slow path), "unbound": of
# those, the calls no binder took


def count_launches() -> None:
    """Count the launches that go through Triton's `kernel[grid]` (FastLaunch falls back to it) and the calls
    FastLaunch could not bind: a run whose eager launches take Triton's path pays ~25 us each on the H200 host."""
    getitem, bind = KernelInterface.__getitem__, FastLaunch._bind

    def counted_getitem(self, grid):
        LAUNCHES["triton"] += 1
        return getitem(self, grid)

    def counted_bind(self, device, args, kwargs):
        bound = bind(self, device, args, kwargs)
        LAUNCHES["unbound"] += bound is None
        return bound

    KernelInterface.__getitem__, FastLaunch._bind = counted_getitem, counted_bind


ALLOCATOR_COUNTS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")


def allocator_counts() -> dict:
    """The caching allocator's counters that mean device calls (cudaMalloc / cudaFree, a retry after a failed
    malloc that frees the cache, a device-wide sync) and the free device memory: a row whose eager steps pay
    them is short of cached blocks (a graph's private pool holding memory), not slow on the host."""
    if not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats()
    free, total = torch.cuda.mem_get_info()
    return {**{k: stats.get(k, 0) for k in ALLOCATOR_COUNTS}, "free_gib": free / 2**30,
            "reserved_gib": stats.get("reserved_bytes.all.current", 0) / 2**30}  # fmt: skip


class ClockLog:
    """nvidia-smi sampling the GPU's SM clock, utilisation and power every 100 ms in the background (no-op
    without nvidia-smi): `during(t0, t1)` -> their medians between two time.time() stamps."""

    FIELDS = ("clock_sm_mhz", "util_pct", "power_w")

    def __init__(self):
        self.file = tempfile.NamedTemporaryFile("w+", suffix=".csv")
        query = "--query-gpu=timestamp,clocks.sm,utilization.gpu,power.draw"
        cmd = ["nvidia-smi", query, "--format=csv,noheader,nounits", "-lms", "100"]
        self.proc = subprocess.Popen(cmd, stdout=self.file, stderr=subprocess.DEVNULL) if shutil.which(cmd[0]) else None

    def during(self, t0: float, t1: float) -> dict:
        if self.proc is None:
            return {}
        self.file.flush()
        self.file.seek(0)
        samples = []
        for line in self.file.read().splitlines():
            stamp, *values = (v.strip() for v in line.split(","))
            try:  # nvidia-smi prints local time
                at = datetime.strptime(stamp, "%Y/%m/%d %H:%M:%S.%f").timestamp()
                samples.append((at, [float(v) for v in values]))
            except ValueError:
                continue
        inside = [values for at, values in samples if t0 <= at <= t1]
        return {f: statistics.median(v[i] for v in inside) for i, f in enumerate(self.FIELDS)} if inside else {}

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
        self.file.close()


def profiled(overrides: tuple) -> list[str]:
    """The 12 functions with the most own time in a short run of `overrides` (8 new tokens)."""
    profile = cProfile.Profile()
    profile.enable()
    run_experiment(config(*overrides[:-1], "generation.max_new_tokens=8"))
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(12)
    return [line for line in text.getvalue().splitlines() if "(" in line and "/" in line or "{" in line][:12]


def sequence(model: str, graphed: tuple, tokens: int, long_prompt: int, batches: tuple) -> list[tuple[str, tuple]]:
    """(label, overrides): the eager row first in a fresh process, then after each of the rows bench_e2e runs
    before it, in its order (batch 1 at two prompt lengths, the batches, the torch-ops reference runner)."""
    eager = (model, "runtime=reference", "kernels=triton", "prompt.length=128", f"generation.max_new_tokens={tokens}")
    torch_ops = (model, "runtime=reference", "prompt.length=128", f"generation.max_new_tokens={tokens}")
    loop = (model, *graphed, f"generation.max_new_tokens={4 * tokens}")
    rows = [
        ("eager triton, fresh process", eager),
        ("eager triton, again", eager),
        ("copy-free loop, prompt 128", (*loop, "prompt.length=128")),
        ("eager triton, after it", eager),
        (f"copy-free loop, prompt {long_prompt}", (*loop, f"prompt.length={long_prompt}")),
        ("eager triton, after it", eager),
    ]
    for b in batches:
        rows.append((f"copy-free loop, batch {b}", (*loop, f"generation.batch_size={b}", "prompt.length=128")))
    rows += [
        ("eager triton, after the batches", eager),
        ("eager torch ops", torch_ops),
        ("eager triton, after torch ops", eager),
        ("eager triton, again", eager),
    ]
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/probe_eager_in_process.json")
    parser.add_argument("--smoke", action="store_true", help="the tiny model on the CPU: checks the script runs")
    parser.add_argument("--short", action="store_true", help="the first four rows, each eager one profiled")
    args = parser.parse_args()
    t0 = time.time()
    model = "model.device=cpu" if args.smoke else "model=qwen35_moe"
    if args.smoke:
        rows_in = sequence(model, ("runtime=host",), 3, 64, (2,))
    else:
        rows_in = sequence(model, FAST, 32, 4096, (8, 32))
    rows_in = rows_in[:4] if args.short else rows_in
    base = config(model)
    get_model(base, validate(base), progress=False)  # built once, as in bench_e2e
    count_launches()
    clocks = ClockLog()
    rows = []
    for label, overrides in rows_in:
        LAUNCHES.clear()
        allocator_before = allocator_counts()
        started, cpu_started = time.time(), time.process_time()
        r = run_experiment(config(*overrides))
        # the process's CPU seconds (every thread) against the wall: well above it, other threads were busy (a
        # GIL shared); well below it, the host waited (on the GPU)
        wall, cpu = time.time() - started, time.process_time() - cpu_started
        gpu = clocks.during(started, started + wall)
        allocator = allocator_counts()
        allocator.update({f"{k}_in_row": allocator[k] - allocator_before[k] for k in ALLOCATOR_COUNTS if allocator})
        decode = r["latency"]["decode_ms"]
        steps = decode.get("steps") or 1
        rows.append({"label": label, "decode_ms_p50": decode["p50"], "decode_ms_p90": decode["p90"],
                     "triton_path_launches_per_step": LAUNCHES["triton"] / steps,
                     "unbound_per_step": LAUNCHES["unbound"] / steps, "gc_objects": len(gc.get_objects()),
                     "gc_freeze_count": gc.get_freeze_count(), "gc_counts": gc.get_count(), "gpu": gpu,
                     "threads": sorted(t.name for t in threading.enumerate()), "wall_s": wall, "allocator": allocator,
                     "cpu_s": cpu})  # fmt: skip
        if args.short and "eager" in label:
            rows[-1]["profile_top"] = profiled(overrides)
        print(f"{label:<40} p50 {decode['p50']:8.3f} ms  p90 {decode['p90']:8.3f} ms  Triton-path launches/step "
              f"{rows[-1]['triton_path_launches_per_step']:6.1f} (unbound {rows[-1]['unbound_per_step']:.1f})  "
              f"frozen {rows[-1]['gc_freeze_count']}  GPU {gpu}")  # fmt: skip
        print(f"    wall {wall:.2f} s, process CPU {cpu:.2f} s; threads {rows[-1]['threads']}; allocator {allocator}")
        for line in rows[-1].get("profile_top", []):
            print("    " + line)
        write_json(args.out, "probe_eager_in_process", "cpu" if args.smoke else "cuda", rows=rows,
                   seconds=time.time() - t0)  # fmt: skip
    clocks.close()


if __name__ == "__main__":
    main()
