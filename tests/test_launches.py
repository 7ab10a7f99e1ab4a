"""Kernel launches of one decode step (forward + sample) of the tiny model with kernels=triton, counted on the CPU.

A launch is a Triton kernel launch (counted at the JIT function's `run`) or an aten op that launches a device
kernel (a TorchDispatchMode sees every aten op, also inside custom ops; views, allocations and metadata launch
nothing). Each launch is charged to the op group (`model.ops[group]`) whose function was running, or to `model`
for the model's own glue. The issue's target: <= 8 launches per layer + O(1); at batch 1 the model takes 6 (the
MoE block counted as its linear + 2).
"""

from collections import Counter
from pathlib import Path

import pytest
import torch
import yaml
from torch.utils._python_dispatch import TorchDispatchMode

from qmoe.model import build_model
from tests.helpers import tiny_config

TRITON_KERNELS = yaml.safe_load((Path(__file__).parents[1] / "configs/kernels/triton.yaml").read_text())
# aten ops that launch no device kernel beyond views (func.is_view): allocations and metadata
NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_unsafe_view", "detach"}
NO_KERNEL |= {"_assert_tensor_metadata", "sym_size", "sym_stride", "sym_numel", "lift_fresh", "alias"}

# Launches per layer of each op group in a decode step. linear: the mixer's fused in-projection and the MoE
# block's fused in-projection, each with the add + RMSNorm before it in its GEMV prologue, and the mixer's
# out-projection; the mixer (gdn or attention) one launch each; no separate norm. At batch > 1 the rows take the
# dot path, where each add + RMSNorm is its own kernel before the projection (charged to linear).
PER_LAYER = {"linear": 3, "norm": 0, "mixer": 1}
NORMS_OUTSIDE_GEMV = {1: 0, 2: 2}  # by batch
# The MoE block after its in-projection: routing, shared expert and combine fused into the two expert kernels.
MOE_LAUNCHES = 2
# Per step: the prologue (the embedding, the empty residual stream and the positions in one launch; as torch ops,
# the model's own glue, they were four), the final add + RMSNorm, lm_head (its fp32 logits stored by the GEMV: no
# cast launch), and sampling: a greedy run (temperature 0, the default) takes the sampler's one-launch argmax.
PER_STEP = {"model": 0, "embedding": 1, "norm": 1, "linear": 1, "sampling": 1}
PER_LAYER_LIMIT, PER_STEP_LIMIT = 8, 12  # the budget; batch 1 takes 6 per layer


def launches_kernel(func) -> bool:
    return func.namespace == "aten" and not func.is_view and func._opname not in NO_KERNEL


class LaunchCounter(TorchDispatchMode):
    """counts[group] launches; `group` is set by the wrapped op groups."""

    def __init__(self):
        super().__init__()
        self.counts, self.ops, self.group = Counter(), [], "model"

    def record(self, name: str) -> None:
        self.counts[self.group] += 1
        self.ops.append((self.group, name))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if launches_kernel(func):
            self.record(str(func))
        if func.namespace not in ("aten", "prims"):  # a custom op: count what its implementation launches
            with self:
                return func._op_dk(torch._C.DispatchKey.CompositeExplicitAutograd, *args, **kwargs)
        return func(*args, **kwargs)


class Grouped:
    """An op-group module whose functions charge their launches to `group`."""

    def __init__(self, group: str, module, counter: LaunchCounter):
        self._group, self._module, self._counter = group, module, counter

    def __getattr__(self, name):
        fn = getattr(self._module, name)

        def call(*args, **kwargs):
            outer, self._counter.group = self._counter.group, self._group
            try:
                return fn(*args, **kwargs)
            finally:
                self._counter.group = outer

        return call


@pytest.fixture
def counter(monkeypatch):
    """A LaunchCounter that also counts Triton launches (JIT or interpreted) and does not run them: how many
    kernels a step launches depends on shapes and launch plans, never on values (no launcher reads a kernel's
    output on the host at decode), and interpreting them took ~4 minutes of this file's CPU time. What the kernels
    compute is tested in tests/kernel_ops; the aten ops still run (on whatever the skipped kernels left)."""
    import triton.runtime.interpreter as interpreter
    import triton.runtime.jit as jit

    counter = LaunchCounter()
    for cls in (jit.JITFunction, interpreter.InterpretedFunction):

        def run(fn_self, *args, **kwargs):
            counter.record(fn_self.fn.__name__)

        monkeypatch.setattr(cls, "run", run)
    return counter


def sampling_args(B: int) -> tuple:
    """Greedy sampling parameters (temperature 0), as the exported sample method's example inputs."""
    zeros = lambda dtype: torch.zeros(B, dtype=dtype)
    return zeros(torch.float32), zeros(torch.int64), torch.ones(B), zeros(torch.float32), *(zeros(torch.int64),) * 2


@torch.no_grad()
def count_decode_step(counter: LaunchCounter, B: int = 1) -> tuple[Counter, int]:
    """(launches per group of one decode step after a short prefill, number of layers) of the fp16 tiny model
    (fp16: the logits are rounded to it and stored fp32, as bf16 on the GPU; an fp32 model would need no cast)."""
    cfg = tiny_config()
    model = build_model(cfg, torch.float16, "cpu", seed=1)
    model.set_kernels(TRITON_KERNELS, greedy=True)
    model.ops = {group: Grouped(group, module, counter) for group, module in model.ops.items()}
    model.setup_caches(B, 16)
    tokens = torch.randint(0, cfg.vocab_size, (B, 2), generator=torch.Generator().manual_seed(0))
    token, pos, args = tokens[:, 1:], torch.ones(B, dtype=torch.int64), sampling_args(B)
    # the first step at a batch size allocates the kernels' arrival counters (the sampler's too)
    model.sample(model(tokens[:, :1], torch.zeros(B, dtype=torch.int64)), *args)
    counter.counts.clear()
    counter.ops.clear()
    with counter:
        model.sample(model(token, pos), *args)
    return counter.counts, cfg.num_hidden_layers


@pytest.mark.parametrize("B", [1, 2])  # batch 2: strided projection rows must not add copies
def test_decode_step_launches_by_group(counter, B):
    counts, L = count_decode_step(counter, B)
    cfg = tiny_config()
    attn_layers = sum(t == "full_attention" for t in cfg.layer_types)
    report = f"launches by group {dict(counts)}; ops: {counter.ops}"
    # exact for the groups of this change: one more launch (a separate sigmoid, mul, copy) fails the test
    assert counts["model"] == PER_STEP["model"], report
    assert counts["embedding"] == PER_STEP["embedding"], report
    assert counts["norm"] == PER_LAYER["norm"] * L + PER_STEP["norm"], report
    assert counts["attention"] == PER_LAYER["mixer"] * attn_layers, report
    assert counts["gdn"] == PER_LAYER["mixer"] * (L - attn_layers), report
    assert counts["linear"] == (PER_LAYER["linear"] + NORMS_OUTSIDE_GEMV[B]) * L + PER_STEP["linear"], report
    assert counts["moe"] == MOE_LAUNCHES * L, report
    assert counts["sampling"] == PER_STEP["sampling"], report
    total = sum(counts.values())  # the measure: <= 8 per layer + O(1)
    assert total <= PER_LAYER_LIMIT * L + PER_STEP_LIMIT, f"{total} launches; {report}"
    if B == 1:
        assert total == 6 * L + sum(PER_STEP.values()), report


@torch.no_grad()
def test_exported_decode_launches_as_eager(counter):
    """The exported forward (what the CUDA graph captures) launches exactly what the eager forward does: the
    custom ops the export traces add no copies."""
    from qmoe.export.methods import export_methods

    cfg = tiny_config()
    model = build_model(cfg, torch.float16, "cpu", seed=1)
    model.set_kernels(TRITON_KERNELS)
    model.setup_caches(1, 16)
    forward = export_methods(model, "split", 1, 16)["forward"].module()
    tokens, pos = torch.tensor([[7]]), torch.tensor([2])
    model(tokens, pos)  # warm-up: the first decode step allocates the kernels' arrival counters
    totals = []
    for step in (model, forward):
        counter.counts.clear()
        with counter:
            step(tokens, pos)
        totals.append(sum(counter.counts.values()))
    assert totals[0] == totals[1], totals


@torch.no_grad()
def test_decode_loop_tuner_parts_launch_nothing(counter):
    """experiments/tune_decode_loop.py costs a part as step - step without it: each part's stand-in must launch
    nothing (a zero buffer made once, or a view), and every other group must launch exactly what it launches in the
    full step ("dense" keeps lm_head), or the difference charges the part with the wrong kernels."""
    import sys

    sys.path.insert(0, str(Path(__file__).parents[1] / "experiments"))
    from tune_decode_loop import without

    cfg = tiny_config()
    model = build_model(cfg, torch.float16, "cpu", seed=1)
    model.set_kernels(TRITON_KERNELS, greedy=True)
    model.setup_caches(1, 16)
    full, token, args = model.ops, torch.tensor([[5]]), sampling_args(1)

    def launches(ops) -> Counter:
        model.ops = {group: Grouped(group, module, counter) for group, module in ops.items()}
        model.sample(model(token, torch.tensor([1])), *args)  # the first call makes the zero buffers
        counter.counts.clear()
        with counter:
            model.sample(model(token, torch.tensor([2])), *args)
        return +Counter(counter.counts)

    all_groups = launches(full)
    for part in ("moe", "gdn", "attention", "dense", "sampling"):
        group = {"dense": "linear"}.get(part, part)
        expected = Counter({g: n for g, n in all_groups.items() if g != group})
        if part == "dense":
            expected["linear"] = PER_STEP["linear"]  # lm_head
        assert launches(without(model, full, part)) == +expected, part
