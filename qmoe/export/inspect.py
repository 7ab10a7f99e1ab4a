"""Print, per export preset and method, the copy nodes (direction, tensor, bytes) and the arena sizes per device.

    python -m qmoe.export.inspect export=device_planned export.method_split=split
    python -m qmoe.export.inspect model=qwen35_moe export.method_split=fused     # every preset when export= is absent

Takes Hydra overrides of configs/config.yaml. The model is built on the meta device (shapes only, no weights),
so any model size inspects in seconds; the delegate device is cuda:0 unless export.delegate_device names one.
"""

import sys
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from qmoe.export.methods import export_methods
from qmoe.export.passes import call_delegate
from qmoe.export.program import Program
from qmoe.export.settings import PRESETS, ExportSettings
from qmoe.model.config import ModelConfig
from qmoe.model.qwen35_moe import build_model

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


def compose_config(overrides: list[str]):
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        return compose("config", overrides=overrides)


def describe(program: Program) -> str:
    """The copy-node table and arena sizes of one program."""
    s = program.settings
    lines = [
        f"preset={s.preset} method_split={s.method_split} device_memory_planning={s.device_memory_planning} "
        f"delegate={program.delegate_device} batch={program.batch_size} max_seq_len={program.max_seq_len}",
        f"  {'method':<8} {'copy':<5} {'tensor':<16} {'bytes':>12}  from -> to",
    ]
    for method in program.plan.methods:
        copies = program.plan.copies[method]
        if not copies:
            delegate = program.graphs[method].graph.find_nodes(op="call_function", target=call_delegate)[0]
            note = "delegate copies its host inputs/outputs itself" if delegate.meta["qmoe_self_copies"] else "none"
            lines.append(f"  {method:<8} {'-':<5} {note}")
        for c in copies:
            lines.append(
                f"  {method:<8} {c['direction']:<5} {c['tensor']:<16} {c['nbytes']:>12,}  "
                f"{c['src_device']} -> {c['dst_device']}"
            )
    for device, size in program.plan.arenas.items():
        lines.append(f"  arena {device:<7} {size:>12,} B (naive sum {program.plan.naive_bytes[device]:,} B)")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    """Bad input (an unknown option or key, a bad export setting) is one line on stderr and exit code 2."""
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip())
        return
    from hydra.errors import HydraException

    from qmoe.settings import compose_error

    try:
        inspect(argv)
    except (HydraException, ValueError) as e:  # ValueError: ExportError, ModelConfig's architecture checks
        print(f"error: {compose_error(e)}", file=sys.stderr)
        sys.exit(2)


def inspect(argv: list[str]) -> None:
    presets = [None] if any(a.startswith("export=") for a in argv) else PRESETS
    by_split = {}
    for preset in presets:
        cfg = compose_config(argv + ([f"export={preset}"] if preset else []))
        export_cfg = OmegaConf.to_container(cfg.export, resolve=True)
        if export_cfg.get("delegate_device", "auto") == "auto":
            export_cfg["delegate_device"] = "cuda:0"
        settings = ExportSettings.from_cfg(export_cfg)
        batch, length = int(cfg.generation.batch_size), int(cfg.model.max_seq_len)
        arch = {**OmegaConf.to_container(cfg.model.arch), **OmegaConf.to_container(cfg.model.arch_overrides)}
        model = build_model(ModelConfig.from_dict(arch), getattr(torch, cfg.model.dtype), "meta", seed=None)
        model.setup_caches(batch, length)
        if settings.method_split not in by_split:
            by_split[settings.method_split] = export_methods(model, settings.method_split, batch, length)
        print(describe(Program(by_split[settings.method_split], model, settings, batch, length)))


if __name__ == "__main__":
    main(sys.argv[1:])
