"""Triton kernels for qmoe, one op group per sub-package.

Each op group (`embedding`, `linear`, `moe`, `sampling`, `gdn`, `attention`, `norm`) has a plain PyTorch reference in
`naive.py` -- the model's `torch` path and the oracle for the kernel tests -- and its Triton
implementation beside it. `kernels.resolve(op, impl)` picks one for the model's `kernels.<op>` switch.
"""

import importlib
from types import ModuleType

# transformers probes for the PyPI package `kernels` and parses its version; this package shadows
# that name on sys.path, so give it a parseable version that is below any the hub integration accepts.
__version__ = "0.0.0"

IMPLEMENTATIONS = ("torch", "triton")
OPS = ("embedding", "linear", "moe", "sampling", "gdn", "attention", "norm")
# The kernels' environment switches and the values each takes (the first is its default when unset); read where
# they act (kernels/pdl.py, launch.py, linear/triton.py, tuned.py), checked here so that a typo is one line
ENVIRONMENT = {
    "QMOE_PDL": ("1", "0"),  # 0: no Programmatic Dependent Launch
    "QMOE_FAST_LAUNCH": ("1", "0"),  # 0: every launch through Triton's own
    "QMOE_FP8_PREFILL": ("dequantize", "fp8"),  # fp8 weights above 64 rows: bf16 cuBLAS, or FP8 x FP8
    "QMOE_GEMV_DEFAULT_CONFIGS": ("0", "1"),  # 1: the linear op's default configs, not the GPU's table
    "QMOE_MOE_DEFAULT_CONFIGS": ("0", "1"),  # 1: the MoE op's default configs, not the GPU's table
}


def environment_error(environ) -> str | None:
    """One line naming the first kernel switch in `environ` set to a value it does not take, or None."""
    for name, allowed in ENVIRONMENT.items():
        value = environ.get(name)
        if value is not None and value not in allowed:
            return f"environment variable {name}={value!r} is not allowed; use one of: {', '.join(allowed)}"
    return None


def resolve(op: str, impl: str) -> ModuleType:
    """The module implementing op group `op` with `impl` ('torch' -> naive.py, 'triton' -> triton.py)."""
    if op not in OPS:
        raise ValueError(f"unknown kernel op {op!r}; allowed: {', '.join(OPS)}")
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"kernels.{op}={impl!r} is not allowed; use one of: {', '.join(IMPLEMENTATIONS)}")
    return importlib.import_module(f"kernels.{op}.{'naive' if impl == 'torch' else 'triton'}")


def tracing() -> bool:
    """True while torch.export / torch.compile trace the model. The Triton ops launch through their
    `torch.library.custom_op` (which carries the fake the tracer needs) only then; in eager they call their
    launcher directly, which saves the custom-op dispatch on every call (host time the CUDA graph hides but
    an eager user pays)."""
    import torch  # not at import time: `run.py --help` must not load torch

    return torch.compiler.is_compiling()
