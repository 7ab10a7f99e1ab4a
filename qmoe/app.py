"""run_experiment(cfg) -> results: the whole app, callable in-process (notebooks, tests, sweeps).

config (Hydra) -> settings -> model (random init or checkpoint) -> prompts -> runner (reference | host |
cuda_native, over exported programs) -> generation -> metrics -> results.json (+ wandb).
"""

import time
from pathlib import Path
from typing import NamedTuple

from omegaconf import DictConfig, OmegaConf

from qmoe.metrics.logging import log_wandb, write_results
from qmoe.metrics.measure import environment, latency_stats, peak_memory, reset_peak_memory
from qmoe.model import ModelConfig, Qwen35MoE, build_model
from qmoe.prompts import build_prompts, check_fits
from qmoe.runtime.combos import resolve_cuda_graph
from qmoe.runtime.generate import generate
from qmoe.runtime.ledger import TransferLedger
from qmoe.runtime.runners import make_runner
from qmoe.settings import ConfigError, Settings, validate

SCHEMA_VERSION = 1


class LoadedModel(NamedTuple):
    model: Qwen35MoE
    identity: dict  # where the weights came from: random seed + arch, or the checkpoint's file hashes
    tokenizer: object | None  # qmoe.checkpoint.Tokenizer when the checkpoint has tokenizer.json


# Weights built or loaded once per process and reused by every run (and multirun job) with the same key.
_MODELS: dict[tuple, LoadedModel] = {}


def get_model(cfg: DictConfig, s: Settings, progress: bool) -> LoadedModel:
    """The model for cfg.model (random from its seed, or the checkpoint's), cached per process."""
    overrides = OmegaConf.to_container(cfg.model.arch_overrides) if cfg.model.get("arch_overrides") else {}
    if s.checkpoint is not None:
        key = ("checkpoint", str(Path(s.checkpoint).resolve()), s.dtype, str(s.device), repr(sorted(overrides.items())))
    else:
        arch = OmegaConf.to_container(cfg.model.arch)
        key = ("random", repr(sorted(arch.items())), int(cfg.model.seed), s.dtype, str(s.device))
    if key not in _MODELS:
        _MODELS.clear()  # hold one set of weights at a time: the 35B shape takes most of a GPU
        if s.checkpoint is not None:
            from qmoe.checkpoint import load_checkpoint, load_tokenizer

            model, info = load_checkpoint(
                s.checkpoint, dtype=s.dtype, device=s.device, arch_overrides=overrides, progress=progress
            )
            loaded = LoadedModel(model, {"kind": "checkpoint", **info.to_dict()}, load_tokenizer(s.checkpoint))
        else:
            try:
                model_cfg = ModelConfig.from_dict(arch)
            except (TypeError, ValueError) as e:
                raise ConfigError(str(e).splitlines()[0]) from None
            model = build_model(model_cfg, s.dtype, s.device, seed=int(cfg.model.seed), progress=progress)
            loaded = LoadedModel(
                model, {"kind": "random", "seed": int(cfg.model.seed), "arch": model_cfg.to_dict()}, None
            )
        _MODELS[key] = loaded
    return _MODELS[key]


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


def runtime_setup(runner) -> dict:
    """What produced the transfers: runner, CUDA graphs, export preset and split, the plan's copy nodes."""
    program = getattr(runner, "program", None)
    setup = {"runtime": runner.name, "cuda_graph": bool(getattr(runner, "graphs", None))}
    if program is not None:
        setup.update(
            preset=program.settings.preset,
            method_split=program.settings.method_split,
            delegate_device=program.delegate_device,
            copy_nodes=program.plan.copies,
            arena_bytes=program.plan.arenas,
        )
    return setup


def run_experiment(cfg: DictConfig, run_dir: str | Path | None = None, progress: bool = False) -> dict:
    """Run one configuration end to end; writes results.json into run_dir (default: outputs/latest)."""
    s = validate(cfg)
    run_dir = Path(run_dir or "outputs/latest")
    reset_peak_memory()
    t0 = time.perf_counter()
    loaded = get_model(cfg, s, progress)
    model, identity, tokenizer = loaded
    model_ready_s = time.perf_counter() - t0
    mcfg = model.config

    prompts = build_prompts(cfg.prompt, s.batch_size, mcfg.vocab_size, tokenizer)
    check_fits(prompts, s.max_new_tokens, s.max_seq_len)
    model.set_kernels(s.kernels)
    if (model.batch_size, model.max_seq_len) != (s.batch_size, s.max_seq_len):
        model.setup_caches(s.batch_size, s.max_seq_len)

    ledger = TransferLedger()
    runner = runner_for(s, cfg, loaded, ledger)
    eos = (
        (tokenizer.eos_token_ids if tokenizer is not None else mcfg.eos_token_ids) if cfg.generation.stop_on_eos else ()
    )
    warmup_steps = int(OmegaConf.select(cfg, "runtime.warmup_steps", default=0))
    warmup_ms = None
    if warmup_steps > 0:  # compile / autotune / allocate outside the measured run
        t0 = time.perf_counter()
        generate(runner, prompts, min(warmup_steps + 1, s.max_new_tokens), ())
        warmup_ms = (time.perf_counter() - t0) * 1e3
    ledger.clear()
    gen = generate(runner, prompts, s.max_new_tokens, eos, progress=progress)

    results = {
        "schema_version": SCHEMA_VERSION,
        "config": OmegaConf.to_container(cfg, resolve=True),
        "model": {"params": mcfg.param_counts(), "weights": identity, "ready_s": model_ready_s},
        "prompt": {"token_ids": prompts, "lengths": [len(p) for p in prompts]},
        "generated": {
            "token_ids": gen.tokens,
            "text": [tokenizer.decode(t) for t in gen.tokens] if tokenizer is not None else None,
        },
        "latency": latency_stats(gen.ttft_ms, gen.decode_ms, gen.decode_tokens, warmup_ms),
        "transfers": {**ledger.summary(gen.decode_tokens), "setup": runtime_setup(runner)},
        "memory": peak_memory(),
        "environment": environment(s.device),
    }
    path = write_results(results, run_dir)
    results["results_path"] = str(path)
    if s.logger == "wandb":
        try:
            results["wandb_dir"] = log_wandb(results, gen.decode_ms, OmegaConf.to_container(cfg.logger), run_dir)
        except Exception as e:  # noqa: BLE001 - any logger failure must leave the measured results intact
            results["logger_error"] = f"wandb: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        write_results({k: v for k, v in results.items() if k != "results_path"}, run_dir)
    return results


def summary_table(results: dict) -> str:
    lat = results["latency"]
    d = lat["decode_ms"]

    def fmt(x, spec=".2f"):
        return "-" if x is None else format(x, spec)

    rows = [
        ("TTFT", f"{fmt(lat['ttft_ms'])} ms"),
        ("decode p50 / p90", f"{fmt(d['p50'])} / {fmt(d['p90'])} ms/token-step"),
        ("tokens/s", fmt(lat["tokens_per_s"], ".1f")),
        (
            "generated",
            f"{sum(map(len, results['generated']['token_ids']))} tokens in "
            f"{len(results['generated']['token_ids'])} row(s)",
        ),
        ("results", results["results_path"]),
    ]
    if "logger_error" in results:
        rows.append(("logger", results["logger_error"]))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
