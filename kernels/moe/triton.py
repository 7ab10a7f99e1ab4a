"""Triton MoE block: router (softmax + top-k), routed-expert SwiGLU FFN as a grouped GEMM, gated shared expert.

Shapes: M tokens, H hidden, E experts, I expert intermediate, K experts per token, P = M * K (token, expert) pairs.

`fused_moe` runs two grouped GEMMs and a deterministic combine:
  up:    h[p]       = silu(x[t] @ gate[e]^T) * (x[t] @ up[e]^T)      (silu * up fused in the epilogue)  [P, I]
  down:  partial[p] = topk_weight[p] * h[p] @ w2[e]^T                                                 [P, H]
  out[t]            = sum_k partial[t * K + k]    (fixed order, no atomics: bit-reproducible)           [M, H]
(The prefill align ranks pairs with atomics, but that order inside an expert's group changes no result.)
Every program owns one expert and a group of its pairs, so each selected expert's weight tile is read once per
group. Two ways to form the groups, both without host sync and with shapes that depend only on M, K, E:
  decode (M <= DECODE_MAX_M): one slot per pair; the slot that holds the first pair of expert e gathers every
    pair routed to e (an in-register compaction over the P ids) and the other slots of e exit. One launch each
    for up and down, no sort: the weights of every distinct selected expert are streamed exactly once.
  prefill: pairs are counted, padded to BLOCK_M per expert and scattered into expert-contiguous blocks on
    device (three tiny kernels); a grid sized for the worst case skips blocks past the padded total, and each
    block finds its expert from the E group ends (no per-block table to build serially).
Launch configs come from configs/<gpu>.json (experiments/tune_moe.py), keyed by (E, H, I, dtype, M bucket);
QMOE_MOE_DEFAULT_CONFIGS=1 or an unknown GPU uses DEFAULT_CONFIGS. Nothing autotunes at run time.
"""

import json
import os
import re
from pathlib import Path

import torch
import triton
import triton.language as tl

from kernels.moe.naive import shared_expert, split_projection

__all__ = ["route", "fused_moe", "shared_expert", "moe_block"]

DECODE_MAX_M = 64
M_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
CONFIG_DIR = Path(__file__).parent / "configs"
DEFAULT_CONFIGS = {
    "decode": {
        "BLOCK_M": 16,
        "up": {"BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3},
        "down": {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3},
    },
    "prefill": {
        "BLOCK_M": 64,
        "up": {"BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3},
        "down": {"BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3},
    },
}


# ----------------------------------------------------------------------------------------------- configs


def gpu_config_path(device_name: str) -> Path:
    return CONFIG_DIR / (re.sub(r"[^A-Za-z0-9]+", "_", device_name).strip("_") + ".json")


def shape_key(E: int, H: int, I: int, dtype: torch.dtype) -> str:
    return f"E{E}_H{H}_I{I}_{str(dtype).removeprefix('torch.')}"


def m_bucket(M: int) -> int:
    return next((b for b in M_BUCKETS if b >= M), M_BUCKETS[-1])


def load_table() -> dict:
    """The tuned table for this process's GPU: {shape_key: {str(M bucket): config}}; empty -> defaults."""
    if os.environ.get("QMOE_MOE_DEFAULT_CONFIGS") == "1" or not torch.cuda.is_available():
        return {}
    path = gpu_config_path(torch.cuda.get_device_name())
    return json.loads(path.read_text()) if path.exists() else {}


CONFIG_TABLE = load_table()


def get_config(M: int, E: int, H: int, I: int, dtype: torch.dtype) -> dict:
    tuned = CONFIG_TABLE.get(shape_key(E, H, I, dtype), {}).get(str(m_bucket(M)))
    return tuned or DEFAULT_CONFIGS["decode" if M <= DECODE_MAX_M else "prefill"]


# ----------------------------------------------------------------------------------------------- router


@triton.jit
def _route_kernel(
    logits_ptr, weights_ptr, ids_ptr, E, TOP_K: tl.constexpr, BLOCK_TOP: tl.constexpr, BLOCK_E: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    offs_e = tl.arange(0, BLOCK_E)
    logits = tl.load(logits_ptr + row * E + offs_e, mask=offs_e < E, other=-float("inf")).to(tl.float32)
    probs = tl.exp(logits - tl.max(logits, 0))
    probs = probs / tl.sum(probs, 0)
    offs_k = tl.arange(0, BLOCK_TOP)
    top_w = tl.zeros(offs_k.shape, tl.float32)
    top_ids = tl.zeros(offs_k.shape, tl.int64)
    for k in tl.static_range(TOP_K):  # top-k by repeated argmax; probabilities are >= 0, taken ones become -1
        idx = tl.argmax(probs, 0)
        top_w = tl.where(offs_k == k, tl.max(probs, 0), top_w)
        top_ids = tl.where(offs_k == k, idx.to(tl.int64), top_ids)
        probs = tl.where(offs_e == idx, -1.0, probs)
    top_w = top_w / tl.sum(top_w, 0)
    tl.store(weights_ptr + row * TOP_K + offs_k, top_w, mask=offs_k < TOP_K)
    tl.store(ids_ptr + row * TOP_K + offs_k, top_ids, mask=offs_k < TOP_K)


@torch.library.custom_op("qmoe::moe_route", mutates_args=())
def _route_op(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    logits = router_logits.contiguous()
    M, E = logits.shape
    weights = torch.empty(M, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(M, top_k, dtype=torch.int64, device=logits.device)
    if M:
        BLOCK_TOP, BLOCK_E = triton.next_power_of_2(top_k), triton.next_power_of_2(E)
        _route_kernel[(M,)](logits, weights, ids, E, TOP_K=top_k, BLOCK_TOP=BLOCK_TOP, BLOCK_E=BLOCK_E)
    return weights, ids


@_route_op.register_fake
def _(router_logits, top_k):
    M = router_logits.shape[0]
    return router_logits.new_empty(M, top_k, dtype=torch.float32), router_logits.new_empty(M, top_k, dtype=torch.int64)


def route(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts in fp32, top-k, renormalised to sum 1 -> (weights [M, K] fp32, ids [M, K] int64)."""
    return _route_op(router_logits, top_k)


# ----------------------------------------------------------------------------------------------- align (prefill)


@triton.jit
def _align_count_kernel(ids_ptr, counts_ptr, rank_ptr, P, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < P
    expert = tl.load(ids_ptr + offs, mask=mask, other=0)
    # Rank of the pair inside its expert's group; the order inside a group does not change any result.
    rank = tl.atomic_add(counts_ptr + expert, 1, mask=mask)
    tl.store(rank_ptr + offs, rank, mask=mask)


@triton.jit
def _align_offsets_kernel(counts_ptr, starts_ptr, ends_ptr, E, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    offs_e = tl.arange(0, BLOCK_E)
    counts = tl.load(counts_ptr + offs_e, mask=offs_e < E, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)  # [BLOCK_E]
    tl.store(starts_ptr + offs_e, ends - padded, mask=offs_e < E)
    tl.store(ends_ptr + offs_e, ends, mask=offs_e < E)


@triton.jit
def _align_scatter_kernel(ids_ptr, rank_ptr, starts_ptr, sorted_ptr, P, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < P
    expert = tl.load(ids_ptr + offs, mask=mask, other=0)
    dest = tl.load(starts_ptr + expert, mask=mask, other=0) + tl.load(rank_ptr + offs, mask=mask, other=0)
    tl.store(sorted_ptr + dest, offs, mask=mask)


def align_pairs(topk_ids: torch.Tensor, E: int, block_m: int):
    """Group the P pairs by expert into BLOCK_M-row blocks -> (sorted pair ids [num_blocks * BLOCK_M] int32, P in
    padding rows; ends [E] int32, the end of each expert's padded group). num_blocks is the worst case (every used
    expert wastes BLOCK_M - 1 rows); the GEMMs skip blocks at or past ends[E - 1]."""
    P = topk_ids.numel()
    ids = topk_ids.flatten()
    num_blocks = triton.cdiv(P + min(E, P) * (block_m - 1), block_m)
    counts = torch.zeros(E, dtype=torch.int32, device=ids.device)
    rank = torch.empty(P, dtype=torch.int32, device=ids.device)
    starts = torch.empty(E, dtype=torch.int32, device=ids.device)
    ends = torch.empty(E, dtype=torch.int32, device=ids.device)
    sorted_pairs = torch.full((num_blocks * block_m,), P, dtype=torch.int32, device=ids.device)
    BLOCK = 1024
    _align_count_kernel[(triton.cdiv(P, BLOCK),)](ids, counts, rank, P, BLOCK=BLOCK)
    _align_offsets_kernel[(1,)](counts, starts, ends, E, BLOCK_M=block_m, BLOCK_E=triton.next_power_of_2(E))
    _align_scatter_kernel[(triton.cdiv(P, BLOCK),)](ids, rank, starts, sorted_pairs, P, BLOCK=BLOCK)
    return sorted_pairs, ends


# ----------------------------------------------------------------------------------------------- grouped GEMMs


@triton.jit
def _dot(a, b, acc):
    if a.dtype == tl.float32:  # fp32 stays fp32 (no tf32), so the fp32 model matches the torch path
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _decode_slot(ids_ptr, slot, P, P_BLOCK: tl.constexpr):
    """The expert of pair `slot`, which of the P pairs share it, their ranks, their count, and whether
    `slot` is the first of them (the one program that does the expert's work)."""
    offs_p = tl.arange(0, P_BLOCK)
    all_ids = tl.load(ids_ptr + offs_p, mask=offs_p < P, other=-1)  # [P_BLOCK]
    expert = tl.load(ids_ptr + slot)
    match = all_ids == expert
    first = tl.min(tl.where(match, offs_p, P_BLOCK), 0)
    pos = tl.cumsum(match.to(tl.int32), 0) - 1
    return expert, match, pos, tl.sum(match.to(tl.int32), 0), first == slot


@triton.jit
def _sorted_block(ends_ptr, sorted_ptr, block, E, P, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """Block `block` of the aligned pairs -> (its expert, pair ids [BLOCK_M], row mask, whether it holds pairs).
    Its expert is the number of experts whose padded group ends at or before the block's first row."""
    offs_e = tl.arange(0, BLOCK_E)
    ends = tl.load(ends_ptr + offs_e, mask=offs_e < E, other=2**30)
    row0 = block * BLOCK_M
    expert = tl.sum((ends <= row0).to(tl.int32), 0)
    pairs = tl.load(sorted_ptr + row0 + tl.arange(0, BLOCK_M))
    return expert, pairs, pairs < P, row0 < tl.load(ends_ptr + E - 1)


@triton.jit
def _decode_rows(match, pos, r0, BLOCK_M: tl.constexpr, P_BLOCK: tl.constexpr):
    """Pairs r0 .. r0 + BLOCK_M of the matching ones, compacted into rows -> (pair ids [BLOCK_M], row mask)."""
    sel = match[None, :] & (pos[None, :] == (r0 + tl.arange(0, BLOCK_M))[:, None])  # [BLOCK_M, P_BLOCK]
    pairs = tl.sum(tl.where(sel, tl.arange(0, P_BLOCK)[None, :], 0), 1)
    return pairs, tl.sum(sel.to(tl.int32), 1) > 0


@triton.jit
def _up_tile(x_ptr, w_ptr, h_ptr, pairs, row_mask, offs_n, H, I, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """h[pairs, offs_n] = silu(x[t] @ gate^T) * (x[t] @ up^T) for one expert (w_ptr at its [2I, H] matrix)."""
    tokens = (pairs // TOP_K).to(tl.int64)
    n_mask = offs_n < I
    acc_gate = tl.zeros((pairs.shape[0], offs_n.shape[0]), tl.float32)
    acc_up = tl.zeros((pairs.shape[0], offs_n.shape[0]), tl.float32)
    for k0 in range(0, H, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < H
        a = tl.load(x_ptr + tokens[:, None] * H + offs_k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w_offs = offs_n[None, :] * H + offs_k[:, None]  # [BLOCK_K, BLOCK_N], gate rows; up rows are I further
        w_mask = k_mask[:, None] & n_mask[None, :]
        acc_gate = _dot(a, tl.load(w_ptr + w_offs, mask=w_mask, other=0.0), acc_gate)
        acc_up = _dot(a, tl.load(w_ptr + I * H + w_offs, mask=w_mask, other=0.0), acc_up)
    h = acc_gate * tl.sigmoid(acc_gate) * acc_up
    h_offs = pairs.to(tl.int64)[:, None] * I + offs_n[None, :]
    tl.store(h_ptr + h_offs, h.to(h_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


@triton.jit
def _down_tile(h_ptr, w_ptr, out_ptr, weights_ptr, pairs, row_mask, offs_n, H, I, BLOCK_K: tl.constexpr):
    """partial[pairs, offs_n] = topk_weight * h[pairs] @ w2^T for one expert (w_ptr at its [H, I] matrix)."""
    rows = pairs.to(tl.int64)
    n_mask = offs_n < H
    acc = tl.zeros((pairs.shape[0], offs_n.shape[0]), tl.float32)
    for k0 in range(0, I, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < I
        a = tl.load(h_ptr + rows[:, None] * I + offs_k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptr + offs_n[None, :] * I + offs_k[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = _dot(a, w, acc)
    scale = tl.load(weights_ptr + rows, mask=row_mask, other=0.0)
    out = (acc * scale[:, None]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows[:, None] * H + offs_n[None, :], out, mask=row_mask[:, None] & n_mask[None, :])


@triton.jit
def _moe_up_kernel(
    x_ptr, w13_ptr, h_ptr, ids_ptr, sorted_ptr, ends_ptr, P, E, H, I,
    TOP_K: tl.constexpr, DECODE: tl.constexpr, P_BLOCK: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # Axis 0 walks N tiles of one group, so neighbouring programs share the group's activations.
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.program_id(1)
    if DECODE:
        expert, match, pos, count, owner = _decode_slot(ids_ptr, slot, P, P_BLOCK)
        if owner:
            w_ptr = w13_ptr + expert.to(tl.int64) * (2 * I * H)
            for r0 in range(0, count, BLOCK_M):
                pairs, row_mask = _decode_rows(match, pos, r0, BLOCK_M, P_BLOCK)
                _up_tile(x_ptr, w_ptr, h_ptr, pairs, row_mask, offs_n, H, I, TOP_K, BLOCK_K)
    else:
        expert, pairs, row_mask, used = _sorted_block(ends_ptr, sorted_ptr, slot, E, P, BLOCK_M, BLOCK_E)
        if used:
            w_ptr = w13_ptr + expert.to(tl.int64) * (2 * I * H)
            _up_tile(x_ptr, w_ptr, h_ptr, pairs, row_mask, offs_n, H, I, TOP_K, BLOCK_K)


@triton.jit
def _moe_down_kernel(
    h_ptr, w2_ptr, out_ptr, weights_ptr, ids_ptr, sorted_ptr, ends_ptr, P, E, H, I,
    DECODE: tl.constexpr, P_BLOCK: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.program_id(1)
    if DECODE:
        expert, match, pos, count, owner = _decode_slot(ids_ptr, slot, P, P_BLOCK)
        if owner:
            w_ptr = w2_ptr + expert.to(tl.int64) * (H * I)
            for r0 in range(0, count, BLOCK_M):
                pairs, row_mask = _decode_rows(match, pos, r0, BLOCK_M, P_BLOCK)
                _down_tile(h_ptr, w_ptr, out_ptr, weights_ptr, pairs, row_mask, offs_n, H, I, BLOCK_K)
    else:
        expert, pairs, row_mask, used = _sorted_block(ends_ptr, sorted_ptr, slot, E, P, BLOCK_M, BLOCK_E)
        if used:
            w_ptr = w2_ptr + expert.to(tl.int64) * (H * I)
            _down_tile(h_ptr, w_ptr, out_ptr, weights_ptr, pairs, row_mask, offs_n, H, I, BLOCK_K)


def fused_moe_into(x, w13, w2, topk_weights, topk_ids, h, partials, decode=None, config=None) -> torch.Tensor:
    """fused_moe with caller-owned scratch: h [P, I] and partials [P, H] in x's dtype (tests pass NaN-filled ones,
    so a row the kernels forget reaches the output). decode/config override the choice by M (tests, tuner)."""
    M, H = x.shape
    E, I = w2.shape[0], w2.shape[2]
    K = topk_ids.shape[1]
    P = M * K
    decode = M <= DECODE_MAX_M if decode is None else decode
    config = config or get_config(M, E, H, I, x.dtype)
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    ids = topk_ids.contiguous()
    weights = topk_weights.float().contiguous()
    block_m, up, down = config["BLOCK_M"], config["up"], config["down"]
    if decode:
        sorted_pairs = ends = ids  # unused by the decode branch
        num_slots, p_block, block_e = P, max(16, triton.next_power_of_2(P)), 1
    else:
        sorted_pairs, ends = align_pairs(ids, E, block_m)
        num_slots, p_block, block_e = sorted_pairs.numel() // block_m, 1, triton.next_power_of_2(E)
    grid = (triton.cdiv(I, up["BLOCK_N"]), num_slots)
    _moe_up_kernel[grid](
        x, w13, h, ids, sorted_pairs, ends, P, E, H, I,
        TOP_K=K, DECODE=decode, P_BLOCK=p_block, BLOCK_E=block_e, BLOCK_M=block_m, **up,
    )  # fmt: skip
    grid = (triton.cdiv(H, down["BLOCK_N"]), num_slots)
    _moe_down_kernel[grid](
        h, w2, partials, weights, ids, sorted_pairs, ends, P, E, H, I,
        DECODE=decode, P_BLOCK=p_block, BLOCK_E=block_e, BLOCK_M=block_m, **down,
    )  # fmt: skip
    return partials.view(M, K, H).sum(1)


@torch.library.custom_op("qmoe::fused_moe", mutates_args=())
def fused_moe(
    x: torch.Tensor,  # [M, H]
    w13: torch.Tensor,  # [E, 2I, H], gate rows first
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [M, K]
    topk_ids: torch.Tensor,  # [M, K]
) -> torch.Tensor:
    """sum_k topk_weights[:, k] * w2[e] @ (silu(gate) * up), e = topk_ids[:, k] -> [M, H] in x's dtype."""
    M, K = topk_ids.shape
    if M == 0:
        return torch.empty_like(x)
    h = x.new_empty(M * K, w2.shape[2])
    partials = x.new_empty(M * K, x.shape[1])
    return fused_moe_into(x, w13, w2, topk_weights, topk_ids, h, partials)


@fused_moe.register_fake
def _(x, w13, w2, topk_weights, topk_ids):
    return torch.empty_like(x)


def moe_block(
    x: torch.Tensor,  # [M, H]
    proj: torch.Tensor,  # [M, E + 2 Is + 1]: router logits | shared gate | shared up | shared-expert gate logit
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    shared_down_proj: torch.Tensor,  # [H, Is]
    top_k: int,
) -> torch.Tensor:
    """The sparse MoE block after its fused input projection -> [M, H]: routing and the routed experts in Triton,
    the shared expert's down projection on cuBLAS."""
    router_logits, gate, up, gate_logit = split_projection(proj, w13.shape[0], shared_down_proj.shape[1])
    topk_weights, topk_ids = route(router_logits, top_k)
    routed = fused_moe(x, w13, w2, topk_weights, topk_ids)
    return routed + shared_expert(gate, up, shared_down_proj, gate_logit)
