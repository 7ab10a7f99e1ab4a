"""The first hour of a new user (issue 14): the CLIs' one-line errors, Ctrl-C, sweeps checked before job 0,
run.log, no directory left behind by a failed run."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import kernels

ROOT = Path(__file__).resolve().parents[1]


def cli(*args, env=None, timeout=120):
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env or os.environ
    )


def one_line_exit_2(p, *words):
    lines = [line for line in p.stderr.strip().splitlines() if line.strip()]
    assert p.returncode == 2, p.stderr
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def test_inspect_unknown_preset_is_one_line():
    line = one_line_exit_2(cli("-m", "qmoe.export.inspect", "export=foo"), "export/foo", "copy_elided")
    assert "allowed: baseline, copy_elided, device_planned" in line


@pytest.mark.parametrize(
    "args,words",
    [
        (["model=nope", "out=x"], ["model=nope", "qwen35_moe_tiny"]),  # names the options there are
        (["model=qwen35_moe", "layers=abc", "out=x"], ["layers=abc", "integer"]),
        (["model=qwen35_moe_tiny", "out=x", "expert_layout=rows"], ["expert_layout", "per_expert"]),
    ],
    ids=["model", "layers", "expert_layout"],
)
def test_synth_bad_argument_is_one_line(args, words, tmp_path):
    one_line_exit_2(
        cli("-m", "qmoe.checkpoint.synth", *[a.replace("out=x", f"out={tmp_path}/x") for a in args]), *words
    )
    assert not (tmp_path / "x").exists()  # checked before anything is written


def test_synth_help_prints_usage():
    p = cli("-m", "qmoe.checkpoint.synth", "--help")
    assert p.returncode == 0 and p.stderr == "", p.stderr
    assert "python -m qmoe.checkpoint.synth model=" in p.stdout and "tokenizer=true" in p.stdout


def test_sweep_values_checked_before_job_0(tmp_path):
    """The bad value is the second of the sweep: nothing runs, no sweep directory is made."""
    p = cli("run.py", "-m", "sampling.top_p=0.5,1.5", "logger=none", f"hydra.sweep.dir={tmp_path / 'sweep'}")
    line = one_line_exit_2(p, "sampling.top_p", "1.5", "sweep value 2 of 2", "no job was started")
    assert "(0, 1]" in line
    assert not (tmp_path / "sweep").exists()


@pytest.mark.parametrize("name,value", [("QMOE_FP8_PREFILL", "fp9"), ("QMOE_PDL", "off")], ids=["fp8_prefill", "pdl"])
def test_bad_kernel_switch_in_the_environment_is_one_line(name, value, tmp_path):
    """A kernel switch the kernels read from the environment, set to a value they do not take (QMOE_PDL=off would
    have run with PDL on): one line naming it and its values, nothing run, no run directory."""
    p = cli("run.py", "logger=none", f"hydra.run.dir={tmp_path / 'run'}", env={**os.environ, name: value})
    line = one_line_exit_2(p, f"{name}={value!r}")
    assert ", ".join(kernels.ENVIRONMENT[name]) in line
    assert not (tmp_path / "run").exists()


def test_ctrl_c_writes_partial_results_in_one_line(tmp_path):
    """SIGINT in the middle of decoding: one line on stderr, exit 130, results.json with the steps so far."""
    run_dir = tmp_path / "run"
    args = ["run.py", "logger=none", f"hydra.run.dir={run_dir}"]
    args += ["generation.max_new_tokens=2000", "model.max_seq_len=2048", "generation.stop_on_eos=false"]
    p = subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 90
    log = run_dir / "run.log"
    while not (log.exists() and "generating up to" in log.read_text()):  # decode has started
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()[1]
        time.sleep(0.05)
    time.sleep(1.5)  # the prefill and some decode steps (about 10 ms each here)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert p.returncode == 130 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("interrupted: Ctrl-C after") and "partial" in lines[0]
    r = json.loads((run_dir / "results.json").read_text())
    steps = r["latency"]["decode_ms"]["steps"]
    assert r["partial"] is True and 0 < steps < 1999
    assert len(r["generated"]["token_ids"][0]) == steps + 1  # the prefill's token and one per measured step
    assert "(partial: interrupted)" in out


def test_run_log_holds_the_log_and_summary(tmp_path):
    p = cli("run.py", "logger=none", f"hydra.run.dir={tmp_path}", "generation.max_new_tokens=3")
    assert p.returncode == 0, p.stderr
    log = (tmp_path / "run.log").read_text()
    assert "[qmoe][INFO] - model qwen35_moe_tiny ready" in log and "results:" in log
    for row in ("runtime", "export / split", "kernels", "CUDA graph off", "float32", "device", "per decode token"):
        assert row in log and row in p.stdout
    assert "tokens/s" in p.stdout
