"""End-to-end speed of Qwen3.5-35B-A3B (random bf16 weights) on one GPU: qmoe's copy-free CUDA-native loop on
Triton kernels against its own reference runner and transformers' generate on the same weights.

Rows: batch 1 with prompts of 128 and 4096 tokens and 256 new tokens (TTFT, prefill tokens/s, decode ms/token
p50/p90, tokens/s, fraction of the bandwidth floor = active weight bytes per token / copy bandwidth measured in
this run); decode tokens/s at batch 8 and 32; per-kernel torch.profiler tables of one decode step and of the
128-token prefill (results/profile_*.txt).

    PYTHONPATH=. python experiments/bench_e2e.py [--out results/bench_e2e.json] [--smoke]   (--smoke: tiny model on CPU)
"""

import argparse
import time
from pathlib import Path

import torch
from benchlib import ceilings, print_targets, target, write_json
from hydra import compose, initialize_config_dir

from qmoe.app import get_model, run_experiment
from qmoe.metrics.measure import active_weight_bytes
from qmoe.settings import validate

CONFIG_DIR = str(Path(__file__).resolve().parents[1] / "configs")
FAST = ("runtime=cuda_native", "export=copy_elided", "kernels=triton", "runtime.cuda_graph=true")


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


@torch.no_grad()
def profile(model, prompt_len: int, out_dir: Path) -> dict:
    """torch.profiler tables (top kernels by device time) of one eager prefill and one eager decode step."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    device = model.device
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    tokens = torch.randint(0, model.config.vocab_size, (1, prompt_len), device=device)
    pos0 = torch.zeros(1, dtype=torch.int64, device=device)
    model.reset_caches()
    model(tokens, pos0)  # warm-up (compiles the kernels)
    tables = {}
    for name, fn in (
        ("prefill", lambda: model(tokens, pos0)),
        ("decode", lambda: model(tokens[:, :1], pos0 + prompt_len)),
    ):
        model.reset_caches()
        fn()
        with torch_profile(activities=activities) as prof:
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by=sort, row_limit=30)
        (out_dir / f"profile_{name}.txt").write_text(table)
        tables[name] = str(out_dir / f"profile_{name}.txt")
    return tables


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/bench_e2e.json")
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU with the host runner")
    parser.add_argument("--new-tokens", type=int, default=256)
    args = parser.parse_args()
    out_dir = Path(args.out).parent
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        model_args, fast, device, prompts, batches = ["model.device=cpu"], ("runtime=host",), "cpu", (16, 64), (2,)
        new_tokens, hf_new = 8, 4
    else:
        model_args, fast, device, prompts, batches = ["model=qwen35_moe"], FAST, "cuda", (128, 4096), (8, 32)
        new_tokens, hf_new = args.new_tokens, 32
    t0 = time.time()
    ceil = ceilings(device)

    base = config(*model_args)
    model = get_model(base, validate(base), progress=False).model
    active_bytes = active_weight_bytes(model.config, model.dtype)
    floor_ms = active_bytes / (ceil["copy_gbs"] * 1e9) * 1e3

    rows: list[dict] = []
    targets: list[dict] = []
    profiles: dict = {}

    def save():  # after every row: a run cut short keeps what it measured
        write_json(
            args.out,
            "e2e",
            device,
            ceilings=ceil,
            active_weight_bytes=active_bytes,
            floor_ms=floor_ms,
            rows=rows,
            targets=targets,
            profiles=profiles,
            seconds=time.time() - t0,
        )

    for L in prompts:
        r = run_experiment(config(*model_args, *fast, f"prompt.length={L}", f"generation.max_new_tokens={new_tokens}"))
        rows.append(row_from(r, "qmoe " + " ".join(fast), floor_ms))
        targets.append(target(f"decode ms/token, prompt {L}", rows[-1]["decode_ms_p50"], 2.0, at_most=True))
        if L == prompts[-1]:
            targets.append(target(f"prefill tokens/s, prompt {L}", rows[-1]["prefill_tokens_per_s"], 25000, False))
        save()
    for B in batches:
        r = run_experiment(
            config(
                *model_args, *fast, f"generation.batch_size={B}", "prompt.length=128", "generation.max_new_tokens=32"
            )
        )
        rows.append(row_from(r, f"qmoe batch {B}", floor_ms))
        save()
    model.setup_caches(1, model.max_seq_len)
    rows.append(transformers_row(model, prompts[0], hf_new, model.device))
    save()
    for L in prompts:
        r = run_experiment(
            config(*model_args, "runtime=reference", f"prompt.length={L}", "generation.max_new_tokens=32")
        )
        rows.append(row_from(r, "qmoe reference runner (torch ops, eager)", floor_ms))
        save()
    model.set_kernels({g: "torch" if args.smoke else "triton" for g in ("moe", "gdn", "attention", "norm")})
    profiles.update(profile(model, prompts[0], out_dir))
    save()

    print(f"copy {ceil['copy_gbs']:.0f} GB/s; active weights {active_bytes / 1e9:.2f} GB -> floor {floor_ms:.3f} ms")
    print(
        f"{'configuration':<58} {'B':>3} {'L':>5} {'TTFT ms':>9} {'prefill t/s':>11} {'p50 ms':>8} {'tok/s':>8} "
        f"{'floor':>6}"
    )
    for r in rows:
        floor = f"{100 * r['floor_fraction']:.0f}%" if r.get("floor_fraction") else "-"
        print(
            f"{r['label'][:58]:<58} {r['batch']:>3} {r['prompt_len']:>5} {r['ttft_ms']:>9.1f} "
            f"{r['prefill_tokens_per_s']:>11.0f} {r['decode_ms_p50']:>8.3f} {r['tokens_per_s']:>8.1f} {floor:>6}"
        )
    print_targets(targets)


if __name__ == "__main__":
    main()
