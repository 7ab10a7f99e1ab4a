"""Runtime on CPU (tiny model): the host and cuda_native loops give the reference runner's tokens for every export
preset x method split they support, invalid combinations are one-line errors, and the ledger is what the design
says. On a CPU delegate nothing crosses a bus: copy nodes alias their source, so the ledger records nothing. On
the staged CPU delegate ("cpu:1": a second CPU memory space, the same executor as on a GPU) every copy really
happens, and the ledger is checked against the design table, the plan's copy nodes and an independent count of
Tensor.copy_ calls (tests/test_runtime_gpu.py checks the same table against the profiler on the GPU)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from compose import compose_config

from qmoe.app import run_experiment
from qmoe.export import ExportError, ExportSettings
from qmoe.export.program import DELEGATE_RANGE
from qmoe.model import ModelConfig, build_model
from qmoe.runtime.combos import combination_error, resolve_cuda_graph
from qmoe.runtime.cuda_native import CudaNativeRunner
from qmoe.runtime.executor import Exports, build_program
from qmoe.runtime.generate import ReferenceRunner, generate
from qmoe.runtime.host import HostRunner
from qmoe.runtime.ledger import DIRECTIONS, TransferLedger, direction
from qmoe.runtime.profile import ledger_totals, memcpy_totals
from qmoe.settings import ConfigError, SamplingSettings
from tests.test_export import PRESET_FLAGS as PRESETS

ROOT = Path(__file__).resolve().parents[1]
STAGED = "cpu:1"  # the staged CPU delegate: its own memory space, real copies
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


def program(model, preset, split, delegate_device="auto"):
    settings = ExportSettings(preset=preset, method_split=split, delegate_device=delegate_device, **PRESETS[preset])
    return build_program(model, settings, 2, 32)


LOOPS = [(HostRunner, s) for s in ("split", "forward_only")] + [(CudaNativeRunner, s) for s in ("split", "fused")]


def expected_decode_step(runtime: str, split: str, preset: str, B: int, V: int, token_in_place=False) -> dict:
    """Copies between memory spaces in one decode step (batch B), by design: tokens and positions are 8 B per
    row, logits 4 V B per row, the six sampling inputs 36 B per row. Device to device: with planning on, the
    sampled token is copied into its planned buffer (8 B per row) unless its op has an out-variant
    (token_in_place: the Triton greedy sampler); the logits are computed straight into theirs (the lm_head
    linear's out-variant)."""
    tok, logits, params = 8 * B, 4 * V * B, 36 * B
    if runtime == "reference" or (runtime == "cuda_native" and preset == "copy_elided"):
        table = (0, 0, 1, tok)  # the token ids read back
    elif runtime == "host":  # token + position up (runner, copy nodes or delegate), logits down
        table = (2, 2 * tok, 1, logits)
    elif split == "split":  # forward: token, position up, logits down; sample: logits + params up, token down
        table = (9, 2 * tok + logits + params, 2, logits + tok)
    else:  # decode: token, position, params up, token down
        table = (8, 2 * tok + params, 1, tok)
    h, hb, d, db = table
    dd = int(runtime == "cuda_native" and preset != "baseline" and not token_in_place)
    return {
        "h2d": {"count": h, "bytes": hb},
        "d2h": {"count": d, "bytes": db},
        "d2d": {"count": dd, "bytes": dd * tok},
    }


class CopyCounter:
    """An independent count of the copies between memory spaces: every Tensor.copy_ made outside a delegate call
    (inside, the delegate writes its own memory), classified by where its two sides live as this counter sees it:
    the staged arena, or any tensor a delegate took or returned, is the delegate's memory; anything else is the
    host's. Holds every tensor it saw, so no address is reused while it counts."""

    def __init__(self, monkeypatch, runner):
        self.ledger, self.arena = runner.ledger, (runner.program.arenas or {}).get(STAGED)
        self.copies, self.delegate_tensors, self.depth = [], [], 0
        original = torch.Tensor.copy_

        def copy_(dst, src, *args, **kw):
            if self.depth == 0:
                self.copies.append((self.ledger.phase, self.ledger.step, dst, src))
            return original(dst, src, *args, **kw)

        monkeypatch.setattr(torch.Tensor, "copy_", copy_)
        for method in runner.methods.values():
            monkeypatch.setattr(method, "delegate", self._watch(method.delegate))

    def _watch(self, delegate):
        def call(*inputs, out):
            self.depth += 1
            try:
                outputs = delegate(*inputs, out=out)
            finally:
                self.depth -= 1
            self.delegate_tensors += [*inputs, *outputs]
            return outputs

        return call

    def _space(self, t: torch.Tensor) -> str:
        ptr = t.untyped_storage().data_ptr()
        arena = self.arena
        if arena is not None and arena.data_ptr() <= t.data_ptr() < arena.data_ptr() + arena.numel():
            return STAGED
        return STAGED if any(d.untyped_storage().data_ptr() == ptr for d in self.delegate_tensors) else "cpu"

    def transfers(self) -> list[tuple]:
        """Sorted (phase, step, direction, bytes) of the copies that cross memory spaces."""
        seen = [(p, s, direction(self._space(src), self._space(dst)), src.nbytes) for p, s, dst, src in self.copies]
        return sorted(t for t in seen if t[2] is not None)


def ledger_transfers(ledger) -> list[tuple]:
    return sorted((t.phase, t.step, t.direction, t.nbytes) for t in ledger.transfers)


@pytest.mark.parametrize("delegate_device", ["auto", STAGED])
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("runner_cls,split", LOOPS)
def test_loops_match_reference(model, reference, runner_cls, split, preset, delegate_device, monkeypatch):
    """Same tokens as the eager model (greedy; sampled once per loop: the sampler's `step` input must line up),
    ragged batch (the forced prompt ids go up as well); nothing recorded on a CPU delegate, on the staged one
    exactly the copies an independent count sees."""
    for sampling in (GREEDY, SAMPLED) if preset == "copy_elided" else (GREEDY,):
        ledger = TransferLedger()
        prog = program(model, preset, split, delegate_device)
        runner = runner_cls(prog, model, sampling, 2, ledger, cuda_graph=False)
        if delegate_device == "auto":
            assert generate(runner, PROMPTS, NEW).tokens == reference[sampling]
            assert ledger.transfers == []
            continue
        with monkeypatch.context() as patch:
            counter = CopyCounter(patch, runner)
            assert generate(runner, PROMPTS, NEW).tokens == reference[sampling]
        assert ledger.transfers and ledger_transfers(ledger) == counter.transfers()


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("runner_cls,split", LOOPS)
def test_staged_ledger_is_the_design_and_the_plan(model, runner_cls, split, preset, monkeypatch):
    """Staged CPU delegate, equal prompts, 3 decode steps: per step the ledger holds the design table's copies
    (copy_elided + cuda_native: one 8-byte read-back per row, nothing up, the token's d2d copy), one record
    per copy node of every method the step runs (bytes at T = 1), and what the independent count sees."""
    ledger, steps = TransferLedger(), 3
    prog = program(model, preset, split, STAGED)
    runner = runner_cls(prog, model, GREEDY, 2, ledger, cuda_graph=False)
    prompt = torch.tensor([p[:5] for p in PROMPTS])
    with monkeypatch.context() as patch:
        counter = CopyCounter(patch, runner)
        runner.start(prompt)
        for _ in range(steps):
            runner.step(None)
    assert ledger_transfers(ledger) == counter.transfers()
    runtime = "host" if runner_cls is HostRunner else "cuda_native"
    per_step = expected_decode_step(runtime, split, preset, 2, model.config.vocab_size)
    assert ledger_totals(ledger, "decode") == {d: {k: v * steps for k, v in per_step[d].items()} for d in per_step}
    step_methods = {"host": ("forward",), "cuda_native": {"split": ("forward", "sample"), "fused": ("decode",)}}
    methods = step_methods[runtime] if runtime == "host" else step_methods[runtime][split]
    planned = sorted(
        (c["direction"], 2 * 8 if c["tensor"] == "tokens" else c["nbytes"])
        for m in methods
        for c in prog.plan.copies[m]
    )
    for step in range(1, steps + 1):
        nodes = [t for t in ledger.transfers if (t.phase, t.step, t.source) == ("decode", step, "copy_node")]
        assert sorted((t.direction, t.nbytes) for t in nodes) == planned
        assert {t.method for t in nodes} <= set(methods)


def test_staged_input_passed_outside_its_buffer_is_a_recorded_d2d(model, monkeypatch):
    """A device tensor passed to a method but not in that input's planned buffer costs a device-to-device copy."""
    prog = program(model, "copy_elided", "split", STAGED)
    ledger = TransferLedger()
    elsewhere = prog.methods["sample"].input_buffer("seed").view(2, 1).fill_(3)  # cpu:1 int64 [B, 1], another slot
    pos = prog.methods["forward"].input_buffer("input_pos").zero_()
    with monkeypatch.context() as patch:
        counter = CopyCounter(patch, HostRunner(prog, model, GREEDY, 2, ledger))
        model.reset_caches()
        prog.methods["forward"](elsewhere, pos, ledger=ledger)
    assert [(t.direction, t.nbytes, t.source) for t in ledger.transfers] == [("d2d", 16, "runner")]
    assert ledger_transfers(ledger) == counter.transfers()


def test_fed_outputs_are_their_consumers_inputs(model):
    """Split: forward's logits are sample's logits buffer and sample's token is forward's tokens buffer, on every
    preset, so the cuda_native loop copies neither; fused: both token outputs are decode's tokens."""
    for preset in PRESETS:
        m = program(model, preset, "split", STAGED).methods
        model.reset_caches()
        tokens, pos = m["forward"].input_buffer("tokens", (2, 1)).zero_(), m["forward"].input_buffer("input_pos")
        (logits,) = m["forward"](tokens, pos.zero_())
        assert logits.data_ptr() == m["sample"].input_buffer("logits").data_ptr()
        fused = program(model, preset, "fused", STAGED).plan
        for method in ("prefill", "decode"):
            out = [a for a in fused.allocations if a.method == method and a.role == "output"]
            assert [a.offset for a in out] == [fused.allocation("decode", "tokens").offset]


def test_exports_belong_to_one_model(model):
    """The export cache answers only for the model it holds; another model drops its entries."""
    exports = Exports()
    first = exports.get(model, "split", ("forward", "sample"), 2, 32)
    assert exports.get(model, "forward_only", ("forward",), 2, 32)["forward"] is first["forward"]  # not re-exported
    other = build_model(model.config, torch.float32, "cpu", seed=1)
    other.setup_caches(2, 32)
    again = exports.get(other, "forward_only", ("forward",), 2, 32)
    assert exports.model is other and again["forward"] is not first["forward"]
    assert list(exports.programs) == [("forward", 2, 32, tuple(sorted((g, m.__name__) for g, m in other.ops.items())))]


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
    assert tr["per_decode_token"] == {d: {"count": 0, "bytes": 0} for d in DIRECTIONS}


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


def test_a_saved_program_samples_only_as_it_was_exported(tmp_path):
    """A program whose methods sample bakes in what its config fixed (greedy: the argmax alone): loading it for a
    run that samples otherwise is refused in one line, not run with the exported sampler."""
    from qmoe.runtime.executor import load_program

    cfg = ModelConfig.from_dict(dict(compose_config().model.arch))
    model = build_model(cfg, torch.float32, "cpu", seed=0)
    model.setup_caches(1, 16)
    identity = {"source": "random", "seed": 0}
    settings = ExportSettings(preset="baseline", method_split="split")
    model.set_kernels({}, greedy=True)
    build_program(model, settings, 1, 16, exports=Exports()).save(tmp_path / "greedy", identity)
    assert load_program(tmp_path / "greedy", model, identity, settings).kernels["sampling"].endswith("[greedy]")
    model.set_kernels({}, greedy=False)
    with pytest.raises(ExportError, match=r"^refusing program .*sample with kernels\.sampling\.naive\[greedy\], "):
        load_program(tmp_path / "greedy", model, identity, settings)
    forward_only = ExportSettings(preset="baseline", method_split="forward_only")  # the runner samples: any config
    build_program(model, forward_only, 1, 16, exports=Exports()).save(tmp_path / "forward", identity)
    model.set_kernels({}, greedy=True)
    load_program(tmp_path / "forward", model, identity, forward_only)


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
    assert s["prefill"] == {
        "h2d": {"count": 1, "bytes": 64},
        "d2h": {"count": 1, "bytes": 8},
        "d2d": {"count": 0, "bytes": 0},
    }
    assert s["per_decode_token"] == {
        "h2d": {"count": 0.5, "bytes": 4.0},
        "d2h": {"count": 1.0, "bytes": 1028.0},
        "d2d": {"count": 0, "bytes": 0},
    }
    assert s["per_decode_token_by_method"]["sample"]["d2h"] == {"count": 0.5, "bytes": 4.0}
    assert s["by_phase_method_direction"]["decode/forward/d2h"] == {"count": 2, "bytes": 4096}


def test_memcpy_totals_from_a_trace():
    """HtoD, DtoH and DtoD memcpys are counted; a DtoD launched inside a delegate's range is its own work."""
    delegate = {"ph": "X", "cat": "user_annotation", "name": DELEGATE_RANGE, "ts": 100, "dur": 50, "tid": 1}
    events = [
        delegate,
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pageable -> Device)", "args": {"bytes": 16}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "args": {"bytes": 8}},
        {
            "ph": "X",
            "cat": "gpu_memcpy",
            "name": "Memcpy DtoD (Device -> Device)",
            "args": {"bytes": 4096, "correlation": 7},
        },
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpyAsync", "ts": 90, "tid": 1, "args": {"correlation": 7}},
        {
            "ph": "X",
            "cat": "gpu_memcpy",
            "name": "Memcpy DtoD (Device -> Device)",
            "args": {"bytes": 64, "correlation": 9},
        },
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 120, "tid": 1, "args": {"correlation": 9}},
        {
            "ph": "X",
            "cat": "gpu_memcpy",
            "name": "Memcpy DtoD (Device -> Device)",
            "args": {"bytes": 32, "correlation": 11},
        },
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpyAsync", "ts": 120, "tid": 2, "args": {"correlation": 11}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "args": {"bytes": 4}},
    ]
    assert memcpy_totals(events) == {
        "h2d": {"count": 2, "bytes": 20},
        "d2h": {"count": 1, "bytes": 8},
        "d2d": {"count": 2, "bytes": 4096 + 32},  # before the range, and in it on another thread; not in it
    }


class ScriptedRunner:
    """A runner whose samples are scripted per position; it logs the loop's calls in order."""

    def __init__(self, samples):
        self.samples, self.log, self.pos = samples, [], 0

    def start(self, prompt):
        self.pos = prompt.shape[1]
        return torch.tensor([self.samples[self.pos]])

    def launch(self, forced):
        self.pos += 1
        step, token = self.pos, torch.tensor([self.samples[self.pos]])
        self.log.append(("launch", step))

        def ids():
            self.log.append(("read", step))
            return token

        return ids


def test_generate_queues_the_next_step_before_reading_one():
    """The loop launches step t + 1 before it reads step t's ids (the device never waits on the host), stops
    queueing at max_new_tokens, and drops the one step queued past an EOS."""
    runner = ScriptedRunner(list(range(100, 120)))
    gen = generate(runner, [[1, 2]], max_new_tokens=4)
    assert gen.tokens == [[102, 103, 104, 105]]
    assert runner.log == [("launch", 3), ("launch", 4), ("read", 3), ("launch", 5), ("read", 4), ("read", 5)]
    runner = ScriptedRunner(list(range(100, 120)))
    gen = generate(runner, [[1, 2]], max_new_tokens=10, eos_ids=[104])
    assert gen.tokens == [[102, 103, 104]] and runner.log[-2:] == [("launch", 5), ("read", 4)]


class TwoRowRunner(ScriptedRunner):
    """ScriptedRunner with two rows (the second's samples 1000 above the first's)."""

    def start(self, prompt):
        return torch.cat([super().start(prompt)] * 2) + torch.tensor([0, 1000])

    def launch(self, forced):
        ids = super().launch(forced)
        return lambda: torch.cat([ids()] * 2) + torch.tensor([0, 1000])


@pytest.mark.parametrize("at_step", [1, 4])
def test_ctrl_c_between_a_steps_tokens_and_its_record_undoes_the_step(at_step, monkeypatch):
    # the race the Ctrl-C CLI test once hit (289 tokens for 287 steps): SIGINT after a step's tokens were taken
    # and before its time was recorded. The step is undone: every row holds the prefill's token and one per
    # recorded step, and decode_tokens counts them
    from qmoe.runtime import generate as generate_module

    class InterruptedList(list):
        def append(self, value):
            if len(self) + 1 == at_step:
                raise KeyboardInterrupt  # as a signal lands between the take and the record
            super().append(value)

    class Interrupted(generate_module.Generation):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.decode_ms = InterruptedList()

    monkeypatch.setattr(generate_module, "Generation", Interrupted)
    gen = generate(TwoRowRunner(list(range(100, 120))), [[1, 2], [3, 4]], max_new_tokens=8)
    assert gen.interrupted and len(gen.decode_ms) == at_step - 1
    assert [len(row) for row in gen.tokens] == [at_step, at_step]  # the prefill's token + one per recorded step
    assert gen.tokens == [list(range(102, 102 + at_step)), list(range(1102, 1102 + at_step))]
    assert gen.decode_tokens == 2 * (at_step - 1)
