"""Triton's front end, as for the H200 (sm_90), on the kernels at the GPU's launch parameters.

The CPU suite runs kernels in Triton's interpreter, which accepts code that the compiler rejects: a name rebound to
another type inside an `if` passed every interpreter test and failed the first device call of session 14. The
scripts' `--front-end` compiles each kernel to Triton IR (no LLVM, no ptxas: seconds) in a process without
TRITON_INTERPRET, where the kernels are JIT functions.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "script, kernels",
    [
        ("aot_sampling.py", 16),  # the sampler's launches, greedy, a vocab-parallel rank's 2, at B = 1 and 256
        ("aot_decode_sass.py", 8),  # the 35B decode step's projections, MoE pair, DeltaNet and attention (H200 tables)
    ],
)
def test_kernels_pass_tritons_front_end_for_the_gpu(script, kernels):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(ROOT / "experiments" / script), "--front-end"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert run.stdout.count("front end ok") == kernels
