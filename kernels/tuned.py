"""Launch configs tuned on a GPU: `kernels/<op>/configs/<GPU name>.json`, written by `experiments/tune_<op>.py`,
read once at import. Nothing autotunes at run time."""

import json
import os
import re
from pathlib import Path

import torch


def gpu_config_path(config_dir: Path, device_name: str) -> Path:
    """The table of GPU `device_name` in `config_dir` ("NVIDIA H200" -> NVIDIA_H200.json)."""
    return config_dir / (re.sub(r"[^A-Za-z0-9]+", "_", device_name).strip("_") + ".json")


def load_table(config_dir: Path, defaults_env: str) -> dict:
    """This process's GPU's table {shape key: {str(M bucket): config}}; empty (the op's defaults) without CUDA,
    without a table for this GPU, or when the environment variable `defaults_env` is 1."""
    if os.environ.get(defaults_env) == "1" or not torch.cuda.is_available():
        return {}
    path = gpu_config_path(config_dir, torch.cuda.get_device_name())
    return json.loads(path.read_text()) if path.exists() else {}
