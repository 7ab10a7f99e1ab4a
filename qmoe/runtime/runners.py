"""make_runner: the runner for a runtime over a live model, used by the app and the ablation rows alike."""

from qmoe.runtime.combos import combination_error
from qmoe.runtime.generate import ReferenceRunner
from qmoe.runtime.ledger import TransferLedger
from qmoe.settings import ConfigError


def make_runner(
    model, runtime: str, export, sampling, batch: int, ledger: TransferLedger, cuda_graph: bool, program=None
):
    """runtime in reference | host | cuda_native; export: ExportSettings (reference runs the eager model and
    ignores it). `program`: a loaded program directory's Program, else the model is exported in-process (once per
    process and method, see qmoe.runtime.executor). An invalid combination is a one-line ConfigError."""
    error = combination_error(
        runtime, export.method_split, export.device_memory_planning, cuda_graph, model.device.type == "cuda"
    )
    if error is not None:
        raise ConfigError(error)
    if runtime == "reference":
        return ReferenceRunner(model, sampling, batch, ledger)
    from qmoe.runtime.cuda_native import CudaNativeRunner
    from qmoe.runtime.executor import build_program
    from qmoe.runtime.host import HostRunner

    program = program or build_program(model, export, batch, model.max_seq_len)
    cls = HostRunner if runtime == "host" else CudaNativeRunner
    return cls(program, model, sampling, batch, ledger, cuda_graph=cuda_graph)
