"""The `host` runner: the loop before device support. The host owns the loop state (token, position, sampling
parameters as CPU tensors); every step its inputs go up into the program's `forward`, the logits come back
and are sampled on the CPU with kernels/sampling/naive.sample (the sampler's reference semantics), and the
next token goes back up. Needs a method split whose forward returns logits: split (its `sample` method is not
used) or forward_only.
"""

import torch

from kernels.sampling import naive
from qmoe.runtime.combos import split_error
from qmoe.runtime.executor import ProgramRunner
from qmoe.runtime.generate import sampling_tensors
from qmoe.runtime.ledger import HOST
from qmoe.settings import ConfigError


class HostRunner(ProgramRunner):
    name = "host"

    def __init__(self, program, model, sampling, batch, ledger, cuda_graph: bool = False):
        if error := split_error(self.name, program.settings.method_split):
            raise ConfigError(error)
        super().__init__(program, model, batch, ledger, cuda_graph, graphed=("forward",))
        self.params = sampling_tensors(sampling, batch, "cpu")
        self.greedy = sampling.greedy
        V = model.config.vocab_size
        self.logits_host = torch.empty(batch, V, dtype=torch.float32, pin_memory=model.device.type == "cuda")
        self.pos = 0

    def _forward_sample(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, T] (host) at positions pos.. -> next token [B] (host) sampled on the CPU."""
        B, T = tokens.shape
        forward = self.methods["forward"]
        tokens_in = self.put("forward", forward.input_buffer("tokens", (B, T)), tokens)
        input_pos = torch.full((B,), self.pos, dtype=torch.int64)
        pos_in = self.put("forward", forward.input_buffer("input_pos"), input_pos)
        (logits,) = forward(tokens_in, pos_in, ledger=self.ledger)
        if self.space_of(logits) != HOST:
            logits = self.put("forward", self.logits_host, logits)
        self.pos += T
        step = torch.full((B,), self.pos - 1, dtype=torch.int64)  # the sampler's step: the last input position
        self.last = naive.greedy(logits) if self.greedy else naive.sample(logits, step=step, **self.params)
        return self.last.clone()

    @torch.no_grad()
    def start(self, prompt: torch.Tensor) -> torch.Tensor:
        self.begin_prefill()
        self.pos = 0
        return self._forward_sample(prompt)

    @torch.no_grad()
    def step(self, forced: torch.Tensor | None) -> torch.Tensor:
        self.begin_decode()
        token = self.last if forced is None else torch.where(forced >= 0, forced, self.last)
        return self._forward_sample(token[:, None])
