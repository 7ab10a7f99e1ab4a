"""Which runtime x export x cuda_graph combinations can run, and why not: one line each.

Imports nothing heavy (no torch): the ablation sweeper checks every job with it before any model is built. The
one source of these messages: the runners raise split_error's too.
"""


def resolve_cuda_graph(value, runtime: str, planning: bool, has_cuda: bool) -> bool:
    """runtime.cuda_graph: true | false | auto (on for cuda_native on a GPU with planned buffers)."""
    if value == "auto":
        return runtime == "cuda_native" and has_cuda and planning
    if not isinstance(value, bool):
        raise ValueError(f"runtime.cuda_graph: must be true, false or auto (got {value!r})")
    return value


def device_error(runtime: str, has_cuda: bool) -> str | None:
    """None if `runtime` can run on this machine's device, else '<key>: <why>' (one line)."""
    if runtime == "cuda_native" and not has_cuda:
        return "runtime: cuda_native needs a CUDA device (use runtime=host or reference)"
    return None


def split_error(runtime: str, method_split: str) -> str | None:
    """None if `runtime` can drive the methods of `method_split`, else '<key>: <why>' (one line)."""
    if runtime == "host" and method_split == "fused":
        return (
            "runtime: host samples on the CPU and needs a forward method that returns logits "
            "(export.method_split=split or forward_only), not fused"
        )
    if runtime == "cuda_native" and method_split == "forward_only":
        return (
            "runtime: cuda_native samples on the device inside the program (export.method_split=split or fused); "
            "forward_only leaves sampling to the host (use runtime=host)"
        )
    return None


def combination_error(runtime: str, method_split: str, planning: bool, cuda_graph, has_cuda: bool) -> str | None:
    """None if the combination runs on this machine, else '<key>: <why>' (one line)."""
    if error := device_error(runtime, has_cuda) or split_error(runtime, method_split):
        return error
    if cuda_graph is True:
        if runtime == "reference":
            return "runtime.cuda_graph: the reference runner runs the eager model; graphs capture an exported program"
        if not has_cuda:
            return "runtime.cuda_graph: needs a CUDA device"
        if not planning:
            return (
                "runtime.cuda_graph: needs export.device_memory_planning=true (static planned buffers); "
                "without it the delegate allocates and copies its inputs on every call"
            )
    return None


def cfg_combination_error(cfg, has_cuda: bool) -> str | None:
    """combination_error for a composed config (a DictConfig)."""
    from omegaconf import OmegaConf

    device = OmegaConf.select(cfg, "model.device", default="auto")
    on_cuda = has_cuda and not str(device).startswith("cpu")
    return combination_error(
        OmegaConf.select(cfg, "runtime.name"),
        OmegaConf.select(cfg, "export.method_split", default="split"),
        bool(OmegaConf.select(cfg, "export.device_memory_planning", default=False)),
        OmegaConf.select(cfg, "runtime.cuda_graph", default=False),
        on_cuda,
    )
