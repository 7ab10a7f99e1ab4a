"""Expert parallel MoE block: this rank's experts' share of every token's routed output, plus its shared-expert
slice. The block's all-reduce over the world adds the other ranks' shares. Torch reference ops (kernels/moe/naive)
inside a custom op, so it exports with a dynamic token count as the unsharded naive block does."""

import torch

from kernels.moe import naive


def ep_moe_block(x, proj, w13, w2, shared_down_proj, top_k: int, first: int) -> torch.Tensor:
    """x [M, H], proj [M, E + 2 Is + 1] (the full router, every rank routes), w13 [El, 2I, H] / w2 [El, H, I] the
    experts first .. first + El -> [M, H]: pairs routed to another rank's experts weigh 0 here."""
    E = proj.shape[-1] - 2 * shared_down_proj.shape[1] - 1
    router_logits, gate, up, gate_logit = naive.split_projection(proj, E, shared_down_proj.shape[1])
    weights, ids = naive.route(router_logits, top_k)  # [M, K] over all E experts
    local = ids - first
    mine = (local >= 0) & (local < w13.shape[0])
    weights, local = torch.where(mine, weights, 0), torch.where(mine, local, 0)
    return naive.fused_moe(x, w13, w2, weights, local) + naive.shared_expert(gate, up, shared_down_proj, gate_logit)


@torch.library.custom_op("qmoe::moe_block_ep", mutates_args=())
def moe_block_ep(
    x: torch.Tensor,
    proj: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    shared_down_proj: torch.Tensor,
    top_k: int,
    first: int,
) -> torch.Tensor:
    return ep_moe_block(x, proj, w13, w2, shared_down_proj, top_k, first)


@moe_block_ep.register_fake
def _(x, *args):
    return torch.empty_like(x)
