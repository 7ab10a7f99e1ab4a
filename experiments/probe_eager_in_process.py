"""Why bench_e2e's eager reference runner (kernels=triton) is slower than `python run.py runtime=reference
kernels=triton` on the same host: the same run, 35B-A3B, prompt 128, 32 new tokens, repeated in one process
around the rows bench_e2e runs before it (the copy-free loop, the torch-ops reference runner), on one model.

    python experiments/probe_eager_in_process.py [--out results/probe_eager_in_process.json]
"""

import argparse
import gc
import time

from bench_e2e import FAST, config
from benchlib import write_json

from qmoe.app import get_model, run_experiment
from qmoe.settings import validate

EAGER = ("runtime=reference", "kernels=triton", "prompt.length=128", "generation.max_new_tokens=32")
SEQUENCE = [  # (label, overrides): the eager row first in a fresh process, then after what bench_e2e runs before it
    ("eager triton, fresh process", EAGER),
    ("eager triton, again", EAGER),
    ("copy-free loop (graph)", (*FAST, "prompt.length=128", "generation.max_new_tokens=128")),
    ("eager triton, after the graphed loop", EAGER),
    ("eager torch ops", ("runtime=reference", "prompt.length=128", "generation.max_new_tokens=32")),
    ("eager triton, after torch ops", EAGER),
    ("eager triton, again", EAGER),
]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/probe_eager_in_process.json")
    args = parser.parse_args()
    t0 = time.time()
    base = config("model=qwen35_moe")
    get_model(base, validate(base), progress=False)  # built once, as in bench_e2e
    rows = []
    for label, overrides in SEQUENCE:
        r = run_experiment(config("model=qwen35_moe", *overrides))
        decode = r["latency"]["decode_ms"]
        rows.append({"label": label, "decode_ms_p50": decode["p50"], "decode_ms_p90": decode["p90"],
                     "gc_objects": len(gc.get_objects()), "gc_counts": gc.get_count()})  # fmt: skip
        print(f"{label:<40} p50 {decode['p50']:8.3f} ms  p90 {decode['p90']:8.3f} ms  objects {rows[-1]['gc_objects']}")
        write_json(args.out, "probe_eager_in_process", "cuda", rows=rows, seconds=time.time() - t0)


if __name__ == "__main__":
    main()
