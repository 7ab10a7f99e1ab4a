"""Zero-centred RMSNorm (with an optional fused residual add) and the gated RMSNorm of DeltaNet."""
