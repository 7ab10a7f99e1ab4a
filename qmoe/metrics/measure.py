"""Latency statistics, peak memory per device and the environment a result was measured in."""

import datetime
import os
import platform
import resource
import subprocess
import sys
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


def active_weight_bytes(config, dtype: torch.dtype) -> int:
    """Weight bytes one decode step at batch 1 must read: the active parameters (routed top-k and shared experts,
    mixers, router, norms, lm_head; the embedding is a row gather) in the weights' dtype."""
    return config.param_counts()["active"] * dtype.itemsize


def weight_bytes(config, dtype: torch.dtype) -> int:
    """Bytes of all the weights in `dtype`: what building or loading the model allocates."""
    return config.param_counts()["total"] * dtype.itemsize


_COPY_GBS: dict[str, float] = {}  # device -> measured copy bandwidth, once per process


def copy_bandwidth_gbs(device: torch.device) -> float:
    """Device-to-device copy bandwidth (read + write bytes) of a 256 MiB copy, median of 10 event-timed copies;
    measured once per process and device (about 10 ms on an H200)."""
    key = str(device)
    if key not in _COPY_GBS:
        nbytes = 256 * 2**20
        src = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        dst.copy_(src)  # warm-up
        times = []
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(10):
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        _COPY_GBS[key] = 2 * nbytes / (sorted(times)[len(times) // 2] * 1e-3) / 1e9
        del src, dst
    return _COPY_GBS[key]


def bandwidth_floor(config, dtype: torch.dtype, device: torch.device, decode_p50_ms: float | None) -> dict:
    """floor = active weight bytes per decode step (batch 1) / device copy bandwidth; the copy ceiling only on a
    GPU (on the CPU there is no floor to report)."""
    active = active_weight_bytes(config, dtype)
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
