"""The sparse MoE block: softmax top-k router, routed SwiGLU experts (fused gate_up), gated shared expert."""
