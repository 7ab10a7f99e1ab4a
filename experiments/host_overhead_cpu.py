"""The host Python of eager Triton op calls on a machine without a GPU: every launch is stubbed, so what is timed is
the op wrappers' Python and kernels/launch.py's fast path up to the compiled kernel's launcher (a no-op here; on the
H200 host it adds ~9 µs per launch, results/host_overhead.json). Tensors are on the CPU (pdl() is off there, and
CPU allocations cost about what the caching allocator's do); the H200 launch tables pick the configs.

  ops    µs per call (median of 5 loops of 2,000 calls) at 35B-A3B decode shapes, M = 1, bf16: linear (out_proj),
         add_rms_norm_linear (a DeltaNet in_proj with its input norm), moe_block (two launches).
  model  wall µs per eager decode step of the reference runner (kernels=triton) on a 40-layer model of the tiny
         model's widths (the 35B's layer pattern; median of 3 loops), then a cProfile of the same steps: Python
         function calls, the torch calls that go through the dispatcher (allocations, views: ~1.5-3.5 µs each on
         the H200 host, where they cost more than here) per step, and the functions with the most calls.

    PYTHONPATH=.:experiments python experiments/host_overhead_cpu.py [--sections ops model] [--steps 20] [--out F]
"""

import os

os.environ.pop("TRITON_INTERPRET", None)  # the interpreter returns kernels unwrapped: no fast path to time

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from benchlib import host_us_per_call, write_json
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

from kernels.launch import FastLaunch
from kernels.linear import triton as linear_triton
from kernels.moe import triton as moe_triton

ROOT = Path(__file__).resolve().parents[1]


ALLOCATIONS = {"new_empty", "empty", "empty_like", "zeros", "zeros_like", "full_like", "new_zeros"}
# (not contiguous(): on a contiguous tensor its Python binding returns the tensor without a dispatch)
DISPATCHED = ALLOCATIONS | {"view", "reshape", "flatten", "view_as", "split_with_sizes", "chunk", "narrow", "select",
                            "as_strided", "unbind", "clone", "copy_", "where", "fill_"}  # fmt: skip


def _stub_run(*args):
    """The compiled kernel's launcher: no GPU work."""


def stub_gpu() -> None:
    """Triton's launch returns a stub CompiledKernel (kept by kernels/launch.py as if compiled) and its driver says
    device 0, stream 0; the ops read the H200's launch tables."""
    kernel = SimpleNamespace(run=_stub_run, function=None, packed_metadata=None)
    JITFunction.run = lambda self, *args, grid, warmup, **kwargs: kernel
    driver.set_active(SimpleNamespace(get_current_device=lambda: 0, get_current_stream=abs))
    for module in (linear_triton, moe_triton):
        table = Path(module.CONFIG_DIR) / "NVIDIA_H200.json"
        module.CONFIG_TABLE.clear()
        module.CONFIG_TABLE.update(json.loads(table.read_text()))
    moe_triton.get_config.cache_clear()


def ops_section() -> dict:
    dt = torch.bfloat16
    h, w = torch.randn(1, 4096, dtype=dt), torch.randn(2048, 4096, dtype=dt)  # out_proj: N = 2048, K = 4096
    x, residual = torch.randn(1, 1, 2048, dtype=dt), torch.randn(1, 1, 2048, dtype=dt)  # [B, T, H] as the model's
    norm_weight = torch.ones(2048, dtype=dt)
    in_proj = torch.randn(12352, 2048, dtype=dt)  # a DeltaNet layer's fused in_proj
    E, H, I, IS = 256, 2048, 512, 512
    w13, w2 = torch.empty(E, 2 * I, H, dtype=dt), torch.empty(E, H, I, dtype=dt)  # never read: left unallocated
    shared_down, proj = torch.randn(H, IS, dtype=dt), torch.randn(1, E + 2 * IS + 1, dtype=dt)
    rows_x = x[0]  # [M, H]
    rows = {
        "linear": lambda: linear_triton.linear(h, w),
        "add_rms_norm_linear": lambda: linear_triton.add_rms_norm_linear(x, residual, norm_weight, 1e-6, in_proj),
        "moe_block": lambda: moe_triton.moe_block(rows_x, proj, w13, w2, shared_down, 8),
    }
    return {name: host_us_per_call(fn, repeats=5) for name, fn in rows.items()}


def model_section(steps: int) -> dict:
    from benchlib import GREEDY

    from qmoe.model.qwen35_moe import build_model
    from qmoe.runtime.generate import ReferenceRunner
    from qmoe.runtime.ledger import TransferLedger
    from tests.helpers import tiny_config

    cfg = tiny_config(num_hidden_layers=40, full_attention_interval=4)
    model = build_model(cfg, torch.bfloat16, "cpu", seed=0)
    model.set_kernels({group: "triton" for group in model.ops}, greedy=True)
    model.setup_caches(1, 64)
    runner = ReferenceRunner(model, GREEDY, 1, TransferLedger())
    token = torch.zeros(1, dtype=torch.int64)  # forced: the stubbed sampler's output is never read
    runner.start(torch.zeros(1, 4, dtype=torch.int64))
    for _ in range(3):
        runner.step(token)
    loops = []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(steps):
            runner.step(token)
        loops.append((time.perf_counter() - start) * 1e6 / steps)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        runner.step(token)
    profiler.disable()
    stats = pstats.Stats(profiler)
    calls = sum(nc for _, nc, _, _, _ in stats.stats.values())
    torch_calls = {}  # the builtins of torch / Tensor that dispatch (not data_ptr, stride, dim, ...: plain getters)
    for (file, _, name), (_, nc, _, _, _) in stats.stats.items():
        op = (name.split("'")[1] if "'" in name else name.removeprefix("<built-in method ").rstrip(">")).rsplit(".", 1)[
            -1
        ]
        if file == "~" and op in DISPATCHED:
            torch_calls[op] = torch_calls.get(op, 0) + nc / steps
    text = io.StringIO()
    for key in ("ncalls", "tottime"):
        text.write(f"\n==== sorted by {key}, {steps} steps\n")
        pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(25)
    print(text.getvalue())
    return {
        "wall_us_per_step": statistics.median(loops),
        "wall_us_per_step_loops": loops,
        "python_calls_per_step": calls / steps,
        "torch_calls_per_step": sum(torch_calls.values()),
        "allocations_per_step": sum(n for op, n in torch_calls.items() if op in ALLOCATIONS),
        "torch_calls_by_op": dict(sorted(torch_calls.items(), key=lambda kv: -kv[1])),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", nargs="+", default=["ops", "model"], choices=["ops", "model"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", help="a JSON of both sections (with the environment and commit)")
    args = parser.parse_args()
    assert FastLaunch.enabled, "QMOE_FAST_LAUNCH=0: nothing of kernels/launch.py to time"
    stub_gpu()
    torch.set_num_threads(1)
    out = {}
    if "model" in args.sections:
        out["model"] = model_section(args.steps)
        for name, value in out["model"].items():
            if not isinstance(value, (dict, list)):
                print(f"{name:<40} {value:10.1f}")
    if "ops" in args.sections:
        out["ops_us_per_call"] = ops_section()
        for name, us in out["ops_us_per_call"].items():
            print(f"{name:<40} {us:8.1f} us")
    if args.out:
        write_json(args.out, "host_overhead_cpu", "cpu", **out)


if __name__ == "__main__":
    main()
