"""Programmatic Dependent Launch on and off, one change at a time: 35B-A3B decode in the default fast loop
(runtime=cuda_native, copy_elided, every op group on Triton, CUDA graph, greedy, batch 1 and 8), alternating
QMOE_PDL=1 / 0 in the same process on the same weights (kernels/pdl.py reads it per call, so each run compiles
and captures its own variant). Batch 1 twice each (in turn, so drift between runs shows), batch 8 once.

    PYTHONPATH=. python experiments/bench_pdl.py [--out results/bench_pdl.json] [--new-tokens 128]
"""

import argparse
import os
import time

from bench_e2e import FAST, config, row_from
from benchlib import ceilings, write_json

from qmoe.app import get_model, run_experiment
from qmoe.metrics.measure import active_weight_bytes
from qmoe.settings import validate


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/bench_pdl.json")
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args()
    t0 = time.time()
    ceil = ceilings("cuda")
    base = config("model=qwen35_moe")
    model = get_model(base, validate(base), progress=False).model
    floor_ms = active_weight_bytes(model.config, model.dtype) / (ceil["copy_gbs"] * 1e9) * 1e3
    rows = []
    for batch, round_, pdl in ((1, 0, "1"), (1, 0, "0"), (1, 1, "1"), (1, 1, "0"), (8, 0, "1"), (8, 0, "0")):
        os.environ["QMOE_PDL"] = pdl
        overrides = (*FAST, "model=qwen35_moe", "prompt.length=128", f"generation.batch_size={batch}",
                     f"generation.max_new_tokens={args.new_tokens if batch == 1 else 32}")  # fmt: skip
        row = row_from(run_experiment(config(*overrides)), f"PDL {'on' if pdl == '1' else 'off'}", floor_ms)
        rows.append({**row, "pdl": pdl == "1", "round": round_})
        write_json(args.out, "pdl", "cuda", ceilings=ceil, floor_ms=floor_ms, rows=rows, seconds=time.time() - t0)
    os.environ.pop("QMOE_PDL")
    print(f"{'PDL':<5} {'B':>3} {'round':>5} {'decode p50 ms':>14} {'of floor':>9}")
    for r in rows:
        print(f"{'on' if r['pdl'] else 'off':<5} {r['batch']:>3} {r['round']:>5} {r['decode_ms_p50']:>14.3f} "
              f"{100 * r.get('floor_fraction', 0):>8.0f}%")  # fmt: skip


if __name__ == "__main__":
    main()
