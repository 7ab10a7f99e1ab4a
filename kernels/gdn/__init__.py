"""Gated DeltaNet: causal conv1d over q/k/v, the gated delta rule (chunked prefill, recurrent decode), gated norm."""
