"""FP8 weights: the one layout every fp8 kernel reads, and the conversions into and out of it.

A quantized weight is a pair: `weight` float8_e4m3fn [..., N, K] and `scale` float32 [..., N, ceil(K / 128)],
one multiplier per (row, 128-wide K block): w[..., n, k] = weight[..., n, k] * scale[..., n, k // 128].
Row-granular scales let projections of any row count be concatenated into one fused [sum n_i, K] buffer (the
router's 256 rows, the shared-expert gate's 1, DeltaNet's b / a 32 each) without a 128-row block straddling two of
them. Both checkpoint formats map onto it exactly: a 128x128 block scale is repeated over its block's rows
(`rows_from_blocks`), a per-channel scale [N, 1] over the K blocks (`rows_from_channels`). The scales cost 1/32 of
the fp8 bytes.
"""

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
BLOCK_K = 128  # K columns per scale
QUANTIZE_CHUNK = 1 << 26  # elements quantized per step: bounds the fp32 temporaries (256 MB)


def k_blocks(K: int) -> int:
    return -(-K // BLOCK_K)


def scale_shape(shape) -> tuple:
    """The scale's shape for a weight of `shape` [..., N, K] -> [..., N, ceil(K / 128)]."""
    return (*shape[:-1], k_blocks(shape[-1]))


def expand_scale(scale: torch.Tensor, K: int) -> torch.Tensor:
    """[..., N, ceil(K / 128)] -> [..., N, K]: each scale repeated over its K block."""
    return scale.repeat_interleave(BLOCK_K, dim=-1)[..., :K]


def dequantize(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """weight [..., N, K] fp8 * scale [..., N, Kb] -> [..., N, K] in dtype (computed in fp32, rounded once)."""
    return (weight.float() * expand_scale(scale.float(), weight.shape[-1])).to(dtype)


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] -> (fp8 [..., N, K], scale fp32 [..., N, Kb]) with scale = amax of the (row, K block) / 448,
    so each block's largest value maps onto e4m3's largest. An all-zero block gets scale 1."""
    K = w.shape[-1]
    pad = k_blocks(K) * BLOCK_K - K
    blocks = torch.nn.functional.pad(w.float(), (0, pad)).unflatten(-1, (-1, BLOCK_K))  # [..., N, Kb, 128]
    amax = blocks.abs().amax(-1)  # [..., N, Kb]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).flatten(-2)[..., :K].to(FP8)
    return q, scale


@torch.no_grad()
def quantize_into(weight: torch.Tensor, scale: torch.Tensor, w: torch.Tensor) -> None:
    """Quantize w [..., N, K] (any float dtype, on weight's device) into weight (fp8) and scale, a few rows at a
    time, so the fp32 temporaries stay small whatever the tensor's size."""
    rows = w.reshape(-1, w.shape[-1])
    step = max(1, QUANTIZE_CHUNK // max(1, w.shape[-1]))
    q_rows, s_rows = weight.view(-1, weight.shape[-1]), scale.view(-1, scale.shape[-1])
    for r in range(0, rows.shape[0], step):
        q_rows[r : r + step], s_rows[r : r + step] = quantize_rows(rows[r : r + step].to(weight.device))


def rows_from_blocks(scale_inv: torch.Tensor, N: int, K: int, block: tuple[int, int]) -> torch.Tensor:
    """A block-FP8 checkpoint's weight_scale_inv [..., ceil(N / bn), ceil(K / bk)] (bk a multiple of 128) ->
    [..., N, ceil(K / 128)] fp32."""
    bn, bk = block
    rows = scale_inv.float().repeat_interleave(bn, dim=-2)[..., :N, :]
    return rows.repeat_interleave(bk // BLOCK_K, dim=-1)[..., : k_blocks(K)]


def rows_from_channels(scale: torch.Tensor, K: int) -> torch.Tensor:
    """A per-channel checkpoint's weight_scale [..., N, 1] -> [..., N, ceil(K / 128)] fp32."""
    return scale.float().expand(*scale.shape[:-1], k_blocks(K)).contiguous()
