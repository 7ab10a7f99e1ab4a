"""PyTorch reference for Gated DeltaNet: the model's `kernels.gdn=torch` path and the kernels' oracle.

Shapes: B batch, T tokens, C = conv channels = 2*nk*dk + nv*dv laid out [q | k | v], K conv kernel,
nk/nv key/value heads (value head h reads q/k head h // (nv // nk)), dk/dv head dims.
"""

import torch
import torch.nn.functional as F

from kernels.norm.naive import gated_rms_norm

CHUNK = 64


def causal_conv1d(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv + SiLU over x [B, T, C] continuing from conv_state [B, C, K-1] (updated in place)."""
    seq = torch.cat((conv_state, x.transpose(1, 2).to(conv_state.dtype)), dim=-1)  # [B, C, K-1+T]
    conv_state.copy_(seq[:, :, -conv_state.shape[-1] :])
    out = F.conv1d(seq.to(weight.dtype), weight, groups=weight.shape[0])  # [B, C, T]
    return F.silu(out).transpose(1, 2).to(x.dtype)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def recurrent_gated_delta_rule(q, k, v, g, beta, state):
    """Token-by-token rule. q, k [B, T, H, dk] (normed, q scaled), v [B, T, H, dv], g, beta [B, T, H] fp32,
    state [B, H, dk, dv] fp32 (updated in place). Returns o [B, T, H, dv] fp32."""
    s = state.clone()
    out = []
    for t in range(q.shape[1]):
        s = s * g[:, t].exp()[..., None, None]
        kv = torch.einsum("bhkv,bhk->bhv", s, k[:, t])
        delta = (v[:, t] - kv) * beta[:, t, :, None]  # [B, H, dv]
        s = s + k[:, t, :, :, None] * delta[:, :, None, :]
        out.append(torch.einsum("bhkv,bhk->bhv", s, q[:, t]))
    state.copy_(s)
    return torch.stack(out, dim=1)


def chunk_gated_delta_rule(q, k, v, g, beta, state, chunk: int = CHUNK):
    """Chunked (WY/UT) form of the same rule, equal up to rounding; same arguments and result."""
    B, T, H, dk = q.shape
    dv = v.shape[-1]
    pad = (-T) % chunk
    # Padded tokens have k = beta = 0 and g = 0: they neither write to nor decay the state.
    q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)).transpose(1, 2) for x in (q, k, v))  # [B, H, Tp, d]
    g, beta = (F.pad(x, (0, 0, 0, pad)).transpose(1, 2) for x in (g, beta))  # [B, H, Tp]
    n = (T + pad) // chunk
    q, k, v = (x.reshape(B, H, n, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = (x.reshape(B, H, n, chunk) for x in (g, beta))

    gc = g.cumsum(-1)  # [B, H, n, C] log decay from chunk start
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (gc[..., :, None] - gc[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # [.., C, C]
    k_beta = k * beta[..., None]
    # (I + A) with A strictly lower: A[i, j] = beta_i k_i.k_j exp(gc_i - gc_j)
    a = (k_beta @ k.transpose(-1, -2) * decay).tril(-1)
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    u = torch.linalg.solve_triangular(eye + a, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(eye + a, k_beta * gc.exp()[..., None], upper=False, unitriangular=True)
    intra = q @ k.transpose(-1, -2) * decay  # [B, H, n, C, C]
    q_decayed = q * gc.exp()[..., None]
    k_to_end = k * (gc[..., -1:] - gc).exp()[..., None]
    chunk_decay = gc[..., -1].exp()  # [B, H, n]

    s = state.clone()
    out = torch.empty(B, H, n, chunk, dv, dtype=q.dtype, device=q.device)
    for i in range(n):
        v_new = u[:, :, i] - w[:, :, i] @ s  # [B, H, C, dv]
        out[:, :, i] = q_decayed[:, :, i] @ s + intra[:, :, i] @ v_new
        s = s * chunk_decay[:, :, i, None, None] + k_to_end[:, :, i].transpose(-1, -2) @ v_new
    state.copy_(s)
    return out.reshape(B, H, n * chunk, dv)[:, :, :T].transpose(1, 2)


def gated_delta_net(
    mixed_qkv: torch.Tensor,  # [B, T, C] output of in_proj_qkv
    z: torch.Tensor,  # [B, T, nv * dv] output of in_proj_z
    a: torch.Tensor,  # [B, T, nv] output of in_proj_a
    b: torch.Tensor,  # [B, T, nv] output of in_proj_b
    conv_weight: torch.Tensor,  # [C, 1, K]
    A_log: torch.Tensor,  # [nv]
    dt_bias: torch.Tensor,  # [nv]
    norm_weight: torch.Tensor,  # [dv]
    conv_state: torch.Tensor,  # [B, C, K-1], updated in place
    recurrent_state: torch.Tensor,  # [B, nv, dk, dv] fp32, updated in place
    num_k_heads: int,
    eps: float,
) -> torch.Tensor:
    """DeltaNet core between in_proj and out_proj -> [B, T, nv * dv]: conv + SiLU, gates, the delta rule
    (recurrent step for T == 1, chunked otherwise) and the gated RMSNorm."""
    B, T, _ = mixed_qkv.shape
    nv, dk, dv = recurrent_state.shape[1:]
    nk = num_k_heads
    qkv = causal_conv1d(mixed_qkv, conv_state, conv_weight)
    q, k, v = qkv.split([nk * dk, nk * dk, nv * dv], dim=-1)
    q = q.reshape(B, T, nk, dk).float()
    k = k.reshape(B, T, nk, dk).float()
    v = v.reshape(B, T, nv, dv).float()
    q = l2norm(q) * dk**-0.5
    k = l2norm(k)
    q, k = (x.repeat_interleave(nv // nk, dim=2) for x in (q, k))
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())  # [B, T, nv]
    beta = b.float().sigmoid()
    rule = recurrent_gated_delta_rule if T == 1 else chunk_gated_delta_rule
    o = rule(q, k, v, g, beta, recurrent_state).to(mixed_qkv.dtype)  # [B, T, nv, dv]
    return gated_rms_norm(o, z.reshape(B, T, nv, dv), norm_weight, eps).reshape(B, T, nv * dv)
