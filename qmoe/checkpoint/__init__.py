"""Hugging Face Qwen3.5-MoE checkpoints: load (safetensors, memory-mapped, shard by shard), write synthetic ones,
and the tokenizer."""

from qmoe.checkpoint.loader import CheckpointError, CheckpointInfo, load_checkpoint, read_config, read_eos_token_ids
from qmoe.checkpoint.synth import save_model, write_checkpoint, write_tokenizer
from qmoe.checkpoint.tokenizer import Tokenizer, load_tokenizer, special_token_ids

__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "Tokenizer",
    "load_checkpoint",
    "load_tokenizer",
    "read_config",
    "read_eos_token_ids",
    "save_model",
    "special_token_ids",
    "write_checkpoint",
    "write_tokenizer",
]
