"""Dense projections y = x @ w^T: a skinny GEMM (GEMV at M = 1) for decode, cuBLAS for prefill."""
