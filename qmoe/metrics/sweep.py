"""The summary of a sweep directory: one row per configuration (transfers per token, latency), markdown + CSV.

A sweep directory holds one `<job>/results.json` per job that ran and, from the ablation sweeper
(hydra_plugins/qmoe_sweeper.py), `skipped.json`: the combinations that were not run and why. `SweepSummary` is
the Hydra callback that writes `summary.md` and `summary.csv` into the sweep directory and prints the table
when the sweep ends; `load_rows(sweep_dir)` is what the notebook reads.
"""

import csv
import json
from pathlib import Path

from hydra.experimental.callback import Callback

SKIPPED_FILE = "skipped.json"
COLUMNS = (
    "job",
    "runtime",
    "export",
    "method_split",
    "cuda_graph",
    "status",
    "h2d_per_token",
    "h2d_bytes_per_token",
    "d2h_per_token",
    "d2h_bytes_per_token",
    "planned_h2d_bytes_per_token",
    "planned_d2h_bytes_per_token",
    "prefill_h2d_bytes",
    "prefill_d2h_bytes",
    "ttft_ms",
    "decode_p50_ms",
    "decode_p90_ms",
    "decode_p99_ms",
    "tokens_per_s",
    "reason",
)


def _row(job: str, results: dict) -> dict:
    cfg, lat, tr = results["config"], results["latency"], results["transfers"]
    setup = tr.get("setup", {})
    per = tr.get("per_decode_token", {})
    prefill = tr.get("prefill", {})
    planned = setup.get("planned_per_decode_token")  # None: no exported program (the reference runner)
    return {
        "job": job,
        "runtime": cfg["runtime"]["name"],
        "export": setup.get("preset", "-"),  # the reference runner runs no exported program
        "method_split": setup.get("method_split", "-"),
        "cuda_graph": setup.get("cuda_graph", cfg["runtime"].get("cuda_graph")),
        "status": "ok",
        "h2d_per_token": per.get("h2d", {}).get("count"),
        "h2d_bytes_per_token": per.get("h2d", {}).get("bytes"),
        "d2h_per_token": per.get("d2h", {}).get("count"),
        "d2h_bytes_per_token": per.get("d2h", {}).get("bytes"),
        "planned_h2d_bytes_per_token": None if planned is None else planned.get("h2d", {}).get("bytes", 0),
        "planned_d2h_bytes_per_token": None if planned is None else planned.get("d2h", {}).get("bytes", 0),
        "prefill_h2d_bytes": prefill.get("h2d", {}).get("bytes"),
        "prefill_d2h_bytes": prefill.get("d2h", {}).get("bytes"),
        "ttft_ms": lat["ttft_ms"],
        "decode_p50_ms": lat["decode_ms"]["p50"],
        "decode_p90_ms": lat["decode_ms"]["p90"],
        "decode_p99_ms": lat["decode_ms"]["p99"],
        "tokens_per_s": lat["tokens_per_s"],
        "reason": "",
    }


def _job_key(path: Path) -> tuple:
    return (0, int(path.name), "") if path.name.isdigit() else (1, 0, path.name)


def load_rows(sweep_dir) -> list[dict]:
    """Rows of every job that ran (sorted by job number), then of every skipped combination."""
    sweep_dir = Path(sweep_dir)
    rows = []
    for path in sorted((p.parent for p in sweep_dir.glob("*/results.json")), key=_job_key):
        rows.append(_row(path.name, json.loads((path / "results.json").read_text())))
    skipped = sweep_dir / SKIPPED_FILE
    for s in json.loads(skipped.read_text()) if skipped.exists() else []:
        rows.append({c: None for c in COLUMNS} | {k: s.get(k) for k in COLUMNS if k in s} | {"job": "-"})
    return rows


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


RAN = [c for c in COLUMNS if c not in ("status", "reason")]
NOT_RAN = ("runtime", "export", "method_split", "cuda_graph", "status", "reason")


def markdown(rows: list[dict]) -> str:
    """The measured configurations, then the combinations not run with the reason."""

    def table(columns, rows):
        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        return lines + ["| " + " | ".join(_fmt(r[c]) for c in columns) + " |" for r in rows]

    ran = [r for r in rows if r["status"] == "ok"]
    not_ran = [r for r in rows if r["status"] != "ok"]
    lines = [
        "Transfers per generated token (decode), latency in ms, warm-up excluded. planned_*: what the export plan "
        "moves per token on a GPU (planned, not moved without CUDA):",
        "",
    ] + table(RAN, ran)
    if not_ran:
        lines += ["", f"Not run ({len(not_ran)}):", ""] + table(NOT_RAN, not_ran)
    return "\n".join(lines) + "\n"


def latest_sweep(*roots) -> Path | None:
    """The newest sweep directory (one with a summary.md) under <root>/multirun of the given roots."""
    found = [p.parent for root in roots for p in Path(root, "multirun").glob("*/*/summary.md")]
    return max(found, key=lambda p: (p.parent.name, p.name)) if found else None


def write_summary(sweep_dir) -> str:
    """Write summary.md and summary.csv into sweep_dir; returns the markdown table."""
    sweep_dir = Path(sweep_dir)
    rows = load_rows(sweep_dir)
    table = markdown(rows)
    (sweep_dir / "summary.md").write_text(table)
    with open(sweep_dir / "summary.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    return table


class SweepSummary(Callback):
    """Hydra callback: at the end of a multirun, write and print the sweep's summary table."""

    def on_multirun_end(self, config, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        print(write_summary(sweep_dir), end="")
        print(f"summary: {sweep_dir / 'summary.md'} and summary.csv")
