"""Gated full attention pieces: q/k RMSNorm + partial RoPE, and attention over the static KV cache."""
