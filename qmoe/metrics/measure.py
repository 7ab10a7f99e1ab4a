"""Latency statistics, peak memory per device and the environment a result was measured in."""

import datetime
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]


def latency_stats(ttft_ms: float, decode_ms: list[float], decode_tokens: int, warmup_ms: float | None) -> dict:
    t = torch.tensor(decode_ms, dtype=torch.float64)
    decode = {"p50": None, "p90": None, "p99": None, "mean": None, "steps": len(decode_ms)}
    if len(decode_ms):
        q = torch.quantile(t, torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64)).tolist()
        decode.update(p50=q[0], p90=q[1], p99=q[2], mean=t.mean().item())
    total_s = t.sum().item() / 1e3
    return {
        "ttft_ms": ttft_ms,
        "decode_ms": decode,
        "tokens_per_s": decode_tokens / total_s if total_s > 0 else None,
        "warmup_ms": warmup_ms,
    }


def active_weight_bytes(config, dtype: torch.dtype, fp8=frozenset()) -> int:
    """Weight bytes one decode step at batch 1 must read: the active parameters (routed top-k and shared experts,
    mixers, router, norms, lm_head; the embedding is a row gather) in the weights' dtype, the `fp8` ones (parameter
    names) in float8 with their scales."""
    if not fp8:
        return config.param_counts()["active"] * dtype.itemsize
    from qmoe.model import active_weight_nbytes

    return active_weight_nbytes(config, dtype, fp8)


_COPY_GBS: dict[tuple[str, int], float] = {}  # (device, bytes) -> measured copy bandwidth, once per process


def copy_bandwidth_gbs(device: torch.device, nbytes: int = 256 * 2**20, reps: int = 10) -> float:
    """Device copy bandwidth (read + write bytes) of an `nbytes` copy of random bytes, median of `reps` copies
    (CUDA events on a GPU, wall clock on the CPU); measured once per process, device and size (about 10 ms on an
    H200 at the default size). Timed eagerly: inside a CUDA graph a plain copy becomes a memcpy node that the copy
    engines serve, at about 2/3 of the SMs' rate."""
    key = (str(device), nbytes)
    if key not in _COPY_GBS:
        src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()  # never time a copy of zeros
        dst = torch.empty_like(src)
        dst.copy_(src)  # warm-up
        times = []
        for _ in range(reps):
            if src.is_cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                dst.copy_(src)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e-3)
            else:
                t0 = time.perf_counter()
                dst.copy_(src)
                times.append(time.perf_counter() - t0)
        _COPY_GBS[key] = 2 * nbytes / sorted(times)[len(times) // 2] / 1e9
        del src, dst
    return _COPY_GBS[key]


def bandwidth_floor(
    config,
    dtype: torch.dtype,
    device: torch.device,
    decode_p50_ms: float | None,
    fp8=frozenset(),
    shards: int = 1,
) -> dict:
    """floor = active weight bytes per decode step (batch 1) / device copy bandwidth; the copy ceiling only on a
    GPU (on the CPU there is no floor to report). fp8: the parameters held in float8. With the model sharded over
    `shards` GPUs each reads about 1 / shards of them."""
    active = active_weight_bytes(config, dtype, fp8) // shards
    out = {"active_weight_bytes": active, "copy_gbs": None, "floor_ms": None, "fraction_of_decode_p50": None}
    if device.type == "cuda":
        gbs = copy_bandwidth_gbs(device)
        floor_ms = active / (gbs * 1e9) * 1e3
        out.update(copy_gbs=gbs, floor_ms=floor_ms)
        if decode_p50_ms:
            out["fraction_of_decode_p50"] = floor_ms / decode_p50_ms
    return out


def available_memory_bytes(device: torch.device) -> int:
    """Free bytes on `device`: the CUDA driver's free memory plus what PyTorch's caching allocator holds unused,
    or the host's available RAM."""
    if device.type == "cuda":
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return torch.cuda.mem_get_info(device)[0] + cached
    import psutil

    return psutil.virtual_memory().available


def reset_peak_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def peak_memory() -> dict:
    """Peak bytes per device: CUDA allocator peaks since the last reset; the process's peak host RSS."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    peaks = {"cpu_peak_rss_bytes": rss}
    for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        peaks[f"cuda:{i}_peak_allocated_bytes"] = torch.cuda.max_memory_allocated(i)
    return peaks


def git_commit() -> str | None:
    """HEAD (with -dirty for uncommitted changes); QMOE_GIT_COMMIT overrides it where the tree travels without
    its history (the device machine)."""
    if os.environ.get("QMOE_GIT_COMMIT"):
        return os.environ["QMOE_GIT_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return (out.stdout.strip() + ("-dirty" if dirty else "")) or None
    except (OSError, subprocess.SubprocessError):
        return None


def environment(device: torch.device | None = None) -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    on_cuda = device is not None and device.type == "cuda"
    return {
        "device": str(device) if device is not None else None,
        "device_name": torch.cuda.get_device_name(device) if on_cuda else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "git_commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
    }
