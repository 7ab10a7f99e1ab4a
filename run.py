"""qmoe command line: `python run.py [group=option ...] [key=value ...]`, or `-m` for sweeps (Hydra).

Heavy imports happen inside `main`, so `python run.py --help` is fast. Bad input ends with one line on
stderr naming the key and what is allowed, and exit code 2.
"""

import os
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

CONFIG_DIR = str(Path(__file__).resolve().parent / "configs")
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports Ctrl-C
EXIT_FAILED = 1
RANK = int(os.environ.get("RANK", "0"))  # under torchrun: this process's rank (rank 0 alone reports and writes)
DISTRIBUTED = int(os.environ.get("WORLD_SIZE", "1")) > 1
RANK_GRACE_S = 20  # how long a rank > 0 leaves rank 0 to report a bad input first


def fail(message: str) -> None:
    """Bad input: one line (from rank 0 only: every rank checks the same config) and exit 2. The other ranks
    wait for torchrun to end them once rank 0 has exited, so that they cannot end rank 0 before it has said why."""
    if RANK == 0:
        print(f"error: {message}", file=sys.stderr)
    elif DISTRIBUTED:
        import time

        time.sleep(RANK_GRACE_S)
    sys.exit(EXIT_BAD_INPUT)


def fail_rank(message: str, code: int) -> None:
    """A sharded run failed on this rank: one line naming it, unless another rank failed first (this rank's error
    is then that failure seen from here: its peer left a collective), and the process ends at once, so no rank
    waits in a collective for it (torchrun ends the ranks still blocked in one)."""
    from qmoe.parallel import report_failure

    if report_failure():
        print(f"rank {RANK}: error: {message}", file=sys.stderr)
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(code)


def rank_overrides() -> list[str]:
    """Hydra overrides for ranks > 0: no run directory, no log files (rank 0 writes them)."""
    import tempfile

    scratch = tempfile.mkdtemp(prefix=f"qmoe-rank{RANK}-")
    return [
        f"hydra.run.dir={scratch}",
        "hydra.output_subdir=null",
        "hydra/job_logging=none",
        "hydra/hydra_logging=none",
    ]


def preflight(argv: list[str]) -> None:
    """Compose and validate the config before Hydra makes a run directory, so bad input is one line and exit 2.
    In a sweep (-m) every value of every swept key is checked (with the other keys at their first value)
    before job 0 starts; combinations the ablation sweeper skips are left to it."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from qmoe.errors import BAD_INPUT_ERRORS
    from qmoe.runtime.combos import cfg_combination_error
    from qmoe.settings import CONFIG_DIR, compose_error, first_line, validate_for_run

    multirun = any(a in ("-m", "--multirun") for a in argv)
    args = [a for a in argv if not a.startswith("-")]
    try:
        parsed = OverridesParser.create().parse_overrides(args)
    except Exception as e:  # noqa: BLE001 - Hydra raises several types for malformed overrides
        fail(f"bad override: {str(e).strip().splitlines()[0]}")
    first, sweeps = [], []
    for o in parsed:
        if o.key_or_group.startswith("hydra"):
            continue
        key = o.get_key_element()
        if o.is_sweep_override():
            values = list(o.sweep_string_iterator())
            first.append(f"{key}={values[0]}")
            sweeps += [(len(first) - 1, key, v, i + 1, len(values)) for i, v in enumerate(values) if multirun]
        else:
            first.append(f"{key}={o.get_value_element_as_str()}")
    candidates = [(first, None)] + [
        (first[:i] + [f"{key}={value}"] + first[i + 1 :], f"{key}={value}, sweep value {n} of {total}")
        for i, key, value, n, total in sweeps
        if n > 1
    ]
    try:
        with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
            ablation = None
            for overrides, where in candidates:
                try:
                    cfg = compose("config", overrides=overrides, return_hydra_config=multirun)
                except Exception as e:  # noqa: BLE001
                    fail(compose_error(e) + (f" [{where}; no job was started]" if where else ""))
                if ablation is None:
                    ablation = multirun and "AblationSweeper" in str(cfg.hydra.sweeper.get("_target_", ""))
                try:
                    validate_for_run(cfg)
                except BAD_INPUT_ERRORS as e:
                    import torch

                    if ablation and cfg_combination_error(cfg, torch.cuda.is_available()) is not None:
                        continue  # the ablation sweeper records it as not run
                    fail(first_line(e) + (f" [{where}; no job was started]" if where else ""))
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


def discard_run_dir(run_dir: str) -> None:
    """A run that failed before it measured anything leaves no directory: Hydra's .hydra/ and run.log go, then
    the directory if that emptied it (and Hydra's date directory above it, if that emptied it)."""
    import re
    import shutil

    d = Path(run_dir)
    if (d / "results.json").exists():
        return
    shutil.rmtree(d / ".hydra", ignore_errors=True)
    (d / "run.log").unlink(missing_ok=True)
    for directory in (d, d.parent if re.fullmatch(r"\d{4}-\d{2}-\d{2}", d.parent.name) else None):
        try:
            if directory is not None:
                directory.rmdir()
        except OSError:  # not empty: it holds something else
            break


@hydra.main(config_path="configs", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    import logging
    import traceback

    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    from qmoe.app import run_experiment, summary_table
    from qmoe.errors import BAD_INPUT_ERRORS
    from qmoe.settings import first_line

    logging.captureWarnings(True)  # warnings go to run.log too (and to stderr, as Hydra's console handler does)
    log = logging.getLogger("qmoe")
    hc = HydraConfig.get()
    run_dir = hc.runtime.output_dir
    with open_dict(cfg):
        cfg.model.arch_overrides = {**cfg.model.arch_overrides, **explicit_arch_overrides(list(hc.overrides.task))}
    try:
        results = run_experiment(cfg, run_dir=run_dir, progress=sys.stderr.isatty() and RANK == 0)
    except BAD_INPUT_ERRORS as e:
        discard_run_dir(run_dir)
        if DISTRIBUTED:
            fail_rank(first_line(e), EXIT_BAD_INPUT)
        fail(first_line(e))
    except KeyboardInterrupt:
        discard_run_dir(run_dir)
        print("interrupted before the first decode step was measured: nothing written", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)
    except Exception as e:
        if RANK == 0:
            (Path(run_dir) / "error.txt").write_text(traceback.format_exc())  # the directory holds the error
        if DISTRIBUTED:
            fail_rank(f"{type(e).__name__}: {first_line(e)}", EXIT_FAILED)
        raise
    from qmoe.parallel import shutdown

    shutdown()
    if RANK != 0:
        import shutil

        shutil.rmtree(run_dir, ignore_errors=True)  # the scratch directory rank_overrides gave it
        return
    table = summary_table(results)
    log.info("summary\n" + table)
    print(table)
    if results.get("partial"):
        print(
            f"interrupted: {results['interrupted']}; results so far in {results['results_path']} (partial)",
            file=sys.stderr,
        )
        sys.exit(EXIT_INTERRUPTED)


if __name__ == "__main__":
    if not any(
        a in ("--help", "-h", "--hydra-help", "--info", "--cfg", "-c", "--shell-completion")
        or a.startswith(("--cfg", "--info"))
        for a in sys.argv[1:]
    ):
        preflight(sys.argv[1:])
    if RANK > 0:
        sys.argv += rank_overrides()
    main()
