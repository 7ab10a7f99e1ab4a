"""Runtime on CPU (tiny model): the host and cuda_native loops give the reference runner's tokens for every export
preset x method split they support, invalid combinations are one-line errors, and the ledger is what the design
says. On a CPU delegate nothing crosses a bus: copy nodes alias their source, the delegate's inputs are already
where it runs and the runner's token reads are host to host, so the ledger records nothing (the byte counts per
copy node are in the plan, tested by the export issue; on the GPU, tests/test_runtime_gpu.py checks them)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from compose import compose_config

from qmoe.app import run_experiment
from qmoe.export import ExportError, ExportSettings
from qmoe.model import ModelConfig, build_model
from qmoe.runtime.combos import combination_error, resolve_cuda_graph
from qmoe.runtime.cuda_native import CudaNativeRunner
from qmoe.runtime.executor import build_program
from qmoe.runtime.generate import ReferenceRunner, generate
from qmoe.runtime.host import HostRunner
from qmoe.runtime.ledger import TransferLedger
from qmoe.runtime.profile import memcpy_totals
from qmoe.settings import ConfigError, SamplingSettings

ROOT = Path(__file__).resolve().parents[1]
PRESETS = {
    "baseline": {},
    "device_planned": {"device_memory_planning": True},
    "copy_elided": {
        "device_memory_planning": True,
        "skip_h2d_for_method_inputs": True,
        "skip_d2h_for_method_outputs": True,
    },
}
GREEDY = SamplingSettings(0.0, 0, 1.0, 0.0, 0)
SAMPLED = SamplingSettings(1.0, 20, 0.9, 0.0, 3)  # exercises the sampler's per-step seed: `step` must line up
PROMPTS = [[5, 17, 300, 2, 9], [44, 1, 8, 250, 13, 77, 6, 31]]  # ragged: row 1 is fed its prompt while row 0 decodes
NEW = 5


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny shapes: one thread is several times faster than two on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model():
    arch = compose_config().model.arch
    m = build_model(ModelConfig.from_dict(dict(arch)), torch.float32, "cpu", seed=0)
    m.setup_caches(len(PROMPTS), 32)
    return m


@pytest.fixture(scope="module")
def reference(model):
    return {s: generate(ReferenceRunner(model, s, 2, TransferLedger()), PROMPTS, NEW).tokens for s in (GREEDY, SAMPLED)}


def program(model, preset, split):
    return build_program(model, ExportSettings(preset=preset, method_split=split, **PRESETS[preset]), 2, 32)


LOOPS = [(HostRunner, s) for s in ("split", "forward_only")] + [(CudaNativeRunner, s) for s in ("split", "fused")]


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("runner_cls,split", LOOPS)
def test_loops_match_reference(model, reference, runner_cls, split, preset):
    """Same tokens as the eager model (greedy; sampled once per loop: the sampler's `step` input must line up),
    ragged batch; nothing recorded on a CPU delegate."""
    for sampling in (GREEDY, SAMPLED) if preset == "copy_elided" else (GREEDY,):
        ledger = TransferLedger()
        runner = runner_cls(program(model, preset, split), model, sampling, 2, ledger, cuda_graph=False)
        assert generate(runner, PROMPTS, NEW).tokens == reference[sampling]
        assert ledger.transfers == []


def test_host_refuses_fused_cuda_native_refuses_forward_only(model):
    with pytest.raises(ConfigError, match="^runtime: host samples on the CPU"):
        HostRunner(program(model, "baseline", "fused"), model, GREEDY, 2, TransferLedger())
    with pytest.raises(ConfigError, match="^runtime: cuda_native samples on the device"):
        CudaNativeRunner(program(model, "baseline", "forward_only"), model, GREEDY, 2, TransferLedger())


@pytest.mark.parametrize(
    "runtime,split,planning,graph,has_cuda,error",
    [
        ("reference", "split", False, False, False, None),
        ("host", "forward_only", True, False, False, None),
        ("cuda_native", "fused", True, True, True, None),
        ("cuda_native", "split", False, False, False, "runtime: cuda_native needs a CUDA device"),  # no GPU here
        ("host", "fused", True, False, True, "runtime: host samples on the CPU"),  # fused samples in the program
        ("cuda_native", "forward_only", True, False, True, "runtime: cuda_native samples on the device"),
        ("reference", "split", False, True, True, "runtime.cuda_graph: the reference runner"),  # nothing exported
        ("host", "split", True, True, False, "runtime.cuda_graph: needs a CUDA device"),
        ("cuda_native", "split", False, True, True, "runtime.cuda_graph: needs export.device_memory_planning"),
    ],
)
def test_combination_errors(runtime, split, planning, graph, has_cuda, error):
    got = combination_error(runtime, split, planning, graph, has_cuda)
    assert got == error if error is None else got.startswith(error) and "\n" not in got


def test_cuda_graph_auto():
    assert resolve_cuda_graph("auto", "cuda_native", True, True) is True
    assert resolve_cuda_graph("auto", "cuda_native", False, True) is False  # baseline: nothing static to capture
    assert resolve_cuda_graph("auto", "host", True, True) is False
    assert resolve_cuda_graph("auto", "cuda_native", True, False) is False
    with pytest.raises(ValueError, match="runtime.cuda_graph"):
        resolve_cuda_graph("yes", "host", True, True)


def test_app_host_runner_results(tmp_path, model):
    """run_experiment with runtime=host: the reference's tokens, the setup and an empty ledger in results."""
    args = ("logger=none", "generation.max_new_tokens=5", "prompt.token_ids=[3,1,4,1,5]")
    ref = run_experiment(compose_config(*args), run_dir=tmp_path / "ref")
    host = run_experiment(compose_config(*args, "runtime=host", "export=copy_elided"), run_dir=tmp_path / "host")
    assert host["generated"]["token_ids"] == ref["generated"]["token_ids"]
    tr = host["transfers"]
    assert tr["setup"]["runtime"] == "host" and tr["setup"]["preset"] == "copy_elided"
    assert tr["setup"]["cuda_graph"] is False and tr["setup"]["copy_nodes"] == {"forward": [], "sample": []}
    assert tr["per_decode_token"] == {"h2d": {"count": 0, "bytes": 0}, "d2h": {"count": 0, "bytes": 0}}


def test_app_loads_a_saved_program(tmp_path):
    """runtime.program: the saved directory is loaded (not re-exported) and must match the export config."""
    from qmoe.app import get_model
    from qmoe.settings import validate

    args = ("logger=none", "generation.max_new_tokens=4", "prompt.token_ids=[2,7,1,8]", "runtime=host")
    cfg = compose_config(*args, "export=device_planned", "export.method_split=forward_only")
    s = validate(cfg)
    model, identity, _ = get_model(cfg, s, progress=False)
    model.setup_caches(s.batch_size, s.max_seq_len)
    build_program(model, ExportSettings.from_cfg(cfg.export), s.batch_size, s.max_seq_len).save(
        tmp_path / "p", identity
    )
    fresh = run_experiment(cfg, run_dir=tmp_path / "fresh")
    loaded = run_experiment(
        compose_config(
            *args, "export=device_planned", "export.method_split=forward_only", f"runtime.program={tmp_path / 'p'}"
        ),
        run_dir=tmp_path / "loaded",
    )
    assert loaded["generated"] == fresh["generated"]
    with pytest.raises(ExportError, match="^refusing program .*exported with"):
        run_experiment(
            compose_config(
                *args, "export=copy_elided", "export.method_split=forward_only", f"runtime.program={tmp_path / 'p'}"
            ),
            run_dir=tmp_path / "bad",
        )


def test_invalid_combination_is_one_line_exit_2():
    cmd = [sys.executable, "run.py", "runtime=host", "export.method_split=fused", "logger=none"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [p.stderr.strip()] and "runtime: host samples on the CPU" in p.stderr


def test_ledger_summary_phases_and_methods():
    ledger = TransferLedger()
    ledger.at("prefill", 0).record("h2d", 64, "forward", "runner")
    ledger.record("d2h", 8, "sample", "runner")
    for step in (1, 2):
        ledger.at("decode", step).record("h2d", 8, "forward", "copy_node")
        ledger.record("d2h", 2048, "forward", "delegate")
        ledger.record("d2h", 8, "sample", "runner")
    s = ledger.summary(decode_tokens=4)  # 2 steps x 2 rows
    assert s["prefill"] == {"h2d": {"count": 1, "bytes": 64}, "d2h": {"count": 1, "bytes": 8}}
    assert s["per_decode_token"] == {"h2d": {"count": 0.5, "bytes": 4.0}, "d2h": {"count": 1.0, "bytes": 1028.0}}
    assert s["per_decode_token_by_method"]["sample"]["d2h"] == {"count": 0.5, "bytes": 4.0}
    assert s["by_phase_method_direction"]["decode/forward/d2h"] == {"count": 2, "bytes": 4096}


def test_memcpy_totals_from_a_trace():
    events = [
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pageable -> Device)", "args": {"bytes": 16}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "args": {"bytes": 8}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)", "args": {"bytes": 4096}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpyAsync", "args": {}},  # the API call, not the copy
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "args": {"bytes": 4}},
    ]
    assert memcpy_totals(events) == {"h2d": {"count": 2, "bytes": 20}, "d2h": {"count": 1, "bytes": 8}}
