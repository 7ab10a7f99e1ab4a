"""PyTorch reference for the MoE block: the model's `kernels.moe=torch` path and the kernels' oracle.

Shapes: M tokens, H hidden, E experts, I expert intermediate, K experts per token.
"""

import torch
import torch.nn.functional as F

from kernels.fp8 import dequantize

# Up to this many (token, expert) pairs the experts run as one gather + batched matmul: no host sync and
# static shapes, so decode steps can be captured; above it, one matmul per expert that has tokens.
GATHER_MAX_PAIRS = 256


def route(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts in fp32, top-k, renormalised to sum 1 -> (weights [M, K] fp32, ids [M, K] int64)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    return weights / weights.sum(-1, keepdim=True), ids


def fused_moe(
    x: torch.Tensor,  # [M, H]
    w13: torch.Tensor,  # [E, 2I, H], gate rows first
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [M, K]
    topk_ids: torch.Tensor,  # [M, K]
    w13_scale: torch.Tensor | None = None,  # [E, 2I, ceil(H / 128)] when w13 is fp8 (kernels/fp8.py)
    w2_scale: torch.Tensor | None = None,  # [E, H, ceil(I / 128)] when w2 is fp8
) -> torch.Tensor:
    """sum_k topk_weights[:, k] * w2[e] @ (silu(gate) * up), e = topk_ids[:, k] -> [M, H] in x's dtype.
    fp8 experts are dequantized to x's dtype, only those used."""
    M, K = topk_ids.shape
    weights = topk_weights.to(x.dtype)

    def expert_weights(w, scale, ids):  # w[ids] in x's dtype
        return w[ids] if scale is None else dequantize(w[ids], scale[ids], x.dtype)

    if M * K <= GATHER_MAX_PAIRS:
        gate_up = torch.einsum("mh,mkoh->mko", x, expert_weights(w13, w13_scale, topk_ids))  # [M, K, 2I]
        gate, up = gate_up.chunk(2, dim=-1)
        down = torch.einsum("mki,mkhi->mkh", F.silu(gate) * up, expert_weights(w2, w2_scale, topk_ids))  # [M, K, H]
        return (down * weights[..., None]).sum(1)
    out = torch.zeros_like(x)
    flat_ids = topk_ids.flatten()
    order = flat_ids.argsort(stable=True)
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start : start + count]
        start += count
        tokens = pairs // K
        gate, up = F.linear(x[tokens], expert_weights(w13, w13_scale, expert)).chunk(2, dim=-1)
        down = F.linear(F.silu(gate) * up, expert_weights(w2, w2_scale, expert))
        out.index_add_(0, tokens, down * weights.flatten()[pairs, None])
    return out


def router_experts(proj: torch.Tensor, shared_intermediate: int) -> int:
    """The router's expert count E in the fused projection [M, E + 2 Is + 1] (under expert parallel: every rank's
    experts, more than this rank holds)."""
    return proj.shape[-1] - 2 * shared_intermediate - 1


def split_projection(proj: torch.Tensor, num_experts: int, shared_intermediate: int):
    """The fused input projection [M, E + 2 Is + 1] -> (router logits [M, E], shared gate [M, Is], shared up
    [M, Is], shared-expert gate logit [M, 1]): the row order of the model's SparseMoE.in_proj."""
    return proj.split([num_experts, shared_intermediate, shared_intermediate, 1], dim=-1)


def shared_expert(gate, up, down_proj, gate_logit, down_scale=None):
    """sigmoid(gate_logit) * down(silu(gate) * up) -> [M, H] (down_proj fp8 when down_scale is given)."""
    down = down_proj if down_scale is None else dequantize(down_proj, down_scale, gate.dtype)
    return torch.sigmoid(gate_logit) * F.linear(F.silu(gate) * up, down)


def rows_of(x: torch.Tensor, proj: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The block's x [..., H] and proj [..., N] (the model passes its [B, T, ...] activations) as [M, H], [M, N]."""
    return x.reshape(-1, x.shape[-1]), proj.reshape(-1, proj.shape[-1])


def moe_block(
    x: torch.Tensor,  # [..., H]: M rows
    proj: torch.Tensor,  # [..., E + 2 Is + 1]: router logits | shared gate | shared up | shared-expert gate logit
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    shared_down_proj: torch.Tensor,  # [H, Is]
    top_k: int,
    w13_scale: torch.Tensor | None = None,  # the scales of fp8 weights (kernels/fp8.py); None: that weight is not
    w2_scale: torch.Tensor | None = None,
    shared_down_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The sparse MoE block after its fused input projection -> x's shape."""
    rows, proj = rows_of(x, proj)
    router_logits, gate, up, gate_logit = split_projection(proj, w13.shape[0], shared_down_proj.shape[1])
    topk_weights, topk_ids = route(router_logits, top_k)
    routed = fused_moe(rows, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
    return (routed + shared_expert(gate, up, shared_down_proj, gate_logit, shared_down_scale)).view(x.shape)


def ep_moe_block(
    x, proj, w13, w2, shared_down_proj, top_k: int, first: int, w13_scale=None, w2_scale=None, shared_down_scale=None
) -> torch.Tensor:  # fmt: skip
    """Expert parallel: x [..., H], proj [..., E + 2 Is + 1] (the whole router, every rank routes; this rank's
    shared slices), w13 [El, 2I, H] / w2 [El, H, I] the experts first .. first + El - 1 -> x's shape, this rank's
    share: pairs routed to another rank's experts weigh 0 here (the block's all-reduce adds the other shares). The
    scales: those of fp8 weights, as moe_block's."""
    shape = x.shape
    x, proj = rows_of(x, proj)
    E = router_experts(proj, shared_down_proj.shape[1])
    router_logits, gate, up, gate_logit = split_projection(proj, E, shared_down_proj.shape[1])
    weights, ids = route(router_logits, top_k)  # [M, K] over all E experts
    local = ids - first
    mine = (local >= 0) & (local < w13.shape[0])
    weights, local = torch.where(mine, weights, 0), torch.where(mine, local, 0)
    routed = fused_moe(x, w13, w2, weights, local, w13_scale, w2_scale)
    return (routed + shared_expert(gate, up, shared_down_proj, gate_logit, shared_down_scale)).view(shape)


# a custom op, so the block exports with a dynamic token count as the unsharded one does
@torch.library.custom_op("qmoe::moe_block_ep", mutates_args=())
def moe_block_ep(
    x: torch.Tensor,
    proj: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    shared_down_proj: torch.Tensor,
    top_k: int,
    first: int,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    shared_down_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    return ep_moe_block(x, proj, w13, w2, shared_down_proj, top_k, first, w13_scale, w2_scale, shared_down_scale)


@moe_block_ep.register_fake
def _(x, *args):
    return torch.empty_like(x)
