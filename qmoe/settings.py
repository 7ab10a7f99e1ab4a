"""Validate a composed Hydra config into typed settings; every bad value is a one-line ConfigError naming its key."""

from dataclasses import dataclass

import torch
from omegaconf import DictConfig, OmegaConf

import kernels

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
RUNTIMES = ("reference", "host", "cuda_native")
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
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
    require(ok, key, "must be a number", value)
    return float(value)


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
    max_seq_len: int
    checkpoint: str | None
    runtime: str
    kernels: dict
    sampling: SamplingSettings
    max_new_tokens: int
    batch_size: int
    logger: str


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


def validate(cfg: DictConfig) -> Settings:
    """Check every key a run reads; the model architecture is checked by ModelConfig when it is built."""
    dtype = OmegaConf.select(cfg, "model.dtype")
    require(dtype in DTYPES, "model.dtype", f"must be one of {', '.join(DTYPES)}", dtype)
    device = resolve_device(OmegaConf.select(cfg, "model.device"))
    checkpoint = OmegaConf.select(cfg, "model.checkpoint")
    require(checkpoint is None or isinstance(checkpoint, str), "model.checkpoint", "must be a directory path or null")

    runtime = OmegaConf.select(cfg, "runtime.name")
    require(runtime in RUNTIMES, "runtime", f"must be one of {', '.join(RUNTIMES)}", runtime)
    if runtime == "cuda_native":
        require(device.type == "cuda", "runtime", "cuda_native needs a CUDA device (use runtime=host or reference)")

    choice = OmegaConf.to_container(cfg.kernels) if "kernels" in cfg else {}
    for group, impl in choice.items():
        require(group in kernels.OPS, f"kernels.{group}", f"unknown op group; allowed: {', '.join(kernels.OPS)}")
        require(impl in kernels.IMPLEMENTATIONS, f"kernels.{group}", "must be torch or triton", impl)

    temperature = _float(cfg, "sampling.temperature")
    require(temperature >= 0, "sampling.temperature", "must be >= 0 (0 = greedy)", temperature)
    top_p = _float(cfg, "sampling.top_p")
    require(0 < top_p <= 1, "sampling.top_p", "must be in (0, 1]", top_p)
    min_p = _float(cfg, "sampling.min_p")
    require(0 <= min_p <= 1, "sampling.min_p", "must be in [0, 1]", min_p)
    sampling = SamplingSettings(temperature, _int(cfg, "sampling.top_k"), top_p, min_p, _int(cfg, "sampling.seed"))

    logger = OmegaConf.select(cfg, "logger.name")
    require(logger in LOGGERS, "logger", f"must be one of {', '.join(LOGGERS)}", logger)
    return Settings(
        dtype=DTYPES[dtype],
        device=device,
        max_seq_len=_int(cfg, "model.max_seq_len", 1),
        checkpoint=checkpoint,
        runtime=runtime,
        kernels=choice,
        sampling=sampling,
        max_new_tokens=_int(cfg, "generation.max_new_tokens", 1),
        batch_size=_int(cfg, "generation.batch_size", 1),
        logger=logger,
    )
