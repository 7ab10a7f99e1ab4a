"""Eager launches of already-compiled Triton kernels without Triton's per-call work.

`kernel[grid](*args, **kwargs)` costs ~25 µs of host time per call on the H200 host (results/host_overhead.json),
about 2.5x what the compiled kernel's own launcher needs: beyond binding the arguments, Triton turns its options
into a string key, checks the kernel's globals and builds launch metadata on every call. A CUDA graph hides that; an
eager decode step with ~250 launches pays it (the reference runner with kernels=triton is host-bound).

`@fast_launch` on a `@triton.jit` kernel keeps `kernel[grid](...)` as the call syntax. A call's key is the current
device, each argument's dtype, device type and pointer alignment (tensors: data_ptr % 16), type (floats) or value
(ints, bools, None), and the keyword arguments (constexprs and launch options such as num_warps and launch_pdl).
That is finer than what Triton specializes on (16-byte alignment, integer divisibility by 16 and == 1, dtypes,
constexprs, options), so one key always maps to the one kernel Triton would launch. The first call with a key goes
through Triton (compile or find, launch) and keeps the CompiledKernel it returns; later calls call its launcher
directly on the current stream, with each tensor passed as its data pointer (an int: the launcher's per-tensor
data_ptr() call and cuPointerGetAttribute query are skipped, 14.2 -> 11.9 us a launch on the H200 host,
results/host_overhead.json). Key and pointers come from a binder generated once per pattern of argument classes,
repeated tensors and keyword names (_binder), so a call pays no per-argument type dispatch. Integer arguments in the
key mean one entry per distinct shape, so the table is dropped when it passes MAX_KEYS. Launch hooks
(knobs.runtime.launch_enter_hook, e.g. proton) and Triton's check that a kernel's globals did not change after
compilation are skipped on the fast path; QMOE_FAST_LAUNCH=0 (read at import) launches everything through Triton.
Under the CPU interpreter (TRITON_INTERPRET=1) kernels are returned unchanged.
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


def _arg_code(i: int, a) -> tuple[str, str, str]:
    """Argument i's (guard, key part, launcher argument) in a binder's source (see _binder). A tensor's key part
    is its dtype, device type (is_cuda) and pointer alignment (data_ptr % 16), and the launcher gets its pointer
    (an int: the launcher's own data_ptr() call and cuPointerGetAttribute query per tensor are skipped); a float's
    is its type (Triton passes every float as fp32); an int's, None's or any other object's its value; a bool's
    (bool, value): True == 1 as a dict key, but Triton types a bool i1 and specializes an int 1."""
    v = f"a{i}"
    if isinstance(a, torch.Tensor):  # the guard (exact class) keeps its methods: the key is a tensor's for sure
        return f"{v}.__class__ is C{i}", f"{v}.dtype, {v}.is_cuda, p{i} & 15", f"p{i}"
    if a.__class__ is float:
        return f"{v}.__class__ is float", "float", v
    if a.__class__ is bool:
        return f"{v}.__class__ is bool", f"(bool, {v})", v
    if a is None:
        return f"{v} is None", "None", v
    return f"{v}.__class__ is C{i}", v, v  # int (never a bool: the class is exact), or an object as itself


def _binder(pattern_id: int, args: tuple, names: tuple, tail: tuple):
    """A function (device, args, kwargs) -> (the launch key, the launcher's arguments in order) for calls whose
    arguments have the classes of `args`, the same tensor wherever `args` repeats one (_repeats), and whose keyword
    arguments are `names` (sorted); None when an argument's class or a repeat differs (a ValueError or KeyError
    when their number or the names do). Generated source: one line per argument, no loop and no type dispatch per
    call; a repeated tensor costs an identity check, not a key part (the linear kernel's 20 arguments, x four times
    in unused slots: 2.7 -> 1.1 us on this project's CPU machine). The key starts with pattern_id: two patterns
    never share a key."""
    env = {f"C{i}": a.__class__ for i, a in enumerate(args)}
    code, pointers = [], ""
    for i, (a, j) in enumerate(zip(args, _repeats(args))):
        if j < i:  # the tensor of argument j again
            code.append((f"a{i} is a{j}", None, f"p{j}"))
            continue
        code.append(_arg_code(i, a))
        pointers += f"    p{i} = a{i}.data_ptr()\n" if isinstance(a, torch.Tensor) else ""
    unpack = "".join(f"a{i}, " for i in range(len(args))) or "[] "  # a ValueError for another number of args
    guards = " and ".join(guard for guard, _, _ in code) or "True"
    parts = (part for _, part, _ in code if part is not None)
    key = ", ".join([str(pattern_id), "device", *parts, *(f"kw[{n!r}]" for n in names)])
    run = ", ".join([*(arg for _, _, arg in code), *(f"kw[{n!r}]" for n in tail)])
    source = (
        f"def bind(device, args, kw):\n    {unpack}= args\n    if len(kw) != {len(names)} or not ({guards}):\n"
        f"        return None\n{pointers}    return ({key},), [{run}]\n"
    )
    exec(compile(source, f"<fast_launch binder {pattern_id}>", "exec"), env)
    return env["bind"]


def _repeats(args: tuple) -> tuple:
    """For each argument, the index of the first argument that is the same tensor (its own index otherwise): part
    of a binder's pattern (a launcher's unused pointer slots often repeat one tensor)."""
    first = {}
    return tuple(first.setdefault(id(a), i) if isinstance(a, torch.Tensor) else i for i, a in enumerate(args))


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
        self.compiled = {}  # key -> CompiledKernel
        self.binders = []  # one per pattern of argument classes and keyword names seen, newest first
        self.patterns = {}  # (classes, names) -> its binder, or None where the pattern always goes through Triton
        self._driver = None  # (get_current_device, get_current_stream), bound at the first launch

    def __getattr__(self, name):
        return getattr(self.fn, name)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def _bind(self, device, args: tuple, kwargs: dict):
        """-> (key, launcher arguments) by the first binder whose pattern the call has, else by a new pattern's
        binder; None where the call must go through Triton (a keyword parameter left to its default)."""
        for bind in self.binders:
            try:
                bound = bind(device, args, kwargs)
            except (ValueError, KeyError):  # another number of arguments, other keyword names
                continue
            if bound is not None:
                return bound
        names = tuple(sorted(kwargs))
        pattern = tuple(a.__class__ for a in args), names, _repeats(args)
        if pattern not in self.patterns:
            tail = tuple(self.fn.arg_names[len(args) :])  # the kernel's parameters passed by keyword, in order
            bindable = all(name in kwargs for name in tail)  # else (defaults): always through Triton
            self.patterns[pattern] = bind = _binder(len(self.patterns), args, names, tail) if bindable else None
            if bind is not None:
                self.binders.insert(0, bind)
        bind = self.patterns[pattern]
        return None if bind is None else bind(device, args, kwargs)

    def launch(self, grid, args: tuple, kwargs: dict):
        """Launch on the current stream -> the CompiledKernel (as Triton's launch returns it)."""
        if self._driver is None:
            self._driver = _current_device_and_stream()
        if not FastLaunch.enabled or callable(grid):  # a grid function needs Triton's bound arguments
            return self.fn[grid](*args, **kwargs)
        current_device, current_stream = self._driver
        device = current_device()
        bound = self._bind(device, args, kwargs)
        if bound is None:
            return self.fn[grid](*args, **kwargs)
        key, run_args = bound
        try:
            kernel = self.compiled.get(key)
        except TypeError:  # an unhashable argument (a list constexpr): no key, through Triton
            return self.fn[grid](*args, **kwargs)
        if kernel is None:  # through Triton: it compiles (or finds) the kernel and launches it
            kernel = self.fn[grid](*args, **kwargs)
            if kernel is not None:
                if len(self.compiled) >= MAX_KEYS:
                    self.compiled.clear()
                self.compiled[key] = kernel
            return kernel
        n = len(grid)
        kernel.run(
            grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, current_stream(device), kernel.function,
            kernel.packed_metadata, None, None, None, *run_args,
        )  # fmt: skip
        return kernel


def fast_launch(fn):
    """Decorator for a launched @triton.jit kernel (place it above @triton.jit): see the module docstring."""
    return FastLaunch(fn) if ENABLED else fn
