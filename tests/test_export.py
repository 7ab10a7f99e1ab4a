"""Export: methods per split, device propagation and copy nodes per preset, skip flags, exact execution on CPU.

Devices are metadata here: tables use a pretend "cuda:0" delegate (a plan-only program); execution uses the
model's device (the CPU), where copy nodes are no-ops that move nothing.
"""

import json

import pytest
import torch

from qmoe.export import METHOD_SPLITS, PRESETS, ExportError, ExportSettings, Program, export_program
from qmoe.export.methods import export_methods
from qmoe.export.passes import call_delegate
from qmoe.export.planning import ProgramPlan, Request, align
from qmoe.model import ModelConfig, build_model
from qmoe.runtime.ledger import TransferLedger
from qmoe.runtime.profile import ledger_totals, profiled_memcpys
from tests.compose import compose_config
from tests.test_export_planning import assert_no_live_overlap
from tests.test_model import TINY

B, S, V = 2, 32, TINY["vocab_size"]  # batch rows, max_seq_len, vocab
PRESET_FLAGS = {  # configs/export/<preset>.yaml, as flags (test_presets_compose checks them)
    "baseline": {},
    "device_planned": {"device_memory_planning": True},
    "copy_elided": {
        "device_memory_planning": True,
        "skip_h2d_for_method_inputs": True,
        "skip_d2h_for_method_outputs": True,
    },
}


def settings(preset: str, split: str, **kw) -> ExportSettings:
    return ExportSettings(preset=preset, method_split=split, **{**PRESET_FLAGS[preset], **kw})


def tiny_model(batch: int, max_seq_len: int, device="cpu"):
    """The tiny model (fp32, seed 0) with caches for batch x max_seq_len."""
    model = build_model(ModelConfig(**TINY), torch.float32, device, seed=0)
    model.setup_caches(batch, max_seq_len)
    return model


@pytest.fixture(scope="module")
def model():
    return tiny_model(B, S)


@pytest.fixture(scope="module")
def exported(model):
    """torch.export of each split, once: presets only change the passes and the plan, not the export."""
    return {split: export_methods(model, split, B, S) for split in METHOD_SPLITS}


def program(model, exported, preset, split, **kw) -> Program:
    return Program(exported[split], model, settings(preset, split, **kw), B, S)


# The sampling parameters enter as [B] tensors: 4 bytes per row for fp32, 8 for int64.
SAMPLING_H2D = [
    ("h2d", "temperature", B * 4),
    ("h2d", "top_k", B * 8),
    ("h2d", "top_p", B * 4),
    ("h2d", "min_p", B * 4),
    ("h2d", "seed", B * 8),
    ("h2d", "step", B * 8),
]
PLANNED_FORWARD = [
    ("h2d", "tokens", B * S * 8),  # dynamic T planned at max_seq_len
    ("h2d", "input_pos", B * 8),
    ("d2h", "delegate_logits", B * V * 4),  # logits leave the GPU ...
]
# (preset, method_split) -> {method: [(direction, tensor, bytes)]}; baseline and copy_elided have none.
COPY_NODES = {
    ("device_planned", "split"): {
        "forward": PLANNED_FORWARD,
        "sample": [("h2d", "logits", B * V * 4), *SAMPLING_H2D, ("d2h", "delegate_token", B * 8)],  # ... and return
    },
    ("device_planned", "fused"): {
        "prefill": [
            ("h2d", "tokens", B * S * 8),
            ("h2d", "input_pos", B * 8),
            *SAMPLING_H2D,
            ("d2h", "delegate_token", B * 8),
        ],
        "decode": [
            ("h2d", "tokens", B * 1 * 8),
            ("h2d", "input_pos", B * 8),
            *SAMPLING_H2D,
            ("d2h", "delegate_token", B * 8),
        ],
    },
    ("device_planned", "forward_only"): {"forward": PLANNED_FORWARD},
}


@pytest.mark.parametrize("split", METHOD_SPLITS)
@pytest.mark.parametrize("preset", PRESETS)
def test_copy_nodes_per_preset_and_split(model, exported, preset, split):
    prog = program(model, exported, preset, split, delegate_device="cuda:0")
    expected = COPY_NODES.get((preset, split), {m: [] for m in METHOD_SPLITS[split]})
    assert set(prog.plan.copies) == set(expected)
    for method, copies in prog.plan.copies.items():
        assert [(c["direction"], c["tensor"], c["nbytes"]) for c in copies] == expected[method], method
        for c in copies:
            host_to_device = ("cpu", "cuda:0") if c["direction"] == "h2d" else ("cuda:0", "cpu")
            assert (c["src_device"], c["dst_device"]) == host_to_device
        graph = prog.graphs[method].graph
        delegate = graph.find_nodes(op="call_function", target=call_delegate)[0]
        assert delegate.meta["qmoe_device"] == "cuda:0"
        # Planning off: no copy nodes, the delegate copies its host inputs in and outputs out itself.
        assert delegate.meta["qmoe_self_copies"] == (preset == "baseline")
        on_device = preset == "copy_elided"
        for node in graph.nodes:
            if node.op == "placeholder":
                assert node.meta["qmoe_device"] == ("cuda:0" if on_device else "cpu")
        outputs = next(iter(graph.find_nodes(op="output"))).args[0]
        assert [o.meta["qmoe_device"] for o in outputs] == ["cuda:0" if on_device else "cpu"] * len(outputs)
        # every delegate input lives on its device when planning is on
        if preset != "baseline":
            assert all(a.meta["qmoe_device"] == "cuda:0" for a in delegate.args)


def test_device_planned_arena_per_device(model, exported):
    plan = program(model, exported, "device_planned", "split", delegate_device="cuda:0").plan
    assert set(plan.arenas) == {"cpu", "cuda:0"}
    # forward's device tensors and sample's never live at once: they share bytes
    assert plan.arenas["cuda:0"] < plan.naive_bytes["cuda:0"]
    assert set(program(model, exported, "baseline", "split", delegate_device="cuda:0").plan.arenas) == {"cpu"}
    assert set(program(model, exported, "copy_elided", "split", delegate_device="cuda:0").plan.arenas) == {"cuda:0"}


def test_per_method_skip_map_applies_only_to_its_method(model, exported):
    prog = program(
        model,
        exported,
        "device_planned",
        "split",
        delegate_device="cuda:0",
        skip_d2h_for_method_outputs={"forward": True},
        skip_h2d_for_method_inputs={"sample": True},
    )
    # logits stay on the device after forward and are read there by sample: no copy either way
    assert [(c["direction"], c["tensor"]) for c in prog.plan.copies["forward"]] == [
        ("h2d", "tokens"),
        ("h2d", "input_pos"),
    ]
    assert [(c["direction"], c["tensor"]) for c in prog.plan.copies["sample"]] == [("d2h", "delegate_token")]


@pytest.mark.parametrize(
    "flags",
    [
        {"skip_h2d_for_method_inputs": True},
        {"skip_d2h_for_method_outputs": True},
        {"skip_d2h_for_method_outputs": {"sample": True}},
    ],
)
def test_skip_flags_need_planning(flags):
    with pytest.raises(ExportError, match="needs export.device_memory_planning=true"):
        ExportSettings(method_split="split", device_memory_planning=False, **flags)


def test_settings_refuse_bad_values():
    with pytest.raises(ExportError, match="method_split"):
        ExportSettings(method_split="both")
    with pytest.raises(ExportError, match="not methods of method_split=fused"):
        ExportSettings(method_split="fused", device_memory_planning=True, skip_h2d_for_method_inputs={"forward": 1})
    with pytest.raises(ExportError, match="export.skip_h2d: unknown key"):
        ExportSettings.from_cfg({"skip_h2d": True})
    # a map with planning off is fine when it skips nothing
    assert not ExportSettings(skip_h2d_for_method_inputs={"forward": False}).skip_h2d("forward")


@pytest.mark.parametrize("preset", PRESETS)
def test_presets_compose(preset):
    s = ExportSettings.from_cfg(compose_config(f"export={preset}", "export.method_split=fused").export)
    assert (s.preset, s.method_split, s.delegate_device) == (preset, "fused", "auto")
    assert s == settings(preset, "fused")


SAMPLING_ARGS = {
    "temperature": torch.zeros(B),
    "top_k": torch.zeros(B, dtype=torch.int64),
    "top_p": torch.ones(B),
    "min_p": torch.zeros(B),
    "seed": torch.zeros(B, dtype=torch.int64),
}


def greedy_sampling(step: int) -> tuple[torch.Tensor, ...]:
    return (*SAMPLING_ARGS.values(), torch.full((B,), step, dtype=torch.int64))


def run_eager(model, prompt, steps):
    """(logits per step, tokens per step) of the eager model: prefill, then `steps` decode steps."""
    model.reset_caches()
    logits, tokens = [], []
    device = model.device
    x, pos = prompt.to(device), torch.zeros(B, dtype=torch.int64, device=device)
    for step in range(steps + 1):
        out = model(x, pos)
        tok = model.sample(out, *(t.to(device) for t in greedy_sampling(step)))
        logits.append(out)
        tokens.append(tok)
        pos = pos + x.shape[1]
        x = tok[:, None]
    return logits, tokens


def run_program(prog, model, prompt, steps, ledger):
    model.reset_caches()  # the program's caches are the model's buffers
    logits, tokens = [], []
    x, pos = prompt, torch.zeros(B, dtype=torch.int64)
    m = prog.methods
    for step in range(steps + 1):
        if "decode" in m:
            (tok,) = (m["prefill"] if step == 0 else m["decode"])(x, pos, *greedy_sampling(step), ledger=ledger)
        else:
            (out,) = m["forward"](x, pos, ledger=ledger)
            logits.append(out.clone())
            if "sample" in m:
                (tok,) = m["sample"](out, *greedy_sampling(step), ledger=ledger)
            else:  # forward_only: the runner samples on the host
                tok = model.sample(out, *greedy_sampling(step))
        tokens.append(tok.clone())
        pos = pos + x.shape[1]
        x = tokens[-1][:, None]
    return logits, tokens


@pytest.mark.parametrize("split", METHOD_SPLITS)
@pytest.mark.parametrize("preset", PRESETS)
def test_methods_reproduce_eager_exactly(model, exported, preset, split):
    prog = program(model, exported, preset, split)
    assert prog.delegate_device == "cpu" and prog.executable
    prompt = torch.randint(0, V, (B, 5), generator=torch.Generator().manual_seed(1))
    eager_logits, eager_tokens = run_eager(model, prompt, steps=3)
    ledger = TransferLedger()
    logits, tokens = run_program(prog, model, prompt, 3, ledger)
    for got, want in zip(tokens, eager_tokens, strict=True):
        assert torch.equal(got, want)
    for got, want in zip(logits, eager_logits if logits else [], strict=not logits == []):
        assert torch.equal(got, want)
    assert ledger.transfers == []  # a CPU delegate moves no bytes: copy nodes and delegate copies are no-ops


def test_buffers_are_reused_and_outputs_are_planned_views(model, exported):
    prog = program(model, exported, "device_planned", "split")
    forward = prog.methods["forward"]
    tokens, pos = torch.zeros(B, 3, dtype=torch.int64), torch.zeros(B, dtype=torch.int64)
    (first,) = forward(tokens, pos)
    ptr = first.data_ptr()
    (second,) = forward(tokens, pos)
    assert second.data_ptr() == ptr  # same planned buffer every call
    arena = prog.arenas["cpu"]
    assert arena.data_ptr() <= ptr < arena.data_ptr() + arena.numel()
    # a caller that fills the planned input buffer in place skips the input copy
    buf = forward.input_buffer("tokens", (B, 3))
    buf.copy_(tokens)
    (third,) = forward(buf, pos)
    assert torch.equal(third, second)


def test_call_time_checks(model, exported):
    forward = program(model, exported, "device_planned", "split").methods["forward"]
    pos = torch.zeros(B, dtype=torch.int64)
    with pytest.raises(ExportError, match="input tokens must be on cpu"):
        forward(torch.zeros(B, 3, dtype=torch.int64, device="meta"), pos)
    with pytest.raises(ExportError, match="expected int64"):
        forward(torch.zeros(B, 3), pos)
    with pytest.raises(ExportError, match="does not fit"):
        forward(torch.zeros(B, S + 1, dtype=torch.int64), pos)
    with pytest.raises(ExportError, match="takes 2 inputs"):
        forward(pos)
    elided = program(model, exported, "copy_elided", "split").methods["forward"]
    with pytest.raises(ExportError, match="skip_h2d_for_method_inputs is set"):
        elided(torch.zeros(B, 3, dtype=torch.int64, device="meta"), pos)
    plan_only = program(model, exported, "device_planned", "split", delegate_device="cuda:0")
    assert not plan_only.executable
    with pytest.raises(ExportError, match="plan only"):
        plan_only.methods["forward"](torch.zeros(B, 3, dtype=torch.int64), pos)


def test_export_needs_matching_caches(model):
    with pytest.raises(ExportError, match="setup_caches"):
        export_program(model, ExportSettings(), B + 1, S)


@pytest.mark.parametrize("split", METHOD_SPLITS)
@pytest.mark.parametrize("preset", PRESETS)
def test_program_plans(model, exported, preset, split):
    plan = program(model, exported, preset, split, delegate_device="cuda:0").plan
    for device, size in plan.arenas.items():
        allocs = [a for a in plan.allocations if a.device == device and a.alias_of is None]
        requests = [Request(a.key, a.nbytes, a.start, a.end) for a in allocs]
        assert_no_live_overlap(requests, {a.key: a.offset for a in allocs}, size, plan.alignment)
        assert size <= plan.naive_bytes[device] == sum(align(r.nbytes, plan.alignment) for r in requests)
    for a in plan.allocations:
        assert a.nbytes == torch.Size(a.shape).numel() * getattr(torch, a.dtype).itemsize
        if a.tensor == "tokens" and a.method in ("forward", "prefill"):
            assert a.shape == [B, S]  # dynamic T at its upper bound
    # inputs and outputs are pinned for the program's lifetime: the static buffers callers bind to
    horizon = max(a.end for a in plan.allocations)
    assert all((a.start, a.end) == (0, horizon) for a in plan.allocations if a.role in ("input", "output"))
    assert ProgramPlan.from_json(plan.to_json()) == plan
    json.loads(plan.to_json())


def test_cpu_delegate_copies_alias_their_source(model, exported):
    """On a CPU delegate a copy node takes no memory: it is its source's bytes."""
    plan = program(model, exported, "device_planned", "split").plan
    assert set(plan.arenas) == {"cpu"}
    h2d = plan.allocation("forward", "h2d_tokens")
    assert h2d.alias_of == "forward.tokens" and h2d.offset == plan.allocation("forward", "tokens").offset


def test_delegate_is_swappable_and_reads_the_planned_buffers(model, exported):
    prog = program(model, exported, "device_planned", "fused")
    decode = prog.methods["decode"]
    seen = []
    original = decode.delegate

    def recording(*args, out):
        seen.append([a.data_ptr() for a in (*args, *out)])
        return original(*args, out=out)

    decode.delegate = recording  # what a CUDA graph replay would replace
    inputs = (torch.zeros(B, 1, dtype=torch.int64), torch.zeros(B, dtype=torch.int64), *greedy_sampling(0))
    decode(*inputs)
    decode(*inputs)
    planned_out = [decode.buffer("delegate_token").data_ptr()]
    assert seen[0] == seen[1] == [t.data_ptr() for t in decode.delegate_inputs()] + planned_out


def test_triton_ops_pass_through_and_only_naive_ops_are_swapped():
    """Ops that are custom ops already (Triton) stay as they are; the naive gdn is swapped for its stand-in."""
    model = build_model(ModelConfig(**TINY), torch.float32, "cpu", seed=0)
    model.setup_caches(1, 8)
    model.set_kernels({"moe": "triton"})
    ops = model.ops.copy()
    (ep,) = export_methods(model, "forward_only", 1, 8).values()
    assert model.ops == ops  # restored after export
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert "qmoe_export.gated_delta_net.default" in targets
    assert "qmoe_export.moe_block.default" not in targets
    assert any(t.startswith("qmoe.") and "moe" in t for t in targets)  # the Triton MoE custom ops


@torch.no_grad()
def test_program_calls_the_triton_ops_without_the_dispatcher():
    """A program's delegate calls each custom op's own function (eager_custom_ops: the dispatcher's round trip is
    ~7 us of host time per op call), in place and out-of-place graphs alike, and computes exactly what the
    exported graph, whose nodes dispatch the ops, computes (a prefill, then a decode step on its caches)."""
    from torch._library.custom_ops import OPDEFS

    from qmoe.export.program import Delegate

    model = build_model(ModelConfig(**TINY), torch.float32, "cpu", seed=0)
    model.setup_caches(1, 8)
    model.set_kernels({group: "triton" for group in model.ops}, greedy=True)
    ep = export_methods(model, "forward_only", 1, 8)["forward"]
    delegate = Delegate("forward", ep, model)

    def targets(gm):
        return {n.target for n in gm.graph.nodes if n.op == "call_function"}

    for gm in (delegate.graph_module, delegate.graph_module_in_place):
        dispatched = [t for t in targets(gm) if isinstance(t, torch._ops.OpOverload) and t._schema.name in OPDEFS]
        assert not dispatched and OPDEFS["qmoe::add_rms_norm_linear"]._init_fn in targets(gm)
    assert any(isinstance(t, torch._ops.OpOverload) and t._schema.name in OPDEFS for t in targets(ep.graph_module))
    steps = [(torch.tensor([[3, 1, 4]]), torch.tensor([0])), (torch.tensor([[5]]), torch.tensor([3]))]
    logits = []
    module = ep.module()
    for run in (lambda *a: (module(*a),), delegate):  # the module returns its one output as it is
        model.reset_caches()
        logits.append([run(tokens, pos)[0].clone() for tokens, pos in steps])
    for dispatched, direct in zip(*logits):
        torch.testing.assert_close(direct, dispatched, rtol=0, atol=0)


def test_inspect_prints_copy_nodes_and_arenas(capsys):
    from qmoe.export.inspect import main

    main(["export=device_planned", "export.method_split=split"])
    out = capsys.readouterr().out
    assert "preset=device_planned method_split=split" in out
    assert out.count(" h2d ") == 2 + 7 and out.count(" d2h ") == 2
    assert "arena cpu" in out and "arena cuda:0" in out


@pytest.fixture(scope="module")
def gpu():
    """(tiny model on the GPU, exports per split), made once for the GPU tests."""
    model = tiny_model(B, S, "cuda")
    return model, {split: export_methods(model, split, B, S) for split in METHOD_SPLITS}


@pytest.mark.gpu
@pytest.mark.parametrize("split", METHOD_SPLITS)
@pytest.mark.parametrize("preset", PRESETS)
def test_gpu_methods_match_eager_and_ledger_matches_profiler(gpu, preset, split):
    """On the GPU: greedy tokens equal the eager model's; the ledger holds one record per copy node (or per
    delegate copy under baseline) with the bytes moved; in decode it equals the profiler's memcpys exactly."""
    model, exported = gpu
    prog = program(model, exported, preset, split)
    assert prog.delegate_device == "cuda:0" and set(prog.arenas) <= {"cpu", "cuda:0"}
    on_device = preset == "copy_elided"
    where = "cuda" if on_device else "cpu"
    prompt = torch.randint(0, V, (B, 5), generator=torch.Generator().manual_seed(1))
    _, eager_tokens = run_eager(model, prompt.cuda(), steps=3)
    params = [t.to(where) for t in greedy_sampling(0)[:-1]]
    steps = [torch.full((B,), s, dtype=torch.int64, device=where) for s in range(4)]
    m = prog.methods

    def step(x, pos, s, ledger):
        """The program's part of step s: the token (split, fused) or the logits (forward_only)."""
        if "decode" in m:
            return (m["prefill"] if s == 0 else m["decode"])(x, pos, *params, steps[s], ledger=ledger)[0]
        (logits,) = m["forward"](x, pos, ledger=ledger)
        if "sample" in m:
            return m["sample"](logits, *params, steps[s], ledger=ledger)[0]
        return logits

    def token(out, s):  # forward_only: the test samples, outside the profiled region (its copies are not ours)
        return out if "sample" in m or "decode" in m else model.sample(out, *params, steps[s])

    model.reset_caches()
    ledger = TransferLedger()
    x, pos, tokens = prompt.to(where), torch.zeros(B, dtype=torch.int64, device=where), []
    for s in range(3):
        tokens.append(token(step(x, pos, s, ledger), s).clone())
        pos, x = pos + x.shape[1], tokens[-1][:, None]
    out, seen = profiled_memcpys(lambda: step(x, pos, 3, ledger.at("decode", 3)))
    tokens.append(token(out, 3).clone())
    for got, want in zip(tokens, eager_tokens, strict=True):
        assert torch.equal(got.cpu(), want.cpu())
    assert ledger_totals(ledger, "decode") == seen
    sources = {t.source for t in ledger.transfers}
    # copy_elided: the inputs passed here are device tensors outside their planned buffers: device-to-device
    # copies; with planning on, the sampled token (the torch sampler has no out-variant) is copied into its buffer
    expected = {"baseline": {"delegate"}, "device_planned": {"copy_node"}, "copy_elided": {"runner"}}[preset]
    assert sources == expected | ({"delegate"} if preset != "baseline" and split != "forward_only" else set())
    if preset == "copy_elided":
        assert {t.direction for t in ledger.transfers} == {"d2d"}
    if preset == "device_planned":  # one record per copy node per call, in decode with T = 1
        recorded = [t for t in ledger.transfers if t.phase == "decode" and t.source == "copy_node"]
        copies = [c for method in prog.plan.methods if method != "prefill" for c in prog.plan.copies[method]]
        assert len(recorded) == len(copies)


@pytest.mark.parametrize(
    "dtype,tail,in_place",
    [
        (torch.bfloat16, "cast", True),  # the bf16 -> fp32 cast writes the planned buffer itself
        (torch.float32, "cast", True),  # a no-op cast: the linear's out-variant writes it
        (torch.float32, "relu", False),  # no out-variant: the executor copies (a recorded d2d)
    ],
)
def test_outputs_in_place(dtype, tail, in_place):
    """A method output is computed straight into its planned buffer when its last op has an out-variant."""
    from qmoe.export.program import outputs_in_place

    class Head(torch.nn.Module):
        def forward(self, x, w):
            y = torch.nn.functional.linear(x, w)
            return (y.float() if tail == "cast" else torch.relu(y)).float()

    x, w = torch.randn(2, 8, dtype=dtype), torch.randn(5, 8, dtype=dtype)
    ep = torch.export.export(Head(), (x, w))
    gm, written = outputs_in_place(ep.graph_module, [0])
    assert written == [in_place]
    linears = [n for n in gm.graph.nodes if n.target is torch.ops.aten.linear.default]
    assert len(linears) == 1 - (in_place and dtype == torch.float32)  # the replaced op is gone: it runs once
    out = torch.full((2, 5), float("nan"))
    (result,) = gm(x, w, out)
    assert (result.data_ptr() == out.data_ptr()) == in_place
    ref = torch.nn.functional.linear(x.double(), w.double())
    ref = (ref if tail == "cast" else torch.relu(ref)).float()
    torch.testing.assert_close(result, ref, rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-2)


def test_logits_are_written_in_place():
    """The Triton lm_head's logits op (fp32 out of a bf16/fp16 GEMV, no cast node) has an out-variant: a method
    whose output is the logits computes them into the planned buffer, no copy."""
    from kernels.linear import triton as linear
    from qmoe.export.program import outputs_in_place

    class Head(torch.nn.Module):
        def forward(self, x, w):
            return linear.logits(x, w)

    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(1, 1, 32, generator=gen, dtype=torch.float16), torch.randn(40, 32, generator=gen).half()
    gm, written = outputs_in_place(torch.export.export(Head(), (x, w)).graph_module, [0])
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"] == [linear.logits_out]
    out = torch.full((1, 1, 40), float("nan"))
    (logits,) = gm(x, w, out)
    assert written == [True] and logits.data_ptr() == out.data_ptr()
    assert torch.equal(out, linear.linear(x, w).float())


def test_greedy_token_is_written_in_place():
    """The Triton greedy sampler's op has an out-variant: a method's token lands in its planned buffer, no copy."""
    from kernels.sampling import triton as sampling
    from qmoe.export.program import outputs_in_place

    class Greedy(torch.nn.Module):
        def forward(self, logits):
            return sampling.greedy(logits)

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    gm, written = outputs_in_place(torch.export.export(Greedy(), (logits,)).graph_module, [0])
    out = torch.full((3,), -7, dtype=torch.int64)
    (token,) = gm(logits, out)
    assert written == [True] and token.data_ptr() == out.data_ptr()
    assert torch.equal(out, logits.argmax(-1))
