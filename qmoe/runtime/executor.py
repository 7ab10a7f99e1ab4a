"""Executor: exported programs for the `host` and `cuda_native` runners.

- Programs: loaded from a saved program directory (`runtime.program`), or exported in-process: torch.export
  runs once per (method, batch, length, kernels) of the model in hand and each export preset re-lowers and
  re-plans those exported methods (cheap), so a sweep exports each method once (`EXPORTS`).
- Arenas: a Program allocates its planned arenas once per device; the executor re-allocates the host arena in
  pinned memory when the delegate is a GPU (copies from and to it are true async DMA and can sit next to CUDA
  graphs), before any buffer is handed out. Nothing else is allocated per step by the executor.
- Binding: runners write method inputs straight into the planned input buffers (`Method.input_buffer`) and pass
  those buffers back, so a Method never copies an input, and read outputs from their planned buffers. An output
  that the next method takes (logits into sample, a sampled token into the next step) is planned in that
  input's slot, so handing it over copies nothing.
- Ledger: every copy between memory spaces the runner itself makes (`put`, `read_back`, `feed`) is recorded as
  source "runner" under the method it feeds or drains; the Methods record their copy nodes and, without
  planning, the delegate's own copies. On a CPU delegate nothing crosses a bus and nothing is recorded; on the
  staged CPU delegate ("cpu:1") everything is, as on a GPU.
"""

import torch

from qmoe.export import ExportError, ExportSettings, Program
from qmoe.export.methods import export_methods
from qmoe.runtime.generate import Runner
from qmoe.runtime.graphs import graph_delegates
from qmoe.runtime.ledger import TransferLedger


class Exports:
    """torch.export results of one model, reused by every program built for it: {(method, batch, length,
    kernels): ExportedProgram}. It holds that model (so the cache can never answer for another object that
    happens to reuse its id) and drops every entry when asked for another model: one model's exports at a time,
    as the app holds one model's weights at a time."""

    def __init__(self):
        self.model = None
        self.programs: dict[tuple, object] = {}

    def get(self, model, method_split: str, methods, batch_size: int, max_seq_len: int) -> dict:
        """{method: ExportedProgram} for `methods` (those of `method_split`), exported where missing."""
        if model is not self.model:
            self.model, self.programs = model, {}
        kernels = tuple(sorted((group, module.__name__) for group, module in model.ops.items()))
        keys = {m: (m, batch_size, max_seq_len, kernels) for m in methods}
        if any(k not in self.programs for k in keys.values()):  # a method is the same program in every split
            exported = export_methods(model, method_split, batch_size, max_seq_len)
            self.programs.update({keys[m]: ep for m, ep in exported.items()})
        return {m: self.programs[k] for m, k in keys.items()}


EXPORTS = Exports()  # the process's: the app and the ablation rows build every program through it


def build_program(model, settings: ExportSettings, batch_size: int, max_seq_len: int, exports=EXPORTS) -> Program:
    """The exported program of `model` (caches set up for batch_size x max_seq_len) under `settings`."""
    exported = exports.get(model, settings.method_split, settings.methods, batch_size, max_seq_len)
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
    # every method but forward samples, with what the config that exported it fixed (greedy; under tensor
    # parallel, the filters: the sampler's name says both)
    saved, wanted = program.kernels["sampling"], model.ops["sampling"].__name__
    if program.settings.methods != ("forward",) and saved != wanted:
        raise ExportError(
            f"refusing program {directory}: its methods sample with {saved}, the config's sampling needs {wanted} "
            f"(sampling.temperature 0 exports the argmax alone; under parallel.tp x ep > 1, sampling.top_k / top_p "
            f"decide how the cuts are found)"
        )
    return pin_host_arena(program)


def pin_host_arena(program: Program) -> Program:
    """With a GPU delegate, the host arena in pinned memory (before any buffer of it is handed out)."""
    if program.arenas is not None and "cpu" in program.arenas and program.delegate_device.startswith("cuda"):
        # Methods share this dict: replacing the entry re-binds every host buffer they hand out.
        program.arenas["cpu"] = torch.empty(program.arenas["cpu"].numel(), dtype=torch.uint8, pin_memory=True)
    return program


class ProgramRunner(Runner):
    """What the host and cuda_native runners share: the program, its CUDA graphs, where its buffers live."""

    name = "program"

    def __init__(self, program: Program, model, batch: int, ledger: TransferLedger, cuda_graph: bool, graphed):
        super().__init__(model, batch, ledger)
        self.program = program
        self.methods = program.methods
        self.graphs = graph_delegates(program, graphed) if cuda_graph else []

    def space_of(self, t: torch.Tensor) -> str:
        return self.program.space_of(t)

    def begin_prefill(self) -> None:
        super().begin_prefill()
        for g in self.graphs:
            g.enabled = False

    def begin_decode(self) -> None:
        super().begin_decode()
        for g in self.graphs:
            g.enabled = True

    def feed(self, method: str, dst: torch.Tensor, last: torch.Tensor, forced: torch.Tensor | None) -> None:
        """dst [B] <- the token to feed: the forced (prompt) id where forced >= 0, else the last sample (usually
        planned in dst's own bytes: then nothing moves). Forced ids are merged on the host, with the last sample
        read back, and go up once."""
        if forced is None:
            self.put(method, dst, last)
        else:
            self.put(method, dst, torch.where(forced >= 0, forced, self.token_host))
