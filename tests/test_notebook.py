"""notebooks/copy_elision.ipynb runs headless from notebooks/ as `jupyter execute` runs it (nbclient, the kernel
in the notebook's directory) on a tiny-model ablation sweep this test makes, and the sweep writes its summary
table (markdown + CSV, measured and planned bytes per token) with the combinations it did not run and why."""

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
    # nothing moves on the CPU, but the plan shows what copy elision removes: baseline's delegate copies
    planned = {r["export"]: (r["planned_h2d_bytes_per_token"], r["planned_d2h_bytes_per_token"]) for r in rows[:3]}
    assert planned == {"-": ("", ""), "baseline": ("16.0", "2048.0"), "copy_elided": ("0", "0")}
    summary = (sweep_dir / "summary.md").read_text()
    assert "Not run (21):" in summary and "planned, not moved without CUDA" in summary


def kernel_env(monkeypatch, sweep_dir) -> None:
    """The notebook's kernel inherits this environment. `import qmoe` from notebooks/ needs the package installed
    (`pip install -e .`, the README's install step, which CI runs); where it is not, the repository goes on
    PYTHONPATH, which is what the editable install provides."""
    monkeypatch.setenv("SWEEP_DIR", str(sweep_dir))
    probe = subprocess.run([sys.executable, "-c", "import qmoe"], cwd=ROOT / "notebooks", capture_output=True)
    if probe.returncode != 0:
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))


def execute(nb) -> str:
    """Run the notebook as `jupyter execute notebooks/copy_elision.ipynb` does; its printed text."""
    NotebookClient(
        nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(ROOT / "notebooks")}}
    ).execute()
    return "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))


def test_notebook_runs_from_notebooks_dir(sweep_dir, monkeypatch):
    nb = nbformat.read(ROOT / "notebooks/copy_elision.ipynb", as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code")  # committed with outputs cleared
    kernel_env(monkeypatch, sweep_dir)
    text = execute(nb)
    assert "3 configurations measured, 21 not run" in text
    assert any("image/png" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", []))
    tables = "".join(o.get("data", {}).get("text/plain", "") for c in nb.cells for o in c.get("outputs", []))
    assert "planned_h2d_bytes_per_token" in tables


def test_notebook_without_a_sweep_says_how_to_point_at_one(tmp_path, monkeypatch):
    """SWEEP_DIR empty and no multirun/ anywhere it looks: one line saying what to run or set, no error."""
    from qmoe.metrics.sweep import latest_sweep

    assert latest_sweep(tmp_path) is None
    (tmp_path / "multirun/2026-01-02/10-00-00").mkdir(parents=True)
    (tmp_path / "multirun/2026-01-02/10-00-00/summary.md").write_text("")
    (tmp_path / "multirun/2026-01-01/23-00-00").mkdir(parents=True)
    (tmp_path / "multirun/2026-01-01/23-00-00/summary.md").write_text("")
    assert latest_sweep(tmp_path) == tmp_path / "multirun/2026-01-02/10-00-00"
    if latest_sweep(ROOT, ROOT / "notebooks") is not None:
        pytest.skip("this checkout has sweeps under multirun/: the notebook would find them")
    nb = nbformat.read(ROOT / "notebooks/copy_elision.ipynb", as_version=4)
    kernel_env(monkeypatch, "")
    text = execute(nb)
    assert "no sweep under" in text and "SWEEP_DIR=" in text and "nothing measured" in text


@pytest.mark.slow
def test_pip_install_makes_qmoe_importable_anywhere(tmp_path):
    """The README's `pip install --no-deps -e .` into a fresh virtual environment (with this one's packages):
    qmoe, kernels and the Hydra sweeper import from any directory."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    python = venv / "bin" / "python"
    p = subprocess.run(
        [python, "-m", "pip", "install", "-q", "--no-deps", "-e", str(ROOT)], capture_output=True, text=True
    )
    assert p.returncode == 0, p.stderr[-2000:]
    p = subprocess.run(
        [python, "-c", "import qmoe, kernels, hydra_plugins.qmoe_sweeper; print(qmoe.__file__)"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    assert p.returncode == 0 and p.stdout.strip() == str(ROOT / "qmoe/__init__.py"), p.stderr
