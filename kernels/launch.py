"""Eager launches of already-compiled Triton kernels without Triton's per-call work.

`kernel[grid](*args, **kwargs)` costs ~25 µs of host time per call on the H200 host (results/host_overhead.json),
about 2.5x what the compiled kernel's own launcher needs: beyond binding the arguments, Triton turns its options
into a string key, checks the kernel's globals and builds launch metadata on every call. A CUDA graph hides that;
an eager decode step with ~250 launches pays it (the reference runner with kernels=triton is host-bound).

`@fast_launch` on a `@triton.jit` kernel keeps `kernel[grid](...)` as the call syntax. A call's key is the current
device, each argument's dtype, device type and pointer alignment (tensors: data_ptr % 16), type (floats) or value
(ints, bools, None), and the keyword arguments (constexprs and launch options such as num_warps and launch_pdl).
That is finer than what Triton specializes on (16-byte alignment, integer divisibility by 16 and == 1, dtypes,
constexprs, options), so one key always maps to the one kernel Triton would launch. The first call with a key goes
through Triton (compile or find, launch) and keeps the CompiledKernel it returns; later calls call its launcher
directly on the current stream, with each tensor passed as its data pointer (an int: the launcher's per-tensor
data_ptr() call and cuPointerGetAttribute query are skipped, 14.2 -> 11.9 us a launch on the H200 host,
results/host_overhead.json). Integer arguments in the key mean one entry per distinct shape, so the table is
dropped when it passes MAX_KEYS. Launch hooks (knobs.runtime.launch_enter_hook, e.g. proton) and Triton's check
that a kernel's globals did not change after compilation are skipped on the fast path; QMOE_FAST_LAUNCH=0 (read at
import) launches everything through Triton. Under the CPU interpreter (TRITON_INTERPRET=1) kernels are returned
unchanged.
"""

import os

import torch

__all__ = ["cdiv", "fast_launch", "next_power_of_2"]

ENABLED = os.environ.get("QMOE_FAST_LAUNCH", "1") != "0" and os.environ.get("TRITON_INTERPRET") != "1"


MAX_KEYS = 4096


# Host-side grid arithmetic for the launchers. triton.cdiv and triton.next_power_of_2 are ConstexprFunctions (callable
# in kernels too), ~2 us a call on the host (triton 3.9 here): the M = 1 MoE block made five a call, and its Python
# went 28.5 -> 15.1 us per call with these (this project's CPU machine, its kernels stubbed).
def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints, as triton.cdiv."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 >= n (0 for n <= 0), as triton.next_power_of_2."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def _key_and_pointers(args: tuple) -> tuple[tuple, list]:
    """-> (the launch key of args, args with each tensor replaced by its data pointer). The launcher takes a
    pointer argument as a Python int as it is; given a tensor it calls data_ptr() and asks the driver for the
    pointer's attributes (cuPointerGetAttribute), once per tensor per launch. The key keeps is_cuda, so a CPU
    tensor's key is new and goes through Triton, which refuses it."""
    key, run = [], list(args)
    for i, a in enumerate(args):
        c = a.__class__
        if c is float:  # Triton passes every float as fp32: the value is not part of the kernel
            key.append(float)
        elif c is int or a is None:
            key.append(a)
        elif c is bool:  # True == 1 as a dict key, but Triton types a bool i1 and specializes an int 1
            key.append((bool, a))
        elif isinstance(a, torch.Tensor):
            pointer = a.data_ptr()
            key.append((a.dtype, a.is_cuda, pointer & 15))
            run[i] = pointer
        else:
            key.append(a)
    return tuple(key), run


def _current_device_and_stream() -> tuple:
    """The active Triton driver's getters of the current device and of its current stream."""
    from triton.runtime.driver import driver

    current_device = driver.active.get_current_device
    if current_device is torch.cuda.current_device:  # its Python _lazy_init(), which the C getter does too
        current_device = torch._C._cuda_getDevice
    return current_device, driver.active.get_current_stream


class FastLaunch:
    """A @triton.jit kernel whose `[grid](...)` launches skip Triton's per-call work after the first per key."""

    enabled = True  # False: every launch through Triton (one process can time both: experiments/profile_model.py)

    def __init__(self, fn):
        self.fn = fn  # the JITFunction: everything else (arg_names, warmup, ...) is forwarded to it
        self.compiled = {}  # key -> (CompiledKernel, names of the parameters passed by keyword, in order)
        self._driver = None  # (get_current_device, get_current_stream), bound at the first launch

    def __getattr__(self, name):
        return getattr(self.fn, name)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid, args: tuple, kwargs: dict):
        """Launch on the current stream -> the CompiledKernel (as Triton's launch returns it)."""
        if self._driver is None:
            self._driver = _current_device_and_stream()
        if not FastLaunch.enabled or callable(grid):  # a grid function needs Triton's bound arguments
            return self.fn[grid](*args, **kwargs)
        current_device, current_stream = self._driver
        device = current_device()
        arg_key, run_args = _key_and_pointers(args)
        key = (device, arg_key, tuple(kwargs.items()))
        try:
            entry = self.compiled.get(key)
        except TypeError:  # an unhashable argument (a list constexpr): no key, through Triton
            return self.fn[grid](*args, **kwargs)
        if entry is None:  # through Triton: it compiles (or finds) the kernel and launches it
            kernel = self.fn[grid](*args, **kwargs)
            tail = self.fn.arg_names[len(args) :]
            if kernel is not None and all(name in kwargs for name in tail):  # else (defaults): always through Triton
                if len(self.compiled) >= MAX_KEYS:
                    self.compiled.clear()
                self.compiled[key] = kernel, tail
            return kernel
        kernel, tail = entry
        n = len(grid)
        kernel.run(
            grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, current_stream(device), kernel.function,
            kernel.packed_metadata, None, None, None, *run_args, *map(kwargs.__getitem__, tail),
        )  # fmt: skip
        return kernel


def fast_launch(fn):
    """Decorator for a launched @triton.jit kernel (place it above @triton.jit): see the module docstring."""
    return FastLaunch(fn) if ENABLED else fn
