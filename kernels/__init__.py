"""Triton kernels for qmoe, one op group per sub-package.

Each op group (`linear`, `moe`, `sampling`, `gdn`, `attention`, `norm`) has a plain PyTorch reference in
`naive.py` -- the model's `torch` path and the oracle for the kernel tests -- and its Triton
implementation beside it. `kernels.resolve(op, impl)` picks one for the model's `kernels.<op>` switch.
"""

import importlib
from types import ModuleType

# transformers probes for the PyPI package `kernels` and parses its version; this package shadows
# that name on sys.path, so give it a parseable version that is below any the hub integration accepts.
__version__ = "0.0.0"

IMPLEMENTATIONS = ("torch", "triton")
OPS = ("linear", "moe", "sampling", "gdn", "attention", "norm")


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
