"""The methods of an exported program, per `export.method_split`, and their torch.export.

split:        forward(tokens [B, T], input_pos [B]) -> logits [B, V] fp32;  sample(logits, *SAMPLING) -> token [B]
fused:        prefill(tokens [B, T], input_pos, *SAMPLING) -> token [B];  decode(tokens [B, 1], input_pos, *SAMPLING)
forward_only: forward alone (the runner samples on the host).
T is dynamic (1..max_seq_len) in forward and prefill, 1 in decode. SAMPLING = temperature [B] f32, top_k [B] i64,
top_p [B] f32, min_p [B] f32, seed [B] i64, step [B] i64 (the arguments of model.sample).
Caches are the model's buffers (*_cache, *_state), mutated in place by every method; weights are parameters.
"""

import torch
from torch import nn
from torch.export import Dim, ExportedProgram

from qmoe.export.ops import traceable_ops
from qmoe.export.settings import METHOD_SPLITS

SAMPLING = (
    ("temperature", torch.float32),
    ("top_k", torch.int64),
    ("top_p", torch.float32),
    ("min_p", torch.float32),
    ("seed", torch.int64),
    ("step", torch.int64),
)
SAMPLING_NAMES = tuple(name for name, _ in SAMPLING)
INPUT_NAMES = {
    "forward": ("tokens", "input_pos"),
    "sample": ("logits", *SAMPLING_NAMES),
    "prefill": ("tokens", "input_pos", *SAMPLING_NAMES),
    "decode": ("tokens", "input_pos", *SAMPLING_NAMES),
}
OUTPUT_NAMES = {"forward": ("logits",), "sample": ("token",), "prefill": ("token",), "decode": ("token",)}
# (method, output) -> (method, input) that takes it next: forward's logits are what sample samples, a sampled
# token is the next decode step's tokens. The planner puts each pair in one slot (same device permitting).
FEEDS = {
    ("forward", "logits"): ("sample", "logits"),
    ("sample", "token"): ("forward", "tokens"),
    ("prefill", "token"): ("decode", "tokens"),
    ("decode", "token"): ("decode", "tokens"),
}


class Forward(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, tokens, input_pos):
        return self.model(tokens, input_pos)


class Sample(nn.Module):
    """Holds no parameters: the sampler is stateless."""

    def __init__(self, model):
        super().__init__()
        self.sample = model.sample  # a bound method, not a submodule: no weights enter this method

    def forward(self, logits, temperature, top_k, top_p, min_p, seed, step):
        return self.sample(logits, temperature, top_k, top_p, min_p, seed, step)


class ForwardSample(nn.Module):
    """prefill and decode: forward then sample, one method."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, tokens, input_pos, temperature, top_k, top_p, min_p, seed, step):
        return self.model.sample(self.model(tokens, input_pos), temperature, top_k, top_p, min_p, seed, step)


def example_inputs(method: str, model, batch_size: int, max_seq_len: int) -> tuple[dict, dict]:
    """({name: example tensor}, {name: dynamic shape}) for `method`, on the model's device."""
    B, V, device = batch_size, model.lm_head.weight.shape[0], model.device  # V: this rank's vocabulary slice
    T = min(8, max_seq_len) if method in ("forward", "prefill") else 1
    dyn_T = {1: Dim("T", min=1, max=max_seq_len)} if method in ("forward", "prefill") and max_seq_len > 1 else {}
    sampling = {name: torch.zeros(B, dtype=dtype, device=device) for name, dtype in SAMPLING}
    sampling["top_p"].fill_(1.0)
    if method == "sample":
        inputs = {"logits": torch.zeros(B, V, dtype=torch.float32, device=device), **sampling}
        return inputs, {name: {} for name in inputs}
    inputs = {
        "tokens": torch.zeros(B, T, dtype=torch.int64, device=device),
        "input_pos": torch.zeros(B, dtype=torch.int64, device=device),
    }
    if method != "forward":
        inputs.update(sampling)
    return inputs, {name: dyn_T if name == "tokens" else {} for name in inputs}


METHOD_MODULES = {"forward": Forward, "sample": Sample, "prefill": ForwardSample, "decode": ForwardSample}


@torch.no_grad()
def export_methods(model, method_split: str, batch_size: int, max_seq_len: int) -> dict[str, ExportedProgram]:
    """torch.export every method of `method_split` over the live model (weights and caches are not copied:
    the exported programs refer to the model's tensors by name)."""
    programs = {}
    with traceable_ops(model):
        for method in METHOD_SPLITS[method_split]:
            inputs, dynamic = example_inputs(method, model, batch_size, max_seq_len)
            module = METHOD_MODULES[method](model)
            args, shapes = tuple(inputs.values()), tuple(dynamic.values())
            programs[method] = torch.export.export(module, args, dynamic_shapes=shapes, strict=False)
    return programs
