"""Executor: exported programs for the `host` and `cuda_native` runners.

- Programs: loaded from a saved program directory (`runtime.program`), or exported in-process: torch.export
  runs once per (model, method, batch, length, kernels) per process and each export preset re-lowers and
  re-plans those exported methods (cheap), so a sweep exports each method once.
- Arenas: a Program allocates its planned arenas once per device; the executor re-allocates the host arena in
  pinned memory when the delegate is a GPU (copies from and to it are true async DMA and can sit next to CUDA
  graphs), before any buffer is handed out. Nothing else is allocated per step by the executor.
- Binding: runners write method inputs straight into the planned input buffers (`Method.input_buffer`) and pass
  those buffers back, so a Method never copies an input, and read outputs from their planned buffers.
- Ledger: every host<->device copy the runner itself makes (`put`, `read_back`) is recorded as source "runner"
  under the method it feeds or drains; the Methods record their copy nodes and, without planning, the
  delegate's own copies. On a CPU delegate nothing crosses a bus and nothing is recorded.
"""

import torch

from qmoe.export import ExportError, ExportSettings, Program
from qmoe.export.methods import export_methods
from qmoe.runtime.graphs import graph_delegates
from qmoe.runtime.ledger import TransferLedger

_EXPORTED: dict[tuple, tuple] = {}  # (model id, method, batch, length, kernels) -> (model, ExportedProgram)


def build_program(model, settings: ExportSettings, batch_size: int, max_seq_len: int) -> Program:
    """The exported program of `model` (caches set up for batch_size x max_seq_len) under `settings`."""
    for stale in [k for k, (m, _) in _EXPORTED.items() if m is not model]:  # one model's exports at a time
        del _EXPORTED[stale]
    kernels = tuple(sorted((group, module.__name__) for group, module in model.ops.items()))
    keys = {m: (id(model), m, batch_size, max_seq_len, kernels) for m in settings.methods}
    if any(k not in _EXPORTED for k in keys.values()):  # a method is the same program in every split it is in
        exported = export_methods(model, settings.method_split, batch_size, max_seq_len)
        _EXPORTED.update({keys[m]: (model, ep) for m, ep in exported.items()})
    exported = {m: _EXPORTED[k][1] for m, k in keys.items()}
    return pin_host_arena(Program(exported, model, settings, batch_size, max_seq_len))


def load_program(directory, model, weights_identity: dict, settings: ExportSettings) -> Program:
    """A saved program directory (qmoe.export.artifact), refused unless it was exported with `settings`."""
    from qmoe.export import load_program as load

    program = load(directory, model, weights_identity)
    if program.settings != settings:
        raise ExportError(
            f"refusing program {directory}: exported with {program.settings.to_dict()}, the config asks for "
            f"{settings.to_dict()}"
        )
    return pin_host_arena(program)


def pin_host_arena(program: Program) -> Program:
    """With a GPU delegate, the host arena in pinned memory (before any buffer of it is handed out)."""
    if program.arenas is not None and "cpu" in program.arenas and program.delegate_device.startswith("cuda"):
        # Methods share this dict: replacing the entry re-binds every host buffer they hand out.
        program.arenas["cpu"] = torch.empty(program.arenas["cpu"].numel(), dtype=torch.uint8, pin_memory=True)
    return program


class ProgramRunner:
    """What the host and cuda_native runners share: the program, the ledger's phase/step tags, the copies."""

    name = "program"

    def __init__(self, program: Program, model, batch: int, ledger: TransferLedger, cuda_graph: bool, graphed):
        self.program, self.model, self.batch, self.ledger = program, model, batch, ledger
        self.methods = program.methods
        on_cuda = model.device.type == "cuda"
        self.graphs = graph_delegates(program, graphed) if cuda_graph else []
        self.token_host = torch.empty(batch, dtype=torch.int64, pin_memory=on_cuda)  # the per-step read-back
        self.decode_steps = 0

    def begin_prefill(self) -> None:
        self.model.reset_caches()
        self.ledger.at("prefill", 0)
        self.decode_steps = 0
        for g in self.graphs:
            g.enabled = False

    def begin_decode(self) -> None:
        self.decode_steps += 1
        self.ledger.at("decode", self.decode_steps)
        for g in self.graphs:
            g.enabled = True

    def put(self, method: str, dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        """dst.copy_(src); a copy across devices is the runner's and is recorded."""
        if src.device != dst.device:
            self.ledger.record("h2d" if dst.device.type != "cpu" else "d2h", src.nbytes, method, "runner")
        return dst.copy_(src)

    def read_back(self, method: str, token: torch.Tensor) -> torch.Tensor:
        """Token ids [B] -> host (for EOS checks and streaming): the one read-back a step needs."""
        return self.put(method, self.token_host, token).clone()

    def feed(self, method: str, dst: torch.Tensor, last: torch.Tensor, forced: torch.Tensor | None) -> None:
        """dst [B] <- the token to feed: the forced (prompt) id where forced >= 0, else the last sample."""
        if forced is not None:
            forced = self.put(method, torch.empty_like(forced, device=last.device), forced)
            last = torch.where(forced >= 0, forced, last)
        self.put(method, dst, last)
