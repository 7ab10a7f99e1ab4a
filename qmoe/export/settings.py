"""ExportSettings: the `export` config group (configs/export/*.yaml) as a validated dataclass."""

from dataclasses import asdict, dataclass, fields

import torch
from omegaconf import OmegaConf

# Method names of each `export.method_split`, in the order they are exported and planned.
METHOD_SPLITS = {
    "split": ("forward", "sample"),
    "fused": ("prefill", "decode"),
    "forward_only": ("forward",),
}
PRESETS = ("baseline", "device_planned", "copy_elided")


class ExportError(ValueError):
    """A setting, call or artifact the export pipeline refuses; the message is one line that says why."""


@dataclass(frozen=True)
class ExportSettings:
    preset: str = "baseline"
    method_split: str = "split"
    device_memory_planning: bool = False
    # bool, or a per-method map {forward: true, sample: false}; methods not named are not skipped.
    skip_h2d_for_method_inputs: bool | dict = False
    skip_d2h_for_method_outputs: bool | dict = False
    # auto = the model's device; "cpu:1" on a CPU model = a staged CPU delegate (its own memory space, real
    # copies); a device the model is not on is a label (plan only)
    delegate_device: str = "auto"
    alignment: int = 256  # bytes; every planned tensor starts at a multiple of it

    def __post_init__(self):
        if self.method_split not in METHOD_SPLITS:
            raise ExportError(
                f"export.method_split={self.method_split!r} is not allowed; use one of: {', '.join(METHOD_SPLITS)}"
            )
        if self.alignment < 1 or self.alignment & (self.alignment - 1):
            raise ExportError(f"export.alignment={self.alignment} must be a power of two")
        for key in ("skip_h2d_for_method_inputs", "skip_d2h_for_method_outputs"):
            flag = getattr(self, key)
            if isinstance(flag, dict):
                unknown = set(flag) - set(self.methods)
                if unknown:
                    raise ExportError(
                        f"export.{key} names {sorted(unknown)}, not methods of method_split={self.method_split} "
                        f"({', '.join(self.methods)})"
                    )
                object.__setattr__(self, key, {m: bool(v) for m, v in flag.items()})
            elif not isinstance(flag, bool):
                raise ExportError(f"export.{key} must be a bool or a per-method map, got {flag!r}")
            if not self.device_memory_planning and any(self._flag(key, m) for m in self.methods):
                raise ExportError(
                    f"export.{key} needs export.device_memory_planning=true: without device memory planning "
                    "method inputs and outputs live on the CPU"
                )

    @classmethod
    def from_cfg(cls, cfg) -> "ExportSettings":
        """From the composed `cfg.export` (a DictConfig or a dict); an unknown key is refused."""
        d = _to_container(cfg)
        unknown = sorted(set(d) - {f.name for f in fields(cls)})
        if unknown:
            raise ExportError(f"export.{unknown[0]}: unknown key; allowed: {', '.join(f.name for f in fields(cls))}")
        return cls(**d)

    @property
    def methods(self) -> tuple[str, ...]:
        return METHOD_SPLITS[self.method_split]

    def _flag(self, key: str, method: str) -> bool:
        flag = getattr(self, key)
        return bool(flag.get(method, False)) if isinstance(flag, dict) else flag

    def skip_h2d(self, method: str) -> bool:
        """True: `method`'s inputs are device tensors (the caller passes them on the delegate device)."""
        return self._flag("skip_h2d_for_method_inputs", method)

    def skip_d2h(self, method: str) -> bool:
        """True: `method`'s outputs stay on the delegate device."""
        return self._flag("skip_d2h_for_method_outputs", method)

    def resolve_delegate_device(self, model_device: torch.device | str) -> str:
        """'auto' -> the model's device (cuda:N / cpu); an explicit device is kept as given (a label: a program
        whose delegate device is not the model's is a plan only, it cannot run)."""
        return device_name(model_device if self.delegate_device == "auto" else self.delegate_device)

    def to_dict(self) -> dict:
        return asdict(self)


def device_name(device: torch.device | str) -> str:
    """'cuda' -> 'cuda:0', 'cpu' -> 'cpu': one spelling per device."""
    device = torch.device(device)
    return f"cuda:{device.index or 0}" if device.type == "cuda" else str(device)


def torch_device(space: str) -> torch.device:
    """The device that holds a memory space's bytes. "cpu:1" is a second CPU memory space: a CPU delegate with
    staging buffers of its own, so its copy nodes copy between distinct host buffers and are counted."""
    device = torch.device(space)
    return torch.device("cpu") if device.type == "cpu" else device


def _to_container(cfg) -> dict:
    return OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else dict(cfg)
