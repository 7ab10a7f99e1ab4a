"""Where the graphed decode step (35B-A3B; the 122B-A10B FP8 one with --model) spends its time, kernel by kernel,
with PDL overlap as it runs.

tune_decode_loop.py's parts remove one op group at a time; this script reads the step's own timeline instead: the
step (forward + greedy sample, as the CUDA-native runner's graph holds it) is captured in a CUDA graph and replayed
under torch.profiler, and every kernel's start and end come from CUPTI. Under Programmatic Dependent Launch a
kernel starts before its producer ends, so a kernel's duration overstates what it adds; what it adds to the step
is its *increment*: its end minus the latest end of the kernels before it. The increments of one replay sum to
the replay's span. Per kernel kind (the projection shape, mixer, MoE launch) the JSON gives the count, the
increments, the durations, the overlap with the producer (start minus the producer's end, negative under PDL), the
bytes its weights and states must move and the bandwidth of those bytes over the increments.

    PYTHONPATH=.:experiments python experiments/profile_decode_loop.py [--weights fp8]
        [--model qwen35_moe_122b --weights fp8: the 122B-A10B FP8 step] [--out results/profile_decode_loop.json]
"""

import argparse
import json
import os
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from benchlib import ceilings, write_json
from tune_decode_loop import (
    PROJECTIONS,
    PROMPT_POS,
    capture_step,
    decode_model,
    named_tensors,
    projection_weights,
    replay_ms,
)

from kernels.fp8 import FP8
from kernels.linear import triton as linear_triton

KIND_NAMES = {  # tune_decode_loop.PROJECTIONS -> the kind this table names
    "gdn_in": "gdn in_proj (+ add, RMSNorm)",
    "attn_qkv": "attention qkv (+ add, RMSNorm)",
    "out_proj": "out_proj / o_proj",
    "moe_in": "moe_in (+ add, RMSNorm)",
    "lm_head": "lm_head",
}


GEMV_KERNELS = ("_linear_kernel", "_gemv_persistent_kernel")


def nbytes_with_scale(tensors: dict, name: str) -> int:
    """Bytes of tensors[name] and, for an FP8 weight, of its `<name>_scale` beside it (tensors: the model's
    parameters and buffers by name)."""
    return sum(t.nbytes for t in (tensors[name], tensors.get(name + "_scale")) if t is not None)


def projection_kinds(model) -> dict:
    """(GEMV kernel, grid size) -> {kind: weight bytes, scales included} for the step's projection shapes. Two
    shapes can share a launch (the DeltaNet and attention in-projections on the persistent GEMV's grid of programs
    per SM)."""
    kinds, tensors = defaultdict(dict), named_tensors(model)
    for what, weight in projection_weights(model).items():
        N, K = weight.shape
        dtype = FP8 if weight.dtype == FP8 else model.dtype  # cached_plan's key: x's dtype, or FP8 for fp8 weights
        grid, _, _, meta = linear_triton.cached_plan(1, N, K, dtype, model.device)
        kernel = GEMV_KERNELS[1] if meta.get("PERSISTENT") else GEMV_KERNELS[0]
        kinds[(kernel, grid[0])][KIND_NAMES[what]] = nbytes_with_scale(tensors, PROJECTIONS[what])
    return kinds


def moe_kernel_bytes(model) -> dict:
    """{"up": bytes, "down": bytes} one token's MoE launches read (layer 0's weights and scales): the top-k experts'
    gate and up rows; their down rows and the shared expert's down projection (its gate and up are moe_in's)."""
    c, mlp, tensors = model.config, "layers.0.mlp.", named_tensors(model)
    routed = c.num_experts_per_tok / c.num_experts
    up = nbytes_with_scale(tensors, mlp + "experts.gate_up_proj") * routed
    down = nbytes_with_scale(tensors, mlp + "experts.down_proj") * routed
    return {"up": up, "down": down + nbytes_with_scale(tensors, mlp + "shared_expert.down_proj.weight")}


def kind_of(event: dict, previous: str, attention_layer: bool, projections: dict, moe: dict, c) -> tuple[str, int]:
    """A kernel event -> (kind, bytes its weights / states must move from HBM; 0 where latency, not bytes, rules).
    attention_layer: the event's layer has full attention (names a GEMV that two shapes share); projections,
    moe: projection_kinds' and moe_kernel_bytes' tables; c: the model's config."""
    name, grid = event["name"], tuple(event["args"].get("grid", (0, 0, 0)))
    kernel = next((k for k in GEMV_KERNELS if name.startswith(k)), None)
    if kernel and (kernel, grid[0]) in projections:
        kinds = projections[(kernel, grid[0])]
        if len(kinds) > 1:  # shared by both mixers' in-projections
            mixer = "attention" if attention_layer else "gdn"
            kinds = {k: v for k, v in kinds.items() if k.startswith(mixer)}
        (kind, nbytes), *_ = kinds.items()
        if kind.startswith("out_proj"):  # the same shape after both mixers
            kind = "o_proj (after attention)" if previous.startswith("attention") else "out_proj (after DeltaNet)"
        return kind, nbytes
    if name.startswith("_moe_up_gemv_kernel"):
        return "moe up (routing + 8 experts' gate, up)", moe["up"]
    if name.startswith("_moe_down_gemv_kernel"):
        return "moe down (8 experts + shared, combine)", moe["down"]
    if name.startswith("_decode_kernel"):  # attention's grid is (B, kv heads, splits), DeltaNet's (B, v heads, splits)
        if grid[1] == c.num_key_value_heads:
            return "attention decode", 0
        return "DeltaNet decode", 0
    return name.split("(")[0][:60], 0


def kernel_events(prof) -> list[dict]:
    """The profiler's kernel events (CUPTI, Chrome-trace form) in start order."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    return sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/profile_decode_loop.json")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--weights", default="auto", choices=("auto", "fp8"), help="fp8: model.weights=fp8")
    models = ("qwen35_moe", "qwen35_moe_122b")
    parser.add_argument("--model", default=models[0], choices=models, help="qwen35_moe_122b: with --weights fp8")
    args = parser.parse_args()
    if args.model != models[0] and args.weights != "fp8":
        parser.error(f"--model {args.model} fits one H200 only with --weights fp8")
    t0 = time.time()
    ceil = ceilings("cuda")
    model, floor_ms = decode_model(args.weights, ceil["copy_gbs"], name=args.model)
    runs = {}
    for pdl_on in (True, False):  # PDL off: each kernel runs alone, its duration is all it costs
        os.environ["QMOE_PDL"] = "1" if pdl_on else "0"
        runs["pdl" if pdl_on else "pdl_off"] = timeline(model, args.replays, ceil)
    os.environ.pop("QMOE_PDL")
    write_json(
        args.out, "profile_decode_loop", "cuda", model=args.model, weights=args.weights, ceilings=ceil,
        floor_ms=floor_ms, position=PROMPT_POS, **runs,
        seconds=time.time() - t0,
    )  # fmt: skip
    off = {r["kind"]: r for r in runs["pdl_off"]["kinds"]}
    run = runs["pdl"]
    print(f"floor {floor_ms:.3f} ms; step {run['replay_ms_unprofiled']:.4f} ms unprofiled, profiled span "
          f"{run['span_us_profiled'] / 1e3:.4f} ms, {run['kernels_per_step']} kernels; PDL off "
          f"{runs['pdl_off']['replay_ms_unprofiled']:.4f} ms")  # fmt: skip
    print(f"{'kind':<42} {'n':>4} {'incr us':>9} {'each':>6} {'dur':>6} {'overlap':>7} {'no-PDL':>7} "
          f"{'floor us':>8} {'GB/s':>6}")  # fmt: skip
    for r in run["kinds"]:
        gbs = f"{r['gbs_over_increment']:.0f}" if r["gbs_over_increment"] else "-"
        alone = off[r["kind"]]["increment_us_each"] if r["kind"] in off else float("nan")
        print(f"{r['kind'][:42]:<42} {r['per_step']:>4} {r['increment_us']:>9.1f} {r['increment_us_each']:>6.2f} "
              f"{r['duration_us_each']:>6.2f} {r['overlap_us_each']:>7.2f} {alone:>7.2f} {r['floor_us']:>8.1f} "
              f"{gbs:>6}")  # fmt: skip


def timeline(model, replays: int, ceil: dict) -> dict:
    """The step's graph replayed under the profiler -> its span and the per-kind table (see the docstring)."""
    graph = capture_step(model)
    unprofiled_ms = replay_ms(graph, 100)  # the step without the profiler, for comparison
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:  # kernels per replay: one replay alone
        graph.replay()
        torch.cuda.synchronize()
    per_replay = len(kernel_events(prof))
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    kernels = kernel_events(prof)
    timed = [kernels[i : i + per_replay] for i in range(0, len(kernels) - per_replay + 1, per_replay)]
    timed = timed[2:]  # the first replays warm the profiler
    projections, moe = projection_kinds(model), moe_kernel_bytes(model)
    spans, per_kind, one_replay = [], defaultdict(lambda: defaultdict(list)), []
    attention = [t == "full_attention" for t in model.config.layer_types] + [False]  # past the last: lm_head
    for kernels in timed:
        start0 = kernels[0]["ts"]
        latest_end, previous, layer = start0, "", 0
        for e in kernels:
            end = e["ts"] + e["dur"]
            kind, nbytes = kind_of(e, previous, attention[layer], projections, moe, model.config)
            layer += kind.startswith("moe down")  # a layer ends with its MoE down kernel
            if kernels is timed[len(timed) // 2]:  # one replay kernel by kernel, times from its first start
                grid = e["args"].get("grid")
                one_replay.append(dict(kind=kind, grid=grid, start=e["ts"] - start0, dur=e["dur"]))
            row = per_kind[kind]
            row["increment"].append(max(end - latest_end, 0.0))
            row["duration"].append(e["dur"])
            row["overlap"].append(e["ts"] - latest_end)
            row["bytes"].append(nbytes)
            latest_end, previous = max(latest_end, end), kind
        spans.append(latest_end - start0)
    n = len(timed)
    table = []
    for kind, row in per_kind.items():
        inc = sum(row["increment"]) / n  # µs per step
        nbytes = sum(row["bytes"]) / n
        table.append({
            "kind": kind, "per_step": len(row["increment"]) // n, "increment_us": inc,
            "increment_us_each": statistics.median(row["increment"]),
            "duration_us_each": statistics.median(row["duration"]),
            "overlap_us_each": statistics.median(row["overlap"]),
            "mb_per_step": nbytes / 1e6, "floor_us": nbytes / (ceil["copy_gbs"] * 1e3),
            "gbs_over_increment": nbytes / inc / 1e3 if inc else None,
        })  # fmt: skip
    table.sort(key=lambda r: -r["increment_us"])
    return dict(replay_ms_unprofiled=unprofiled_ms, span_us_profiled=statistics.median(spans),
                kernels_per_step=per_replay, replays=n, kinds=table, one_replay=one_replay)  # fmt: skip


if __name__ == "__main__":
    main()
