"""End-to-end speed of Qwen3.5-35B-A3B (random bf16 weights) on one GPU: qmoe's copy-free CUDA-native loop
(runtime=cuda_native export=copy_elided kernels=triton, CUDA graph, set explicitly here) against its own
reference runner (eager, torch ops and Triton ops) and transformers' generate on the same weights.

Rows: batch 1 with prompts of 128 and 4096 tokens (3 runs each, medians: TTFT, prefill tokens/s, decode ms/token
p50/p90, tokens/s, fraction of the bandwidth floor = active weight bytes per token / copy bandwidth measured in this
run; every run and the worst TTFT in the JSON); decode
ms/step at batch 8 and 32; the reference runner on torch ops and on Triton ops (eager: host time per op call
counts); transformers; the batch-1 loop on FP8 weights (model.weights=fp8, its floor from its own bytes). Then
one eager decode step with kernels=triton, profiled: CUDA kernels per step (launches)
and the step's GPU time per part (dense GEMVs, routed MoE, GDN, attention, norms, sampling, other) with the bytes
each part must move and its achieved GB/s (results/profile_decode.{txt,json}); host µs per op call per group;
peak GPU memory and the weight bytes (the fused projection buffers share the parameters' storage: they must add
nothing). Targets are printed met / missed with factors.

    PYTHONPATH=. python experiments/bench_e2e.py [--out results/bench_e2e.json] [--smoke]   (--smoke: tiny model on CPU)
"""

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

if "--smoke" in sys.argv:  # CPU: the Triton rows run in the interpreter (set before any kernel is defined)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from benchlib import ceilings, print_targets, target, write_json  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402

import kernels  # noqa: E402
from qmoe.app import MODELS, get_model, run_experiment  # noqa: E402
from qmoe.metrics.measure import active_weight_bytes  # noqa: E402
from qmoe.settings import validate  # noqa: E402

CONFIG_DIR = str(Path(__file__).resolve().parents[1] / "configs")
FAST = ("runtime=cuda_native", "export=copy_elided", "kernels=triton", "runtime.cuda_graph=true")
TRITON_GROUPS = kernels.OPS
PARTS = {  # op group -> part of the decode step
    "embedding": "embedding, positions",
    "linear": "dense GEMVs",
    "moe": "routed MoE (+ shared expert)",
    "gdn": "GDN",
    "attention": "attention",
    "norm": "norms",
    "sampling": "sampling",
}
TARGETS_MS = {(1, 128): 2.0, (1, 4096): 2.3, (8, 128): 4.0, (32, 128): 8.0}  # decode ms/step by (batch, prompt)
TARGET_RUNS = 3  # runs of each batch-1 target row and the eager one (TTFT, decode p50: medians; each run in the JSON)
PER_LAYER_LAUNCHES, STEP_LAUNCHES = 8, 12  # <= 8 per layer + O(1) (tests/test_launches.py: the same budget)


def config(*overrides):
    with initialize_config_dir(CONFIG_DIR, version_base="1.3"):
        return compose("config", overrides=["logger=none", *overrides])


def row_from(results: dict, label: str, floor_ms: float | None) -> dict:
    lat = results["latency"]
    prompt_tokens = sum(results["prompt"]["lengths"])
    decode = lat["decode_ms"]
    row = {
        "label": label,
        "batch": len(results["prompt"]["lengths"]),
        "prompt_len": results["prompt"]["lengths"][0],
        "new_tokens": len(results["generated"]["token_ids"][0]),
        "ttft_ms": lat["ttft_ms"],
        "prefill_tokens_per_s": prompt_tokens / lat["ttft_ms"] * 1e3,
        "decode_ms_p50": decode["p50"],
        "decode_ms_p90": decode["p90"],
        "tokens_per_s": lat["tokens_per_s"],
        "transfers_per_decode_token": results["transfers"].get("per_decode_token"),
        "config": {k: results["config"][k] for k in ("runtime", "export", "kernels")},
    }
    if floor_ms is not None and decode["p50"]:
        row["floor_fraction"] = floor_ms / decode["p50"]
    return row


@torch.no_grad()
def transformers_row(model, prompt_len: int, new_tokens: int, device) -> dict:
    """transformers' generate (greedy) on the very same weight tensors."""
    from qmoe.model.hf import to_transformers

    hf = to_transformers(model, attn_implementation="sdpa", share_weights=True)
    ids = torch.randint(0, model.config.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)

    def timed(n):
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        out = hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        sync()
        return (time.perf_counter() - t0) * 1e3, out

    timed(2)  # warm-up
    ttft, _ = timed(1)
    total, _ = timed(new_tokens)
    decode = (total - ttft) / (new_tokens - 1)
    return {
        "label": "transformers generate",
        "batch": 1,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "ttft_ms": ttft,
        "prefill_tokens_per_s": prompt_len / ttft * 1e3,
        "decode_ms_p50": decode,
        "tokens_per_s": 1e3 / decode,
        "note": "decode ms = (generate(N) - generate(1)) / (N - 1)",
    }


def nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def unique_experts(num_experts: int, top_k: int, rows: int) -> float:
    """Expected distinct experts a batch of `rows` tokens reads under uniform routing (random weights)."""
    return num_experts * (1 - (1 - top_k / num_experts) ** rows)


def bytes_moved(group: str, name: str, args: tuple, out) -> int:
    """The bytes a call must move at least: weights it reads, the part of the caches it touches, activations."""
    if group == "moe" and name == "moe_block":  # rows, proj, w13, w2, shared_down, top_k
        x, proj, w13, w2, shared_down, top_k = args
        per_expert = nbytes(w13[0], w2[0])
        return int(unique_experts(w13.shape[0], top_k, x.shape[0]) * per_expert) + nbytes(x, proj, shared_down, out)
    if group == "attention":  # q, gate, k, v, q_w, k_w, k_cache, v_cache, positions, ...
        q, gate, k, v, _, _, k_cache, _, positions = args[:9]
        context = int((positions[:, -1] + 1).sum())  # keys read over all rows
        return 2 * context * k_cache.shape[1] * k_cache.shape[3] * k_cache.element_size() + nbytes(q, gate, k, v, out)
    if group == "gdn":  # the conv and recurrent states are read and written
        return nbytes(*args[:4], out) + 2 * nbytes(args[8], args[9]) + nbytes(*args[4:8])
    if group == "embedding":  # tokens, input_pos, table -> h, residual, positions: the rows gathered, not the table
        return nbytes(*args[:2], *out) + nbytes(out[0])
    if group == "norm":
        outs = out if isinstance(out, tuple) else (out,)
        return nbytes(*[a for a in args if isinstance(a, torch.Tensor)], *outs)
    outs = out if isinstance(out, tuple) else (out,)
    return nbytes(*[a for a in args if isinstance(a, torch.Tensor)], *outs)


class Metered:
    """An op-group module whose calls run inside a profiler range `ops.<group>` and add to the group's bytes,
    call count and host µs (the Python call, launches included; the GPU runs asynchronously)."""

    def __init__(self, group: str, module, meter: dict):
        self._group, self._module, self._meter = group, module, meter
        self.calls = None  # a list while profiling: (name, args, out) of each call, counted in bytes afterwards

    def __getattr__(self, name):
        fn = getattr(self._module, name)
        group, meter, wrapper = self._group, self._meter, self

        def call(*args, **kwargs):
            t0 = time.perf_counter()
            with torch.profiler.record_function(f"ops.{group}"):
                out = fn(*args, **kwargs)
            m = meter[group]
            m["host_us"] += (time.perf_counter() - t0) * 1e6
            m["calls"] += 1
            if wrapper.calls is not None:  # bytes_moved reads positions (a sync, a copy): not inside the profile
                wrapper.calls.append((name, args, out))
            return out

        return call


def kernel_parts(trace_path: Path) -> dict:
    """{part: [kernel durations µs]} of a Chrome trace: each GPU kernel is charged to the innermost `ops.<group>`
    range around the CPU call that launched it (matched by correlation id), else to "other"."""
    events = json.loads(trace_path.read_text())["traceEvents"]
    ranges = [e for e in events if e.get("cat") == "user_annotation" and e.get("name", "").startswith("ops.")]
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    parts = defaultdict(list)
    for k in (e for e in events if e.get("cat") == "kernel"):
        launch = launches.get(k["args"].get("correlation"))
        part = "other"
        if launch is not None:
            around = [r for r in ranges if r["ts"] <= launch["ts"] <= r["ts"] + r["dur"] and r["tid"] == launch["tid"]]
            if around:
                part = PARTS[min(around, key=lambda r: r["dur"])["name"].removeprefix("ops.")]
        parts[part].append(k["dur"])
    return parts


@torch.no_grad()
def profile_decode(model, prompt_len: int, out_dir: Path, groups: dict, name: str = "profile_decode") -> dict:
    """One eager decode step (forward + greedy sample) on `groups`, profiled: CUDA kernels per step and GPU
    time, bytes and GB/s per part (results/profile_decode.{txt,json}); plus host µs per op call of each group
    over a few unprofiled steps. On CPU (smoke) only the host side. The profiled step launches without PDL
    (QMOE_PDL=0): with it, a kernel's span includes its wait for the previous one, so the parts would overlap."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    device = model.device
    cuda = device.type == "cuda"
    saved = dict(model.ops)
    model.set_kernels(groups, greedy=True)  # the decode loop's sampler (the runs here are greedy)
    meter = defaultdict(lambda: defaultdict(float))
    model.ops = {g: Metered(g, m, meter) for g, m in model.ops.items()}
    B = model.batch_size
    tokens = torch.randint(0, model.config.vocab_size, (B, prompt_len), device=device)
    zeros = torch.zeros(B, device=device)
    sampling = (zeros, zeros.long(), torch.ones(B, device=device), zeros, zeros.long(), zeros.long())
    model.reset_caches()
    model(tokens, torch.zeros(B, dtype=torch.int64, device=device))  # prefill: compiles the prefill kernels
    token, pos = tokens[:, :1], torch.full((B,), prompt_len, device=device)

    def step():
        return model.sample(model(token, pos), *sampling)

    for _ in range(3):  # compile, allocate counters, then steady state
        step()
    meter.clear()
    for _ in range(5):
        step()
    if cuda:
        torch.cuda.synchronize()
    host = {
        g: {"calls_per_step": m["calls"] / 5, "host_us_per_call": m["host_us"] / m["calls"]} for g, m in meter.items()
    }
    result = {"groups": groups, "host": host}
    if cuda:
        os.environ["QMOE_PDL"] = "0"
        step()  # the variant without PDL compiles outside the profile (and outside the byte meter)
        meter.clear()
        for wrapper in model.ops.values():
            wrapper.calls = []
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        os.environ.pop("QMOE_PDL")
        for g, wrapper in model.ops.items():
            meter[g]["bytes"] = sum(bytes_moved(g, *call) for call in wrapper.calls)
        trace = out_dir / "profile_decode_trace.json"
        prof.export_chrome_trace(str(trace))
        parts = kernel_parts(trace)
        trace.unlink()
        part_bytes = {PARTS[g]: m["bytes"] for g, m in meter.items()}
        result["launches_per_step"] = sum(len(v) for v in parts.values())
        result["gpu_us_per_step"] = sum(sum(v) for v in parts.values())
        result["parts"] = {
            part: {
                "kernels": len(durs),
                "us": sum(durs),
                "bytes": part_bytes.get(part),
                "gbs": part_bytes[part] / sum(durs) / 1e3 if part_bytes.get(part) and sum(durs) else None,
            }
            for part, durs in sorted(parts.items(), key=lambda kv: -sum(kv[1]))
        }
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)
        lines = [f"{'part':<30} {'kernels':>7} {'us':>9} {'MB':>9} {'GB/s':>7}"]
        for part, p in result["parts"].items():
            mb = f"{p['bytes'] / 1e6:.1f}" if p["bytes"] else "-"
            gbs = f"{p['gbs']:.0f}" if p["gbs"] else "-"
            lines.append(f"{part:<30} {p['kernels']:>7} {p['us']:>9.1f} {mb:>9} {gbs:>7}")
        lines.append(f"{'total':<30} {result['launches_per_step']:>7} {result['gpu_us_per_step']:>9.1f}")
        (out_dir / f"{name}.txt").write_text("\n".join(lines) + "\n\n" + table)
        (out_dir / f"{name}.json").write_text(json.dumps(result, indent=2))
    model.ops = saved
    return result


def weight_memory(model) -> dict:
    """Parameter bytes against the bytes of the distinct storages under the parameters and the fused projection
    buffers: equal when the fused buffers add nothing (the parameters are their row slices)."""
    params = list(model.parameters())
    fused = [b for n, b in model.named_buffers() if n.rsplit(".", 1)[-1] in ("in_proj", "qkv_proj")]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in params + fused}
    param_bytes = nbytes(*params)
    return {"param_bytes": param_bytes, "storage_bytes": sum(storages.values()), "fused_buffers": len(fused)}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/bench_e2e.json")
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU with the host runner")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--profile-only", action="store_true", help="only the profiled decode step")
    parser.add_argument("--weights", default="auto", choices=("auto", "fp8"),
                        help="with --profile-only: profile the FP8 model (results/profile_decode_fp8.*)")  # fmt: skip
    args = parser.parse_args()
    out_dir = Path(args.out).parent
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        model_args, fast, device, prompts, batches = ["model.device=cpu"], ("runtime=host",), "cpu", (16, 64), (2,)
        new_tokens, hf_new, ref_tokens = 4, 3, 3
    else:
        model_args, fast, device, prompts, batches = ["model=qwen35_moe"], FAST, "cuda", (128, 4096), (8, 32)
        new_tokens, hf_new, ref_tokens = args.new_tokens, 32, 32
    groups = {g: "triton" for g in TRITON_GROUPS}
    t0 = time.time()
    ceil = ceilings(device)

    base = config(*model_args, f"model.weights={args.weights}")
    model = get_model(base, validate(base), progress=False).model
    L = model.config.num_hidden_layers
    active_bytes = active_weight_bytes(model.config, model.dtype)
    floor_ms = active_bytes / (ceil["copy_gbs"] * 1e9) * 1e3

    rows: list[dict] = []
    targets: list[dict] = []
    extra: dict = {"weights": weight_memory(model)}
    if args.profile_only:
        model.setup_caches(1, validate(base).max_seq_len)
        name = "profile_decode" + ("_fp8" if args.weights == "fp8" else "")
        prof = profile_decode(model, prompts[0], out_dir, groups, name)
        for part, p in prof.get("parts", {}).items():
            print(f"gpu  {part:<30} {p['kernels']:>4} kernels {p['us']:>8.1f} us")
        print(f"kernels per step {prof.get('launches_per_step')}, GPU us per step {prof.get('gpu_us_per_step')}")
        return

    def save():  # after every row: a run cut short keeps what it measured
        write_json(
            args.out, "e2e", device, ceilings=ceil, active_weight_bytes=active_bytes, floor_ms=floor_ms, rows=rows,
            targets=targets, **extra, seconds=time.time() - t0,
        )  # fmt: skip

    def run(label, *overrides, repeats=1):
        """One row: `repeats` runs of the same config (the model is built once), the TTFT and decode p50 their
        medians, each run's in `runs` (a TTFT is one start: a single run's can be an outlier)."""
        runs = []
        for _ in range(repeats):
            r = run_experiment(config(*model_args, *overrides))
            runs.append({**row_from(r, label, floor_ms), "peak_memory": r["memory"]})
        row = dict(runs[0])
        if repeats > 1:
            per_run = ("ttft_ms", "prefill_tokens_per_s", "decode_ms_p50", "tokens_per_s")
            row["runs"] = [{k: x[k] for k in per_run} for x in runs]
            for k in per_run:
                row[k] = statistics.median(x[k] for x in runs)
            row["ttft_ms_max"] = max(x["ttft_ms"] for x in runs)
            if "floor_fraction" in row:  # row_from's, of the median p50
                row["floor_fraction"] = floor_ms / row["decode_ms_p50"]
        rows.append(row)
        save()
        return row

    for L_prompt in prompts:
        row = run(
            "qmoe " + " ".join(fast),
            *fast,
            f"prompt.length={L_prompt}",
            f"generation.max_new_tokens={new_tokens}",
            repeats=TARGET_RUNS,
        )
        if not args.smoke:
            limit = TARGETS_MS[(1, L_prompt)]
            targets.append(target(f"decode ms/token, batch 1, prompt {L_prompt}", row["decode_ms_p50"], limit, True))
        if L_prompt == prompts[-1]:
            targets.append(target(f"prefill tokens/s, prompt {L_prompt}", row["prefill_tokens_per_s"], 60000, False))
    for B in batches:
        row = run(
            f"qmoe batch {B}", *fast, f"generation.batch_size={B}", "prompt.length=128", "generation.max_new_tokens=32"
        )
        if not args.smoke:
            targets.append(target(f"decode ms/step, batch {B}", row["decode_ms_p50"], TARGETS_MS[(B, 128)], True))
    for label, kernel_args, repeats in (("torch ops", (), 1), ("Triton ops", ("kernels=triton",), TARGET_RUNS)):
        row = run(f"qmoe reference runner ({label}, eager)", "runtime=reference", *kernel_args,
                  f"prompt.length={prompts[0]}", f"generation.max_new_tokens={ref_tokens}",
                  repeats=repeats)  # fmt: skip
    targets.append(target("eager reference runner, Triton ops, tokens/s", row["tokens_per_s"], 100, False))
    model.setup_caches(1, model.max_seq_len)
    rows.append(transformers_row(model, prompts[0], hf_new, model.device))
    save()

    extra["decode_profile"] = profile_decode(model, prompts[0], out_dir, groups)
    if "launches_per_step" in extra["decode_profile"]:
        launches = extra["decode_profile"]["launches_per_step"]
        targets.append(target("CUDA kernels per decode step", launches, PER_LAYER_LAUNCHES * L + STEP_LAUNCHES, True))
    save()

    # The same loop on FP8 weights (model.weights=fp8: quantized on the device at build; the bf16 model is freed
    # first), its floor from its own weight bytes.
    del model
    MODELS.clear()
    if device == "cuda":
        torch.cuda.empty_cache()
    r = run_experiment(config(*model_args, *fast, "model.weights=fp8", f"prompt.length={prompts[0]}",
                              f"generation.max_new_tokens={new_tokens}"))  # fmt: skip
    fp8_floor = r["bandwidth_floor"].get("floor_ms")
    rows.append({**row_from(r, "qmoe copy-free loop, FP8 weights", fp8_floor), "peak_memory": r["memory"]})
    if not args.smoke:
        targets.append(target("decode ms/token, batch 1, prompt 128, FP8", rows[-1]["decode_ms_p50"], 1.15, True))
    save()

    w = extra["weights"]
    print(f"copy {ceil['copy_gbs']:.0f} GB/s; active weights {active_bytes / 1e9:.2f} GB -> floor {floor_ms:.3f} ms")
    added_mb = (w["storage_bytes"] - w["param_bytes"]) / 1e6
    print(
        f"weights {w['param_bytes'] / 1e9:.3f} GB in parameters, {w['storage_bytes'] / 1e9:.3f} GB of storage "
        f"({w['fused_buffers']} fused projection buffers add {added_mb:.1f} MB)"
    )
    prof = extra["decode_profile"]
    for g, h in prof["host"].items():
        print(f"host {g:<10} {h['calls_per_step']:>5.0f} calls/step {h['host_us_per_call']:>7.1f} us/call")
    for part, p in prof.get("parts", {}).items():
        gbs = f"{p['gbs']:.0f} GB/s" if p["gbs"] else ""
        print(f"gpu  {part:<30} {p['kernels']:>4} kernels {p['us']:>8.1f} us {gbs}")
    print(
        f"{'configuration':<58} {'B':>3} {'L':>5} {'TTFT ms':>9} {'prefill t/s':>11} {'p50 ms':>8} {'tok/s':>8} "
        f"{'floor':>6} {'peak GB':>8}"
    )
    for r in rows:
        floor = f"{100 * r['floor_fraction']:.0f}%" if r.get("floor_fraction") else "-"
        peak = max((v for k, v in r.get("peak_memory", {}).items() if k.endswith("peak_allocated_bytes")), default=0)
        print(
            f"{r['label'][:58]:<58} {r['batch']:>3} {r['prompt_len']:>5} {r['ttft_ms']:>9.1f} "
            f"{r['prefill_tokens_per_s']:>11.0f} {r['decode_ms_p50']:>8.3f} {r['tokens_per_s']:>8.1f} {floor:>6} "
            f"{peak / 1e9:>8.2f}"
        )
    print_targets(targets)


if __name__ == "__main__":
    main()
