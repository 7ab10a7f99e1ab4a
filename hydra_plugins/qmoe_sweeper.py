"""The ablation sweeper: Hydra's basic sweeper, minus the combinations that cannot run here.

Before launching, every job of the cartesian product is composed and checked (qmoe.runtime.combos): an invalid
combination (e.g. runtime=cuda_native without CUDA, host with method_split=fused, cuda_graph on baseline) and a
reference job that repeats one already queued (the reference runner ignores the export config) are not
launched; they are listed with the reason in <sweep dir>/skipped.json, which the sweep summary reads. Selected
by configs/experiment/copy_elision_ablation.yaml (hydra.sweeper._target_). Hydra only loads sweepers from the
hydra_plugins package.
"""

import json
import logging
from pathlib import Path

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from omegaconf import OmegaConf

log = logging.getLogger(__name__)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


class AblationSweeper(BasicSweeper):
    def launch_filtered(self, batch, skipped: list, seen_reference: dict) -> list:
        from qmoe.metrics.sweep import SKIPPED_FILE
        from qmoe.runtime.combos import cfg_combination_error

        has_cuda = _has_cuda()
        keep = []
        for overrides in batch:
            cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            reason = cfg_combination_error(cfg, has_cuda)
            status = "invalid"
            if reason is None and cfg.runtime.name == "reference":
                signature = tuple(o for o in overrides if not o.startswith(("export", "runtime.cuda_graph")))
                if signature in seen_reference:
                    reason, status = f"reference ignores export: same run as {seen_reference[signature]}", "skipped"
                first = [o for o in overrides if o.startswith("export")]
                seen_reference.setdefault(signature, " ".join(first) or "the first reference job")
            if reason is None:
                keep.append(overrides)
                continue
            skipped.append(
                {
                    "runtime": cfg.runtime.name,
                    "export": cfg.export.preset,
                    "method_split": cfg.export.method_split,
                    "cuda_graph": OmegaConf.select(cfg, "runtime.cuda_graph"),
                    "status": status,
                    "reason": reason,
                    "overrides": list(overrides),
                }
            )
        sweep_dir = Path(self.config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        (sweep_dir / SKIPPED_FILE).write_text(json.dumps(skipped, indent=1))
        log.info(f"{len(keep)} jobs to run, {len(batch) - len(keep)} skipped (see {sweep_dir / SKIPPED_FILE})")
        return keep

    def sweep(self, arguments):
        """BasicSweeper.sweep with each batch filtered before it is launched."""
        from hydra.core.override_parser.overrides_parser import OverridesParser

        params = self._parse_config() + list(arguments)
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        self.overrides = self.split_arguments(parser.parse_overrides(params), self.max_batch_size)
        sweep_dir = Path(self.config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        returns, skipped, seen_reference, job_idx = [], [], {}, 0
        while not self.is_done():
            batch = self.launch_filtered(self.get_job_batch(), skipped, seen_reference)
            if not batch:
                continue
            results = self.launcher.launch(batch, initial_job_idx=job_idx)
            for r in results:
                _ = r.return_value  # re-raises a job's exception, as BasicSweeper does
            job_idx += len(batch)
            returns.append(results)
        return returns
