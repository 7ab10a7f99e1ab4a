"""Merge tuned launch configs ({op: {shape key: {M bucket: config}}}, e.g. results/bench_fp8_configs.json) into this
GPU's tables kernels/<op>/configs/<GPU>.json.

    PYTHONPATH=. python experiments/apply_configs.py results/bench_fp8_configs.json
"""

import json
import sys
from pathlib import Path

import torch

from kernels.tuned import gpu_config_path

ROOT = Path(__file__).resolve().parents[1]


def main():
    winners = json.loads(Path(sys.argv[1]).read_text())
    for op, entries in winners.items():
        path = gpu_config_path(ROOT / "kernels" / op / "configs", torch.cuda.get_device_name())
        table = json.loads(path.read_text()) if path.exists() else {}
        for key, buckets in entries.items():
            table.setdefault(key, {}).update(buckets)
        path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
        print(f"{path}: {len(entries)} entries")


if __name__ == "__main__":
    main()
