"""qmoe command line: `python run.py [group=option ...] [key=value ...]`, or `-m` for sweeps (Hydra).

Heavy imports happen inside `main`, so `python run.py --help` is fast. Bad input ends with one line on
stderr naming the key and what is allowed, and exit code 2.
"""

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

CONFIG_DIR = str(Path(__file__).resolve().parent / "configs")
EXIT_BAD_INPUT = 2


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(EXIT_BAD_INPUT)


def preflight(argv: list[str]) -> None:
    """Compose the config once before Hydra does, so an unknown option or key is one line and exit 2.
    Sweep overrides are checked with their first value."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    args = [a for a in argv if not a.startswith("-")]
    try:
        parsed = OverridesParser.create().parse_overrides(args)
    except Exception as e:  # noqa: BLE001 - Hydra raises several types for malformed overrides
        fail(f"bad override: {str(e).splitlines()[0]}")
    overrides = []
    for o in parsed:
        if o.key_or_group.startswith("hydra"):
            continue
        value = next(iter(o.sweep_string_iterator())) if o.is_sweep_override() else o.get_value_element_as_str()
        overrides.append(f"{o.get_key_element()}={value}")
    try:
        with initialize_config_dir(CONFIG_DIR, version_base="1.3"):
            compose("config", overrides=overrides)
    except Exception as e:  # noqa: BLE001
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        options = ""
        if "Could not find" in first:
            group = first.split("'")[1].split("/")[0] if "'" in first else ""
            names = sorted(p.stem for p in (Path(CONFIG_DIR) / group).glob("*.yaml"))
            options = f"; allowed: {', '.join(names)}" if names else ""
        fail(f"{first}{options}")
    finally:
        GlobalHydra.instance().clear()


def explicit_arch_overrides(task_overrides: list[str]) -> dict:
    """`model.arch.X=v` typed on the command line: a checkpoint's dims may not silently replace them."""
    import yaml

    out = {}
    for o in task_overrides:
        key, _, value = o.lstrip("+").partition("=")
        if key.startswith("model.arch."):
            out[key.removeprefix("model.arch.")] = yaml.safe_load(value)
    return out


@hydra.main(config_path="configs", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    from qmoe.app import run_experiment, summary_table
    from qmoe.errors import BAD_INPUT_ERRORS

    hc = HydraConfig.get()
    with open_dict(cfg):
        cfg.model.arch_overrides = {**cfg.model.arch_overrides, **explicit_arch_overrides(list(hc.overrides.task))}
    try:
        results = run_experiment(cfg, run_dir=hc.runtime.output_dir, progress=sys.stderr.isatty())
    except BAD_INPUT_ERRORS as e:
        fail(str(e).splitlines()[0])
    print(summary_table(results))


if __name__ == "__main__":
    if not any(
        a in ("--help", "-h", "--hydra-help", "--info", "--cfg", "-c", "--shell-completion")
        or a.startswith(("--cfg", "--info"))
        for a in sys.argv[1:]
    ):
        preflight(sys.argv[1:])
    main()
