"""results.json (always written first) and wandb (offline by default; a failure never loses results.json)."""

import json
import os
from pathlib import Path

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


def log_wandb(results: dict, decode_ms: list[float], logger_cfg: dict, run_dir: Path) -> str:
    """One wandb run: resolved config, per-step decode latency history, summary numbers. Returns the run dir."""
    os.environ.setdefault("WANDB_MODE", logger_cfg.get("mode") or "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    import wandb

    run = wandb.init(
        project=logger_cfg.get("project") or "qmoe",
        group=logger_cfg.get("group"),
        config=results["config"],
        dir=os.environ.get("WANDB_DIR", str(run_dir)),
        reinit="finish_previous",
    )
    try:
        for step, ms in enumerate(decode_ms):
            run.log({"decode_ms": ms}, step=step)
        summary = {k: v for k, v in flatten(results).items() if not k.startswith(("config/", "generated/"))}
        run.summary.update(summary)
        return run.dir
    finally:
        wandb.finish()
