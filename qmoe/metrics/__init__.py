"""Metrics: latency statistics, memory peaks, environment, results.json, wandb."""
