"""Dense projections y = x @ w^T: a skinny GEMM (GEMV at M = 1) for decode, cuBLAS for prefill."""


def aligned_rows(n: int, element_size: int) -> int:
    """n rounded up to a multiple of 16 bytes of elements: the N at which cuBLAS runs a GEMM on its aligned kernels
    (another N takes an sm75 `align1` kernel at ~77 TFLOP/s: triton._prefill_gemm). fuse_rows_ pads the fused
    buffers' storage to it, triton.padded_rows reads that padding."""
    align = 16 // element_size
    return -(-n // align) * align
