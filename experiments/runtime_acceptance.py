"""GPU acceptance of the runtime (issue 8): the copy-elision ablation at Qwen3.5-35B-A3B dims on one GPU.

Random bf16 weights initialised on the GPU, a 128-token prompt, 128 new tokens, batch 1, greedy, no EOS. For
every runtime x export preset x method split x CUDA graph that can run: TTFT, decode p50/p90/p99, tokens/s,
transfers per generated token from the ledger (H2D, D2H, D2D), the profiler's HtoD/DtoH/DtoD memcpys outside
the delegates against the ledger (prefill and decode separately, count and bytes), and device allocations per
decode step. Targets: copy_elided + cuda_native shows 0 H2D, 0 D2D and exactly one 8-byte D2H per generated
token (split and fused); the profiler agrees for every row; greedy tokens are identical across rows; CUDA-graph
rows make no device allocation per decode step.

Configs: composed with Hydra (configs/) when hydra is importable, else the same YAML files are read directly
(configs/model/qwen35_moe.yaml arch, configs/export/<preset>.yaml); omegaconf is needed either way (qmoe.export).
Writes results/runtime_acceptance.json and .md (after every row, so a time-out keeps what was measured).

    python experiments/runtime_acceptance.py [--layers 40] [--kernels triton] [--budget-s 240]
"""

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchlib import GREEDY  # noqa: E402

from qmoe.export import ExportSettings  # noqa: E402
from qmoe.metrics.measure import environment  # noqa: E402
from qmoe.model import ModelConfig, build_model  # noqa: E402
from qmoe.runtime.ablation import measure  # noqa: E402
from qmoe.runtime.combos import combination_error  # noqa: E402

PRESETS = ("baseline", "device_planned", "copy_elided")
# most important first: a row not started within the time budget is reported as not run
RUNS = [("reference", "split")] + [(r, s) for r in ("cuda_native", "host") for s in ("split", "fused", "forward_only")]


def load_configs(model: str, layers: int | None) -> tuple[dict, dict[str, dict], str]:
    """(model arch, {preset: export config}, how they were composed)."""
    try:
        from hydra import compose, initialize_config_dir
        from omegaconf import OmegaConf

        with initialize_config_dir(str(ROOT / "configs"), version_base="1.3"):
            arch = OmegaConf.to_container(compose("config", overrides=[f"model={model}"]).model.arch)
            exports = {p: OmegaConf.to_container(compose("config", overrides=[f"export={p}"]).export) for p in PRESETS}
        how = "hydra compose"
    except ImportError:
        arch = yaml.safe_load((ROOT / f"configs/model/{model}.yaml").read_text())["arch"]
        exports = {p: yaml.safe_load((ROOT / f"configs/export/{p}.yaml").read_text()) for p in PRESETS}
        how = "yaml files (hydra not importable)"
    return {**arch, "num_hidden_layers": layers or arch["num_hidden_layers"]}, exports, how


def fmt(x, spec=".2f"):
    return "-" if x is None else format(x, spec)


def markdown(rows: list[dict]) -> str:
    head = (
        "| runtime | export | split | graph | H2D/tok | H2D B/tok | D2H/tok | D2H B/tok | D2D/tok | D2D B/tok "
        "| TTFT ms | p50 ms | p90 ms | p99 ms | tok/s | allocs/step | profiler agrees | tokens = reference |"
    )
    lines = [head, "|" + "---|" * 18]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['runtime']} | {r['export']} | {r['split']} | {r['cuda_graph']} | error: {r['error']} |")
            continue
        per, lat = r["transfers"].get("per_decode_token", {}), r["latency"]
        h, d, dd = per.get("h2d", {}), per.get("d2h", {}), per.get("d2d", {})
        lines.append(
            f"| {r['runtime']} | {r['export']} | {r['split']} | {r['cuda_graph']} | {fmt(h.get('count'))} "
            f"| {fmt(h.get('bytes'), '.0f')} | {fmt(d.get('count'))} | {fmt(d.get('bytes'), '.0f')} "
            f"| {fmt(dd.get('count'))} | {fmt(dd.get('bytes'), '.0f')} "
            f"| {fmt(lat['ttft_ms'])} | {fmt(lat['decode_ms']['p50'], '.3f')} | {fmt(lat['decode_ms']['p90'], '.3f')} "
            f"| {fmt(lat['decode_ms']['p99'], '.3f')} | {fmt(lat['tokens_per_s'], '.1f')} "
            f"| {fmt(r['allocations_per_decode_step']['allocation'], '.1f')} | {r['profile']['agree']} "
            f"| {r['tokens_match_reference']} |"
        )
    return "\n".join(lines) + "\n"


def targets(rows: list[dict]) -> dict:
    ok = [r for r in rows if "error" not in r]
    elided = [r for r in ok if r["runtime"] == "cuda_native" and r["export"] == "copy_elided"]
    per = [r["transfers"]["per_decode_token"] for r in elided]
    graphed = [r for r in ok if r["cuda_graph"]]
    out = {
        "copy_elided_cuda_native_0_h2d_0_d2d_1x8B_d2h_per_token": {
            "met": bool(per)
            and all(p["h2d"]["count"] == p["d2d"]["count"] == 0 and p["d2h"] == {"count": 1, "bytes": 8} for p in per),
            "measured": per,
        },
        "profiler_agrees_every_row": {"met": bool(ok) and all(r["profile"]["agree"] for r in ok)},
        "greedy_tokens_identical": {"met": bool(ok) and all(r["tokens_match_reference"] for r in ok)},
        "cuda_graph_no_allocation_per_step": {
            "met": bool(graphed) and all(r["allocations_per_decode_step"]["allocation"] == 0 for r in graphed),
            "measured": {
                f"{r['runtime']}/{r['export']}/{r['split']}": r["allocations_per_decode_step"] for r in graphed
            },
        },
        "rows_without_error": {"met": len(ok) == len(rows), "errors": [r for r in rows if "error" in r]},
    }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen35_moe", help="a configs/model/ name (its arch; weights random)")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's, 40 for 35B-A3B)")
    ap.add_argument("--kernels", default="triton", choices=("triton", "torch"))
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--budget-s", type=float, default=240.0, help="rows not started by then are reported as not run")
    ap.add_argument("--out", default=str(ROOT / "results/runtime_acceptance.json"))
    args = ap.parse_args()
    t_start = time.perf_counter()
    assert torch.cuda.is_available(), "the runtime acceptance needs a CUDA device"

    arch, exports, how = load_configs(args.model, args.layers)
    model = build_model(ModelConfig.from_dict(arch), torch.bfloat16, "cuda", seed=0)
    sampling = GREEDY
    model.set_kernels({group: args.kernels for group in model.ops}, greedy=sampling.greedy)  # as the app does
    model.setup_caches(1, args.prompt_len + args.new_tokens + 16)
    prompts = torch.randint(
        0, model.config.vocab_size, (1, args.prompt_len), generator=torch.Generator().manual_seed(0)
    )
    prompts = prompts.tolist()
    print(
        f"model ready in {time.perf_counter() - t_start:.1f}s ({arch['num_hidden_layers']} layers, configs: {how})",
        flush=True,
    )

    out = Path(args.out)
    result = {
        "name": "runtime_acceptance",
        "environment": environment(model.device),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "config": {**vars(args), "configs_from": how, "batch": 1, "greedy": True, "eos": "off"},
        "rows": [],
    }
    reference_tokens = None
    for runtime, split in RUNS:
        for preset in PRESETS if runtime != "reference" else ("baseline",):
            settings = ExportSettings.from_cfg({**exports[preset], "method_split": split})
            for graph in (False, True):
                if combination_error(runtime, split, settings.device_memory_planning, graph, True):
                    continue
                row = {"runtime": runtime, "export": preset if runtime != "reference" else "-", "split": split}
                row["cuda_graph"] = graph
                if time.perf_counter() - t_start > args.budget_s:
                    row["error"] = "not run: time budget"
                else:
                    t0 = time.perf_counter()
                    try:
                        row.update(measure(model, runtime, settings, sampling, prompts, args.new_tokens, graph))
                    except Exception as e:  # noqa: BLE001 - one failing row must not lose the others
                        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
                    row["seconds"] = time.perf_counter() - t0
                    if "tokens" in row:
                        reference_tokens = reference_tokens or row["tokens"]
                        row["tokens_match_reference"] = row["tokens"] == reference_tokens
                result["rows"].append(row)
                print(markdown([row]).splitlines()[-1], f"({row.get('seconds', 0):.1f}s)", flush=True)
                result["targets"] = targets(result["rows"])
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps(result, indent=1, default=str))
                out.with_suffix(".md").write_text(markdown(result["rows"]))
    result["total_s"] = time.perf_counter() - t_start
    out.write_text(json.dumps(result, indent=1, default=str))
    print()
    print(markdown(result["rows"]))
    for name, t in result["targets"].items():
        print(f"{name}: {'met' if t['met'] else 'NOT met'}")
    print(f"total {result['total_s']:.0f}s -> {out}")


if __name__ == "__main__":
    main()
