"""Triton MoE block: routing (softmax + top-k) from the fused input projection, routed SwiGLU experts, gated shared
expert, and the combine -- all from `proj`, the block's one dense GEMV (router | shared gate | shared up | gate logit).

Shapes: M tokens, H hidden, E experts, I expert intermediate, Is shared intermediate, K experts per token,
P = M * K (token, expert) pairs. Every program that does an expert's work owns one expert and all its pairs in
this call, so each selected expert's weight tile is streamed once.

Decode (M <= decode_max_m: 16 tokens for dense experts, 64 for fp8 ones): two launches, no host sync, no float
atomics.
  M = 1 (and any M where the table says so): GEMV-style kernels (BLOCK_M == 1 in the config):
        up program (N tile, pair t * K + k) ranks token t's logits as far as rank k (k + 1 max rounds) and streams
        its k-th expert's gate and up rows; program (0, t * K + K - 1) hands token t's routing to the down kernel;
        down program (N tile, t) takes the shared expert, then token t's K experts in fixed order, summing in
        registers (no partials, counters or atomics).
  up:   program (N tile, expert e) ranks e in every token's logits (one compare pass, no top-k) to find the pairs
        routed to e and computes h[pair] = silu(x[t] @ gate_e^T) * (x[t] @ up_e^T) for all of them; an expert
        with no token exits. Programs (0, e) write e's pair ids and softmax numerators exp(l_e - max l) for the
        down kernel (which normalises over the token's K); program (0, 0) zeroes the down kernel's arrival
        counters (scratch allocated per call: no state survives a call).
  down: program (N tile, slot): slot 0 is the shared expert (all tokens: A = silu(gate) * up read from proj,
        weight sigmoid(gate logit)), slot 1 + p the pair p (its expert's first pair does the work, as above).
        Each writes weighted fp32 partials [M, K + 1, H] (k order, shared last), then arrives on its N tile's
        counter (acq_rel); the last of the P + 1 arrivals sums the tile for every token in k order. Fixed order
        -> bit-reproducible whatever order the programs ran in.
  Routing order everywhere: descending logit (softmax is monotonic), ties to the lower expert id, as one int32
  key (_order_key; packed with the id into an int32 for bf16 logits, an int64 otherwise: _packed_keys), so the
  up kernel's ranks, its top-k and the ids it hands over always agree.
Prefill: route kernel -> pairs counted, padded to BLOCK_M per expert and scattered into expert-contiguous blocks
  on device, in pair order inside each group (three tiny kernels; integer atomics only sum the counts) -> grouped
  up and down GEMMs writing [P, H] partials; the shared expert's down projection on cuBLAS; one combine kernel
  sums each token's partials in k order and adds the gated shared output. A grid sized for the worst case skips
  blocks past the padded total.
  SUB_TILES (a config key): a block whose real rows fit half or a quarter of BLOCK_M runs a tile that size.
FP8 weights (kernels/fp8.py: float8_e4m3fn with fp32 scales [..., N, ceil(K / 128)]; the routed experts w13 and
w2 together, the shared expert's down projection on its own) run the same kernels with EXPERTS_FP8 / SHARED_FP8:
on the tiled decode path every K step (BLOCK_K <= 128, inside one scale block) loads one scale per output row and
applies it to the step's tl.dot of the tile converted to the activations' dtype (exact for e4m3). The sorted
prefill kernels run FP8 x FP8 instead (A_FP8, BLOCK_K = 128) on activations quantized beforehand per (row,
128-wide group) by the weights' rule (kernels/fp8.quantize_activations, a pre-pass bit-identical to quantize_rows
on the GPU): x once per call into fp8 token rows + scales, which the up kernel gathers by token as it gathers x;
h (the up kernel's [P, I] output in x's dtype) by a second pre-pass into fp8 pair rows + scales for the down
kernel. Each [BLOCK_M, 128] step is a tl.dot on the fp8 tensor cores scaled by the rows' and the weight rows'
scales; the error is the activations' quantization (~2.6 % relative, as linear's FP8 prefill). (Quantizing in the
K loops instead, as before, redid each activation tile once per N tile, on CUDA cores costing more than the
wgmma: up 1,075 us, down 729 us per 35B layer at 4096 tokens, issue #16. The h pre-pass costs a read of h and
an fp8 write, ~50 MB and ~15 us per 35B layer at 4096 tokens; quantizing h in the up kernel's epilogue would
save that but needs BLOCK_N a multiple of 128 in an up tile that already runs out of registers.)
The M = 1 GEMVs load BLOCK_K columns per step (a multiple of 128, or a divisor) at once and apply one scale per row
per 128-column sub-step to that sub-step's summed products, so a step keeps BLOCK_K columns of loads in flight (one
round trip per 128 columns was 2-2.8x slower in linear's fp8 GEMV); the shared expert's down rows, one
[BLOCK_N, Is] tile, take a scale per column. fp32 accumulation everywhere. The prefill's shared expert dequantizes
its down projection per call (kernels/fp8.dequantize_rows), then cuBLAS.
Expert parallel (moe_block_ep): w13 / w2 hold the router's experts first .. first + El - 1; every path above runs
with an EP constexpr (off: the unsharded code, compiled as before). M = 1: a program whose expert another rank
holds does nothing, the down kernel masks those lanes; M <= 64: the up grid's extra expert column El marks the
other ranks' pairs (id El, their softmax numerators) and the down kernel writes their partials as 0; prefill: those
pairs are grouped after this rank's experts (align_pairs over El + 1 groups) and skipped, their partials 0.
Launch configs come from configs/<gpu>.json (experiments/tune_moe.py, tune_decode_loop.py), keyed by (E, H, I, weight
dtype, M bucket); each kernel's part holds BLOCK_N, BLOCK_K, num_warps, num_stages and optionally maxnreg (Triton's
register cap per thread, a launch option);
QMOE_MOE_DEFAULT_CONFIGS=1 or an unknown GPU uses DEFAULT_CONFIGS. Nothing autotunes at run time.
"""

import functools
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

import kernels
from kernels.counters import Workspaces
from kernels.fp8 import BLOCK_K as SCALE_BLOCK_K
from kernels.fp8 import FP8, dequantize_rows, k_blocks, quantize_activations
from kernels.launch import cdiv, fast_launch, next_power_of_2
from kernels.moe.naive import router_experts, split_projection
from kernels.pdl import allow_dependents, pdl, wait_for_producers
from kernels.tuned import load_table

__all__ = ["route", "fused_moe", "moe_block", "moe_block_ep"]

DECODE_MAX_M = 64  # the most tokens the decode kernels serve (fp8 experts take them up to here)
# dense experts take the grouped path above 16 tokens, where it is faster on the H200 (probe_moe_batch_path.py,
# results/probe_moe_batch_path.json, bf16: M = 32 / 64 6 % / 23 % faster at 35B, 4 % / 11 % at 122B; the decode
# kernels 11 % / 3 % faster at M = 8 / 16). fp8 experts keep the decode kernels: their grouped path quantizes the
# activations (~2.5e-2 relative error), the decode kernels keep them in bf16.
DENSE_DECODE_MAX_M = 16
M_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
CONFIG_DIR = Path(__file__).parent / "configs"
DEFAULT_CONFIGS = {
    "gemv": {  # M = 1; BLOCK_M == 1 selects the GEMV kernels
        "BLOCK_M": 1,
        "up": {"BLOCK_N": 4, "BLOCK_K": 1024, "num_warps": 4, "num_stages": 2},
        "down": {"BLOCK_N": 2, "BLOCK_K": 512, "num_warps": 4, "num_stages": 2},
    },
    # M = 1 with fp8 experts: the bytes per program of the bf16 GEMV's tuned H200 entry (up 8 rows x 512 columns x
    # 2 B, down 8 experts x 4 rows x 256 columns x 2 B) as twice the columns at 1 B, so the same grid; a step's
    # BLOCK_K columns load at once and take one scale per 128 (_up_gemv_fp8)
    "gemv_fp8": {
        "BLOCK_M": 1,
        "up": {"BLOCK_N": 8, "BLOCK_K": 1024, "num_warps": 4, "num_stages": 2},
        "down": {"BLOCK_N": 4, "BLOCK_K": 512, "num_warps": 4, "num_stages": 2},
    },
    "decode": {
        "BLOCK_M": 16,
        "up": {"BLOCK_N": 16, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4},
        "down": {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3},
    },
    "prefill": {
        "BLOCK_M": 64,
        "up": {"BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3},
        "down": {"BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3},
    },
    # M > 64 with fp8 experts: FP8 x FP8 (A_FP8) on pre-quantized activations, BLOCK_K fixed at 128 (one activation
    # and one weight scale group per step). Not timed yet (tune_moe.py --prefill --weights fp8); picked from sm_90
    # compiles (experiments/aot_sm90.py, 35B shape): up 64 x 64 on 8 warps 142 registers, no spill (64 x 128 on 8
    # warps spills 20 B: two accumulators, two dot results and the gathered rows' 64-bit addresses); down 64 x 128 on
    # 8 warps 174 registers, no spill
    "prefill_fp8": {
        "BLOCK_M": 64,
        "up": {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3},
        "down": {"BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3},
    },
}
RANK_CHUNK = 16  # tokens ranked per step in the decode up kernel: bounds its [tokens, E] compare tile


# ----------------------------------------------------------------------------------------------- configs


def shape_key(E: int, H: int, I: int, dtype: torch.dtype) -> str:
    return f"E{E}_H{H}_I{I}_{str(dtype).removeprefix('torch.')}"


def m_bucket(M: int) -> int:
    return next((b for b in M_BUCKETS if b >= M), M_BUCKETS[-1])


CONFIG_TABLE = load_table(CONFIG_DIR, "QMOE_MOE_DEFAULT_CONFIGS")


def decode_max_m(dtype: torch.dtype) -> int:
    """The most tokens moe_block runs on the decode kernels for experts of `dtype` (above: the grouped path)."""
    return DECODE_MAX_M if dtype == FP8 else DENSE_DECODE_MAX_M


@functools.cache  # per-call host time: the lookup formats a key; the table is fixed at import
def get_config(M: int, E: int, H: int, I: int, dtype: torch.dtype) -> dict:
    """dtype: the experts' (float8_e4m3fn keys the FP8 entries and defaults)."""
    # A decode bucket's entry is a GEMV (BLOCK_M = 1) or a tile: tune_moe.py races the two at every tuned M. The
    # GEMV kernels run each token's pairs on their own, so a few tokens keep the M = 1 kernels' many narrow programs
    # (H200, 35B, M = 2: bf16 37.0 us against the tiles' 60.2, fp8 22.5 against 80.3; fp8 M = 16 126.8 against
    # 200.5); the tiles stream an expert once for all its pairs, which wins as M grows (bf16 M = 16: 175.8 against
    # 209.5; results/tune_moe_gemv_race.txt). A GEMV entry serves decode buckets only; M = 1 always runs a GEMV.
    tuned = CONFIG_TABLE.get(shape_key(E, H, I, dtype), {}).get(str(m_bucket(M)))
    if tuned and (M <= DECODE_MAX_M if tuned["BLOCK_M"] == 1 else M > 1):
        return tuned
    fp8 = dtype == FP8
    if M > DECODE_MAX_M:
        return DEFAULT_CONFIGS["prefill_fp8" if fp8 else "prefill"]
    return DEFAULT_CONFIGS[("gemv_fp8" if fp8 else "gemv") if M == 1 else "decode"]


def check_scales(config: dict, w13, w2, shared_down_proj, w13_scale, w2_scale, shared_down_scale) -> tuple:
    """(EXPERTS_FP8, SHARED_FP8) of the weights, checked: each fp8 weight has its [..., N, ceil(K / 128)] fp32
    scale, w13 and w2 agree, and the config's K steps fit the scale blocks: on the tiled (tl.dot) paths each step
    lies in one block (BLOCK_K <= 128); the GEMV (BLOCK_M == 1) splits a step into 128-column sub-steps, so its
    BLOCK_K divides 128 or is a multiple of it."""
    if (w13_scale is None) != (w2_scale is None):
        raise ValueError("moe: w13 and w2 are fp8 together (both scales) or not at all")
    pairs = {"w13": (w13, w13_scale), "w2": (w2, w2_scale), "shared_down": (shared_down_proj, shared_down_scale)}
    for name, (w, scale) in pairs.items():
        if w is None:  # the routed experts alone (fused_moe)
            continue
        if scale is None:
            if w.dtype == FP8:
                raise ValueError(f"moe: {name} is float8_e4m3fn but has no scale")
            continue
        want = (*w.shape[:-1], k_blocks(w.shape[-1]))
        if w.dtype != FP8 or scale.dtype != torch.float32 or tuple(scale.shape) != want:
            raise ValueError(
                f"moe: {name} with a scale must be float8_e4m3fn with a float32 scale {list(want)}, "
                f"got {w.dtype} and {scale.dtype} {list(scale.shape)}"
            )
    fp8 = w13_scale is not None, shared_down_scale is not None
    steps = config["up"]["BLOCK_K"], config["down"]["BLOCK_K"]
    if any(fp8) and config["BLOCK_M"] > 1 and max(steps) > SCALE_BLOCK_K:
        raise ValueError(
            f"moe config: fp8 weights on the tiled path (BLOCK_M > 1) need BLOCK_K <= {SCALE_BLOCK_K} "
            f"(one scale per step): {config}"
        )
    if any(fp8) and any(k % SCALE_BLOCK_K and SCALE_BLOCK_K % k for k in steps):
        raise ValueError(
            f"moe config: fp8 weights need BLOCK_K dividing {SCALE_BLOCK_K} or a multiple of it "
            f"(whole scale blocks per sub-step): {config}"
        )
    return fp8


def check_prefill_fp8_config(config: dict) -> None:
    """The sorted prefill kernels with fp8 experts (A_FP8) step exactly one 128-wide scale group per K step."""
    steps = config["up"]["BLOCK_K"], config["down"]["BLOCK_K"]
    if steps != (SCALE_BLOCK_K, SCALE_BLOCK_K) or config["BLOCK_M"] < 16:
        raise ValueError(
            f"moe config: fp8 experts on the sorted prefill path (FP8 x FP8) need BLOCK_K = {SCALE_BLOCK_K} in up "
            f"and down and BLOCK_M >= 16, got {config}"
        )


# ----------------------------------------------------------------------------------------------- routing


@triton.jit
def _order_key(logits):
    """fp32 -> int32 whose signed order is the float order (NaN above +inf): one total order, shared by the top-k
    and the rank test, so they agree even on ties, infinities and NaN."""
    bits = logits.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _key_value(key):
    """The fp32 whose _order_key is `key`."""
    return tl.where(key >= 0, key, key ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def _packed_keys(logits_ptr, stride_e, E, BLOCK_E: tl.constexpr):
    """One integer per expert: its logit's order key above its inverted id, so the largest is the largest logit
    and, among equal keys, the lower id; padding lanes lie below every real key. bf16 logits pack a 16-bit key
    (a bf16's fp32 bits end in 16 zeros: exact) and the id into an int32, others a 32-bit key into an int64: the
    M = 1 up kernel's max rounds over int32 cost half as much (35B step 2.092 -> 2.058 ms on the H200,
    results/ab_decode_rank2.json). One max per rank finds the value and the id at once (an argmax and a second
    reduction for the value cost twice as long)."""
    offs_e = tl.arange(0, BLOCK_E)
    logits = tl.load(logits_ptr + offs_e * stride_e, mask=offs_e < E, other=0.0)
    keys = _order_key(logits.to(tl.float32))
    if logits_ptr.dtype.element_ty == tl.bfloat16:  # static: the one branch compiles
        tl.static_assert(BLOCK_E <= 65536, "the 16-bit packing holds ids below 2^16")
        packed = tl.where(offs_e < E, keys >> 16, -32768) * 65536 + (BLOCK_E - 1 - offs_e)
    else:
        packed = tl.where(offs_e < E, keys, -2147483648).to(tl.int64) * 4294967296 + (BLOCK_E - 1 - offs_e)
    return packed


@triton.jit
def _take(packed, best):
    """packed with the expert of key `best` dropped below every key (keys are distinct: each holds its id)."""
    if packed.dtype == tl.int32:  # static, as below: the one branch compiles
        taken = tl.where(packed == best, -2147483648, packed)
    else:
        taken = tl.where(packed == best, -2147483648 * 4294967296, packed)
    return taken


@triton.jit
def _unpack(best, BLOCK_E: tl.constexpr):
    """A packed key -> (expert id int32, its logit fp32)."""
    if best.dtype == tl.int32:
        key = best >> 16
        bits = tl.where(key >= 0, key, key ^ 0x7FFF) << 16  # the logit's fp32 bits (ending in 16 zeros)
        idx, value = BLOCK_E - 1 - (best & 65535), bits.to(tl.float32, bitcast=True)
    else:
        idx, value = (BLOCK_E - 1 - (best & 4294967295)).to(tl.int32), _key_value((best >> 32).to(tl.int32))
    return idx, value


@triton.jit
def _token_topk(logits_ptr, stride_e, E, TOP_K: tl.constexpr, BLOCK_TOP: tl.constexpr, BLOCK_E: tl.constexpr):
    """One token's top-k experts (descending logit, ties to the lower id) and their softmax probabilities
    renormalised over the k -> (ids [BLOCK_TOP] int32, weights [BLOCK_TOP] fp32); lanes >= TOP_K hold 0."""
    packed = _packed_keys(logits_ptr, stride_e, E, BLOCK_E)
    offs_k = tl.arange(0, BLOCK_TOP)
    ids = tl.zeros([BLOCK_TOP], tl.int32)
    top = tl.full([BLOCK_TOP], float("-inf"), tl.float32)
    for k in tl.static_range(TOP_K):
        best = tl.max(packed, 0)
        idx, value = _unpack(best, BLOCK_E)
        ids = tl.where(offs_k == k, idx, ids)
        top = tl.where(offs_k == k, value, top)
        packed = _take(packed, best)
    # softmax over all E, renormalised over the top k: the full denominator cancels, exp(l - l_max) stays
    probs = tl.exp(top - tl.max(top, 0))  # lanes >= TOP_K: exp(-inf) = 0
    return ids, probs / tl.sum(probs, 0)


@triton.jit
def _kth_expert(logits_ptr, stride_e, E, k, BLOCK_E: tl.constexpr):
    """The expert of rank k (0 = the largest logit) in _token_topk's order, after k + 1 max rounds instead of
    TOP_K: the M = 1 up kernel's programs of the first slots start streaming their experts sooner (35B step
    2.058 -> 2.024 ms on the H200, results/ab_decode_rank2.json)."""
    packed = _packed_keys(logits_ptr, stride_e, E, BLOCK_E)
    for _ in range(k):
        packed = _take(packed, tl.max(packed, 0))
    idx, _ = _unpack(tl.max(packed, 0), BLOCK_E)
    return idx


@triton.jit
def _expert_ranks(
    proj_ptr, stride_pm, stride_pe, M, E, expert,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK_T: tl.constexpr,
):  # fmt: skip
    """The position of `expert` in each token's top-k order (0 = largest logit) -> (ranks [BLOCK_T] int32, tokens
    >= M get E; exp(logit[expert] - max logit) [BLOCK_T] fp32, the expert's unnormalised routing weight). One
    compare pass over every token's E logits: rank < K is exactly "routed to expert"."""
    offs_t = tl.arange(0, BLOCK_T)
    offs_e = tl.arange(0, BLOCK_E)
    ranks = tl.zeros([BLOCK_T], tl.int32)
    nums = tl.zeros([BLOCK_T], tl.float32)
    for t0 in tl.static_range(0, BLOCK_T, CHUNK_T):
        rows = t0 + tl.arange(0, CHUNK_T)
        valid = (rows < M)[:, None] & (offs_e < E)[None, :]
        ptrs = proj_ptr + rows.to(tl.int64)[:, None] * stride_pm + offs_e[None, :] * stride_pe
        logits = tl.load(ptrs, mask=valid, other=0.0).to(tl.float32)  # [CHUNK_T, BLOCK_E]
        keys = _order_key(logits)
        mine = tl.sum(tl.where(offs_e[None, :] == expert, keys, 0), 1)  # [CHUNK_T]
        top = tl.max(tl.where(valid, logits, float("-inf")), 1)
        num = tl.exp(tl.sum(tl.where(offs_e[None, :] == expert, logits, 0.0), 1) - top)  # [CHUNK_T]
        ahead = (keys > mine[:, None]) | ((keys == mine[:, None]) & (offs_e[None, :] < expert))
        chunk = tl.sum((ahead & valid).to(tl.int32), 1)  # [CHUNK_T]
        at = offs_t[:, None] == rows[None, :]  # scatter into [BLOCK_T]
        ranks += tl.sum(tl.where(at, chunk[None, :], 0), 1)
        nums += tl.sum(tl.where(at, num[None, :], 0.0), 1)
    return tl.where(offs_t < M, ranks, E), nums


@fast_launch
@triton.jit
def _route_kernel(
    logits_ptr, weights_ptr, ids_ptr, stride_lm, stride_le, E,
    TOP_K: tl.constexpr, BLOCK_TOP: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    ids, weights = _token_topk(logits_ptr + row * stride_lm, stride_le, E, TOP_K, BLOCK_TOP, BLOCK_E)
    offs_k = tl.arange(0, BLOCK_TOP)
    tl.store(weights_ptr + row * TOP_K + offs_k, weights, mask=offs_k < TOP_K)
    tl.store(ids_ptr + row * TOP_K + offs_k, ids.to(tl.int64), mask=offs_k < TOP_K)


def route(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts in fp32, top-k, renormalised to sum 1 -> (weights [M, K] fp32, ids [M, K] int64).
    router_logits may be a strided view (the router columns of proj)."""
    M, E = router_logits.shape
    weights = torch.empty(M, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(M, top_k, dtype=torch.int64, device=router_logits.device)
    if M:
        _route_kernel[(M,)](
            router_logits, weights, ids, *router_logits.stride(), E,
            TOP_K=top_k, BLOCK_TOP=next_power_of_2(top_k), BLOCK_E=next_power_of_2(E),
        )  # fmt: skip
    return weights, ids


# ----------------------------------------------------------------------------------------------- align (prefill)


ALIGN_CHUNK = 128  # pairs per program of the align count and scatter kernels (the scatter compares them pairwise)
ALIGN_EXPERTS = 64  # experts per step of the count kernel's compare tile [ALIGN_CHUNK, ALIGN_EXPERTS]


@fast_launch
@triton.jit
def _align_count_kernel(ids_ptr, hist_ptr, counts_ptr, P, E, n_chunks, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr,
                        STEP_E: tl.constexpr):  # fmt: skip
    """hist[e, c] = the pairs of chunk c (pairs c * CHUNK ..) routed to expert e, also added to counts[e] (integer
    atomics: the totals do not depend on the order)."""
    c = tl.program_id(0)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    expert = tl.load(ids_ptr + offs, mask=offs < P, other=-1)
    for e0 in tl.static_range(0, BLOCK_E, STEP_E):
        e = e0 + tl.arange(0, STEP_E)
        counts = tl.sum((expert[:, None] == e[None, :]).to(tl.int32), 0)  # [STEP_E]
        tl.store(hist_ptr + e * n_chunks + c, counts, mask=e < E)
        tl.atomic_add(counts_ptr + e, counts, mask=(e < E) & (counts > 0))


@fast_launch
@triton.jit
def _align_scan_kernel(hist_ptr, counts_ptr, ends_ptr, n_chunks, E, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
                       BLOCK_C: tl.constexpr):  # fmt: skip
    """Expert e (one program): its group starts after the groups of experts < e, each padded to BLOCK_M rows;
    hist[e, c] -> where chunk c's pairs of e start in the sorted pairs (the start plus e's pairs in chunks < c)."""
    expert = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    counts = tl.load(counts_ptr + e, mask=e < E, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    start = tl.sum(tl.where(e < expert, padded, 0), 0)
    tl.store(ends_ptr + expert, start + tl.sum(tl.where(e == expert, padded, 0), 0))
    row = hist_ptr + expert * n_chunks
    for c0 in range(0, n_chunks, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        h = tl.load(row + c, mask=c < n_chunks, other=0)
        tl.store(row + c, start + tl.cumsum(h, 0) - h, mask=c < n_chunks)
        start += tl.sum(h, 0)


@fast_launch
@triton.jit
def _align_scatter_kernel(ids_ptr, hist_ptr, sorted_ptr, P, n_chunks, CHUNK: tl.constexpr):
    """Each pair of chunk c to sorted[where chunk c's pairs of its expert start + those before it in the chunk]:
    pair order inside every group, the same in every run."""
    c = tl.program_id(0)
    i = tl.arange(0, CHUNK)
    offs = c * CHUNK + i
    mask = offs < P
    expert = tl.load(ids_ptr + offs, mask=mask, other=-1)
    earlier = tl.sum(((expert[:, None] == expert[None, :]) & (i[None, :] < i[:, None])).to(tl.int32), 1)
    first = tl.load(hist_ptr + expert * n_chunks + c, mask=mask, other=0)
    tl.store(sorted_ptr + first + earlier, offs, mask=mask)


def align_pairs(topk_ids: torch.Tensor, E: int, block_m: int):
    """Group the P pairs by expert into BLOCK_M-row blocks -> (sorted pair ids [num_blocks * BLOCK_M] int32, P in
    padding rows; ends [E] int32, the end of each expert's padded group). Inside a group the pairs keep their
    order (token, then k): deterministic, whatever order the programs run in. num_blocks is the worst case (every
    used expert wastes BLOCK_M - 1 rows); the GEMMs skip blocks at or past ends[E - 1]."""
    P = topk_ids.numel()
    ids = topk_ids.flatten()
    num_blocks = cdiv(P + min(E, P) * (block_m - 1), block_m)
    n_chunks = cdiv(P, ALIGN_CHUNK)
    block_e = next_power_of_2(E)
    hist = torch.empty(E, n_chunks, dtype=torch.int32, device=ids.device)
    counts = torch.zeros(E, dtype=torch.int32, device=ids.device)
    ends = torch.empty(E, dtype=torch.int32, device=ids.device)
    sorted_pairs = torch.full((num_blocks * block_m,), P, dtype=torch.int32, device=ids.device)
    _align_count_kernel[(n_chunks,)](
        ids, hist, counts, P, E, n_chunks, CHUNK=ALIGN_CHUNK, BLOCK_E=block_e, STEP_E=min(ALIGN_EXPERTS, block_e)
    )
    block_c = min(1024, max(16, next_power_of_2(n_chunks)))
    _align_scan_kernel[(E,)](hist, counts, ends, n_chunks, E, BLOCK_M=block_m, BLOCK_E=block_e, BLOCK_C=block_c)
    _align_scatter_kernel[(n_chunks,)](ids, hist, sorted_pairs, P, n_chunks, CHUNK=ALIGN_CHUNK)
    return sorted_pairs, ends


# ----------------------------------------------------------------------------------------------- GEMM tiles


@triton.jit
def _dot(a, b, acc):
    if a.dtype == tl.float32:  # fp32 stays fp32 (no tf32), so the fp32 model matches the torch path
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _dot_scaled(a, w, acc, s_ptrs, k0, SCALED: tl.constexpr):
    """acc + a @ w. SCALED: w [BLOCK_K, BLOCK_N] is fp8 and s_ptrs [BLOCK_N] point at its columns' (output rows')
    scales of K block 0; the step at k0 lies in K block k0 // 128. The tile converts exactly to a's dtype and the
    scale multiplies the step's product."""
    if SCALED:
        scale = tl.load(s_ptrs + k0 // 128)
        return acc + _dot(a, w.to(a.dtype), tl.zeros_like(acc)) * scale[None, :]
    else:
        return _dot(a, w, acc)


@triton.jit
def _up_tile(
    x_ptr, w_ptr, h_ptr, pairs, row_mask, offs_n, H, I, s_ptr,
    TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, SCALED: tl.constexpr,
):  # fmt: skip
    """h[pairs, offs_n] = silu(x[t] @ gate^T) * (x[t] @ up^T) for one expert (w_ptr at its [2I, H] matrix; s_ptr
    at its [2I, ceil(H / 128)] scales when SCALED)."""
    tokens = (pairs // TOP_K).to(tl.int64)
    n_mask = offs_n < I
    kb = tl.cdiv(H, 128)
    s_gate = s_ptr + tl.minimum(offs_n, I - 1).to(tl.int64) * kb  # [BLOCK_N]; up rows are I further
    acc_gate = tl.zeros((pairs.shape[0], offs_n.shape[0]), tl.float32)
    acc_up = tl.zeros((pairs.shape[0], offs_n.shape[0]), tl.float32)
    for k0 in range(0, H, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < H
        a = tl.load(x_ptr + tokens[:, None] * H + offs_k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w_offs = offs_n[None, :] * H + offs_k[:, None]  # [BLOCK_K, BLOCK_N], gate rows; up rows are I further
        w_mask = k_mask[:, None] & n_mask[None, :]
        acc_gate = _dot_scaled(a, tl.load(w_ptr + w_offs, mask=w_mask, other=0.0), acc_gate, s_gate, k0, SCALED)
        w_up = tl.load(w_ptr + I * H + w_offs, mask=w_mask, other=0.0)
        acc_up = _dot_scaled(a, w_up, acc_up, s_gate + I * kb, k0, SCALED)
    h = acc_gate * tl.sigmoid(acc_gate) * acc_up
    h_offs = pairs.to(tl.int64)[:, None] * I + offs_n[None, :]
    tl.store(h_ptr + h_offs, h.to(h_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


@triton.jit
def _down_acc(h_ptr, w_ptr, pairs, row_mask, offs_n, H, I, s_ptr, BLOCK_K: tl.constexpr, SCALED: tl.constexpr):
    """h[pairs] @ w2^T for one expert (w_ptr at its [H, I] matrix, s_ptr at its [H, ceil(I / 128)] scales when
    SCALED) -> [BLOCK_M, BLOCK_N] fp32."""
    rows = pairs.to(tl.int64)
    n_mask = offs_n < H
    s_ptrs = s_ptr + tl.minimum(offs_n, H - 1).to(tl.int64) * tl.cdiv(I, 128)  # [BLOCK_N]
    acc = tl.zeros((pairs.shape[0], offs_n.shape[0]), tl.float32)
    for k0 in range(0, I, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < I
        a = tl.load(h_ptr + rows[:, None] * I + offs_k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptr + offs_n[None, :] * I + offs_k[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = _dot_scaled(a, w, acc, s_ptrs, k0, SCALED)
    return acc


@triton.jit
def _shared_acc(
    proj_ptr, w_ptr, tokens, row_mask, offs_n, stride_pm, stride_pe, E, H, IS, s_ptr,
    BLOCK_K: tl.constexpr, SCALED: tl.constexpr,
):  # fmt: skip
    """(silu(gate) * up)[tokens] @ shared_down^T -> [BLOCK_M, BLOCK_N] fp32; gate and up are proj's columns
    E .. E + Is and E + Is .. E + 2 Is, rounded like the torch path (silu, then the product, in proj's dtype).
    SCALED: shared_down is fp8 with its [H, ceil(Is / 128)] scales at s_ptr."""
    row_ptr = proj_ptr + tokens.to(tl.int64)[:, None] * stride_pm
    n_mask = offs_n < H
    s_ptrs = s_ptr + tl.minimum(offs_n, H - 1).to(tl.int64) * tl.cdiv(IS, 128)  # [BLOCK_N]
    acc = tl.zeros((tokens.shape[0], offs_n.shape[0]), tl.float32)
    for k0 in range(0, IS, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < IS
        a_mask = row_mask[:, None] & k_mask[None, :]
        gate = tl.load(row_ptr + (E + offs_k)[None, :] * stride_pe, mask=a_mask, other=0.0)
        up = tl.load(row_ptr + (E + IS + offs_k)[None, :] * stride_pe, mask=a_mask, other=0.0)
        gate = gate.to(tl.float32)
        a = (gate * tl.sigmoid(gate)).to(up.dtype) * up
        w = tl.load(w_ptr + offs_n[None, :] * IS + offs_k[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = _dot_scaled(a, w, acc, s_ptrs, k0, SCALED)  # a in proj's dtype (= the dense w's)
    return acc


# ----------------------------------------------------------------------------------------------- decode (M <= 64)


@triton.jit
def _up_decode_expert(
    x_ptr, proj_ptr, w13_ptr, h_ptr, weights_ptr, ids_ptr, M, E, H, I, stride_pm, stride_pe, NUM_COUNTERS,
    w13_s_ptr, expert, routed_as,
    TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr, CHUNK_T: tl.constexpr,
    BLOCK_COUNTERS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EXPERTS_FP8: tl.constexpr,
):  # fmt: skip
    """The up tile of w13's expert `expert` (the router's expert `routed_as`) for the tokens routed to it."""
    # Axis 0 walks N tiles of one expert, so neighbouring programs share the logits and activations in L2.
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ranks, nums = _expert_ranks(proj_ptr, stride_pm, stride_pe, M, E, routed_as, BLOCK_T, BLOCK_E, CHUNK_T)
    routed = ranks < TOP_K  # [BLOCK_T]
    offs_t = tl.arange(0, BLOCK_T)
    pair_ids = offs_t * TOP_K + ranks
    if tl.program_id(0) == 0:  # the routing the down kernel reads: ids and unnormalised weights per pair
        tl.store(ids_ptr + pair_ids, tl.zeros([BLOCK_T], tl.int32) + expert, mask=routed)
        tl.store(weights_ptr + pair_ids, nums, mask=routed)
        if expert == 0:  # the down kernel's arrival counters (ids_ptr + P), zeroed before it starts
            offs_c = tl.arange(0, BLOCK_COUNTERS)
            tl.store(ids_ptr + M * TOP_K + offs_c, tl.zeros([BLOCK_COUNTERS], tl.int32), mask=offs_c < NUM_COUNTERS)
    w_ptr = w13_ptr + expert.to(tl.int64) * (2 * I * H)
    s_ptr = w13_s_ptr + expert.to(tl.int64) * (2 * I * tl.cdiv(H, 128))
    pos = tl.cumsum(routed.to(tl.int32), 0) - 1
    for r0 in range(0, tl.sum(routed.to(tl.int32), 0), BLOCK_M):  # the routed tokens, compacted into rows
        sel = routed[None, :] & (pos[None, :] == (r0 + tl.arange(0, BLOCK_M))[:, None])  # [BLOCK_M, BLOCK_T]
        pairs = tl.sum(tl.where(sel, pair_ids[None, :], 0), 1)
        row_mask = tl.sum(sel.to(tl.int32), 1) > 0
        _up_tile(x_ptr, w_ptr, h_ptr, pairs, row_mask, offs_n, H, I, s_ptr, TOP_K, BLOCK_K, EXPERTS_FP8)


@triton.jit
def _mark_other_ranks_pairs(
    proj_ptr, weights_ptr, ids_ptr, M, E, stride_pm, stride_pe, FIRST, EL,
    TOP_K: tl.constexpr, BLOCK_TOP: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    """Expert parallel: for tokens program_id(0), + num_programs(0), ...: each pair routed to an expert this rank
    does not hold gets the id EL (the down kernel writes its partial as 0) and its softmax numerator exp(logit -
    max logit), as _expert_ranks computes it for the pairs of this rank's experts (the down kernel normalises a
    token's K numerators)."""
    offs_top = tl.arange(0, BLOCK_TOP)
    for t in range(tl.program_id(0), M, tl.num_programs(0)):
        logits_ptr = proj_ptr + t * stride_pm  # t < M <= 64: no overflow
        ids, _ = _token_topk(logits_ptr, stride_pe, E, TOP_K, BLOCK_TOP, BLOCK_E)
        logits = tl.load(logits_ptr + ids * stride_pe, mask=offs_top < TOP_K, other=0.0).to(tl.float32)
        top = tl.max(tl.where(offs_top < TOP_K, logits, float("-inf")), 0)  # the token's max logit: its top-1
        other = (offs_top < TOP_K) & ((ids < FIRST) | (ids >= FIRST + EL))
        tl.store(ids_ptr + t * TOP_K + offs_top, tl.zeros([BLOCK_TOP], tl.int32) + EL, mask=other)
        tl.store(weights_ptr + t * TOP_K + offs_top, tl.exp(logits - top), mask=other)


@fast_launch
@triton.jit
def _moe_up_decode_kernel(
    x_ptr, proj_ptr, w13_ptr, h_ptr, weights_ptr, ids_ptr, M, E, H, I, stride_pm, stride_pe, NUM_COUNTERS, w13_s_ptr,
    FIRST, EL,
    TOP_K: tl.constexpr, BLOCK_TOP: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr,
    CHUNK_T: tl.constexpr, BLOCK_COUNTERS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, EXPERTS_FP8: tl.constexpr, EP: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Program (N tile, expert): the expert's up tile for every token routed to it. EP (expert parallel): w13
    holds the router's experts FIRST .. FIRST + EL - 1; the grid's extra expert column EL marks the pairs of the
    other ranks' experts (_mark_other_ranks_pairs)."""
    allow_dependents(PDL)
    wait_for_producers(PDL)
    expert = tl.program_id(1)
    if EP:
        if expert == EL:
            _mark_other_ranks_pairs(proj_ptr, weights_ptr, ids_ptr, M, E, stride_pm, stride_pe, FIRST, EL, TOP_K,
                                    BLOCK_TOP, BLOCK_E)  # fmt: skip
        else:
            _up_decode_expert(
                x_ptr, proj_ptr, w13_ptr, h_ptr, weights_ptr, ids_ptr, M, E, H, I, stride_pm, stride_pe,
                NUM_COUNTERS, w13_s_ptr, expert, expert + FIRST, TOP_K, BLOCK_E, BLOCK_T, CHUNK_T, BLOCK_COUNTERS,
                BLOCK_M, BLOCK_N, BLOCK_K, EXPERTS_FP8,
            )  # fmt: skip
    else:
        _up_decode_expert(
            x_ptr, proj_ptr, w13_ptr, h_ptr, weights_ptr, ids_ptr, M, E, H, I, stride_pm, stride_pe, NUM_COUNTERS,
            w13_s_ptr, expert, expert, TOP_K, BLOCK_E, BLOCK_T, CHUNK_T, BLOCK_COUNTERS, BLOCK_M, BLOCK_N, BLOCK_K,
            EXPERTS_FP8,
        )  # fmt: skip


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
def _decode_rows(match, pos, r0, BLOCK_M: tl.constexpr, P_BLOCK: tl.constexpr):
    """Pairs r0 .. r0 + BLOCK_M of the matching ones, compacted into rows -> (pair ids [BLOCK_M], row mask)."""
    sel = match[None, :] & (pos[None, :] == (r0 + tl.arange(0, BLOCK_M))[:, None])  # [BLOCK_M, P_BLOCK]
    pairs = tl.sum(tl.where(sel, tl.arange(0, P_BLOCK)[None, :], 0), 1)
    return pairs, tl.sum(sel.to(tl.int32), 1) > 0


@triton.jit
def _down_decode_pairs(
    h_ptr, w2_ptr, w2_s_ptr, weights_ptr, partials_ptr, expert, match, pos, count, offs_n, n_mask, H, I,
    TOP_K: tl.constexpr, BLOCK_TOP: tl.constexpr, P_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr, EXPERTS_FP8: tl.constexpr,
):  # fmt: skip
    """The weighted down tile of w2's expert `expert` for its `count` pairs (match, pos: _decode_slot's)."""
    w_ptr = w2_ptr + expert.to(tl.int64) * (H * I)
    s_ptr = w2_s_ptr + expert.to(tl.int64) * (H * tl.cdiv(I, 128))
    for r0 in range(0, count, BLOCK_M):
        pairs, row_mask = _decode_rows(match, pos, r0, BLOCK_M, P_BLOCK)
        acc = _down_acc(h_ptr, w_ptr, pairs, row_mask, offs_n, H, I, s_ptr, BLOCK_K, EXPERTS_FP8)
        # The routing weight: the pair's softmax numerator over the sum of its token's K numerators.
        offs_top = tl.arange(0, BLOCK_TOP)
        token_pairs = (pairs // TOP_K * TOP_K)[:, None] + offs_top[None, :]  # [BLOCK_M, BLOCK_TOP]
        nums = tl.load(weights_ptr + token_pairs, mask=row_mask[:, None] & (offs_top < TOP_K)[None, :], other=0.0)
        scale = tl.load(weights_ptr + pairs, mask=row_mask, other=0.0) / tl.sum(nums, 1)
        rows = (pairs + pairs // TOP_K).to(tl.int64)  # t * (K + 1) + k
        tl.store(
            partials_ptr + rows[:, None] * H + offs_n[None, :], acc * scale[:, None],
            mask=row_mask[:, None] & n_mask[None, :],
        )  # fmt: skip


@fast_launch
@triton.jit
def _moe_down_decode_kernel(
    h_ptr, proj_ptr, w2_ptr, shared_down_ptr, weights_ptr, ids_ptr, out_ptr, M, E, H, I, IS, stride_pm, stride_pe,
    w2_s_ptr, sd_s_ptr, EL,
    TOP_K: tl.constexpr, BLOCK_TOP: tl.constexpr, P_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EXPERTS_FP8: tl.constexpr, SHARED_FP8: tl.constexpr, EP: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    allow_dependents(PDL)
    wait_for_producers(PDL)
    pid_n = tl.program_id(0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < H
    slot = tl.program_id(1)  # 0: the shared expert; 1 + p: pair p
    P = M * TOP_K
    partials_ptr = weights_ptr + P  # [M, K + 1, H] fp32: routed partials in k order, then the shared one
    counters_ptr = ids_ptr + P  # [cdiv(H, BLOCK_N)] int32, zeroed by the up kernel
    if slot == 0:  # first in the grid, so the one program group with M rows starts early
        for r0 in range(0, M, BLOCK_M):
            tokens = r0 + tl.arange(0, BLOCK_M)
            row_mask = tokens < M
            acc = _shared_acc(
                proj_ptr, shared_down_ptr, tokens, row_mask, offs_n, stride_pm, stride_pe, E, H, IS, sd_s_ptr,
                BLOCK_K, SHARED_FP8,
            )  # fmt: skip
            gate_ptrs = proj_ptr + tokens.to(tl.int64) * stride_pm + (E + 2 * IS) * stride_pe
            scale = tl.sigmoid(tl.load(gate_ptrs, mask=row_mask, other=0.0).to(tl.float32))
            rows = tokens.to(tl.int64) * (TOP_K + 1) + TOP_K
            tl.store(
                partials_ptr + rows[:, None] * H + offs_n[None, :], acc * scale[:, None],
                mask=row_mask[:, None] & n_mask[None, :],
            )  # fmt: skip
    else:
        expert, match, pos, count, owner = _decode_slot(ids_ptr, slot - 1, P, P_BLOCK)
        if owner:
            if EP:
                if expert == EL:  # the pairs of the other ranks' experts: partials of 0
                    for r0 in range(0, count, BLOCK_M):
                        pairs, row_mask = _decode_rows(match, pos, r0, BLOCK_M, P_BLOCK)
                        rows = (pairs + pairs // TOP_K).to(tl.int64)  # t * (K + 1) + k
                        zero = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
                        tl.store(partials_ptr + rows[:, None] * H + offs_n[None, :], zero,
                                 mask=row_mask[:, None] & n_mask[None, :])  # fmt: skip
                else:
                    _down_decode_pairs(h_ptr, w2_ptr, w2_s_ptr, weights_ptr, partials_ptr, expert, match, pos, count,
                                       offs_n, n_mask, H, I, TOP_K, BLOCK_TOP, P_BLOCK, BLOCK_M, BLOCK_K,
                                       EXPERTS_FP8)  # fmt: skip
            else:
                _down_decode_pairs(h_ptr, w2_ptr, w2_s_ptr, weights_ptr, partials_ptr, expert, match, pos, count,
                                   offs_n, n_mask, H, I, TOP_K, BLOCK_TOP, P_BLOCK, BLOCK_M, BLOCK_K,
                                   EXPERTS_FP8)  # fmt: skip
    # Every program arrives once on its N tile (acq_rel: its partials are visible to whoever sees the count);
    # the last of the P + 1 sums the tile's partials of every token in k order. The barrier orders all threads'
    # stores before the one thread's release.
    tl.debug_barrier()
    if tl.atomic_add(counters_ptr + pid_n, 1, sem="acq_rel") == P:
        for r0 in range(0, M, BLOCK_M):
            tokens = (r0 + tl.arange(0, BLOCK_M)).to(tl.int64)
            mask = (tokens < M)[:, None] & n_mask[None, :]
            total = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            for j in tl.static_range(TOP_K + 1):
                ptrs = partials_ptr + (tokens * (TOP_K + 1) + j)[:, None] * H + offs_n[None, :]
                total += tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg")  # L2, never a stale L1 line
            tl.store(out_ptr + tokens[:, None] * H + offs_n[None, :], total.to(out_ptr.dtype.element_ty), mask=mask)


def _row_strides(t: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """t [..., N] -> (t, its rows' stride, its columns' stride) as the decode kernels index it: a 2-D t as it is,
    a contiguous one without a view (a dispatcher call per eager op), else a contiguous [M, N] copy."""
    if t.dim() == 2:
        return t, *t.stride()
    if not t.is_contiguous():
        t = t.reshape(-1, t.shape[-1]).contiguous()
    return t, t.shape[-1], 1


# the decode launches' h, routing weights and ids (partials, counters): written by the up kernel before the down
# kernel reads them, in every call (invariants: Workspaces)
decode_workspace = Workspaces()


def decode_scratch(x: torch.Tensor, I: int, top_k: int, config: dict) -> dict:
    """The decode launches' buffers: h [P, I] in x's dtype; f32 = routing weights [P] | partials [M, K + 1, H];
    i32 = ids [P] | arrival counters [cdiv(H, down BLOCK_N)], these three from decode_workspace (the same buffers
    in every call of a shape: an eager call allocates only its result); out in x's shape [..., H], allocated per
    call. The GEMV path (BLOCK_M = 1) needs neither partials nor counters."""
    H = x.shape[-1]
    M = x.numel() // H
    P = M * top_k
    gemv = config["BLOCK_M"] == 1
    f32 = P if gemv else P + M * (top_k + 1) * H
    i32 = P if gemv else P + cdiv(H, config["down"]["BLOCK_N"])
    return {
        "h": decode_workspace((P, I), x.dtype, x.device),
        "f32": decode_workspace((f32,), torch.float32, x.device),
        "i32": decode_workspace((i32,), torch.int32, x.device),
        "out": x.new_empty(*x.shape),  # sizes as ints: ~0.6 us less than a torch.Size
    }


def moe_block_decode(
    x, proj, w13, w2, shared_down_proj, top_k, config=None, scratch=None,
    w13_scale=None, w2_scale=None, shared_down_scale=None, first=None,
) -> torch.Tensor:  # fmt: skip
    """The block for M <= DECODE_MAX_M in two launches. config / scratch (decode_scratch's dict) override the
    tuned table and the per-call buffers (tests pass NaN-poisoned ones, the tuner its candidates). The scales:
    those of fp8 weights (kernels/fp8.py), None for dense ones. first: expert parallel (moe_block_ep): w13 / w2
    hold the router's experts first .. first + El - 1. x [..., H] and proj [..., E + 2 Is + 1] with any leading
    dimensions (M rows in all), the result in x's shape."""
    H = x.shape[-1]
    M = x.numel() // H
    El, I = w2.shape[0], w2.shape[2]
    IS = shared_down_proj.shape[1]
    E = router_experts(proj, IS)  # expert parallel: every rank's experts
    config = config or get_config(M, El, H, I, w13.dtype)
    scratch = scratch or decode_scratch(x, I, top_k, config)
    h, f32, i32, out = scratch["h"], scratch["f32"], scratch["i32"], scratch["out"]
    x, w13, w2, shared_down_proj = x.contiguous(), w13.contiguous(), w2.contiguous(), shared_down_proj.contiguous()
    scales = w13_scale, w2_scale, shared_down_scale
    experts_fp8, shared_fp8 = check_scales(config, w13, w2, shared_down_proj, *scales)
    if config["BLOCK_M"] == 1:
        if M > DECODE_MAX_M:
            raise ValueError(
                f"moe_block_decode: a GEMV config (BLOCK_M = 1) serves M <= {DECODE_MAX_M} tokens, got M = {M}"
            )
        flags = experts_fp8, shared_fp8
        return moe_block_gemv(x, proj, w13, w2, shared_down_proj, top_k, config, scratch, scales, *flags, first)
    # a scale pointer is only read under its flag: a dense weight passes itself in its place
    w13_s, w2_s = (w13_scale.contiguous(), w2_scale.contiguous()) if experts_fp8 else (w13, w2)
    sd_s = shared_down_scale.contiguous() if shared_fp8 else shared_down_proj
    proj, stride_pm, stride_pe = _row_strides(proj)
    block_m, up, down = config["BLOCK_M"], config["up"], config["down"]
    P = M * top_k
    num_counters = cdiv(H, down["BLOCK_N"])
    on = pdl(x)
    ep = first is not None  # the up grid's extra column marks the other ranks' pairs
    _moe_up_decode_kernel[(cdiv(I, up["BLOCK_N"]), El + ep)](
        x, proj, w13, h, f32, i32, M, E, H, I, stride_pm, stride_pe, num_counters, w13_s, first or 0, El,
        TOP_K=top_k, BLOCK_TOP=next_power_of_2(top_k), BLOCK_E=next_power_of_2(E),
        BLOCK_T=max(RANK_CHUNK, next_power_of_2(M)), CHUNK_T=RANK_CHUNK,
        BLOCK_COUNTERS=next_power_of_2(num_counters), BLOCK_M=block_m, EXPERTS_FP8=experts_fp8,
        EP=ep, PDL=on, launch_pdl=on, **up,
    )  # fmt: skip
    _moe_down_decode_kernel[(num_counters, P + 1)](
        h, proj, w2, shared_down_proj, f32, i32, out, M, E, H, I, IS, stride_pm, stride_pe, w2_s, sd_s, El,
        TOP_K=top_k, BLOCK_TOP=next_power_of_2(top_k), P_BLOCK=max(16, next_power_of_2(P)),
        BLOCK_M=block_m, EXPERTS_FP8=experts_fp8, SHARED_FP8=shared_fp8, EP=ep, PDL=on, launch_pdl=on, **down,
    )  # fmt: skip
    return out


# ----------------------------------------------------------------------------------------------- GEMV (M = 1)


@triton.jit
def _up_tiles(gate_ptrs, up_offset, x_ptrs, k_mask, EVEN_K: tl.constexpr):
    """One K step of the up GEMV: the gate rows at gate_ptrs [BLOCK_N, BLOCK_K], the up rows up_offset further
    and x at x_ptrs [BLOCK_K]; zero where k_mask [BLOCK_K] is off (read only without EVEN_K)."""
    if EVEN_K:
        gate = tl.load(gate_ptrs)
        up = tl.load(gate_ptrs + up_offset)
        x = tl.load(x_ptrs)
    else:
        gate = tl.load(gate_ptrs, mask=k_mask[None, :], other=0.0)
        up = tl.load(gate_ptrs + up_offset, mask=k_mask[None, :], other=0.0)
        x = tl.load(x_ptrs, mask=k_mask, other=0.0)
    return gate, up, x


@triton.jit
def _up_gemv_fp8(
    x_ptr, gate_rows, s_gate, up_offset, s_up_offset, H,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB_K: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    """x @ gate^T and x @ up^T over fp8 rows (gate_rows [BLOCK_N] pointers at column 0, up rows up_offset further;
    s_gate [BLOCK_N] their scales at K block 0, the up rows' s_up_offset further) -> (gate, up) [BLOCK_N] fp32.
    A step loads BLOCK_K columns at once (one memory round trip) and applies the scales per sub-step of SUB_K =
    min(BLOCK_K, 128) columns, each inside one scale block: the product [BLOCK_N, BLOCK_K] reshaped to
    [BLOCK_N, BLOCK_K / SUB_K, SUB_K] and summed per sub-step before its row scale. One 128-column step per
    iteration (BLOCK_K <= 128) is one round trip per 128 bytes per row: 2-2.8x slower in linear's fp8 GEMV.
    A reshape rather than linear's unrolled static_range: compiled for sm_90, the unrolled sub-steps issued later
    sub-steps' loads after earlier ones' conversions; the one wide load issues them all first."""
    offs_k = tl.arange(0, BLOCK_K)
    acc_gate = tl.zeros((BLOCK_N, BLOCK_K // SUB_K), tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_K // SUB_K), tl.float32)
    for k0 in range(0, H, BLOCK_K):
        cols = k0 + offs_k
        gate, up, x = _up_tiles(gate_rows[:, None] + cols[None, :], up_offset, x_ptr + cols, cols < H, EVEN_K)
        blocks = k0 // 128 + tl.arange(0, BLOCK_K // SUB_K)  # the step's scale blocks; none read past H
        s_ptrs = s_gate[:, None] + blocks[None, :]  # [BLOCK_N, BLOCK_K / SUB_K]
        scale_gate = tl.load(s_ptrs, mask=(blocks * 128 < H)[None, :], other=0.0)
        scale_up = tl.load(s_ptrs + s_up_offset, mask=(blocks * 128 < H)[None, :], other=0.0)
        x = x.to(tl.float32)[None, :]
        prod_gate = tl.reshape(gate.to(tl.float32) * x, (BLOCK_N, BLOCK_K // SUB_K, SUB_K))
        prod_up = tl.reshape(up.to(tl.float32) * x, (BLOCK_N, BLOCK_K // SUB_K, SUB_K))
        acc_gate += tl.sum(prod_gate, 2) * scale_gate
        acc_up += tl.sum(prod_up, 2) * scale_up
    return tl.sum(acc_gate, 1), tl.sum(acc_up, 1)


@triton.jit
def _down_tiles(h_ptr, w_ptrs, offs_top, top_mask, k0, I, BLOCK_K: tl.constexpr):
    """K step k0 of the down GEMV: the K experts' rows [TOP, N, BLOCK_K] (w_ptrs [TOP, N, 1] at column 0) and their
    h [TOP, BLOCK_K]; zero past I and in lanes >= TOP_K."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    k_mask = offs_k < I
    w = tl.load(w_ptrs + offs_k[None, None, :], mask=top_mask[:, None, None] & k_mask[None, None, :], other=0.0)
    a = tl.load(h_ptr + offs_top[:, None] * I + offs_k[None, :], mask=top_mask[:, None] & k_mask[None, :], other=0.0)
    return w, a


@triton.jit
def _down_gemv_fp8(
    h_ptr, w_ptrs, w_scales, offs_top, top_mask, I,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB_K: tl.constexpr,
):  # fmt: skip
    """w2[e_k][rows] @ h[k] for every k over fp8 rows (w_ptrs [TOP, N, 1] at column 0, w_scales [TOP, N] at K
    block 0) -> [TOP, N] fp32, stepped like _up_gemv_fp8: the [TOP, N, BLOCK_K] tile in one load, its product
    summed per SUB_K-column sub-step before the sub-step's [TOP, N] scales."""
    acc = tl.zeros((offs_top.shape[0], BLOCK_N), tl.float32)
    for k0 in range(0, I, BLOCK_K):
        w, a = _down_tiles(h_ptr, w_ptrs, offs_top, top_mask, k0, I, BLOCK_K)
        blocks = k0 // 128 + tl.arange(0, BLOCK_K // SUB_K)  # the step's scale blocks; none read past I
        s_mask = top_mask[:, None, None] & (blocks * 128 < I)[None, None, :]
        scale = tl.load(w_scales[:, :, None] + blocks[None, None, :], mask=s_mask, other=0.0)  # [TOP, N, K / SUB]
        prod = w.to(tl.float32) * a.to(tl.float32)[:, None, :]  # [TOP, N, BLOCK_K]
        prod = tl.reshape(prod, (offs_top.shape[0], BLOCK_N, BLOCK_K // SUB_K, SUB_K))
        acc += tl.sum(tl.sum(prod, 3) * scale, 2)
    return acc


@triton.jit
def _up_gemv_rows(
    x_ptr, w13_ptr, h_ptr, w13_s_ptr, expert, pair, pid_n, H, I,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB_K: tl.constexpr, EVEN_K: tl.constexpr,
    EXPERTS_FP8: tl.constexpr,
):  # fmt: skip
    """h[pair, offs_n] = silu(x @ gate^T) * (x @ up^T) over the rows offs_n of expert `expert` (an index into w13)."""
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows past I re-read row I - 1 (unmasked loads keep the 16-byte vectors); the store drops them.
    rows = tl.minimum(offs_n, I - 1).to(tl.int64) * H
    if EXPERTS_FP8:
        kb = tl.cdiv(H, 128)
        s_gate = w13_s_ptr + expert.to(tl.int64) * (2 * I * kb) + tl.minimum(offs_n, I - 1).to(tl.int64) * kb
        gate_rows = w13_ptr + expert.to(tl.int64) * (2 * I * H) + rows  # [BLOCK_N]; up rows are I further
        gate, up = _up_gemv_fp8(x_ptr, gate_rows, s_gate, I * H, I * kb, H, BLOCK_N, BLOCK_K, SUB_K, EVEN_K)
        h = gate * tl.sigmoid(gate) * up
    else:
        offs_k = tl.arange(0, BLOCK_K)
        gate_ptrs = w13_ptr + expert.to(tl.int64) * (2 * I * H) + rows[:, None] + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
        x_ptrs = x_ptr + offs_k
        acc_gate = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
        acc_up = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
        for k0 in range(0, H, BLOCK_K):
            gate, up, x = _up_tiles(gate_ptrs, I * H, x_ptrs, k0 + offs_k < H, EVEN_K)
            x = x.to(tl.float32)[None, :]
            acc_gate += gate.to(tl.float32) * x
            acc_up += up.to(tl.float32) * x
            gate_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        gate = tl.sum(acc_gate, 1)  # [BLOCK_N]
        h = gate * tl.sigmoid(gate) * tl.sum(acc_up, 1)
    tl.store(h_ptr + pair * I + offs_n, h.to(h_ptr.dtype.element_ty), mask=offs_n < I)


@fast_launch
@triton.jit
def _moe_up_gemv_kernel(
    x_ptr, proj_ptr, w13_ptr, h_ptr, weights_ptr, ids_ptr, E, H, I, stride_pm, stride_pe, w13_s_ptr, FIRST, EL,
    TOP_K: tl.constexpr, BLOCK_TOP: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB_K: tl.constexpr, EVEN_K: tl.constexpr,
    EXPERTS_FP8: tl.constexpr, EP: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Program (N tile, pair t * K + k) -> h[pair, offs_n] = silu(x[t] @ gate_e^T) * (x[t] @ up_e^T), e token t's
    k-th expert (each token's pairs on their own: two tokens of one expert stream it twice, the second from L2
    only while it is still there: 122B same-8 routing at M = 4 reads HBM, results/bench_moe_batch.json).
    No tensor cores: [BLOCK_N, BLOCK_K] gate and up tiles with 16-byte loads along H, elementwise fp32 FMAs, one
    reduction after the loop. Every program ranks the E logits itself (no launch for routing), only as far as its
    own slot: k + 1 max rounds (_kth_expert); program (0, a last slot) ranks all K and hands them over.
    EXPERTS_FP8: the loop is _up_gemv_fp8's (one scale per row per SUB_K = min(BLOCK_K, 128) columns). EP (expert
    parallel): w13 holds experts FIRST .. FIRST + EL - 1 of the E the router ranks; a program whose expert another
    rank holds loads and stores nothing (the down kernel reads no h row of it)."""
    allow_dependents(PDL)
    wait_for_producers(PDL)  # the routing needs the router logits first: nothing to load before the wait
    pid_n = tl.program_id(0)
    pair = tl.program_id(1)
    t, k = pair // TOP_K, pair % TOP_K
    x_ptr += t * H  # x is [M, H] contiguous
    logits_ptr = proj_ptr + t * stride_pm
    if (pid_n == 0) & (k == TOP_K - 1):  # the token's routing, which the down kernel reads (K rounds here anyway)
        top_ids, top_weights = _token_topk(logits_ptr, stride_pe, E, TOP_K, BLOCK_TOP, BLOCK_E)
        offs_top = tl.arange(0, BLOCK_TOP)
        tl.store(weights_ptr + t * TOP_K + offs_top, top_weights, mask=offs_top < TOP_K)
        tl.store(ids_ptr + t * TOP_K + offs_top, top_ids, mask=offs_top < TOP_K)
        expert = tl.sum(tl.where(offs_top == k, top_ids, 0), 0)
    else:
        expert = _kth_expert(logits_ptr, stride_pe, E, k, BLOCK_E)
    if EP:
        local = expert - FIRST
        if (local >= 0) & (local < EL):
            _up_gemv_rows(x_ptr, w13_ptr, h_ptr, w13_s_ptr, local, pair, pid_n, H, I, BLOCK_N, BLOCK_K, SUB_K,
                          EVEN_K, EXPERTS_FP8)  # fmt: skip
    else:
        _up_gemv_rows(x_ptr, w13_ptr, h_ptr, w13_s_ptr, expert, pair, pid_n, H, I, BLOCK_N, BLOCK_K, SUB_K, EVEN_K,
                      EXPERTS_FP8)  # fmt: skip


@fast_launch
@triton.jit
def _moe_down_gemv_kernel(
    h_ptr, proj_ptr, w2_ptr, shared_down_ptr, weights_ptr, ids_ptr, out_ptr, E, H, I, IS, stride_pm, stride_pe,
    w2_s_ptr, sd_s_ptr, FIRST, EL,
    TOP_K: tl.constexpr, BLOCK_TOP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SUB_K: tl.constexpr, BLOCK_S: tl.constexpr, EXPERTS_FP8: tl.constexpr, SHARED_FP8: tl.constexpr,
    EP: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Token-major: program (n, t) -> out[t, offs_n] = sum_k weight_k * w2[e_k][offs_n] @ h[t, k] (k in order),
    + sigmoid(gate logit) * shared_down[offs_n] @ (silu(gate) * up). All K experts' rows load as one
    [BLOCK_TOP, BLOCK_N, BLOCK_K] tile (many independent 16-byte loads in flight); the sum over experts stays in
    registers: no partials, no counters, no atomics, bit-reproducible. The shared expert's rows [BLOCK_N, Is]
    load before the wait (weights: under PDL they stream while the up kernel finishes); its activation, the
    routing weights and the gate logit load with the ids, and its product is taken before the experts' loop, which
    frees its rows' registers and leaves no load behind the loop (35B step 2.0136 -> 1.9988 ms on the H200; the
    same loads with the product after the loop: 2.0281, results/ab_decode_down_hoist.json). EP: the experts other
    ranks hold are masked lanes (no loads: their products are 0); the shared expert's rows are this rank's slice."""
    allow_dependents(PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, H - 1).to(tl.int64)  # rows past H re-read row H - 1; the store drops them
    offs_s = tl.arange(0, BLOCK_S)
    s_mask = offs_s < IS
    ws = tl.load(shared_down_ptr + (rows * IS)[:, None] + offs_s[None, :], mask=s_mask[None, :], other=0.0)
    ws = ws.to(tl.float32)  # [BLOCK_N, BLOCK_S]
    if SHARED_FP8:  # column j is in scale block j // 128
        s_cols = sd_s_ptr + (rows * tl.cdiv(IS, 128))[:, None] + (offs_s // 128)[None, :]
        ws = ws * tl.load(s_cols, mask=s_mask[None, :], other=0.0)
    wait_for_producers(PDL)
    t = tl.program_id(1)  # the token: its routing, its h rows, its proj row and its output row
    ids_ptr += t * TOP_K
    weights_ptr += t * TOP_K
    h_ptr += t * TOP_K * I
    proj_ptr += t * stride_pm
    out_ptr += t * H
    offs_top = tl.arange(0, BLOCK_TOP)
    top_mask = offs_top < TOP_K
    ids = tl.load(ids_ptr + offs_top, mask=top_mask, other=0)
    # The shared expert first, in the ids' round trip: A = silu(gate) * up from proj, rounded like the torch path
    # (in proj's dtype), its rows (loaded before the wait) consumed here and freed before the experts' loop.
    gate = tl.load(proj_ptr + (E + offs_s) * stride_pe, mask=s_mask, other=0.0)
    up = tl.load(proj_ptr + (E + IS + offs_s) * stride_pe, mask=s_mask, other=0.0)
    weights = tl.load(weights_ptr + offs_top, mask=top_mask, other=0.0)
    scale = tl.sigmoid(tl.load(proj_ptr + (E + 2 * IS) * stride_pe).to(tl.float32))
    gate = gate.to(tl.float32)
    a_shared = ((gate * tl.sigmoid(gate)).to(up.dtype) * up).to(tl.float32)
    acc_shared = tl.sum(ws * a_shared[None, :], 1)
    if EP:  # indices into this rank's experts; the others' lanes masked off
        ids -= FIRST
        top_mask &= (ids >= 0) & (ids < EL)
        ids = tl.where(top_mask, ids, 0)
    w_ptrs = w2_ptr + (ids.to(tl.int64) * (H * I))[:, None, None] + (rows * I)[None, :, None]  # [TOP, N, 1]
    if EXPERTS_FP8:
        kb_i = tl.cdiv(I, 128)
        w_scales = w2_s_ptr + (ids.to(tl.int64) * (H * kb_i))[:, None] + (rows * kb_i)[None, :]  # [TOP, N], K block 0
        acc = _down_gemv_fp8(h_ptr, w_ptrs, w_scales, offs_top, top_mask, I, BLOCK_N, BLOCK_K, SUB_K)
    else:
        acc = tl.zeros((BLOCK_TOP, BLOCK_N), tl.float32)
        for k0 in range(0, I, BLOCK_K):
            w, a = _down_tiles(h_ptr, w_ptrs, offs_top, top_mask, k0, I, BLOCK_K)
            acc += tl.sum(w.to(tl.float32) * a.to(tl.float32)[:, None, :], 2)
    routed = tl.sum(acc * weights[:, None], 0)  # [BLOCK_N], fixed order
    out = routed + scale * acc_shared
    tl.store(out_ptr + offs_n, out.to(out_ptr.dtype.element_ty), mask=offs_n < H)


def moe_block_gemv(
    x, proj, w13, w2, shared_down_proj, top_k, config, scratch, scales, experts_fp8, shared_fp8, first=None
) -> torch.Tensor:  # fmt: skip
    """The block for M <= DECODE_MAX_M tokens in two GEMV-style launches (config["BLOCK_M"] == 1); moe_block_decode
    has checked the scales (the flags, check_scales'). first: expert parallel, w13 / w2 hold experts first .. first
    + El - 1 of the E = proj's router columns (None: all of them). x, proj and the result: as moe_block_decode's."""
    H = x.shape[-1]
    M = x.numel() // H
    El, I = w2.shape[0], w2.shape[2]
    IS = shared_down_proj.shape[1]
    E = router_experts(proj, IS)
    ep = {"FIRST": first or 0, "EL": El, "EP": first is not None}
    up, down = config["up"], config["down"]
    block_top = next_power_of_2(top_k)
    w13_scale, w2_scale, shared_down_scale = scales
    w13_s, w2_s = (w13_scale.contiguous(), w2_scale.contiguous()) if experts_fp8 else (w13, w2)  # unread if dense
    sd_s = shared_down_scale.contiguous() if shared_fp8 else shared_down_proj
    proj, stride_pm, stride_pe = _row_strides(proj)
    on = pdl(x)
    _moe_up_gemv_kernel[(cdiv(I, up["BLOCK_N"]), M * top_k)](
        x, proj, w13, scratch["h"], scratch["f32"], scratch["i32"], E, H, I, stride_pm, stride_pe, w13_s, ep["FIRST"],
        ep["EL"], TOP_K=top_k, BLOCK_TOP=block_top, BLOCK_E=next_power_of_2(E), EVEN_K=H % up["BLOCK_K"] == 0,
        SUB_K=min(up["BLOCK_K"], SCALE_BLOCK_K), EXPERTS_FP8=experts_fp8, EP=ep["EP"], PDL=on, launch_pdl=on, **up,
    )  # fmt: skip
    _moe_down_gemv_kernel[(cdiv(H, down["BLOCK_N"]), M)](
        scratch["h"], proj, w2, shared_down_proj, scratch["f32"], scratch["i32"], scratch["out"], E, H, I, IS,
        stride_pm, stride_pe, w2_s, sd_s, ep["FIRST"], ep["EL"], TOP_K=top_k, BLOCK_TOP=block_top,
        BLOCK_S=next_power_of_2(IS), SUB_K=min(down["BLOCK_K"], SCALE_BLOCK_K), EXPERTS_FP8=experts_fp8,
        SHARED_FP8=shared_fp8, EP=ep["EP"], PDL=on, launch_pdl=on, **down,
    )  # fmt: skip
    return scratch["out"]


# ----------------------------------------------------------------------------------------------- prefill (M > 64)


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
def _up_tile_fp8(x_ptr, xs_ptr, w_ptr, h_ptr, pairs, row_mask, offs_n, H, I, s_ptr, TOP_K: tl.constexpr):
    """_up_tile with fp8 experts on the sorted prefill path (A_FP8): x_ptr holds the fp8 token rows [M, H] and
    xs_ptr their scales [M, ceil(H / 128)] (kernels/fp8.quantize_activations), gathered by token; both products are
    FP8 x FP8, each 128-column step's scaled by the token's and the weight rows' scales."""
    tokens = (pairs // TOP_K).to(tl.int64)
    n_mask = offs_n < I
    kb = tl.cdiv(H, 128)
    s_gate = s_ptr + tl.minimum(offs_n, I - 1).to(tl.int64) * kb  # [BLOCK_N]; up rows are I further
    xs_ptrs = xs_ptr + tokens * kb  # [BLOCK_M], at K block 0
    acc_gate = tl.zeros((pairs.shape[0], offs_n.shape[0]), tl.float32)
    acc_up = tl.zeros((pairs.shape[0], offs_n.shape[0]), tl.float32)
    for k0 in range(0, H, 128):
        offs_k = k0 + tl.arange(0, 128)
        k_mask = offs_k < H
        a = tl.load(x_ptr + tokens[:, None] * H + offs_k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        a_scale = tl.load(xs_ptrs + k0 // 128, mask=row_mask, other=0.0)  # [BLOCK_M]
        w_offs = offs_n[None, :] * H + offs_k[:, None]  # [128, BLOCK_N], gate rows; up rows are I further
        w_mask = k_mask[:, None] & n_mask[None, :]
        w_gate = tl.load(w_ptr + w_offs, mask=w_mask, other=0.0)
        w_up = tl.load(w_ptr + I * H + w_offs, mask=w_mask, other=0.0)
        s_g, s_u = tl.load(s_gate + k0 // 128), tl.load(s_gate + I * kb + k0 // 128)
        acc_gate += tl.dot(a, w_gate) * (a_scale[:, None] * s_g[None, :])
        acc_up += tl.dot(a, w_up) * (a_scale[:, None] * s_u[None, :])
    h = acc_gate * tl.sigmoid(acc_gate) * acc_up
    h_offs = pairs.to(tl.int64)[:, None] * I + offs_n[None, :]
    tl.store(h_ptr + h_offs, h.to(h_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


@triton.jit
def _down_acc_fp8(h_ptr, hs_ptr, w_ptr, pairs, row_mask, offs_n, H, I, s_ptr):
    """_down_acc with fp8 experts on the sorted prefill path (A_FP8): h_ptr holds the fp8 pair rows [P, I] and
    hs_ptr their scales [P, ceil(I / 128)]; each 128-column step FP8 x FP8, scaled by the pair's and the weight
    rows' scales -> [BLOCK_M, BLOCK_N] fp32."""
    rows = pairs.to(tl.int64)
    n_mask = offs_n < H
    kb = tl.cdiv(I, 128)
    s_ptrs = s_ptr + tl.minimum(offs_n, H - 1).to(tl.int64) * kb  # [BLOCK_N]
    hs_ptrs = hs_ptr + rows * kb  # [BLOCK_M], at K block 0
    acc = tl.zeros((pairs.shape[0], offs_n.shape[0]), tl.float32)
    for k0 in range(0, I, 128):
        offs_k = k0 + tl.arange(0, 128)
        k_mask = offs_k < I
        a = tl.load(h_ptr + rows[:, None] * I + offs_k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        a_scale = tl.load(hs_ptrs + k0 // 128, mask=row_mask, other=0.0)  # [BLOCK_M]
        w = tl.load(w_ptr + offs_n[None, :] * I + offs_k[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        w_scale = tl.load(s_ptrs + k0 // 128)  # [BLOCK_N]
        acc += tl.dot(a, w) * (a_scale[:, None] * w_scale[None, :])
    return acc


@triton.jit
def _sub_tile(row_mask, BLOCK_M: tl.constexpr, SUB_TILES: tl.constexpr):
    """How many times to halve a block's rows: the largest s <= SUB_TILES whose BLOCK_M >> s rows still hold the
    block's real ones (they come first: a group's padding is at its end), so a tail block of a few pairs runs
    a tile of a quarter or half the rows instead of the whole one (0 when SUB_TILES is 0)."""
    tier = 0
    if SUB_TILES >= 1:
        real = tl.sum(row_mask.to(tl.int32), 0)
        tier = (real <= BLOCK_M // 2).to(tl.int32)
        if SUB_TILES >= 2:
            tier += (real <= BLOCK_M // 4).to(tl.int32)
    return tier


@triton.jit
def _block_rows(sorted_ptr, block, P, BLOCK_M: tl.constexpr, ROWS: tl.constexpr):
    """The first ROWS pair ids of block `block` and their mask."""
    pairs = tl.load(sorted_ptr + block * BLOCK_M + tl.arange(0, ROWS))
    return pairs, pairs < P


@triton.jit
def _up_rows(x_ptr, xs_ptr, w_ptr, h_ptr, pairs, row_mask, offs_n, H, I, s_ptr, TOP_K: tl.constexpr,
             BLOCK_K: tl.constexpr, A_FP8: tl.constexpr):  # fmt: skip
    if A_FP8:
        _up_tile_fp8(x_ptr, xs_ptr, w_ptr, h_ptr, pairs, row_mask, offs_n, H, I, s_ptr, TOP_K)
    else:
        _up_tile(x_ptr, w_ptr, h_ptr, pairs, row_mask, offs_n, H, I, s_ptr, TOP_K, BLOCK_K, False)


@fast_launch
@triton.jit
def _moe_up_sorted_kernel(
    x_ptr, w13_ptr, h_ptr, sorted_ptr, ends_ptr, P, E, H, I, w13_s_ptr, xs_ptr,
    TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    A_FP8: tl.constexpr, SUB_TILES: tl.constexpr,
):  # fmt: skip
    """h[pairs, offs_n] = silu(x[t] @ gate^T) * (x[t] @ up^T) for one block of an expert's pairs. A_FP8: the
    experts are fp8 and x is too, with its per-(token, 128-group) scales at xs (FP8 x FP8; BLOCK_K = 128).
    SUB_TILES: a block with few real rows runs a tile of BLOCK_M / 2 or / 4 rows (_sub_tile)."""
    # Axis 0 walks N tiles of one block, so neighbouring programs share the block's activations.
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    block = tl.program_id(1)
    expert, pairs, row_mask, used = _sorted_block(ends_ptr, sorted_ptr, block, E, P, BLOCK_M, BLOCK_E)
    if used:
        w_ptr = w13_ptr + expert.to(tl.int64) * (2 * I * H)
        s_ptr = w13_s_ptr
        if A_FP8:
            tl.static_assert(BLOCK_K == 128, "FP8 x FP8 steps one 128-wide scale group per K step")
            s_ptr = w13_s_ptr + expert.to(tl.int64) * (2 * I * tl.cdiv(H, 128))
        tier = _sub_tile(row_mask, BLOCK_M, SUB_TILES)
        if tier == 2:
            quarter, quarter_mask = _block_rows(sorted_ptr, block, P, BLOCK_M, BLOCK_M // 4)
            _up_rows(x_ptr, xs_ptr, w_ptr, h_ptr, quarter, quarter_mask, offs_n, H, I, s_ptr, TOP_K, BLOCK_K, A_FP8)
        elif tier == 1:
            half, half_mask = _block_rows(sorted_ptr, block, P, BLOCK_M, BLOCK_M // 2)
            _up_rows(x_ptr, xs_ptr, w_ptr, h_ptr, half, half_mask, offs_n, H, I, s_ptr, TOP_K, BLOCK_K, A_FP8)
        else:
            _up_rows(x_ptr, xs_ptr, w_ptr, h_ptr, pairs, row_mask, offs_n, H, I, s_ptr, TOP_K, BLOCK_K, A_FP8)


@triton.jit
def _down_rows(h_ptr, hs_ptr, w_ptr, out_ptr, weights_ptr, pairs, row_mask, offs_n, H, I, s_ptr,
               BLOCK_K: tl.constexpr, A_FP8: tl.constexpr):  # fmt: skip
    """partial[pairs, offs_n] = topk_weight * h[pairs] @ w2^T for the rows `pairs` of one expert."""
    if A_FP8:
        acc = _down_acc_fp8(h_ptr, hs_ptr, w_ptr, pairs, row_mask, offs_n, H, I, s_ptr)
    else:
        acc = _down_acc(h_ptr, w_ptr, pairs, row_mask, offs_n, H, I, s_ptr, BLOCK_K, False)
    rows = pairs.to(tl.int64)
    scale = tl.load(weights_ptr + rows, mask=row_mask, other=0.0)
    out = (acc * scale[:, None]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows[:, None] * H + offs_n[None, :], out, mask=row_mask[:, None] & (offs_n < H)[None, :])


@fast_launch
@triton.jit
def _moe_down_sorted_kernel(
    h_ptr, w2_ptr, out_ptr, weights_ptr, sorted_ptr, ends_ptr, P, E, H, I, w2_s_ptr, hs_ptr,
    BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    A_FP8: tl.constexpr, SUB_TILES: tl.constexpr,
):  # fmt: skip
    """partial[pairs, offs_n] = topk_weight * h[pairs] @ w2^T, in out's dtype. A_FP8: fp8 experts and an fp8 h
    with its per-(pair, 128-group) scales at hs (FP8 x FP8; BLOCK_K = 128). SUB_TILES: as the up kernel."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    block = tl.program_id(1)
    expert, pairs, row_mask, used = _sorted_block(ends_ptr, sorted_ptr, block, E, P, BLOCK_M, BLOCK_E)
    if used:
        w_ptr = w2_ptr + expert.to(tl.int64) * (H * I)
        s_ptr = w2_s_ptr
        if A_FP8:
            tl.static_assert(BLOCK_K == 128, "FP8 x FP8 steps one 128-wide scale group per K step")
            s_ptr = w2_s_ptr + expert.to(tl.int64) * (H * tl.cdiv(I, 128))
        tier = _sub_tile(row_mask, BLOCK_M, SUB_TILES)
        if tier == 2:
            quarter, quarter_mask = _block_rows(sorted_ptr, block, P, BLOCK_M, BLOCK_M // 4)
            _down_rows(h_ptr, hs_ptr, w_ptr, out_ptr, weights_ptr, quarter, quarter_mask, offs_n, H, I, s_ptr,
                       BLOCK_K, A_FP8)  # fmt: skip
        elif tier == 1:
            half, half_mask = _block_rows(sorted_ptr, block, P, BLOCK_M, BLOCK_M // 2)
            _down_rows(h_ptr, hs_ptr, w_ptr, out_ptr, weights_ptr, half, half_mask, offs_n, H, I, s_ptr, BLOCK_K,
                       A_FP8)  # fmt: skip
        else:
            _down_rows(h_ptr, hs_ptr, w_ptr, out_ptr, weights_ptr, pairs, row_mask, offs_n, H, I, s_ptr, BLOCK_K,
                       A_FP8)  # fmt: skip


COMBINE_BLOCK_H = 1024  # hidden columns per program of the prefill combine (and of its shared activation)


@fast_launch
@triton.jit
def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, N, stride_g, stride_u, BLOCK: tl.constexpr):
    """out[t] = silu(gate[t]) * up[t] (the shared expert's activation; rows of the fused projection read in place)
    with the torch path's roundings: silu rounded to the activation dtype, then the product. Program (token,
    block of columns)."""
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = n < N
    dt = out_ptr.dtype.element_ty
    g = tl.load(gate_ptr + t * stride_g + n, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + t * stride_u + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * N + n, ((g * tl.sigmoid(g)).to(dt).to(tl.float32) * u).to(dt), mask=mask)


@fast_launch
@triton.jit
def _combine_kernel(partials_ptr, shared_ptr, gate_logit_ptr, out_ptr, H, stride_g, TOP_K: tl.constexpr,
                    BLOCK_H: tl.constexpr):  # fmt: skip
    """out[t] = sum_k partials[t * TOP_K + k] + sigmoid(gate_logit[t]) * shared[t] with the torch composition's
    roundings: the k sum in fp32 in k order, then each of routed, sigmoid, the gated shared term and the sum
    rounded to the activation dtype. Program (token, block of H columns)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = h < H
    dt = out_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_H,), tl.float32)
    for k in tl.static_range(TOP_K):
        acc += tl.load(partials_ptr + (t * TOP_K + k) * H + h, mask=mask, other=0.0).to(tl.float32)
    gate = tl.sigmoid(tl.load(gate_logit_ptr + t * stride_g).to(tl.float32)).to(dt).to(tl.float32)
    shared = (gate * tl.load(shared_ptr + t * H + h, mask=mask, other=0.0).to(tl.float32)).to(dt).to(tl.float32)
    tl.store(out_ptr + t * H + h, (acc.to(dt).to(tl.float32) + shared).to(dt), mask=mask)


def routed_partials_into(
    x, w13, w2, topk_weights, topk_ids, h, partials, config=None, w13_scale=None, w2_scale=None, others=False
) -> torch.Tensor:
    """Each (token, k) pair's weighted expert output -> partials [P, H] (rows t * K + k), on the aligned grouped
    path with caller-owned scratch: h [P, I] and partials in x's dtype (tests pass NaN-filled ones, so a row the
    kernels forget reaches the output). config overrides the table (tests, tuner); the scales: those of fp8
    experts, which run FP8 x FP8: x quantized by the pre-pass before the up kernel, h after it (four launches).
    others: ids == E name pairs of experts this rank does not hold (expert parallel), grouped after the E experts
    and never computed: their partials rows keep what the caller put there."""
    M, H = x.shape
    E, I = w2.shape[0], w2.shape[2]
    K = topk_ids.shape[1]
    P = M * K
    config = config or get_config(max(M, DECODE_MAX_M + 1), E, H, I, w13.dtype)
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    fp8, _ = check_scales(config, w13, w2, None, w13_scale, w2_scale, None)
    if fp8:
        check_prefill_fp8_config(config)
    w13_s, w2_s = (w13_scale.contiguous(), w2_scale.contiguous()) if fp8 else (w13, w2)  # unread if dense
    ids = topk_ids.contiguous()
    weights = topk_weights.float().contiguous()
    block_m, up, down = config["BLOCK_M"], config["up"], config["down"]
    sub = config.get("SUB_TILES", 0)
    if sub not in (0, 1, 2) or block_m >> sub < 16:
        raise ValueError(f"moe config: SUB_TILES is 0, 1 or 2, with BLOCK_M >> SUB_TILES >= 16 (tl.dot): {config}")
    sorted_pairs, ends = align_pairs(ids, E + others, block_m)  # the kernels skip blocks past the E-th group
    num_blocks, block_e = sorted_pairs.numel() // block_m, next_power_of_2(E)
    x_a, x_s = quantize_activations(x) if fp8 else (x, x)  # x_s unread if dense
    _moe_up_sorted_kernel[(cdiv(I, up["BLOCK_N"]), num_blocks)](
        x_a, w13, h, sorted_pairs, ends, P, E, H, I, w13_s, x_s,
        TOP_K=K, BLOCK_E=block_e, BLOCK_M=block_m, A_FP8=fp8, SUB_TILES=sub, **up,
    )  # fmt: skip
    h_a, h_s = quantize_activations(h) if fp8 else (h, h)
    _moe_down_sorted_kernel[(cdiv(H, down["BLOCK_N"]), num_blocks)](
        h_a, w2, partials, weights, sorted_pairs, ends, P, E, H, I, w2_s, h_s,
        BLOCK_E=block_e, BLOCK_M=block_m, A_FP8=fp8, SUB_TILES=sub, **down,
    )  # fmt: skip
    return partials


def fused_moe_into(
    x, w13, w2, topk_weights, topk_ids, h, partials, config=None, w13_scale=None, w2_scale=None
) -> torch.Tensor:
    """The routed experts' sum per token [M, H] (routed_partials_into, then the k sum in fixed order: no atomics,
    bit-reproducible)."""
    routed_partials_into(x, w13, w2, topk_weights, topk_ids, h, partials, config, w13_scale, w2_scale)
    return partials.view(x.shape[0], topk_ids.shape[1], x.shape[1]).sum(1)


def fused_moe(
    x: torch.Tensor,  # [M, H]
    w13: torch.Tensor,  # [E, 2I, H], gate rows first
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [M, K]
    topk_ids: torch.Tensor,  # [M, K]
    w13_scale: torch.Tensor | None = None,  # [E, 2I, ceil(H / 128)] when w13 is fp8 (kernels/fp8.py)
    w2_scale: torch.Tensor | None = None,  # [E, H, ceil(I / 128)] when w2 is fp8
) -> torch.Tensor:
    """sum_k topk_weights[:, k] * w2[e] @ (silu(gate) * up), e = topk_ids[:, k] -> [M, H] in x's dtype."""
    M, K = topk_ids.shape
    if M == 0:
        return torch.empty_like(x)
    h, partials = x.new_empty(M * K, w2.shape[2]), x.new_empty(M * K, x.shape[1])
    return fused_moe_into(x, w13, w2, topk_weights, topk_ids, h, partials, None, w13_scale, w2_scale)


def moe_block_prefill(
    x, proj, w13, w2, shared_down_proj, top_k, w13_scale=None, w2_scale=None, shared_down_scale=None, first=None
) -> torch.Tensor:
    """The block above decode_max_m tokens: route, the aligned grouped experts' partials, the shared expert (its
    activation one kernel, its down projection on cuBLAS; an fp8 one dequantized per call), then one kernel that
    sums each token's partials and adds the gated shared output (naive.moe_block's roundings). first: expert
    parallel (moe_block_ep): w13 / w2 hold experts first .. first + El - 1 of the router's; the other pairs'
    partials are 0."""
    El, Is = w13.shape[0], shared_down_proj.shape[1]
    E = router_experts(proj, Is)
    router_logits, gate, up, gate_logit = split_projection(proj, E, Is)
    topk_weights, topk_ids = route(router_logits, top_k)
    (M, H), P = x.shape, topk_ids.numel()
    h, partials = x.new_empty(P, w2.shape[2]), x.new_empty(P, H) if first is None else x.new_zeros(P, H)
    if first is not None:  # this rank's experts as 0 .. El - 1, the others' pairs as El (never computed)
        local = topk_ids - first
        topk_ids = torch.where((local >= 0) & (local < El), local, El)
    others = first is not None
    routed_partials_into(x, w13, w2, topk_weights, topk_ids, h, partials, None, w13_scale, w2_scale, others)
    down = shared_down_proj
    if shared_down_scale is not None:
        down = dequantize_rows(shared_down_proj, shared_down_scale, x.dtype)
    act = torch.empty((M, Is), dtype=x.dtype, device=x.device)
    _silu_mul_kernel[(M, cdiv(Is, COMBINE_BLOCK_H))](
        gate, up, act, Is, gate.stride(0), up.stride(0), BLOCK=COMBINE_BLOCK_H
    )
    shared = F.linear(act, down)
    out = torch.empty((M, H), dtype=x.dtype, device=x.device)
    _combine_kernel[(M, cdiv(H, COMBINE_BLOCK_H))](
        partials, shared, gate_logit, out, H, gate_logit.stride(0), TOP_K=top_k, BLOCK_H=COMBINE_BLOCK_H
    )
    return out


# ----------------------------------------------------------------------------------------------- the block


def _moe_block(x, proj, w13, w2, shared_down_proj, top_k, *scales, first=None):
    """The block on x [..., H] and proj [..., E + 2 Is + 1] -> x's shape: the decode kernels read the model's
    [B, T, ...] activations as they are; the prefill path works on their rows."""
    M = x.numel() // x.shape[-1]
    if M == 0:
        return torch.empty_like(x)
    if M <= decode_max_m(w13.dtype):
        return moe_block_decode(x, proj, w13, w2, shared_down_proj, top_k, None, None, *scales, first=first)
    rows, proj = x.reshape(M, x.shape[-1]), proj.reshape(M, proj.shape[-1])
    return moe_block_prefill(rows, proj, w13, w2, shared_down_proj, top_k, *scales, first=first).view(x.shape)


@torch.library.custom_op("qmoe::moe_block", mutates_args=())
def _moe_block_op(
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
    return _moe_block(x, proj, w13, w2, shared_down_proj, top_k, w13_scale, w2_scale, shared_down_scale)


@_moe_block_op.register_fake
def _(x, proj, w13, w2, shared_down_proj, top_k, w13_scale=None, w2_scale=None, shared_down_scale=None):
    return torch.empty_like(x)


def moe_block(
    x: torch.Tensor,  # [..., H]: M rows (the model's [B, T, H] as it is)
    proj: torch.Tensor,  # [..., E + 2 Is + 1]: router logits | shared gate | shared up | shared-expert gate logit
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    shared_down_proj: torch.Tensor,  # [H, Is]
    top_k: int,
    *scales: torch.Tensor | None,  # w13_scale, w2_scale, shared_down_scale of fp8 weights (kernels/fp8.py), or none
) -> torch.Tensor:
    """The sparse MoE block after its fused input projection -> x's shape: up to decode_max_m tokens (16 dense, 64
    fp8) in two launches (moe_block_decode), above on the aligned grouped path. Through the custom op only while
    tracing; eager launches directly."""
    if kernels.tracing():
        return _moe_block_op(x, proj, w13, w2, shared_down_proj, top_k, *scales)
    return _moe_block(x, proj, w13, w2, shared_down_proj, top_k, *scales)


# ----------------------------------------------------------------------------------------------- expert parallel


def _moe_block_ep(x, proj, w13, w2, shared_down_proj, top_k, first, *scales):
    return _moe_block(x, proj, w13, w2, shared_down_proj, top_k, *scales, first=first)


@torch.library.custom_op("qmoe::moe_block_ep_triton", mutates_args=())
def _moe_block_ep_op(
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
    return _moe_block_ep(x, proj, w13, w2, shared_down_proj, top_k, first, w13_scale, w2_scale, shared_down_scale)


@_moe_block_ep_op.register_fake
def _(x, *args, **kwargs):
    return torch.empty_like(x)


def moe_block_ep(
    x: torch.Tensor,  # [..., H]: M rows
    proj: torch.Tensor,  # [..., E + 2 Is + 1]: the whole router (every rank routes), this rank's shared slices
    w13: torch.Tensor,  # [El, 2I, H]: experts first .. first + El - 1
    w2: torch.Tensor,  # [El, H, I]
    shared_down_proj: torch.Tensor,  # [H, Is]: this rank's slice of the shared expert
    top_k: int,
    first: int,
    *scales: torch.Tensor | None,  # w13_scale, w2_scale, shared_down_scale of fp8 weights, or none (as moe_block)
) -> torch.Tensor:
    """Expert parallel: this rank's share of the block -> x's shape; pairs routed to another rank's experts weigh 0
    (the all-reduce after the block adds the other shares), on the kernels one GPU runs at that M: M = 1 the GEMV
    kernels (a program whose expert another rank holds loads nothing), M <= decode_max_m the decode kernels (a
    grid column per expert of this rank, and one that marks the other ranks' pairs, whose partials the down kernel
    writes as 0), above the aligned grouped path (the other ranks' pairs grouped after this rank's experts and
    skipped)."""
    if kernels.tracing():
        return _moe_block_ep_op(x, proj, w13, w2, shared_down_proj, top_k, first, *scales)
    return _moe_block_ep(x, proj, w13, w2, shared_down_proj, top_k, first, *scales)
