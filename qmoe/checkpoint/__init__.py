"""Hugging Face Qwen3.5-MoE checkpoints: load (safetensors, shard by shard), write synthetic ones, and the
tokenizer."""

from qmoe.checkpoint.loader import CheckpointError, CheckpointInfo, load_checkpoint, read_config, read_eos_token_ids
from qmoe.checkpoint.tokenizer import Tokenizer, load_tokenizer, special_token_ids

SYNTH_NAMES = ("save_model", "write_checkpoint", "write_tokenizer")


def __getattr__(name: str):
    # synth is imported on first use, so `python -m qmoe.checkpoint.synth` does not import it twice
    if name in SYNTH_NAMES:
        from qmoe.checkpoint import synth

        return getattr(synth, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "Tokenizer",
    "load_checkpoint",
    "load_tokenizer",
    "read_config",
    "read_eos_token_ids",
    "special_token_ids",
    *SYNTH_NAMES,
]
