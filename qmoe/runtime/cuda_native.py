"""The `cuda_native` runner: the loop state lives where the program takes it, and sampling runs in the program.

Tokens, positions and sampling parameters are written once into the methods' planned input buffers and stay
there: the positions and the sampler's step advance in place (`add_`). The sampled token is planned in the
next step's token buffer and forward's logits in sample's logits buffer (methods.FEEDS), so neither is copied:
the runner passes them on as they are. Which of those buffers sit on the GPU is the export preset's choice:
with copy_elided all of them do, and the only per-step transfer is the token ids read back (8 bytes per row)
for EOS checks and streaming (no H2D, no D2D); with device_planned / baseline the method boundaries are on the
host and the copy nodes / the delegate move them every call. Splits: split (forward + sample) or fused
(prefill + decode).
The config refuses it without CUDA (settings.validate); the class itself runs the same loop on a CPU delegate,
which is how the CPU tests check its tokens, and on the staged CPU delegate (cpu:1), its ledger.
"""

import torch

from qmoe.export import SAMPLING_NAMES
from qmoe.parallel.collectives import recording
from qmoe.runtime.combos import split_error
from qmoe.runtime.executor import ProgramRunner
from qmoe.settings import ConfigError, SamplingSettings


def advance(*counters: torch.Tensor) -> None:
    """Each counter += 1: one launch for all of them where they share a device (the step's two were two kernels
    outside the CUDA graph)."""
    if len({c.device for c in counters}) == 1:
        torch._foreach_add_(list(counters), 1)
    else:
        for c in counters:
            c.add_(1)


class CudaNativeRunner(ProgramRunner):
    name = "cuda_native"
    # per split: the prefill method, then the methods of a decode step (the ones CUDA graphs replay)
    METHODS = {"split": ("forward", "forward", "sample"), "fused": ("prefill", "decode")}

    def __init__(self, program, model, sampling: SamplingSettings, batch, ledger, cuda_graph: bool = True):
        self.split = program.settings.method_split
        if error := split_error(self.name, self.split):
            raise ConfigError(error)
        # prefill-phase and decode-phase method of each split: they read the same or their own input buffers
        self.first, self.next = self.METHODS[self.split][:2]
        super().__init__(program, model, batch, ledger, cuda_graph, graphed=self.METHODS[self.split][1:])
        if model.device.type == "cuda":  # the token ids stay in one planned buffer: read back beside the next step
            self.read_stream = torch.cuda.Stream(model.device)
        values = {name: getattr(sampling, name) for name in SAMPLING_NAMES if name != "step"}
        for method in self._samplers:  # constants: filled in place once (a fill kernel, nothing is copied)
            for name, value in values.items():
                self.methods[method].input_buffer(name).fill_(value)

    @property
    def _samplers(self) -> tuple[str, ...]:
        return ("sample",) if self.split == "split" else ("prefill", "decode")

    def _inputs(self, method: str, T: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens [B, T], input_pos [B], step [B]) planned buffers of the step that runs `method`."""
        m = self.methods[method]
        sampler = self.methods["sample"] if self.split == "split" else m
        return m.input_buffer("tokens", (self.batch, T)), m.input_buffer("input_pos"), sampler.input_buffer("step")

    def _run(self, method: str, tokens, input_pos, step) -> torch.Tensor:
        """One forward + sample over the bound buffers -> the token ids [B] in their planned output buffer."""
        if self.split == "fused":
            m = self.methods[method]
            params = [m.input_buffer(name) for name in SAMPLING_NAMES if name != "step"]
            self.await_read_back()  # its ids overwrite the ones the last step's read-back copies
            with recording(self.ledger, method):  # collectives of a sharded model
                (token,) = m(tokens, input_pos, *params, step, ledger=self.ledger)
            return token
        with recording(self.ledger, "forward"):
            (logits,) = self.methods["forward"](tokens, input_pos, ledger=self.ledger)
        sample = self.methods["sample"]  # logits are planned in its input buffer: handed over as they are
        params = [sample.input_buffer(name) for name in SAMPLING_NAMES if name != "step"]
        self.await_read_back()  # sample writes the ids the last step's read-back copies (forward only reads them)
        with recording(self.ledger, "sample"):
            (token,) = sample(logits, *params, step, ledger=self.ledger)
        return token

    @torch.no_grad()
    def start(self, prompt: torch.Tensor) -> torch.Tensor:
        self.begin_prefill()
        L = prompt.shape[1]
        tokens, input_pos, step = self._inputs(self.first, L)
        self.put(self.first, tokens, prompt)
        input_pos.zero_()
        step.fill_(L - 1)
        self.token = self._run(self.first, tokens, input_pos, step)
        if self.split == "fused":  # decode reads its own buffers: set them to the first decode position
            _, input_pos, step = self._inputs(self.next, 1)
            step.fill_(L)
            input_pos.fill_(L)
        else:
            input_pos.add_(L)
            step.add_(1)
        return self.read_back("sample" if self.split == "split" else self.first, self.token)

    @torch.no_grad()
    def launch(self, forced: torch.Tensor | None):
        """Queue the step: the token ids stay on the device for the next step; only their read-back is waited on."""
        self.begin_decode()
        tokens, input_pos, step = self._inputs(self.next, 1)
        if forced is not None:
            self.await_read_back()  # the forced ids go into the buffer the read-back copies
        self.feed(self.next, tokens.view(self.batch), self.token, forced)
        self.token = self._run(self.next, tokens, input_pos, step)
        advance(input_pos, step)
        return self.read_back_later("sample" if self.split == "split" else self.next, self.token)

    def step(self, forced: torch.Tensor | None) -> torch.Tensor:
        return self.launch(forced)()
