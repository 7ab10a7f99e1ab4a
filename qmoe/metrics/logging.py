"""results.json (always written first) and wandb (offline by default; a failure never loses results.json)."""

import json
import os
import socket
import tempfile
from pathlib import Path
from urllib.parse import urlparse

RESULTS_FILE = "results.json"


def write_results(results: dict, run_dir: Path) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / RESULTS_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(results, indent=2, default=str))
    tmp.replace(path)
    return path


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, f"{key}/"))
        elif isinstance(v, (int, float, str, bool)) or v is None:
            out[key] = v
    return out


class LoggerError(RuntimeError):
    """wandb cannot log this run (no host, no writable directory); results.json is kept."""


def check_wandb_host(timeout_s: float) -> None:
    """Online mode: the wandb host must answer a TCP connect within timeout_s (wandb itself would wait ~90 s)."""
    url = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai")
    host, port = url.hostname or "api.wandb.ai", url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as e:
        raise LoggerError(
            f"WANDB_MODE=online but {host}:{port} did not answer within {timeout_s:g} s ({e}); "
            "nothing logged (WANDB_MODE=offline logs locally)"
        ) from None


def check_writable(directory: Path) -> None:
    """wandb falls back to /tmp/wandb silently when its directory is not writable: refuse instead."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=directory).close()
    except OSError as e:
        raise LoggerError(f"WANDB_DIR={directory} is not writable ({e.strerror or e})") from None


def log_wandb(results: dict, decode_ms: list[float], logger_cfg: dict, run_dir: Path) -> str:
    """One wandb run: resolved config, per-step decode latency history, summary numbers. Returns the run dir."""
    os.environ.setdefault("WANDB_MODE", logger_cfg.get("mode") or "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    timeout_s = float(logger_cfg.get("init_timeout_s") or 30)
    directory = Path(os.environ.get("WANDB_DIR") or run_dir)
    check_writable(directory)
    if os.environ["WANDB_MODE"] == "online":
        check_wandb_host(min(timeout_s, 10.0))
    import wandb

    run = wandb.init(
        project=logger_cfg.get("project") or "qmoe",
        group=logger_cfg.get("group"),
        config=results["config"],
        dir=str(directory),
        reinit="finish_previous",
        settings=wandb.Settings(init_timeout=timeout_s),
    )
    try:
        for step, ms in enumerate(decode_ms):
            run.log({"decode_ms": ms}, step=step)
        summary = {k: v for k, v in flatten(results).items() if not k.startswith(("config/", "generated/"))}
        run.summary.update(summary)
        return run.dir
    finally:
        wandb.finish()
