"""PyTorch reference for attention: the model's `kernels.attention=torch` path and the kernels' oracle."""

import torch
import torch.nn.functional as F

from kernels.norm.naive import rms_norm


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def qk_norm_rope(
    q: torch.Tensor,  # [B, T, Hq, D]
    k: torch.Tensor,  # [B, T, Hkv, D]
    q_weight: torch.Tensor,  # [D]
    k_weight: torch.Tensor,  # [D]
    positions: torch.Tensor,  # [B, T] int64
    inv_freq: torch.Tensor,  # [R/2] fp32, R = rotary dim
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero-centred RMSNorm per head on q and k, then rotate-half RoPE on the first R dims of each head."""
    q, k = rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps)
    freqs = positions[..., None].float() * inv_freq  # [B, T, R/2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]  # [B, T, 1, R]
    cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
    rot = emb.shape[-1]

    def rope(x: torch.Tensor) -> torch.Tensor:
        x_rot, x_pass = x[..., :rot], x[..., rot:]
        return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)

    return rope(q), rope(k)


def attention(
    q: torch.Tensor,  # [B, T, Hq, D]
    k: torch.Tensor,  # [B, T, Hkv, D]
    v: torch.Tensor,  # [B, T, Hkv, D]
    k_cache: torch.Tensor,  # [B, Hkv, S, D], written in place at `positions`
    v_cache: torch.Tensor,  # [B, Hkv, S, D]
    positions: torch.Tensor,  # [B, T] int64, position of each query token
    scale: float,
) -> torch.Tensor:
    """Causal GQA attention of T new tokens over the cache (rows at their own positions) -> [B, T, Hq, D]."""
    batch = torch.arange(q.shape[0], device=q.device)[:, None]  # [B, 1]
    k_cache[batch, :, positions] = k.to(k_cache.dtype)
    v_cache[batch, :, positions] = v.to(v_cache.dtype)
    keys = torch.arange(k_cache.shape[2], device=q.device)
    visible = keys[None, None, :] <= positions[:, :, None]  # [B, T, S]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k_cache,
        v_cache,
        attn_mask=visible[:, None],
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(1, 2)


def gated_attention(
    q: torch.Tensor,  # [B, T, Hq, D] raw query (before its norm)
    gate: torch.Tensor,  # [B, T, Hq, D] output-gate logits
    k: torch.Tensor,  # [B, T, Hkv, D] raw key
    v: torch.Tensor,  # [B, T, Hkv, D]
    q_weight: torch.Tensor,  # [D]
    k_weight: torch.Tensor,  # [D]
    k_cache: torch.Tensor,  # [B, Hkv, S, D], written in place at `positions`
    v_cache: torch.Tensor,  # [B, Hkv, S, D]
    positions: torch.Tensor,  # [B, T] int64
    inv_freq: torch.Tensor,  # [R/2] fp32
    eps: float,
    scale: float,
) -> torch.Tensor:
    """The gated attention layer between its q|k|v projection and o_proj -> [B, T, Hq * D]: q/k norm + RoPE,
    causal GQA attention over the cache (new k/v written in place), times sigmoid(gate)."""
    B, T = q.shape[:2]
    q, k = qk_norm_rope(q, k, q_weight, k_weight, positions, inv_freq, eps)
    out = attention(q, k, v, k_cache, v_cache, positions, scale)
    return out.reshape(B, T, -1) * torch.sigmoid(gate.reshape(B, T, -1))
