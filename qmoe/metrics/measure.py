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
