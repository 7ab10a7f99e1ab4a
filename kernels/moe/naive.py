"""PyTorch reference for the MoE block: the model's `kernels.moe=torch` path and the kernels' oracle.

Shapes: M tokens, H hidden, E experts, I expert intermediate, K experts per token.
"""

import torch
import torch.nn.functional as F

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
) -> torch.Tensor:
    """sum_k topk_weights[:, k] * w2[e] @ (silu(gate) * up), e = topk_ids[:, k] -> [M, H] in x's dtype."""
    M, K = topk_ids.shape
    weights = topk_weights.to(x.dtype)
    if M * K <= GATHER_MAX_PAIRS:
        gate_up = torch.einsum("mh,mkoh->mko", x, w13[topk_ids])  # [M, K, 2I]
        gate, up = gate_up.chunk(2, dim=-1)
        down = torch.einsum("mki,mkhi->mkh", F.silu(gate) * up, w2[topk_ids])  # [M, K, H]
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
        gate, up = F.linear(x[tokens], w13[expert]).chunk(2, dim=-1)
        down = F.linear(F.silu(gate) * up, w2[expert])
        out.index_add_(0, tokens, down * weights.flatten()[pairs, None])
    return out


def shared_expert(x, gate_proj, up_proj, down_proj, shared_gate):
    """sigmoid(x @ shared_gate^T) * down(silu(gate(x)) * up(x)) -> [M, H]."""
    y = F.linear(F.silu(F.linear(x, gate_proj)) * F.linear(x, up_proj), down_proj)
    return torch.sigmoid(F.linear(x, shared_gate)) * y


def moe_block(
    x: torch.Tensor,  # [M, H]
    router: torch.Tensor,  # [E, H]
    w13: torch.Tensor,
    w2: torch.Tensor,
    shared_gate_proj: torch.Tensor,  # [Is, H]
    shared_up_proj: torch.Tensor,  # [Is, H]
    shared_down_proj: torch.Tensor,  # [H, Is]
    shared_gate: torch.Tensor,  # [1, H]
    top_k: int,
) -> torch.Tensor:
    """The whole sparse MoE block -> [M, H]."""
    topk_weights, topk_ids = route(F.linear(x, router), top_k)
    routed = fused_moe(x, w13, w2, topk_weights, topk_ids)
    return routed + shared_expert(x, shared_gate_proj, shared_up_proj, shared_down_proj, shared_gate)
