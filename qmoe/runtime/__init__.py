"""Runtime: runners that drive prefill/decode (reference, host, cuda_native) and the transfer ledger."""
