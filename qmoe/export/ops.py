"""Export-traceable stand-ins for the torch reference ops that torch.export cannot trace with a dynamic T.

`kernels/gdn/naive.gated_delta_net` loops over chunks in Python and branches on T == 1, and
`kernels/moe/naive.fused_moe` calls .tolist() above GATHER_MAX_PAIRS (token, expert) pairs. For export they
run inside `torch.library.custom_op`s (with fake shapes, and the caches declared as mutated), so the graph
holds one opaque, correct call where the reference is data- or shape-dependent. Triton implementations are
custom ops already and pass through untouched; only a group whose module is the naive one is swapped.
"""

import contextlib
from types import SimpleNamespace

import torch

import kernels
from kernels.gdn import naive as gdn_naive
from kernels.moe import naive as moe_naive


@torch.library.custom_op("qmoe_export::gated_delta_net", mutates_args=("conv_state", "recurrent_state"))
def gated_delta_net(
    mixed_qkv: torch.Tensor,
    z: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    conv_weight: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    conv_state: torch.Tensor,
    recurrent_state: torch.Tensor,
    num_k_heads: int,
    eps: float,
) -> torch.Tensor:
    return gdn_naive.gated_delta_net(
        mixed_qkv, z, a, b, conv_weight, A_log, dt_bias, norm_weight, conv_state, recurrent_state, num_k_heads, eps
    )


@gated_delta_net.register_fake
def _(mixed_qkv, z, *args):
    return torch.empty_like(z)  # [B, T, nv * dv]


@torch.library.custom_op("qmoe_export::moe_block", mutates_args=())
def moe_block(
    x: torch.Tensor,
    proj: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    shared_down_proj: torch.Tensor,
    top_k: int,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    shared_down_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    return moe_naive.moe_block(x, proj, w13, w2, shared_down_proj, top_k, w13_scale, w2_scale, shared_down_scale)


@moe_block.register_fake
def _(x, *args):
    return torch.empty_like(x)  # x's shape [..., H]


# group -> the naive functions replaced by their custom-op wrappers
TRACEABLE = {"gdn": {"gated_delta_net": gated_delta_net}, "moe": {"moe_block": moe_block}}


def traceable_module(group: str, module):
    """`module` with its untraceable naive functions swapped for custom ops (other modules unchanged)."""
    if group not in TRACEABLE or module is not kernels.resolve(group, "torch"):
        return module
    namespace = {name: getattr(module, name) for name in dir(module) if not name.startswith("__")}
    return SimpleNamespace(**{**namespace, **TRACEABLE[group], "__name__": f"{module.__name__}[export]"})


@contextlib.contextmanager
def traceable_ops(model):
    """Within the block, model.ops uses the export-traceable stand-ins; restored afterwards."""
    saved = dict(model.ops)
    model.ops.update({group: traceable_module(group, module) for group, module in saved.items()})
    try:
        yield model
    finally:
        model.ops.clear()
        model.ops.update(saved)
