"""notebooks/copy_elision.ipynb runs headless (nbclient) on a tiny-model ablation sweep this test makes, and the
sweep writes its summary table (markdown + CSV) with the combinations it did not run and why."""

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")  # notebook extras are test requirements, absent on the GPU image
NotebookClient = pytest.importorskip("nbclient").NotebookClient

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory):
    """The ablation on CPU, narrowed to 3 jobs: reference once, host x {baseline, copy_elided}."""
    out = tmp_path_factory.mktemp("sweep")
    cmd = [
        sys.executable, "run.py", "-m", "experiment=copy_elision_ablation", "logger=none",
        "runtime=reference,host,cuda_native", "export=baseline,copy_elided", "export.method_split=split,fused",
        "generation.max_new_tokens=3", "prompt.length=6", "runtime.warmup_steps=0", f"hydra.sweep.dir={out}",
    ]  # fmt: skip
    p = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert "| runtime |" in p.stdout and "summary.md" in p.stdout  # printed at the end
    return out


def test_sweep_summary_files(sweep_dir):
    with open(sweep_dir / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    ran = [(r["runtime"], r["export"], r["method_split"]) for r in rows if r["status"] == "ok"]
    assert sorted(ran) == [("host", "baseline", "split"), ("host", "copy_elided", "split"), ("reference", "-", "-")]
    not_run = [r for r in rows if r["status"] != "ok"]
    assert len(rows) == 3 * 2 * 2 * 2 and all(r["reason"] for r in not_run)  # runtime x export x split x graph
    assert {r["reason"].split(":")[0] for r in not_run} >= {"runtime", "runtime.cuda_graph", "reference ignores export"}
    assert all(
        float(r["decode_p50_ms"]) > 0 and float(r["h2d_bytes_per_token"]) == 0 for r in rows if r["status"] == "ok"
    )
    assert "Not run (21):" in (sweep_dir / "summary.md").read_text()


def test_notebook_runs_headless(sweep_dir):
    nb = nbformat.read(ROOT / "notebooks/copy_elision.ipynb", as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code")  # committed with outputs cleared
    os.environ["SWEEP_DIR"] = str(sweep_dir)
    try:
        NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    finally:
        del os.environ["SWEEP_DIR"]
    text = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
    assert "3 configurations measured, 21 not run" in text
    assert any("image/png" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", []))
