"""The program directory: exported methods without their weights, the plan, and a manifest that pins them.

    <dir>/manifest.json          format version, methods, batch/length, delegate device, export and model
                                 configs, weights identity, sha256 of every other file, and its own digest
    <dir>/plan.json              the ProgramPlan (arenas, allocations, copy nodes)
    <dir>/export_config.json     the export settings
    <dir>/model_config.json      the ModelConfig
    <dir>/methods/<method>.pt2   torch.export.save of each method, parameters and caches as meta tensors

Weights are never written (nor copied to the host): at load every method is bound by name to the live model's
parameters and caches, after checking the weights identity the caller gives against the saved one. Anything
changed -- the manifest, a file, the model config, the weights identity, the format -- is refused with a
one-line ExportError.
"""

import hashlib
import json
from pathlib import Path
from typing import NamedTuple

import torch
from torch.export import ExportedProgram

from qmoe.export.settings import ExportError, ExportSettings

FORMAT_VERSION = 1


def _sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _canonical(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def _without_weights(ep: ExportedProgram) -> ExportedProgram:
    """The same program with every parameter and buffer (weights, caches) replaced by a meta tensor."""
    specs = ep.graph_signature.input_specs
    state = {s.target for s in specs if s.kind.name in ("PARAMETER", "BUFFER")}

    def meta(name, t):
        empty = torch.empty_like(t, device="meta")
        return torch.nn.Parameter(empty, requires_grad=False) if isinstance(t, torch.nn.Parameter) else empty

    return ExportedProgram(
        root=ep.graph_module,
        graph=ep.graph,
        graph_signature=ep.graph_signature,
        state_dict={k: meta(k, v) for k, v in ep.state_dict.items()},
        range_constraints=ep.range_constraints,
        module_call_graph=ep.module_call_graph,
        constants={k: meta(k, v) if k in state else v for k, v in ep.constants.items()},
        verifiers=[ep.verifier],
    )


def save_program(program, directory, weights_identity: dict) -> Path:
    """Write `program` (a qmoe.export.Program) into `directory` -> its Path."""
    directory = Path(directory)
    (directory / "methods").mkdir(parents=True, exist_ok=True)
    files = {
        "plan.json": program.plan.to_json(),
        "export_config.json": json.dumps(program.settings.to_dict(), indent=1, sort_keys=True),
        "model_config.json": json.dumps(program.model_config.to_dict(), indent=1, sort_keys=True),
    }
    for name, text in files.items():
        (directory / name).write_text(text)
    for method, ep in program.exported.items():
        torch.export.save(_without_weights(ep), directory / "methods" / f"{method}.pt2")
        files[f"methods/{method}.pt2"] = None
    manifest = {
        "format_version": FORMAT_VERSION,
        "methods": list(program.exported),
        "batch_size": program.batch_size,
        "max_seq_len": program.max_seq_len,
        "delegate_device": program.delegate_device,
        "export_config": program.settings.to_dict(),
        "model_config": program.model_config.to_dict(),
        "weights_identity": weights_identity,
        "kernels": program.kernels,
        "torch_version": torch.__version__,
        "files": {name: sha256_file(directory / name) for name in sorted(files)},
    }
    manifest["digest"] = _sha256_bytes(_canonical(manifest).encode())
    (directory / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return directory


def _refuse(directory: Path, why: str):
    raise ExportError(f"refusing program {directory}: {why}")


class SavedProgram(NamedTuple):
    exported: dict  # method -> ExportedProgram (weights as meta tensors, bound to the model by Program)
    settings: ExportSettings
    batch_size: int
    max_seq_len: int
    kernels: dict
    plan_json: str  # the saved plan: the caller checks it against the plan it makes from `exported`


def read_program(directory, model, weights_identity: dict) -> SavedProgram:
    """The checked contents of a program directory for `model` (caches set up for the saved batch and length)."""
    directory = Path(directory)
    try:
        manifest = json.loads((directory / "manifest.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        _refuse(directory, f"no readable manifest.json ({e})")
    digest = manifest.pop("digest", None)
    if digest != _sha256_bytes(_canonical(manifest).encode()):
        _refuse(directory, "manifest.json was changed after export (digest mismatch)")
    if manifest["format_version"] != FORMAT_VERSION:
        _refuse(directory, f"format version {manifest['format_version']}, this code reads {FORMAT_VERSION}")
    for name, sha in manifest["files"].items():
        path = directory / name
        if not path.is_file() or sha256_file(path) != sha:
            _refuse(directory, f"{name} is missing or changed since export (sha256 mismatch)")
    if _canonical(weights_identity) != _canonical(manifest["weights_identity"]):
        _refuse(directory, f"weights {weights_identity} are not the exported {manifest['weights_identity']}")
    if manifest["model_config"] != model.config.to_dict():
        _refuse(directory, "the model config differs from the exported one")
    settings = ExportSettings.from_cfg(json.loads((directory / "export_config.json").read_text()))
    if manifest["delegate_device"] != settings.resolve_delegate_device(model.device):
        _refuse(
            directory, f"exported for delegate device {manifest['delegate_device']}, the model is on {model.device}"
        )
    batch_size, max_seq_len = manifest["batch_size"], manifest["max_seq_len"]
    if model.batch_size != batch_size or model.max_seq_len < max_seq_len:
        _refuse(directory, f"call model.setup_caches({batch_size}, {max_seq_len}) before loading")
    exported = {m: torch.export.load(directory / "methods" / f"{m}.pt2") for m in manifest["methods"]}
    plan_json = (directory / "plan.json").read_text()
    return SavedProgram(exported, settings, batch_size, max_seq_len, manifest["kernels"], plan_json)
