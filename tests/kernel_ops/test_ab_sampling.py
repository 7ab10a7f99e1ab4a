"""experiments/ab_sampling.py on the CPU interpreter: a variant file loads beside the checkout's sampler (its custom
ops renamed, so both register), a variant passes launch() knobs, and every variant is timed and reports how its
rows finished."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ab_sampling_times_a_variant_beside_the_checkout(tmp_path):
    variant = tmp_path / "sampling_copy.py"
    variant.write_text((ROOT / "kernels/sampling/triton.py").read_text())
    out = tmp_path / "ab.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{ROOT}:{ROOT / 'experiments'}"}
    cmd = [sys.executable, str(ROOT / "experiments/ab_sampling.py"), "--variant", f"copy:{variant}", "--variant",
           "grid:current:grid_steps=1", "--batch", "2", "--shapes", "llm", "--rounds", "2", "--vocab", "1024",
           "--out", str(out)]  # fmt: skip
    subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=600)
    rows = json.loads(out.read_text())["rows"]
    assert [r["variant"] for r in rows] == ["current", "copy", "grid"]
    assert {r["mode"] for r in rows} == {"topk50_topp0.9"}
    assert rows[2]["knobs"] == {"grid_steps": 1}
    for r in rows:
        assert len(r["rounds_us"]) == 2 and r["us"] > 0
        assert sum(r["paths"].values()) == 2  # both rows finished, each counted once
        assert r["max_listed"] >= 50  # top-k 50: the list holds at least k tokens
