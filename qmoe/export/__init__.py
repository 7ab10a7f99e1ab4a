"""qmoe.export: multi-method programs with device propagation, H2D/D2H copy nodes, device-aware memory
planning and per-method copy skipping -- ExecuTorch's device tensor pipeline as plain passes over torch.export.

API (what the runtime builds on):

    settings = ExportSettings.from_cfg(cfg.export)          # configs/export/{baseline,device_planned,copy_elided}
    model.setup_caches(batch_size, max_seq_len)
    program = export_program(model, settings, batch_size, max_seq_len)   # runs where the model lives
    program.methods["forward"](tokens, input_pos, ledger=ledger) -> (logits,)     # see methods.py for every split
    program.settings, program.plan (ProgramPlan: arenas, allocations, copies), program.graphs (method graphs)
    program.save(directory, weights_identity)                # weights are not written: they stay the model's
    program = load_program(directory, model, weights_identity)   # ExportError on any mismatch
    (weights_identity: any JSON dict naming the weights, e.g. the app's {"kind": "random", "seed", "arch"}
    or the checkpoint's file hashes; load refuses one that differs from the saved one)

Pipeline: methods.export_methods (torch.export per method, ops.traceable_ops for the reference ops that cannot
be traced with a dynamic T) -> passes.lower_method (partition, propagate_devices, insert_copy_nodes) ->
planning.plan_program (one arena per device, lifetimes shared across methods, an output fed to the next method
in its input's slot) -> program.Method (executor: arenas allocated once, copy nodes, the delegate, ledger
records). Module order, no cycles: settings <- methods, passes <- planning <- artifact <- program.

The delegate device is `export.delegate_device` (auto = the model's device: cuda:0 with CUDA, else the CPU).
On a CPU delegate the copy nodes stay in the graph and the plan but alias their source: no bytes move and
nothing is recorded in the ledger (the ledger mirrors real memcpys). `delegate_device: "cpu:1"` on a CPU model
is a second CPU memory space: the delegate's planned buffers are host memory of their own, so every copy node,
delegate copy and runner copy really copies and is recorded, through the same executor as on a GPU (how the CPU
suite tests the ledger). A program whose delegate device is not the model's (e.g. "cuda:0" on a CPU-only
machine) is a plan only: its methods refuse to run.
`python -m qmoe.export.inspect export=device_planned export.method_split=split` prints copy nodes and arenas.
"""

from qmoe.export.methods import INPUT_NAMES, OUTPUT_NAMES, SAMPLING_NAMES
from qmoe.export.program import Method, Program, export_program, load_program
from qmoe.export.settings import METHOD_SPLITS, PRESETS, ExportError, ExportSettings

__all__ = [
    "INPUT_NAMES",
    "METHOD_SPLITS",
    "OUTPUT_NAMES",
    "PRESETS",
    "SAMPLING_NAMES",
    "ExportError",
    "ExportSettings",
    "Method",
    "Program",
    "export_program",
    "load_program",
]
