"""Validate a composed Hydra config into typed settings; every bad value is a one-line ConfigError naming its key."""

import difflib
import math
import os
import re
from dataclasses import dataclass, fields
from pathlib import Path

import torch
import yaml
from omegaconf import DictConfig, OmegaConf

import kernels
from qmoe.runtime.combos import device_error

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
RUNTIMES = ("reference", "host", "cuda_native")
WEIGHTS = ("auto", "dense", "fp8")  # as stored (random: dense) | all in model.dtype | projections and experts in FP8
LOGGERS = ("wandb", "none")


class ConfigError(ValueError):
    """A config value the app cannot run with; the message is '<key>: <what is allowed>'."""


def require(ok: bool, key: str, allowed: str, value=None) -> None:
    if not ok:
        got = "" if value is None else f" (got {value!r})"
        raise ConfigError(f"{key}: {allowed}{got}")


def _int(cfg, key: str, minimum: int | None = None) -> int:
    value = OmegaConf.select(cfg, key)
    require(isinstance(value, int) and not isinstance(value, bool), key, "must be an integer", value)
    if minimum is not None:
        require(value >= minimum, key, f"must be >= {minimum}", value)
    return value


def _float(cfg, key: str) -> float:
    value = OmegaConf.select(cfg, key)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    require(ok, key, "must be a finite number", value)
    return float(value)


def _bool(cfg, key: str) -> bool:
    value = OmegaConf.select(cfg, key)
    require(isinstance(value, bool), key, "must be true or false", value)
    return value


@dataclass(frozen=True)
class SamplingSettings:
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class Settings:
    dtype: torch.dtype
    device: torch.device
    weights: str  # WEIGHTS
    max_seq_len: int
    checkpoint: str | None
    runtime: str
    kernels: dict
    sampling: SamplingSettings
    max_new_tokens: int
    batch_size: int
    stop_on_eos: bool
    logger: str
    tp: int = 1
    ep: int = 1


def resolve_device(name: str) -> torch.device:
    require(isinstance(name, str), "model.device", "must be auto, cpu, cuda or cuda:N", name)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"model.device: must be auto, cpu, cuda or cuda:N (got {name!r})") from None
    require(device.type in ("cpu", "cuda"), "model.device", "must be auto, cpu, cuda or cuda:N", name)
    if device.type == "cuda":
        require(torch.cuda.is_available(), "model.device", "cuda was asked for but this machine has no CUDA device")
    return device


def first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def compose_error(e: Exception) -> str:
    """An error composing the config (Hydra's, or a bad value) as one line; an unknown option of a group comes
    with the options there are, an unknown key (`generation.temprature=1`) with the keys there are."""
    first = first_line(e)
    missing = re.search(r"Could not find '([^'/]+)/", first)
    names = sorted(p.stem for p in (CONFIG_DIR / missing.group(1)).glob("*.yaml")) if missing else []
    if names:
        return f"{first}; allowed: {', '.join(names)}"
    unknown = re.match(r"Could not override '([^']+)'", first)
    return unknown_key_error(unknown.group(1)) if unknown else first


def group_keys(group: str) -> set[str]:
    """Every key any option of configs/<group>/ sets: the keys a run of that group may carry."""
    keys = set()
    for file in (CONFIG_DIR / group).glob("*.yaml"):
        keys |= set(yaml.safe_load(file.read_text()) or {}) - {"defaults"}
    return keys


def allowed_keys() -> dict[str, set[str]]:
    """{group: the keys it may carry} for every config group, and "" for the top level."""
    groups = sorted(p.name for p in CONFIG_DIR.iterdir() if p.is_dir() and p.name != "experiment")
    allowed = {"": {*groups, "experiment", "seed", "hydra"}}
    for group in groups:
        allowed[group] = group_keys(group) if group != "kernels" else set(kernels.OPS)
    return allowed


def unknown_key_error(key: str) -> str:
    """'<key>: unknown key, ...; allowed: ...' for a dotted key nothing reads, with a guess where there is one: the
    group that has its name (`generation.temperature` -> sampling.temperature), or a near spelling."""
    allowed = allowed_keys()
    top, name, *deeper = key.split(".") + [""]  # deeper: [""] for a key of two parts
    if (top in allowed[""] and top not in allowed and name) or (top in allowed and name in allowed[top] and deeper[0]):
        if top == "model" and name in ("arch", "arch_overrides"):
            return f"{key}: not a ModelConfig field; allowed: {', '.join(sorted(model_fields()))}"
        value = f"{top}.{name}" if top in allowed else top
        return f"{key}: {value} is a value, not a section"
    group, name = (top, name) if top in allowed and name else ("", top)

    def dotted(g: str, k: str) -> str:
        return f"{g}.{k}" if g else k

    elsewhere = {dotted(g, k): k for g, keys in allowed.items() if g != group for k in keys}
    guesses = [full for full, k in elsewhere.items() if k == name]
    guesses = guesses or [dotted(group, k) for k in difflib.get_close_matches(name, allowed[group], 1)]
    near = set(difflib.get_close_matches(name, set(elsewhere.values()), 2))
    guesses = guesses or [full for full, k in elsewhere.items() if k in near][:2]
    hint = f" (did you mean {' or '.join(guesses)}?)" if guesses else ""
    where = "allowed" if group else "allowed top-level keys"
    return f"{key}: unknown key, nothing reads it{hint}; {where}: {', '.join(sorted(allowed[group]))}"


def model_fields() -> set[str]:
    from qmoe.model.config import ModelConfig  # torch-free, but not needed before a run

    return {f.name for f in fields(ModelConfig)}


def check_known_keys(cfg: DictConfig) -> None:
    """A key nothing reads (`+foo=1`, `+sampling.tempreature=1`) is an error, not silently carried along."""
    allowed = allowed_keys()
    for key in cfg:
        if key not in allowed[""]:
            raise ConfigError(unknown_key_error(str(key)))
    for group in sorted(allowed.keys() - {""}):
        for key in cfg.get(group) or {}:
            if key not in allowed[group]:
                raise ConfigError(unknown_key_error(f"{group}.{key}"))
    arch = model_fields()
    for section in ("arch", "arch_overrides"):
        for key in OmegaConf.select(cfg, f"model.{section}") or {}:
            if key not in arch:
                raise ConfigError(unknown_key_error(f"model.{section}.{key}"))


def check_prompt(cfg: DictConfig, checkpoint: str | None) -> None:
    """Exactly one prompt source; text and chat need a tokenizer (the checkpoint's tokenizer.json)."""
    text, ids = OmegaConf.select(cfg, "prompt.text"), OmegaConf.select(cfg, "prompt.token_ids")
    require(
        text is None or ids is None,
        "prompt.text",
        "give prompt.text or prompt.token_ids, not both (set the other to null)",
    )
    if _bool(cfg, "prompt.chat"):
        require(text is not None, "prompt.chat", "wraps prompt.text in ChatML; it needs prompt.text (and a tokenizer)")
    if text is not None:
        require(
            checkpoint is not None,
            "prompt.text",
            "needs a checkpoint with tokenizer.json (set model.checkpoint) or use prompt.token_ids / prompt.length",
        )


def check_triton_runs(choice: dict, device: torch.device) -> None:
    """Triton kernels compile for a GPU; on the CPU they run only under Triton's interpreter."""
    on_triton = [group for group, impl in choice.items() if impl == "triton"]
    if on_triton and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError(
            f"kernels.{on_triton[0]}: triton needs a CUDA device; on the CPU run with TRITON_INTERPRET=1 "
            "(Triton's interpreter, slow) or use kernels=torch"
        )


def check_parallel(cfg: DictConfig, runtime: str, choice: dict) -> tuple[int, int]:
    """parallel.tp x parallel.ep must be the number of processes torchrun started, the random model's dimensions
    must split that way, and the runtime and kernels must have a sharded path."""
    from qmoe.parallel import env_world_size, fp8_layout_errors, layout_errors

    tp, ep = _int(cfg, "parallel.tp", 1), _int(cfg, "parallel.ep", 1)
    world = env_world_size()
    require(
        tp * ep == world,
        "parallel",
        f"tp x ep = {tp} x {ep} = {tp * ep} processes, but {world} run (torchrun --nproc-per-node {tp * ep}, "
        "or set parallel.tp / parallel.ep to match)",
    )
    if world == 1:
        return tp, ep
    if OmegaConf.select(cfg, "model.checkpoint") is None:
        errors = layout_errors(OmegaConf.to_container(cfg.model.arch), tp, ep)
        if errors:
            raise ConfigError(errors[0])
    require(
        runtime != "host",
        "runtime",
        "host samples full logits on the CPU; with tp x ep > 1 use reference or cuda_native (logits stay sharded)",
    )
    if OmegaConf.select(cfg, "model.weights") == "fp8" and OmegaConf.select(cfg, "model.checkpoint") is None:
        # (a checkpoint's dims are checked by its load)
        errors = fp8_layout_errors(OmegaConf.to_container(cfg.model.arch), tp, ep)
        if errors:
            raise ConfigError(errors[0])
    return tp, ep


def validate(cfg: DictConfig) -> Settings:
    """Check every key a run reads; the model architecture is checked by ModelConfig when it is built."""
    check_known_keys(cfg)
    if error := kernels.environment_error(os.environ):
        raise ConfigError(error)
    dtype = OmegaConf.select(cfg, "model.dtype")
    require(dtype in DTYPES, "model.dtype", f"must be one of {', '.join(DTYPES)}", dtype)
    device = resolve_device(OmegaConf.select(cfg, "model.device"))
    weights = OmegaConf.select(cfg, "model.weights")
    require(weights in WEIGHTS, "model.weights", f"must be one of {', '.join(WEIGHTS)}", weights)
    if weights == "fp8" and device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        require(
            capability >= (8, 9),
            "model.weights",
            f"fp8 needs a GPU with FP8 (compute capability >= 8.9), this one is {capability[0]}.{capability[1]}; "
            "use auto or dense",
        )
    checkpoint = OmegaConf.select(cfg, "model.checkpoint")
    require(checkpoint is None or isinstance(checkpoint, str), "model.checkpoint", "must be a directory path or null")

    runtime = OmegaConf.select(cfg, "runtime.name")
    require(runtime in RUNTIMES, "runtime", f"must be one of {', '.join(RUNTIMES)}", runtime)
    if error := device_error(runtime, device.type == "cuda"):
        raise ConfigError(error)

    named = OmegaConf.to_container(cfg.kernels) if "kernels" in cfg else {}
    for group, impl in named.items():
        require(group in kernels.OPS, f"kernels.{group}", f"unknown op group; allowed: {', '.join(kernels.OPS)}")
        require(impl in kernels.IMPLEMENTATIONS, f"kernels.{group}", "must be torch or triton", impl)
    # every group, so that a model reused from an earlier run is set entirely by this one (a group not named
    # runs its torch reference)
    choice = {group: named.get(group, "torch") for group in kernels.OPS}
    check_triton_runs(choice, device)
    check_prompt(cfg, checkpoint)

    temperature = _float(cfg, "sampling.temperature")
    require(temperature >= 0, "sampling.temperature", "must be >= 0 (0 = greedy)", temperature)
    top_p = _float(cfg, "sampling.top_p")
    require(0 < top_p <= 1, "sampling.top_p", "must be in (0, 1]", top_p)
    min_p = _float(cfg, "sampling.min_p")
    require(0 <= min_p <= 1, "sampling.min_p", "must be in [0, 1]", min_p)
    sampling = SamplingSettings(temperature, _int(cfg, "sampling.top_k"), top_p, min_p, _int(cfg, "sampling.seed"))

    logger = OmegaConf.select(cfg, "logger.name")
    require(logger in LOGGERS, "logger", f"must be one of {', '.join(LOGGERS)}", logger)
    tp, ep = check_parallel(cfg, runtime, choice)
    if tp * ep > 1 and device.type == "cuda":  # one GPU per rank
        from qmoe.parallel import env_local_rank

        device = torch.device("cuda", env_local_rank())
    return Settings(
        dtype=DTYPES[dtype],
        device=device,
        weights=weights,
        max_seq_len=_int(cfg, "model.max_seq_len", 1),
        checkpoint=checkpoint,
        runtime=runtime,
        kernels=choice,
        sampling=sampling,
        max_new_tokens=_int(cfg, "generation.max_new_tokens", 1),
        batch_size=_int(cfg, "generation.batch_size", 1),
        stop_on_eos=_bool(cfg, "generation.stop_on_eos"),
        logger=logger,
        tp=tp,
        ep=ep,
    )


def validate_for_run(cfg: DictConfig) -> Settings:
    """validate(cfg), and what run.py can check before a run directory exists: the export settings, the runtime x
    export x CUDA-graph combination, a random model's architecture numbers."""
    from qmoe.export.settings import ExportSettings
    from qmoe.model.config import ModelConfig
    from qmoe.runtime.combos import cfg_combination_error

    s = validate(cfg)
    ExportSettings.from_cfg(cfg.export)
    error = cfg_combination_error(cfg, s.device.type == "cuda")
    if error is not None:
        raise ConfigError(error)
    if s.checkpoint is None:
        try:
            ModelConfig.from_dict(OmegaConf.to_container(cfg.model.arch))
        except (TypeError, ValueError) as e:
            raise ConfigError(str(e).splitlines()[0]) from None
    return s
