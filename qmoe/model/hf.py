"""Bridge to transformers' Qwen3_5MoeForCausalLM: the test oracle and the baseline in the benchmarks."""

import contextlib
import sys
from pathlib import Path

import torch

from qmoe.model.qwen35_moe import Qwen35MoE, rope_inv_freq

REPO_ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def _without_local_kernels_package():
    """transformers takes a top-level `kernels` on sys.path for the PyPI hub-kernels package (and, in some
    versions, fails to parse its version): hide ours while its model code is imported."""
    saved_modules = {k: v for k, v in sys.modules.items() if k == "kernels" or k.startswith("kernels.")}
    saved_path = list(sys.path)
    for k in saved_modules:
        del sys.modules[k]
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != REPO_ROOT]
    try:
        yield
    finally:
        sys.path[:] = saved_path
        sys.modules.update(saved_modules)


def transformers_qwen35_moe():
    """(Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig), imported safely."""
    with _without_local_kernels_package():
        from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as m
        from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
    return m.Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig


def hf_key(name: str) -> str:
    """Our parameter name -> the key in Qwen3_5MoeForCausalLM's state dict."""
    return name if name.startswith("lm_head.") else f"model.{name}"


@torch.no_grad()
def to_transformers(model: Qwen35MoE, attn_implementation: str = "eager", share_weights: bool = False):
    """A Qwen3_5MoeForCausalLM holding the same weights as `model`, on model's device and dtype: copied, or with
    `share_weights` the very same tensors (both layouts agree), so a 35B model is not held twice."""
    causal_lm, text_config = transformers_qwen35_moe()
    config = text_config(**model.config.to_hf_text_config())
    config._attn_implementation = attn_implementation
    with torch.device("meta"):
        hf = causal_lm(config)
    hf = hf.to(dtype=model.dtype).to_empty(device=model.device)
    hf_state = hf.state_dict()
    ours = dict(model.named_parameters())
    missing = set(hf_state) - {hf_key(n) for n in ours}
    if missing:
        raise KeyError(f"transformers expects tensors qmoe has no counterpart for: {sorted(missing)[:5]}")
    for name, p in ours.items():
        if share_weights:
            hf.get_parameter(hf_key(name)).data = p.data
        else:
            hf_state[hf_key(name)].copy_(p)
    # Non-persistent buffers (rotary inv_freq) were left uninitialised by to_empty.
    rotary = hf.model.rotary_emb
    inv_freq = rope_inv_freq(model.config, model.device)
    rotary.inv_freq.copy_(inv_freq)
    rotary.original_inv_freq.copy_(inv_freq)
    return hf.eval()
