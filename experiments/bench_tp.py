"""Tensor parallel decode on two GPUs (nvidia-h200-x2): 35B-A3B and 122B-A10B bf16 (random weights) at TP2.

    torchrun --nproc-per-node 2 experiments/bench_tp.py [--out results/bench_tp.json] [--rows check,allreduce,...]
    torchrun --nproc-per-node 2 experiments/bench_tp.py --smoke      (CPU, gloo, tiny model: the script's own check)

Rows, in order (JSON rewritten after each, rank 0 writes it):
- check: before anything is timed, TP2 equals one process: the 35B shape cut to 4 layers in fp32 on torch ops
  (greedy tokens equal, logits relative error < 1e-4; rank 0 also builds the unsharded model), and the same in
  bf16 on the Triton kernels the timed rows use (token agreement and logits error reported, error < 3e-2 checked);
  at every step the vocab-parallel sampler (top-k 50 + top-p 0.9 at T 0.8; the cuts by search and from each
  rank's 50 best logits) draws the token that one GPU's sampler draws from the gathered logits (checked).
- allreduce: µs per qmoe::all_reduce call inside a CUDA graph (100 calls captured, replayed, CUDA events) of one
  decode token's hidden state ([1, H] bf16, H = 2048 and 3072) and of batch 32 ([32, H]).
- 35b: decode batch 1, prompt 128: runtime=cuda_native, copy-elided export, Triton kernels (the sampler's
  vocab-parallel form: one launch per rank and one all-gather), CUDA graph; target <= 1.8 ms/token; then the same
  with kernels.sampling=torch (its vocab-parallel sampler in torch ops), to show what the sampler's form costs;
  then sampled at T 0.8, top-p 0.9, with top-k 50 (the cuts from each rank's 50 best logits, two all-gathers) and
  without (the cuts by the search: a sort of the slice, 10 all-reduces and an all-gather).
- ablation: the copy-elision rows at TP2 on 35B (reference; cuda_native baseline / device_planned / copy_elided,
  graph off and on): decode ms/token, H2D/D2H/D2D bytes per token and inter-GPU collectives and bytes per token.
- profile: the ledger's collectives against the profiler's NCCL kernels (35B, copy_elided, graph off, 4 tokens:
  every collective of the run, prefill and decode, is one NCCL kernel).
- 122b: decode batch 1 (target <= 3.5 ms/token) and batch 32 (tok/s), prompt 128, when the weights fit.
- layouts: the routed experts split inside each expert (parallel.tp=N, the default) against whole experts per
  rank (parallel.tp=1 parallel.ep=N), 35B at batch 1 and 32, the 35b row's settings: which is faster where.
- 397b: Qwen3.5-397B-A17B's dimensions cut to 4 layers (512 experts top-10, hidden 4096, the full vocabulary),
  bf16 and FP8 (model.weights=fp8), decode batch 1 at TP2: the 397B issue's shapes, sharding and memory per rank
  on the GPUs this machine has (its 4 / 8-GPU runs need a kind that is not lent).
- symm_mem (last: a rank stuck in a peer's op would hang only this row): the allreduce row's tensors through
  torch.distributed's symmetric-memory one-shot and two-shot all-reduces, in a CUDA graph, their sums checked
  against NCCL's (all-reduce latency is most of what TP adds to a decode step: 80 of them in a 35B step).
The all-reduce table: per decode token, count x µs per call (from the allreduce row) against the step's time.
"""

import argparse
import gc
import os
import sys
import time
from pathlib import Path

SMOKE = "--smoke" in sys.argv
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (the lent machines' note)

import torch  # noqa: E402
from benchlib import print_targets, target, write_json  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402

from qmoe import parallel  # noqa: E402
from qmoe.app import MODELS, run_experiment  # noqa: E402
from qmoe.model import ModelConfig, build_model  # noqa: E402
from qmoe.parallel import collectives  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = str(ROOT / "configs")
DEVICE = "cpu" if SMOKE else "cuda"
FAST = ["runtime=cuda_native", "export=copy_elided", "kernels=triton"]
ROWS = ("check", "allreduce", "35b", "ablation", "profile", "122b", "layouts", "397b", "symm_mem")


def config(*overrides):
    with initialize_config_dir(CONFIG_DIR, version_base="1.3"):
        return compose("config", overrides=["logger=none", "generation.stop_on_eos=false", *overrides])


def rank0() -> bool:
    return parallel.current().rank == 0


def free_models() -> None:
    """Drop the cached model and exported programs before a larger model is built."""
    from qmoe.runtime.executor import EXPORTS

    MODELS.clear()
    EXPORTS.model, EXPORTS.programs = None, {}
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


@torch.no_grad()
def check(arch: dict, layout, dtype, kernels: str, steps: int = 8) -> dict:
    """TP logits and greedy tokens against one process (rank 0 builds the unsharded model too), step by step on
    the same inputs (the TP run's tokens), so one near-tie cannot make every later step differ."""
    import kernels as kernels_module
    from kernels.sampling import naive
    from qmoe.parallel import sampling

    cfg = ModelConfig.from_dict({**arch, "num_hidden_layers": 4})
    device = torch.device(DEVICE, torch.cuda.current_device()) if DEVICE == "cuda" else torch.device("cpu")
    choice = {g: kernels for g in ("embedding", "linear", "moe", "gdn", "attention", "norm")}
    model = build_model(cfg, dtype, device, seed=0, layout=layout)
    model.set_kernels(choice)
    model.setup_caches(1, 64)
    full = None
    if rank0():
        full = build_model(cfg, dtype, device, seed=0)
        full.set_kernels(choice)
        full.setup_caches(1, 64)
    prompt = torch.arange(3, 3 + 16, device=device)[None]
    pos = torch.zeros(1, dtype=torch.int64, device=device)
    one_gpu = kernels_module.resolve("sampling", kernels)  # the sampler one GPU runs with these kernels
    mine, theirs, errs, sampled = [], [], [], []
    x, y = prompt, prompt
    for i in range(steps):
        local = model(x, pos)  # [1, V / world]
        # what the TP run samples, without the logits gathered
        token = sampling.greedy(local, model.vocab_start, triton=kernels == "triton")
        logits = collectives.all_gather(local, "world").permute(1, 0, 2).flatten(1)  # [1, V]: only to compare
        params = (0.8, 50, 0.9, 0.0, 3, i)  # every rank: its sampled token against one GPU's on the same logits
        one = one_gpu.sample(logits, *params).item()
        for filters in (None, sampling.Filters(50, True)):  # the cuts by search; from each rank's 50 best logits
            drawn = sampling.sample(local, model.vocab_start, *params, triton=kernels == "triton", filters=filters)
            sampled.append(drawn.item() == one)
        mine.append(token.item())
        if full is not None:
            ref = full(y, pos)
            theirs.append(naive.greedy(ref).item())
            errs.append(((logits.double() - ref.double()).norm() / ref.double().norm()).item())
        pos = pos + x.shape[1]
        x = y = token[:, None]
    out = {"dtype": str(dtype), "kernels": kernels, "tp_tokens": mine, "sampled_equal": all(sampled)}
    if full is not None:
        out.update(one_process_tokens=theirs, logits_rel_err_max=max(errs), tokens_equal=mine == theirs)
    del model, full
    free_models()
    return out


def allreduce_us(hidden: int, rows: int, calls: int = 100) -> float:
    """µs per qmoe::all_reduce of a [rows, hidden] bf16 tensor: `calls` captured in one CUDA graph, replayed
    (wall clock per call on the CPU smoke run)."""
    from benchlib import event_median_us

    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    x = torch.randn(rows, hidden, dtype=dtype, device=DEVICE)
    run = lambda: [collectives.all_reduce(x, "world") for _ in range(calls)]  # noqa: E731
    run()  # NCCL's communicator and buffers exist before the capture
    if DEVICE != "cuda":
        t0 = time.perf_counter()
        run()
        return (time.perf_counter() - t0) * 1e6 / calls
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    graph.replay()
    return event_median_us(graph.replay, 10) / calls


def symm_mem_allreduce_us(hidden: int, rows: int, op: str, calls: int = 100) -> float | str:
    """µs per all-reduce of a [rows, hidden] bf16 tensor by a symmetric-memory op of torch.distributed, `calls`
    in one CUDA graph: "one_shot" (each rank reads every peer's buffer over NVLink and sums) or "two_shot" (a
    reduce-scatter then an all-gather, in place), each call staging the tensor into the op's symmetric buffer as
    qmoe::all_reduce would. Its sums are checked against NCCL's first. A candidate for qmoe::all_reduce at decode
    sizes, measured before it is one: a failure (an op this torch lacks, a capture it refuses) is returned as one
    line."""
    try:
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem
        from benchlib import event_median_us

        group = dist.group.WORLD.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed before rendezvous by older torch
            symm_mem.enable_symm_mem_for_group(group)
        buffer = symm_mem.empty(rows * hidden, dtype=torch.bfloat16, device=DEVICE)
        symm_mem.rendezvous(buffer, group)
        x = torch.randn(rows, hidden, dtype=torch.bfloat16, device=DEVICE)

        def reduced() -> torch.Tensor:
            buffer.copy_(x.view(-1))
            if op == "one_shot":
                return torch.ops.symm_mem.one_shot_all_reduce(buffer, "sum", group)
            torch.ops.symm_mem.two_shot_all_reduce_(buffer, "sum", group)
            return buffer

        want = collectives.all_reduce(x, "world").view(-1)
        if not torch.equal(reduced(), want):  # two bf16 addends round once either way
            return f"{op}: sums differ from NCCL's"
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                reduced()
        graph.replay()
        return event_median_us(graph.replay, 10) / calls
    except Exception as e:  # noqa: BLE001 - a candidate that cannot run here is reported, not fatal
        return f"{op}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def decode_row(label: str, results: dict) -> dict:
    lat, tr = results["latency"], results["transfers"]
    inter = tr.get("inter_gpu", {})
    return {
        "label": label,
        "batch": len(results["prompt"]["lengths"]),
        "prompt_len": results["prompt"]["lengths"][0],
        "decode_ms_p50": lat["decode_ms"]["p50"],
        "decode_ms_p90": lat["decode_ms"]["p90"],
        "tokens_per_s": lat["tokens_per_s"],
        "ttft_ms": lat["ttft_ms"],
        "per_decode_token": tr.get("per_decode_token"),
        "inter_gpu_per_decode_token": inter.get("per_decode_token"),
        "inter_gpu_by_method": inter.get("per_decode_token_by_method"),
        "inter_gpu_prefill": inter.get("prefill"),
        "bandwidth_floor": results.get("bandwidth_floor"),
        "memory": results.get("memory"),  # this rank's peaks (rank 0's in the JSON)
        "setup": {k: v for k, v in tr.get("setup", {}).items() if k in ("runtime", "cuda_graph", "preset", "kernels")},
        "config": {k: results["config"][k] for k in ("runtime", "export", "kernels", "parallel")},
    }


def nccl_kernels(prof) -> int:
    return sum(e.count for e in prof.key_averages() if "nccl" in e.key.lower() and e.device_type.name == "CUDA")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "results" / ("bench_tp_smoke.json" if SMOKE else "bench_tp.json")))
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()
    rows = args.rows.split(",")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    layout = parallel.init(world, 1, DEVICE)
    model_35b, model_122b, model_397b = (
        ("qwen35_moe_tiny",) * 3 if SMOKE else ("qwen35_moe", "qwen35_moe_122b", "qwen35_moe_397b")
    )
    fast = ["kernels=torch"] if SMOKE else FAST
    common = ["prompt.length=128", f"generation.max_new_tokens={args.new_tokens}"]
    tp_only = [f"parallel.tp={world}"]  # every row's layout but the layouts row's expert-parallel runs
    doc = {"rows": [], "checks": [], "allreduce_us": {}, "allreduce_symm_mem_us": {}, "targets": [], "tp": world}
    command = f"torchrun --nproc-per-node {world} experiments/bench_tp.py {' '.join(sys.argv[1:])}"

    def save():
        if rank0():
            write_json(args.out, "bench_tp", DEVICE, command=command, **doc)

    def run(label, *overrides, layout=tp_only):
        t0 = time.perf_counter()
        results = run_experiment(config(*common, *layout, *overrides))
        row = decode_row(label, results)
        row["wall_s"] = time.perf_counter() - t0
        doc["rows"].append(row)
        save()
        if rank0():
            print(f"{label}: decode p50 {row['decode_ms_p50']:.3f} ms, {row['tokens_per_s']:.1f} tok/s", flush=True)
        return row, results

    if "check" in rows:
        arch = config(f"model={model_35b}").model.arch
        checks = [(torch.float32, "torch", 1e-4)]
        if not SMOKE:
            checks.append((torch.bfloat16, "triton", 3e-2))
        for dtype, kernels, tolerance in checks:
            c = check(dict(arch), layout, dtype, kernels)
            if rank0():
                c["ok"] = c["logits_rel_err_max"] < tolerance and (c["tokens_equal"] or dtype != torch.float32)
                c["ok"] &= c["sampled_equal"]
                doc["checks"].append(c)
                print(
                    f"check {c['dtype']} {kernels}: rel err {c['logits_rel_err_max']:.2e}, tokens equal "
                    f"{c['tokens_equal']}, sampled tokens equal one GPU's sampler {c['sampled_equal']}",
                    flush=True,
                )
            save()
            ok = torch.tensor([float(c.get("ok", True))], device=DEVICE)
            if collectives.all_reduce(ok, "world", "min").item() < 1:
                if rank0():
                    print("check FAILED: nothing timed", flush=True)
                return

    if "allreduce" in rows:
        for hidden in (2048, 3072):
            for batch in (1, 32):
                doc["allreduce_us"][f"{batch}x{hidden}"] = allreduce_us(hidden, batch)
        save()

    if "35b" in rows:
        row, _ = run("35b_tp_b1", f"model={model_35b}", *fast)
        doc["targets"].append(target(f"35B TP{world} decode ms/token, batch 1", row["decode_ms_p50"], 1.8, True))
        run("35b_tp_b1_torch_sampler", f"model={model_35b}", *fast, "kernels.sampling=torch")
        sampled = ["sampling.temperature=0.8", "sampling.top_p=0.9"]  # what sampling costs the TP step: top-k 50's
        run("35b_tp_b1_sampled_top_k", f"model={model_35b}", *fast, *sampled, "sampling.top_k=50")  # cuts from the
        run("35b_tp_b1_sampled_top_p", f"model={model_35b}", *fast, *sampled)  # ranks' 50 best; top-p's by search
        save()

    if "ablation" in rows:
        run(
            "ablation_reference",
            f"model={model_35b}",
            "runtime=reference",
            "kernels=torch" if SMOKE else "kernels=triton",
        )
        if not SMOKE:
            for preset in ("baseline", "device_planned", "copy_elided"):
                for graph in ("false", "true") if preset != "baseline" else ("false",):
                    run(
                        f"ablation_{preset}_graph_{graph}",
                        f"model={model_35b}",
                        *FAST,
                        f"export={preset}",
                        f"runtime.cuda_graph={graph}",
                    )

    if "profile" in rows and not SMOKE:
        from torch.profiler import ProfilerActivity, profile

        overrides = [f"model={model_35b}", *FAST, "runtime.cuda_graph=false", "runtime.warmup_steps=0"]
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            results = run_experiment(config(*tp_only, common[0], "generation.max_new_tokens=4", *overrides))
        inter = results["transfers"]["inter_gpu"]
        decode_tokens = sum(map(len, results["generated"]["token_ids"])) - len(results["generated"]["token_ids"])
        ledger = sum(v["count"] for v in inter["prefill"].values()) + round(
            sum(v["count"] for v in inter["per_decode_token"].values()) * decode_tokens
        )
        doc["profile"] = {"ledger_collectives": ledger, "profiler_nccl_kernels": nccl_kernels(prof)}
        doc["profile"]["equal"] = doc["profile"]["ledger_collectives"] == doc["profile"]["profiler_nccl_kernels"]
        save()

    if "122b" in rows:
        free_models()
        for batch in (1, 32):
            row, _ = run(f"122b_tp_b{batch}", f"model={model_122b}", *fast, f"generation.batch_size={batch}")
            if batch == 1:
                doc["targets"].append(
                    target(f"122B TP{world} decode ms/token, batch 1", row["decode_ms_p50"], 3.5, True)
                )
        save()

    if "layouts" in rows:
        free_models()
        fastest = {}
        for batch in (1, 32):
            for name, layout in (("tp", tp_only), ("ep", ["parallel.tp=1", f"parallel.ep={world}"])):
                row, _ = run(f"35b_{name}{world}_b{batch}", f"model={model_35b}", *fast,
                             f"generation.batch_size={batch}", layout=layout)  # fmt: skip
                fastest.setdefault(batch, []).append((row["decode_ms_p50"], name))
        doc["layouts_fastest"] = {f"batch {b}": min(t)[1] for b, t in fastest.items()}
        save()
        if rank0():
            print(f"layouts, fastest: {doc['layouts_fastest']}", flush=True)

    if "397b" in rows:
        free_models()
        for weights in ("auto",) if SMOKE else ("auto", "fp8"):  # (the tiny model's fp8 K splits are off the blocks)
            run(f"397b_4layers_tp_{weights}", f"model={model_397b}", "model.arch.num_hidden_layers=4", *fast,
                f"model.weights={weights}")  # fmt: skip
            free_models()

    if "symm_mem" in rows and DEVICE == "cuda":
        for hidden in (2048, 3072):
            for batch in (1, 32):
                doc["allreduce_symm_mem_us"][f"{batch}x{hidden}"] = {
                    op: symm_mem_allreduce_us(hidden, batch, op) for op in ("one_shot", "two_shot")
                }
                save()
        if rank0():
            print(f"all-reduce us, NCCL {doc['allreduce_us']}; symmetric memory {doc['allreduce_symm_mem_us']}")

    # where the all-reduce time goes: count per token x µs per call, against the step
    table = []
    for row in doc["rows"]:
        per = (row.get("inter_gpu_per_decode_token") or {}).get("all_reduce")
        hidden = 3072 if "122b" in row["label"] else 2048
        us = doc["allreduce_us"].get(f"{row['batch'] if row['batch'] in (1, 32) else 1}x{hidden}")
        if per and us:
            per_step = per["count"] * row["batch"]
            table.append(
                {
                    "label": row["label"],
                    "all_reduce_per_step": per_step,
                    "us_per_call": us,
                    "all_reduce_ms_per_step": per_step * us / 1e3,
                    "decode_ms_p50": row["decode_ms_p50"],
                }
            )
    doc["allreduce_table"] = table
    save()
    if rank0():
        print_targets(doc["targets"])
        print(f"{'row':<34} {'ms/step':>8} {'tok/s':>8} {'AR/step':>8} {'us/AR':>7} {'AR ms':>7}  inter-GPU B/token")
        by_label = {t["label"]: t for t in table}
        for row in doc["rows"]:
            t = by_label.get(row["label"], {})
            inter = row.get("inter_gpu_per_decode_token") or {}
            moved = sum(v["bytes"] for v in inter.values())
            print(
                f"{row['label']:<34} {row['decode_ms_p50']:>8.3f} {row['tokens_per_s']:>8.1f} "
                f"{t.get('all_reduce_per_step', 0):>8.0f} {t.get('us_per_call', 0):>7.1f} "
                f"{t.get('all_reduce_ms_per_step', 0):>7.3f}  {moved:,.0f}"
            )
        if "profile" in doc:
            print(
                f"ledger collectives {doc['profile']['ledger_collectives']} vs profiler NCCL kernels "
                f"{doc['profile']['profiler_nccl_kernels']}"
            )
    parallel.shutdown()


if __name__ == "__main__":
    main()
