"""kernels/launch.py: a @fast_launch kernel launches through Triton once per specialization key, then through the
compiled kernel's launcher; every launch must compute what Triton's own launch computes. On the GPU only (the CPU
interpreter runs kernels unwrapped)."""

import os
from types import SimpleNamespace

import pytest
import torch
import triton
import triton.language as tl

from kernels import launch
from tests.helpers import captured, poisoned


@launch.fast_launch
@triton.jit
def _scaled_copy_kernel(x_ptr, out_ptr, n, scale, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) * scale, mask=mask)


def copy(x, scale=2.0, block=64, num_warps=4):
    out = poisoned(x.numel(), dtype=x.dtype, device=x.device)
    _scaled_copy_kernel[(triton.cdiv(x.numel(), block),)](x, out, x.numel(), scale, BLOCK=block, num_warps=num_warps)
    return out


def test_host_grid_arithmetic_is_tritons():
    """launch.cdiv and launch.next_power_of_2 (plain Python for the launchers: Triton's are ConstexprFunctions,
    ~2 us a host call) give Triton's results, zero, negatives, powers of two and 64-bit sizes included."""
    sizes = [*range(-4, 1100), 2**31 - 1, 2**31, 2**31 + 1, 2**40 + 7, 248320, 12352]
    for n in sizes:
        assert launch.next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 2, 3, 7, 16, 128, 1000):
            assert launch.cdiv(n, d) == triton.cdiv(n, d), (n, d)


def test_interpreter_runs_kernels_unwrapped():
    """Under TRITON_INTERPRET=1 (the CPU suite) or QMOE_FAST_LAUNCH=0 the decorator returns the kernel itself."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        assert not launch.ENABLED and not isinstance(_scaled_copy_kernel, launch.FastLaunch)
    else:
        assert isinstance(_scaled_copy_kernel, launch.FastLaunch) == launch.ENABLED


@pytest.mark.gpu
def test_each_specialization_gets_its_own_kernel():
    """Repeated calls reuse a key; a misaligned pointer, an n that is not a multiple of 16, another dtype, another
    constexpr and other launch options are new keys; every launch is right (outputs NaN-poisoned)."""
    if not launch.ENABLED:
        pytest.skip("QMOE_FAST_LAUNCH=0")
    _scaled_copy_kernel.compiled.clear()
    base = torch.randn(1000, device="cuda")
    cases = [
        (base[:512], {}),  # 16-byte aligned, n % 16 == 0
        (base[:512], {}),  # the same key: the fast path
        (base[1:513], {}),  # a pointer 4 bytes off: not 16-byte aligned
        (base[:500], {}),  # n not a multiple of 16
        (base[:512].half(), {}),  # another dtype
        (base[:512], {"block": 128}),  # another constexpr
        (base[:512], {"num_warps": 2}),  # another launch option
    ]
    for x, kw in cases:
        torch.testing.assert_close(copy(x, **kw), x * 2.0, rtol=0, atol=0)
    assert len(_scaled_copy_kernel.compiled) == len(cases) - 1
    for x, kw in cases:  # all from the cache now, scalar arguments changed
        torch.testing.assert_close(copy(x, scale=-3.0, **kw), x * -3.0, rtol=0, atol=0)
    assert len(_scaled_copy_kernel.compiled) == len(cases) - 1


@pytest.mark.gpu
def test_fast_launches_run_on_the_current_stream_and_capture():
    """A fast-path launch goes to the current stream: inside a CUDA graph capture it is captured, and a replay
    reads the inputs written in place since."""
    x = torch.randn(4096, device="cuda")
    copy(x)  # compiled and cached: the launches below take the fast path
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        out = copy(x)
    stream.synchronize()
    torch.testing.assert_close(out, x * 2.0, rtol=0, atol=0)
    graph, out = captured(lambda: copy(x))
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(out, x * 2.0, rtol=0, atol=0)


def bound(args, kwargs=None, device=0, fast=None):
    """(key, launcher arguments) of a call to a kernel of args and a BLOCK constexpr (or to `fast`), as the fast path
    binds them; no GPU needed."""
    fast = fast or launch.FastLaunch(SimpleNamespace(arg_names=[f"a{i}" for i in range(len(args))] + ["BLOCK"]))
    return fast._bind(device, args, {"BLOCK": 16} if kwargs is None else kwargs)


def test_key_separates_what_triton_specializes_on():
    """The fast path's key must be at least as fine as Triton's specialization: a 16-byte misaligned pointer, another
    dtype, another int (divisibility, == 1), a bool for an int, None for 0, another constexpr, another device are new
    keys; float values are not (Triton passes every float as fp32)."""
    base = torch.zeros(64)

    def key(*args, **kwargs):
        return bound(args, **kwargs)[0]

    assert key(base[:8]) == key(base[16:24])  # both 16-byte aligned (64 bytes apart)
    assert key(base[:8]) != key(base[1:9])  # 4 bytes off
    assert key(base[:8]) != key(base.half()[:8])  # dtype
    assert key(16) != key(17) and key(1) != key(2)
    assert key(1) != key(True) and key(None) != key(0) and key(1) != key(1.0)
    assert key(0.5) == key(2.0) and key(0.5) != key(0)
    assert key(base[:8], kwargs={"BLOCK": 32}) != key(base[:8]) != key(base[:8], device=1)
    aligned, off = base[:8], base[1:9]
    assert key(aligned, aligned) != key(off, off)  # a tensor passed twice keys on its first place


def test_launcher_gets_tensors_as_their_pointers():
    """The compiled launcher is handed each tensor as its data pointer (an int: no data_ptr() call and driver query
    per tensor per launch), every other argument as it is, then the keyword parameters in the kernel's order; a
    tensor's key names its device type, so a CPU tensor never reuses a GPU tensor's entry (its first launch goes
    through Triton, which refuses it)."""
    base = torch.zeros(64)
    view = base[3:11]
    args = (view, 7, 0.5, None, True, base)
    fast = launch.FastLaunch(SimpleNamespace(arg_names=["v", "i", "f", "n", "b", "t", "BLOCK", "OTHER"]))
    key, run = bound(args, {"OTHER": 2, "BLOCK": 16}, fast=fast)
    assert run == [view.data_ptr(), 7, 0.5, None, True, base.data_ptr(), 16, 2]
    assert all(type(p) is int for p in (run[0], run[5]))
    assert (torch.float32, False, view.data_ptr() & 15) == key[2:5]


def test_one_binder_per_pattern():
    """Calls whose argument classes, repeated tensors or keyword names differ get binders of their own, made once
    and reused as the patterns alternate (the linear kernel's fused norm passes a Parameter where the plain launch
    passes a tensor); a binder refuses a call of another pattern, one whose repeated tensor is two tensors too; a
    keyword parameter left to its default means no binder (such calls always go through Triton)."""
    weight = torch.nn.Parameter(torch.zeros(8), requires_grad=False)
    x = torch.zeros(8)
    fast = launch.FastLaunch(SimpleNamespace(arg_names=["x", "y", "BLOCK"]))
    keys = set()
    for _ in range(3):
        keys.add(bound((x, x), fast=fast)[0])
        keys.add(bound((x, weight), fast=fast)[0])
        keys.add(bound((x, 3), fast=fast)[0])
    assert len(fast.binders) == 3 and len(keys) == 3
    bind_tensor_tensor = fast.binders[-1]  # x passed twice: one key part, its pointer twice
    assert bind_tensor_tensor(0, (x, x), {"BLOCK": 16})[1] == [x.data_ptr(), x.data_ptr(), 16]
    assert bind_tensor_tensor(0, (x, torch.zeros(8)), {"BLOCK": 16}) is None  # two tensors now
    assert bind_tensor_tensor(0, (x, weight), {"BLOCK": 16}) is None  # another class
    with pytest.raises(KeyError):
        bind_tensor_tensor(0, (x, x), {"OTHER": 16})  # other keyword names
    assert bound((x, x), {}, fast=fast) is None  # BLOCK by its default: through Triton
    assert len(fast.binders) == 3


@pytest.mark.gpu
def test_fast_path_getters_are_the_current_device_and_stream():
    """The fast path's device getter (torch's C getter in place of torch.cuda.current_device) and stream getter
    name the device and stream that torch.cuda would, on every device and on a side stream."""
    current_device, current_stream = launch._current_device_and_stream()
    for index in range(torch.cuda.device_count()):
        with torch.cuda.device(index):
            assert current_device() == torch.cuda.current_device() == index
            with torch.cuda.stream(torch.cuda.Stream()):
                assert current_stream(index) == torch.cuda.current_stream(index).cuda_stream
