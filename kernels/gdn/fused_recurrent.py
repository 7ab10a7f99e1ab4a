"""The whole DeltaNet decode step (T == 1) in one kernel: conv state update + SiLU, q/k L2 norm, gates,
fp32 delta-rule state update (state read once, written once), output and gated RMSNorm * silu(z).

Programs (batch row, value head, value split): each owns a [dk, dv / SV] column block of the head's fp32 state
(the delta rule updates the state's value columns independently). Splits are added only for grids of fewer than
MIN_DECODE_PROGRAMS programs (a batch-1 step of the 35B-A3B runs its 32 value heads unsplit: measured faster in
the step than 4 splits over the SMs, see value_splits). The gated RMSNorm needs the whole
value-head row: with SV > 1 each program stores its slice of o (rounded to the activation dtype, as the reference
rounds it) into `out` and its sum of squares into a scratch, then arrives on the (row, value head) counter; the
last of the SV to arrive adds the SV sums in split order, normalises the row in place, gates it with silu(z) and
resets the counter (`norm_arrivals`).

The conv state is updated in place with no grid-wide barrier. A value head's v channels have one reader
and writer: its own program. The q/k channels of key head hk are read by its G = nv / nk value-head
programs (G * SV with value splits), so they are written only by the LAST of them to have read: each program
reads all its old conv slots, syncs its threads (every read done), then counts itself in with an acq_rel atomic
on the (row, key head) counter; the program that gets G * SV - 1 has acquired every other reader's release, so all
reads of those channels happen before its write. It resets the counter to 0 for the next call (calls
are stream ordered, as in a CUDA graph). No program waits on another, so any launch order is safe."""

import functools

import torch
import triton
import triton.language as tl

from kernels.counters import ArrivalCounters, Workspaces
from kernels.gdn.gates import gates
from kernels.launch import fast_launch, next_power_of_2
from kernels.pdl import allow_dependents, pdl, wait_for_producers


@triton.jit
def _conv_load(conv_ptr, w_ptr, ch, mask, KW: tl.constexpr, KP: tl.constexpr):
    """The conv inputs of channels ch [N] but the new token: their state slots [N, KP] (KP = next power of two
    >= KW-1: the slots as one tile), the same shifted left by one slot, the weights [N, KP] and [N]."""
    j = tl.arange(0, KP)
    slots = conv_ptr + ch[:, None] * (KW - 1) + j[None, :]  # [N, KP]
    old = tl.load(slots, mask=mask[:, None] & (j < KW - 1)[None, :], other=0.0)
    shifted = tl.load(slots + 1, mask=mask[:, None] & (j < KW - 2)[None, :], other=0.0)  # old slot j + 1
    w_old = tl.load(w_ptr + ch[:, None] * KW + j[None, :], mask=mask[:, None] & (j < KW - 1)[None, :], other=0.0)
    w_new = tl.load(w_ptr + ch * KW + KW - 1, mask=mask, other=0.0)
    return old, shifted, w_old, w_new


@triton.jit
def _conv_silu(old, x, w_old, w_new, OUT_DTYPE: tl.constexpr):
    """SiLU(conv) of the new token [N] from _conv_load's tiles."""
    acc = tl.sum(old.to(tl.float32) * w_old.to(tl.float32), axis=1) + x.to(tl.float32) * w_new.to(tl.float32)
    return (acc * tl.sigmoid(acc)).to(OUT_DTYPE).to(tl.float32)  # the reference rounds to the activation dtype


@triton.jit
def _conv_write(conv_ptr, ch, mask, shifted, x, KW: tl.constexpr, KP: tl.constexpr):
    """The new conv state of channels ch: the old slots shifted left, the new token last."""
    j = tl.arange(0, KP)
    new = tl.where((j == KW - 2)[None, :], x[:, None], shifted)
    tl.store(conv_ptr + ch[:, None] * (KW - 1) + j[None, :], new, mask=mask[:, None] & (j < KW - 1)[None, :])


@triton.jit
def _l2norm(x):
    return x * tl.rsqrt(tl.sum(x * x, axis=0) + 1e-6)


@fast_launch
@triton.jit
def _decode_kernel(
    x_ptr,  # [B, C] mixed q|k|v of the new token, rows stride_x apart (slices of the fused in_proj output)
    z_ptr,  # [B, NV*DV], rows stride_z apart
    a_ptr,  # [B, NV], rows stride_a apart
    b_ptr,  # [B, NV], rows stride_b apart
    conv_w_ptr,  # [C, KW]
    A_log_ptr,  # [NV]
    dt_bias_ptr,  # [NV]
    norm_w_ptr,  # [DV]
    conv_ptr,  # [B, C, KW-1], updated in place
    state_ptr,  # [B, NV, DK, DV] fp32, updated in place
    readers_ptr,  # [B*NK] int32 zeros: programs that have read a key head's q/k conv state; left at 0
    norm_arrivals_ptr,  # [B*NV] int32 zeros: value splits of a head done with their slice of o; left at 0
    sumsq_ptr,  # [B*NV*SV] fp32 scratch: each value split's sum of o^2
    out_ptr,  # [B, NV*DV]
    C,
    stride_x,
    stride_z,
    stride_a,
    stride_b,
    eps,
    scale,
    NK: tl.constexpr,
    G: tl.constexpr,  # value heads per key head
    DK: tl.constexpr,
    DV: tl.constexpr,
    KW: tl.constexpr,
    KP: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,  # the value columns of one program: next_power_of_2(DV) // SV
    SV: tl.constexpr,  # value splits per head
    PDL: tl.constexpr,
):
    allow_dependents(PDL)
    b, h, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    hk = h // G
    NV = NK * G
    dtype = out_ptr.dtype.element_ty
    x_row, conv_row = x_ptr + b * stride_x, conv_ptr + b * C * (KW - 1)
    ik, iv = tl.arange(0, BK), split * BV + tl.arange(0, BV)
    mk, mv = ik < DK, iv < DV
    q_ch, k_ch, v_ch = hk * DK + ik, (NK + hk) * DK + ik, 2 * NK * DK + h * DV + iv

    s_ptrs = state_ptr + ((b * NV + h) * DK + ik[:, None]) * DV + iv[None, :]
    # No load waits on math. Before the PDL wait: the q/k conv slots, the reader arrival (its acquire holds the
    # loads after it back one round trip, all of it before the wait), then the state tile, the long wait, between
    # the q/k and v conv loads (first, Triton 3.9 moved it to the conv tiles' layout: 32 KiB of shared memory;
    # after the v conv math, a layout conversion's barrier waited on the conv loads before it was issued: sm_90
    # TTGIR/PTX), and the weights. The states were written by this kernel in the previous decode step, which a
    # non-PDL launch -- the next forward's prologue (kernels/embedding) -- separates from this one. After the wait:
    # the new token's q|k|v, z, a, b from the input projection.
    q_old, q_shifted, q_w, q_w_new = _conv_load(conv_row, conv_w_ptr, q_ch, mk, KW, KP)  # [BK, KP]..
    k_old, k_shifted, k_w, k_w_new = _conv_load(conv_row, conv_w_ptr, k_ch, mk, KW, KP)
    # This program is done reading the key head's q/k conv slots: it counts itself in before the wait too, so
    # the counter's round trip (an acq_rel atomic, whose acquire holds back every later memory access) and the
    # broadcast of its result overlap the input projection instead of following it (they sat between the
    # wait's loads and the math).
    tl.debug_barrier()  # every thread's q/k conv reads (lanes may be replicated) before the release
    readers = readers_ptr + b * NK + hk
    earlier = tl.atomic_add(readers, 1, sem="acq_rel", scope="gpu")  # programs of this key head done reading
    s = tl.load(s_ptrs, mask=mk[:, None] & mv[None, :], other=0.0)  # [BK, BV]
    v_old, v_shifted, v_w, v_w_new = _conv_load(conv_row, conv_w_ptr, v_ch, mv, KW, KP)  # [BV, KP]..
    norm_w = tl.load(norm_w_ptr + iv, mask=mv, other=0.0)
    wait_for_producers(PDL)
    conv_dtype = conv_ptr.dtype.element_ty
    q_x = tl.load(x_row + q_ch, mask=mk, other=0.0).to(conv_dtype)  # [BK]
    k_x = tl.load(x_row + k_ch, mask=mk, other=0.0).to(conv_dtype)
    v_x = tl.load(x_row + v_ch, mask=mv, other=0.0).to(conv_dtype)  # [BV]
    z = tl.load(z_ptr + b * stride_z + h * DV + iv, mask=mv, other=0.0).to(tl.float32)  # [BV]
    g, beta = gates(a_ptr + b * stride_a + h, b_ptr + b * stride_b + h, A_log_ptr, dt_bias_ptr, h, h < NV)
    tl.debug_barrier()  # every thread's v conv reads before its write
    _conv_write(conv_row, v_ch, mv, v_shifted, v_x, KW, KP)  # v channels: this program is their only reader

    q = _l2norm(_conv_silu(q_old, q_x, q_w, q_w_new, dtype)) * scale  # [BK]
    k = _l2norm(_conv_silu(k_old, k_x, k_w, k_w_new, dtype))
    v = _conv_silu(v_old, v_x, v_w, v_w_new, dtype)  # [BV]
    s *= tl.exp(g)
    delta = (v - tl.sum(s * k[:, None], axis=0)) * beta  # [BV]
    s += k[:, None] * delta[None, :]
    o = tl.sum(s * q[:, None], axis=0)  # [BV]
    tl.store(s_ptrs, s, mask=mk[:, None] & mv[None, :])

    # gated RMSNorm over the value-head row, with the reference's roundings to the activation dtype
    o = o.to(dtype).to(tl.float32)
    out_row = out_ptr + b * NV * DV + h * DV
    if SV == 1:
        y = (o * tl.rsqrt(tl.sum(o * o, axis=0) / DV + eps)).to(dtype)
        out = (norm_w * y).to(tl.float32) * z * tl.sigmoid(z)
        tl.store(out_row + iv, out.to(dtype), mask=mv)
    else:
        head = b * NV + h
        tl.store(out_row + iv, o.to(dtype), mask=mv)  # exact: o is already rounded to dtype
        tl.store(sumsq_ptr + head * SV + split, tl.sum(o * o, axis=0))
        tl.debug_barrier()  # every thread's stores before the release (made by one thread)
        done = tl.atomic_add(norm_arrivals_ptr + head, 1, sem="acq_rel", scope="gpu")
        tl.debug_barrier()
        if done == SV - 1:  # the last split of the head: every slice and sum is visible
            sumsq = tl.sum(tl.load(sumsq_ptr + head * SV + tl.arange(0, SV), cache_modifier=".cg"), axis=0)
            row = tl.arange(0, BV * SV)
            row_ok = row < DV
            o_row = tl.load(out_row + row, mask=row_ok, other=0.0, cache_modifier=".cg").to(tl.float32)
            y = (o_row * tl.rsqrt(sumsq / DV + eps)).to(dtype)
            z_row = tl.load(z_ptr + b * stride_z + h * DV + row, mask=row_ok, other=0.0).to(tl.float32)
            w_row = tl.load(norm_w_ptr + row, mask=row_ok, other=0.0)
            out = (w_row * y).to(tl.float32) * z_row * tl.sigmoid(z_row)
            tl.store(out_row + row, out.to(dtype), mask=row_ok)
            tl.store(norm_arrivals_ptr + head, 0)

    # the last reader of the key head's q/k channels writes their new state and resets the counter
    tl.debug_barrier()  # every thread's writes after the acquire (made by one thread)
    if earlier == G * SV - 1:
        _conv_write(conv_row, q_ch, mk, q_shifted, q_x, KW, KP)
        _conv_write(conv_row, k_ch, mk, k_shifted, k_x, KW, KP)
        tl.store(readers, 0)


# "splits" over value_splits() and "num_warps" (experiments/tune_decode_loop.py tries them in the decode step)
DECODE_OPTIONS: dict = {}
# one per (row, key head): the last reader of a key head's q/k channels writes them (invariants: ArrivalCounters)
reader_counters = ArrivalCounters()
# one per (row, value head): the last value split to arrive normalises the head's row
norm_arrivals = ArrivalCounters()
# each split's partial sum of squares for its head's gated norm, written before it is read (invariants: Workspaces)
decode_workspace = Workspaces()


# Value splits are added only below this many programs. Measured in the 35B decode step (H200, the in-loop descent
# of experiments/tune_decode_loop.py, results/tune_decode_loop.json at 09dba6c): 32 heads x 1 split on 4 warps
# 2.097 ms against 2.107 for 4 splits (the old rule: splits until the grid covered the 132 SMs) and 2.111 for 2:
# a split head pays an arrival counter and a second pass for its gated norm, more than the state it shares out.
MIN_DECODE_PROGRAMS = 32
# warps per program: 8 only for state tiles larger than a 128 x 128 head (35B: 4 warps 2.097 ms, 8 warps 2.139)
MAX_TILE_4_WARPS = 128 * 128


@functools.cache
def value_splits(B: int, nv: int, dv: int) -> int:
    """Value splits per head: doubled while the grid has fewer than MIN_DECODE_PROGRAMS programs and each split
    keeps >= 32 columns (a split's state tile stays a few KiB of 16-byte loads)."""
    splits = 1
    while B * nv * splits < MIN_DECODE_PROGRAMS and next_power_of_2(dv) // (2 * splits) >= 32:
        splits *= 2
    return splits


def _rows(t: torch.Tensor) -> int:
    """Row stride of a [B, 1, N] activation (a slice of the fused projection's output); its last dim unit-stride."""
    assert t.stride(-1) == 1, "the feature dim must be contiguous"
    return t.stride(0)


def gated_delta_net_decode(
    mixed_qkv,
    z,
    a,
    b,
    conv_weight,
    A_log,
    dt_bias,
    norm_weight,
    conv_state,
    recurrent_state,
    num_k_heads,
    eps,
    splits=None,
) -> torch.Tensor:
    """naive.gated_delta_net for T == 1 as one kernel launch; same arguments, same in-place state updates.
    mixed_qkv, z, a and b may be row-strided views (the fused in_proj's slices): read in place, never copied.
    splits: value splits per head (a power of two; value_splits() when None; tests pin it)."""
    B, T, C = mixed_qkv.shape
    assert T == 1
    nv, dk, dv = recurrent_state.shape[1:]
    nk = num_k_heads
    assert conv_weight.is_contiguous() and conv_state.is_contiguous() and recurrent_state.is_contiguous()
    out = mixed_qkv.new_empty(B, T, nv * dv)  # sizes as ints, dtype and device from the tensor: the cheapest call
    device = mixed_qkv.device
    splits = splits or DECODE_OPTIONS.get("splits") or value_splits(B, nv, dv)
    BK, BV = next_power_of_2(dk), next_power_of_2(dv) // splits
    assert BV >= 1 and BV * splits == next_power_of_2(dv), "splits: a power of two up to the value head dim"
    sumsq = decode_workspace((B * nv * splits,), torch.float32, device)
    kw = conv_weight.shape[-1]
    on = pdl(mixed_qkv)
    _decode_kernel[(B, nv, splits)](
        mixed_qkv, z, a, b, conv_weight, A_log, dt_bias, norm_weight, conv_state, recurrent_state,
        reader_counters(B * nk, device), norm_arrivals(B * nv, device), sumsq, out,
        C, _rows(mixed_qkv), _rows(z), _rows(a), _rows(b), eps, dk**-0.5,
        NK=nk, G=nv // nk, DK=dk, DV=dv, KW=kw, KP=next_power_of_2(kw - 1), BK=BK, BV=BV, SV=splits,
        PDL=on, launch_pdl=on, num_warps=DECODE_OPTIONS.get("num_warps", 8 if BK * BV > MAX_TILE_4_WARPS else 4),
    )  # fmt: skip
    return out
