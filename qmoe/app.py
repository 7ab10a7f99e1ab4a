"""run_experiment(cfg) -> results: the whole app, callable in-process (notebooks, tests, sweeps).

config (Hydra) -> settings -> model (random init or checkpoint) -> prompts -> runner (reference | host |
cuda_native, over exported programs) -> generation -> metrics -> results.json (+ wandb).
"""

import logging
import time
from pathlib import Path
from typing import NamedTuple

from omegaconf import DictConfig, OmegaConf

from qmoe import parallel
from qmoe.metrics.logging import log_wandb, write_results
from qmoe.metrics.measure import (
    available_memory_bytes,
    bandwidth_floor,
    environment,
    latency_stats,
    peak_memory,
    reset_peak_memory,
)
from qmoe.model import ModelConfig, Qwen35MoE, build_model, fp8_parameters, fp8_weight_names, weight_nbytes
from qmoe.parallel.sampling import Filters
from qmoe.prompts import build_prompts, check_fits
from qmoe.runtime.combos import resolve_cuda_graph
from qmoe.runtime.generate import generate
from qmoe.runtime.ledger import TransferLedger
from qmoe.runtime.runners import make_runner
from qmoe.settings import ConfigError, Settings, validate

SCHEMA_VERSION = 1
log = logging.getLogger("qmoe")


class LoadedModel(NamedTuple):
    model: Qwen35MoE
    identity: dict  # where the weights came from: random seed + arch, or the checkpoint's file hashes
    tokenizer: object | None  # qmoe.checkpoint.Tokenizer when the checkpoint has tokenizer.json


class Interrupted(KeyboardInterrupt):
    """Ctrl-C before a single decode step was measured: there is nothing to write."""


def check_layout(config: ModelConfig, layout: parallel.Layout) -> None:
    """Every dimension the layout shards must split evenly (a checkpoint's dims are known only once it is read)."""
    errors = parallel.layout_errors(config.to_dict(), layout.tp, layout.ep) if layout.sharded else []
    if errors:
        raise ConfigError(errors[0])


def check_memory(config: ModelConfig, s: Settings, name: str, fp8=frozenset()) -> None:
    """Refuse, before anything is allocated, weights larger than the device's free memory (a rank holds about
    1 / (tp x ep) of them)."""
    needed, available = weight_nbytes(config, s.dtype, fp8) // (s.tp * s.ep), available_memory_bytes(s.device)
    if needed > available:
        dtype = str(s.dtype).removeprefix("torch.") + (" + fp8" if fp8 else "")
        raise ConfigError(
            f"model: {name} needs {needed / 1e9:.1f} GB for its {dtype} weights on {s.device}, "
            f"{available / 1e9:.1f} GB available (choose a smaller model, model.dtype or model.device)"
        )


class ModelCache:
    """Weights built or loaded once and reused by every run with the same key (multirun jobs, notebooks).

    Safe to share because a run sets everything it changes on the model before using it: every kernel group
    (Settings.kernels names all of them), the caches' batch and length (re-allocated when they differ, zeroed by
    each runner's start), and nothing else of the model is written. Holds one model at a time: the 35B shape
    takes most of a GPU. `run_experiment(cfg, models=ModelCache())` gives a run weights of its own."""

    def __init__(self):
        self._key, self._loaded = None, None

    def clear(self) -> None:
        self._key, self._loaded = None, None

    def get(self, cfg: DictConfig, s: Settings, progress: bool = False) -> LoadedModel:
        """The model for cfg.model (random from its seed, or the checkpoint's)."""
        overrides = OmegaConf.to_container(cfg.model.arch_overrides) if cfg.model.get("arch_overrides") else {}
        if s.checkpoint is not None:
            key = (
                "checkpoint",
                str(Path(s.checkpoint).resolve()),
                s.dtype,
                s.weights,
                str(s.device),
                repr(sorted(overrides.items())),
                parallel.current(),
            )
        else:
            arch = OmegaConf.to_container(cfg.model.arch)
            key = (
                "random",
                repr(sorted(arch.items())),
                int(cfg.model.seed),
                s.dtype,
                s.weights,
                str(s.device),
                parallel.current(),
            )
        if key != self._key:
            self.clear()  # free the old weights before the new ones are allocated
            self._loaded, self._key = self._load(cfg, s, overrides, progress), key
        return self._loaded

    @staticmethod
    def _load(cfg: DictConfig, s: Settings, overrides: dict, progress: bool) -> LoadedModel:
        name = str(cfg.model.get("name", "the model"))
        layout = parallel.current()
        if s.checkpoint is not None:
            from qmoe.checkpoint import load_checkpoint, load_tokenizer
            from qmoe.checkpoint.loader import checkpoint_fp8_names, read_config

            config = read_config(s.checkpoint, overrides)
            check_layout(config, layout)
            check_memory(config, s, s.checkpoint, checkpoint_fp8_names(s.checkpoint, config, s.weights, s.device))
            model, info = load_checkpoint(
                s.checkpoint,
                dtype=s.dtype,
                device=s.device,
                arch_overrides=overrides,
                progress=progress,
                weights=s.weights,
                layout=layout,
            )
            return LoadedModel(model, {"kind": "checkpoint", **info.to_dict()}, load_tokenizer(s.checkpoint))
        try:
            model_cfg = ModelConfig.from_dict(OmegaConf.to_container(cfg.model.arch))
        except (TypeError, ValueError) as e:
            raise ConfigError(str(e).splitlines()[0]) from None
        check_layout(model_cfg, layout)
        fp8 = fp8_weight_names(model_cfg, s.weights)
        check_memory(model_cfg, s, name, fp8)
        model = build_model(
            model_cfg, s.dtype, s.device, seed=int(cfg.model.seed), progress=progress, fp8=fp8, layout=layout
        )
        identity = {"kind": "random", "seed": int(cfg.model.seed), "arch": model_cfg.to_dict(), "fp8": len(fp8) > 0}
        return LoadedModel(model, identity, None)


# The process's cache: what run.py's multirun jobs share (see ModelCache for why that is safe).
MODELS = ModelCache()


def get_model(cfg: DictConfig, s: Settings, progress: bool = False) -> LoadedModel:
    """The model for cfg.model from the process's cache."""
    return MODELS.get(cfg, s, progress)


def runner_for(s: Settings, cfg: DictConfig, loaded: LoadedModel, ledger: TransferLedger):
    """The runner cfg.runtime asks for over the loaded model; host / cuda_native run the program saved in
    runtime.program, else one exported in-process under cfg.export."""
    from qmoe.export import ExportSettings

    settings = ExportSettings.from_cfg(cfg.export)
    try:
        graphs = resolve_cuda_graph(
            OmegaConf.select(cfg, "runtime.cuda_graph", default=False),
            s.runtime,
            settings.device_memory_planning,
            s.device.type == "cuda",
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None
    saved = OmegaConf.select(cfg, "runtime.program", default=None)
    program = None
    if saved and s.runtime != "reference":
        from qmoe.runtime.executor import load_program

        program = load_program(saved, loaded.model, loaded.identity, settings)
    return make_runner(loaded.model, s.runtime, settings, s.sampling, s.batch_size, ledger, graphs, program)


def decode_methods(runner) -> tuple[str, ...]:
    """The program methods one decode step of this runner calls."""
    from qmoe.runtime.cuda_native import CudaNativeRunner

    if runner.name == "cuda_native":
        return CudaNativeRunner.METHODS[runner.program.settings.method_split][1:]
    return ("forward",)  # host: forward returns logits, sampling runs on the CPU


def planned_per_decode_token(program, methods: tuple[str, ...], batch: int) -> dict:
    """{direction: {count, bytes}} per generated token that the export plan moves in a decode step (T = 1):
    its copy nodes, or without device memory planning the delegate's own copies of every method input and
    output. What the plan moves on a GPU; on the CPU delegate the same nodes run and move nothing."""
    from qmoe.export.passes import COPY_DIRECTIONS, call_delegate, is_copy

    out = {}

    def add(direction: str, node) -> None:
        spec = node.meta["qmoe_spec"]
        numel = 1
        for i, n in enumerate(spec.shape):
            numel *= 1 if i in spec.dynamic_dims else n  # the dynamic dim is the token count: 1 when decoding
        entry = out.setdefault(direction, {"count": 0, "bytes": 0})
        entry["count"] += 1 / batch
        entry["bytes"] += numel * spec.torch_dtype.itemsize / batch

    for method in methods:
        graph = program.graphs[method].graph
        for node in graph.nodes:
            if is_copy(node):
                add(COPY_DIRECTIONS[node.target], node)
            elif node.op == "call_function" and node.target is call_delegate and node.meta["qmoe_self_copies"]:
                for arg in node.args:
                    add("h2d", arg)
                for user in node.users:
                    add("d2h", user)
    return out


def runtime_setup(runner, batch: int) -> dict:
    """What produced the transfers: runner, CUDA graphs, export preset and split, the plan's copy nodes and what
    they move per generated token."""
    program = getattr(runner, "program", None)
    setup = {"runtime": runner.name, "cuda_graph": bool(getattr(runner, "graphs", None))}
    if program is not None:
        setup.update(
            preset=program.settings.preset,
            method_split=program.settings.method_split,
            delegate_device=program.delegate_device,
            copy_nodes=program.plan.copies,
            arena_bytes=program.plan.arenas,
            planned_per_decode_token=planned_per_decode_token(program, decode_methods(runner), batch),
        )
    return setup


def prepare(model: Qwen35MoE, s: Settings) -> None:
    """Set everything a run changes on a (possibly reused) model: every kernel group, the caches' shape."""
    filters = Filters(s.sampling.top_k, s.sampling.top_p < 1)
    model.set_kernels(s.kernels, greedy=s.sampling.greedy, filters=filters)
    if (model.batch_size, model.max_seq_len) != (s.batch_size, s.max_seq_len):
        model.setup_caches(s.batch_size, s.max_seq_len)


def run_experiment(
    cfg: DictConfig, run_dir: str | Path | None = None, progress: bool = False, models: ModelCache | None = None
) -> dict:
    """Run one configuration end to end; writes results.json into run_dir (default: outputs/latest).

    Ctrl-C during decode ends the run early: the steps measured so far are written with `partial: true`;
    before any decode step it raises Interrupted (nothing written). `models`: default the process's cache."""
    s = validate(cfg)
    layout = parallel.init(s.tp, s.ep, s.device.type) if s.tp * s.ep > 1 else parallel.current()
    run_dir = Path(run_dir or "outputs/latest")
    reset_peak_memory()
    t0 = time.perf_counter()
    loaded = (models or MODELS).get(cfg, s, progress)
    model, identity, tokenizer = loaded
    model_ready_s = time.perf_counter() - t0
    mcfg = model.config
    log.info(f"model {cfg.model.name} ready in {model_ready_s:.1f} s ({mcfg.param_counts()['total']:,} parameters)")

    prompts = build_prompts(cfg.prompt, s.batch_size, mcfg.vocab_size, tokenizer)
    check_fits(prompts, s.max_new_tokens, s.max_seq_len)
    prepare(model, s)

    ledger = TransferLedger()
    runner = runner_for(s, cfg, loaded, ledger)
    eos = (tokenizer.eos_token_ids if tokenizer is not None else mcfg.eos_token_ids) if s.stop_on_eos else ()
    warmup_steps = int(OmegaConf.select(cfg, "runtime.warmup_steps", default=0))
    warmup_ms = None
    if warmup_steps > 0:  # compile / autotune / allocate outside the measured run
        t0 = time.perf_counter()
        if generate(runner, prompts, min(warmup_steps + 1, s.max_new_tokens), ()).interrupted:
            raise Interrupted("interrupted during warm-up")
        warmup_ms = (time.perf_counter() - t0) * 1e3
        log.info(f"warm-up: {warmup_steps} decode steps in {warmup_ms:.0f} ms")
    ledger.clear()
    log.info(f"generating up to {s.max_new_tokens} tokens for {s.batch_size} row(s)")
    gen = generate(runner, prompts, s.max_new_tokens, eos, progress=progress)
    if gen.interrupted and not gen.decode_ms:
        raise Interrupted("interrupted before the first decode step")
    latency = latency_stats(gen.ttft_ms, gen.decode_ms, gen.decode_tokens, warmup_ms)

    results = {
        "schema_version": SCHEMA_VERSION,
        "partial": gen.interrupted,
        "config": OmegaConf.to_container(cfg, resolve=True),
        "model": {"params": mcfg.param_counts(), "weights": identity, "ready_s": model_ready_s},
        "prompt": {"token_ids": prompts, "lengths": [len(p) for p in prompts]},
        "generated": {
            "token_ids": gen.tokens,
            "text": [tokenizer.decode(t) for t in gen.tokens] if tokenizer is not None else None,
        },
        "latency": latency,
        "transfers": {
            **ledger.summary(gen.decode_tokens),
            "setup": {**runtime_setup(runner, s.batch_size), "kernels": s.kernels},
        },
        "bandwidth_floor": bandwidth_floor(
            mcfg, model.dtype, model.device, latency["decode_ms"]["p50"], fp8_parameters(model), layout.world
        ),
        "parallel": {"tp": layout.tp, "ep": layout.ep, "world": layout.world},
        "memory": peak_memory(),
        "environment": environment(s.device),
    }
    if gen.interrupted:
        results["interrupted"] = f"Ctrl-C after {len(gen.decode_ms)} decode steps"
    if layout.rank != 0:  # rank 0 alone writes results.json and logs (every rank generated the same tokens)
        results["results_path"] = None
        return results
    path = write_results(results, run_dir)
    results["results_path"] = str(path)
    log.info(f"results: {path}")
    if s.logger == "wandb":
        try:
            results["wandb_dir"] = log_wandb(results, gen.decode_ms, OmegaConf.to_container(cfg.logger), run_dir)
        except Exception as e:  # noqa: BLE001 - any logger failure must leave the measured results intact
            results["logger_error"] = f"wandb: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            log.warning(f"{results['logger_error']} (results.json kept)")
        write_results({k: v for k, v in results.items() if k != "results_path"}, run_dir)
    return results


def _bytes(n: float) -> str:
    return f"{n:,.0f} B" if n < 10_000 else f"{n / 1e3:,.1f} KB" if n < 10_000_000 else f"{n / 1e6:,.1f} MB"


def _transfers(per: dict) -> str:
    """'h2d 0 (0 B), d2h 1 (8 B)' for whatever directions the ledger reports."""
    return ", ".join(f"{d} {v['count']:g} ({_bytes(v['bytes'])})" for d, v in per.items()) or "none"


def _kernels(choice: dict) -> str:
    """'triton' when every group runs one implementation, else 'triton: moe, norm; torch: linear, ...'."""
    by_impl = {}
    for group, impl in choice.items():
        by_impl.setdefault(impl, []).append(group)
    if len(by_impl) == 1:
        return next(iter(by_impl))
    return "; ".join(f"{impl}: {', '.join(groups)}" for impl, groups in sorted(by_impl.items()))


def summary_table(results: dict) -> str:
    """What ran (runtime, export, kernels, graph, dtype, device), what moved per token, how fast, the text."""
    cfg, lat, tr = results["config"], results["latency"], results["transfers"]
    setup, d, env = tr.get("setup", {}), lat["decode_ms"], results["environment"]

    def fmt(x, spec=".2f"):
        return "-" if x is None else format(x, spec)

    export = f"{setup['preset']} / {setup['method_split']}" if "preset" in setup else "- (eager model, no export)"
    weights = cfg["model"].get("weights", "auto")
    kind = results["model"]["weights"]["kind"] + ("" if weights == "auto" else f", {weights}")
    rows = [
        ("model", f"{cfg['model']['name']} ({cfg['model']['dtype']}, {kind} weights)"),
        ("device", f"{env['device']} ({env['device_name']})"),
        (
            "runtime",
            f"{setup.get('runtime', cfg['runtime']['name'])}, CUDA graph {'on' if setup.get('cuda_graph') else 'off'}",
        ),
        ("export / split", export),
        ("kernels", _kernels(setup.get("kernels", cfg["kernels"]))),
        ("TTFT", f"{fmt(lat['ttft_ms'])} ms"),
        ("decode p50 / p90", f"{fmt(d['p50'])} / {fmt(d['p90'])} ms/token-step"),
        ("tokens/s", fmt(lat["tokens_per_s"], ".1f")),
    ]
    if "per_decode_token" in tr:
        rows.append(("per decode token", _transfers(tr["per_decode_token"])))
    inter = tr.get("inter_gpu", {}).get("per_decode_token")
    if inter is not None:
        p = results.get("parallel", {})
        rows.append((f"  inter-GPU (tp {p.get('tp')} x ep {p.get('ep')})", _transfers(inter)))
    planned = setup.get("planned_per_decode_token")
    if planned is not None and not str(setup.get("delegate_device", "")).startswith("cuda"):
        rows.append(("  planned", f"{_transfers(planned)} (not moved without CUDA)"))
    floor = results.get("bandwidth_floor") or {}
    if floor.get("floor_ms") is not None:
        at = 100 * (floor["fraction_of_decode_p50"] or 0)
        rows.append(
            (
                "bandwidth floor",
                f"{floor['floor_ms']:.3f} ms = {floor['active_weight_bytes'] / 1e9:.2f} GB active weights / "
                f"{floor['copy_gbs']:,.0f} GB/s copy; decode p50 at {at:.0f} % of it",
            )
        )
    rows.append(
        (
            "generated",
            f"{sum(map(len, results['generated']['token_ids']))} tokens in "
            f"{len(results['generated']['token_ids'])} row(s)",
        )
    )
    for i, text in enumerate(results["generated"]["text"] or []):
        rows.append((f"text[{i}]", repr(text)))
    rows.append(("results", results["results_path"] + (" (partial: interrupted)" if results.get("partial") else "")))
    if "logger_error" in results:
        rows.append(("logger", results["logger_error"]))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
