"""Logits -> token id: greedy, or temperature + top-k + top-p + min-p with stateless per-row randomness."""
