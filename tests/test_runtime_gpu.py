"""GPU: every runnable runtime x export preset x method split x CUDA graph at Qwen3.5-35B-A3B dims (4 layers,
random bf16 weights, Triton kernels): greedy tokens identical to the reference runner; the ledger equals the
design table (tests/test_runtime.expected_decode_step, also checked on the staged CPU delegate) per decode step
and the profiler's HtoD/DtoH/DtoD memcpys outside the delegates (count and bytes) in prefill and decode;
CUDA-graph rows make no device allocation per decode step, eager rows no new cudaMalloc."""

from pathlib import Path

import pytest
import torch
import yaml

from qmoe.export import ExportSettings
from qmoe.model import ModelConfig, build_model
from qmoe.runtime.ablation import decode_allocations
from qmoe.runtime.combos import combination_error
from qmoe.runtime.generate import generate
from qmoe.runtime.ledger import TransferLedger
from qmoe.runtime.profile import ledger_totals, profiled_memcpys
from qmoe.runtime.runners import make_runner
from qmoe.settings import SamplingSettings
from tests.test_runtime import expected_decode_step

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[1]
B, PROMPT, NEW, STEPS = 1, 32, 12, 6
GREEDY = SamplingSettings(0.0, 0, 1.0, 0.0, 0)
PRESETS = ("baseline", "device_planned", "copy_elided")
COMBOS = [
    (runtime, split, preset, graph)
    for runtime, splits in (
        ("reference", ("split",)),
        ("host", ("split", "forward_only")),
        ("cuda_native", ("split", "fused")),
    )
    for split in splits
    for preset in (PRESETS if runtime != "reference" else ("baseline",))
    for graph in (False, True)
    if combination_error(runtime, split, preset != "baseline", graph, True) is None
]


def export_settings(preset: str, split: str) -> ExportSettings:
    cfg = yaml.safe_load((ROOT / f"configs/export/{preset}.yaml").read_text())
    return ExportSettings.from_cfg({**cfg, "method_split": split})


@pytest.fixture(scope="module")
def model():
    arch = yaml.safe_load((ROOT / "configs/model/qwen35_moe.yaml").read_text())["arch"]
    m = build_model(ModelConfig.from_dict({**arch, "num_hidden_layers": 4}), torch.bfloat16, "cuda", seed=0)
    m.set_kernels({group: "triton" for group in m.ops}, greedy=True)  # as the app does for GREEDY
    m.setup_caches(B, PROMPT + 4 * NEW)
    return m


@pytest.fixture(scope="module")
def prompts(model):
    return torch.randint(0, model.config.vocab_size, (B, PROMPT), generator=torch.Generator().manual_seed(0)).tolist()


@pytest.fixture(scope="module")
def reference_tokens(model, prompts):
    ledger = TransferLedger()
    return generate(
        make_runner(model, "reference", export_settings("baseline", "split"), GREEDY, B, ledger, False), prompts, NEW
    ).tokens


@pytest.mark.parametrize("runtime,split,preset,graph", COMBOS)
def test_runtime_combination(model, prompts, reference_tokens, runtime, split, preset, graph):
    ledger = TransferLedger()
    runner = make_runner(model, runtime, export_settings(preset, split), GREEDY, B, ledger, graph)
    generate(runner, prompts, 4)  # warm-up: compiles, captures the graphs
    assert generate(runner, prompts, NEW).tokens == reference_tokens

    ledger.clear()
    prompt = torch.tensor(prompts)
    _, prefill = profiled_memcpys(lambda: runner.start(prompt))
    _, decode = profiled_memcpys(lambda: [runner.step(None) for _ in range(STEPS)])
    assert ledger_totals(ledger, "prefill") == prefill
    assert ledger_totals(ledger, "decode") == decode
    per_step = expected_decode_step(runtime, split, preset, B, model.config.vocab_size, token_in_place=True)
    assert decode == {d: {k: v * STEPS for k, v in per_step[d].items()} for d in per_step}

    allocations = decode_allocations(runner, prompt, STEPS)
    if graph:
        assert allocations["allocation"] == 0  # replayed graphs, planned buffers: nothing is allocated per step
    assert allocations["segment"] == 0  # and nothing ever goes back to cudaMalloc


def test_cuda_native_copy_elided_app_defaults_to_graphs(tmp_path):
    pytest.importorskip("hydra")
    from compose import compose_config

    from qmoe.app import run_experiment

    cfg = compose_config("runtime=cuda_native", "export=copy_elided", "logger=none", "generation.max_new_tokens=8")
    r = run_experiment(cfg, run_dir=tmp_path)
    assert r["transfers"]["setup"]["cuda_graph"] is True
    assert r["transfers"]["per_decode_token"] == {
        "h2d": {"count": 0, "bytes": 0},
        "d2h": {"count": 1, "bytes": 8},
        "d2d": {"count": 0, "bytes": 0},
    }


@pytest.mark.parametrize("split", ["split", "fused"])
def test_read_back_stream_is_waited_for(model, prompts, reference_tokens, split):
    """cuda_native reads each step's ids back on a stream of its own while the next step runs; the next writer of
    the ids' buffer (sample, or the fused decode) must wait for that copy. Here every copy is held up ~25 ms by a
    sleep queued before it on the read-back stream: without the wait the next step's ids overwrite the buffer first,
    and the ids read back are the next step's."""
    runner = make_runner(model, "cuda_native", export_settings("copy_elided", split), GREEDY, B, TransferLedger(), True)
    generate(runner, prompts, 4)  # warm-up: compiles, captures the graphs
    assert runner.read_stream is not None and runner.read_stream != torch.cuda.current_stream()
    queue = runner.read_back_later

    def delayed(method, token):
        with torch.cuda.stream(runner.read_stream):
            torch.cuda._sleep(50_000_000)  # clock cycles: ~25 ms
        return queue(method, token)

    runner.read_back_later = delayed
    assert generate(runner, prompts, NEW).tokens == reference_tokens
