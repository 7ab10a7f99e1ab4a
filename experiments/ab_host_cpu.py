"""The eager decode step's host Python in two source trees on this machine, in alternating processes: OLD (e.g.
`git archive <commit> | tar -x -C x_old`) and the checkout, rounds of old then new. Both run the checkout's
experiments/host_overhead_cpu.py (kernels stubbed, 40 layers of the tiny model's widths), so only the measured code
differs. Per tree: the median over rounds of the step's wall µs, its Python calls, its dispatched torch calls and
allocations, and the ops' µs per call. The counts carry over to the H200 host, where each dispatched call costs
~1.5-3.5 µs (results/host_overhead.json); the wall times are this machine's, without the ~9 µs per launch of the
compiled kernel's launcher.

    PYTHONPATH=.:experiments python experiments/ab_host_cpu.py x_old --old-commit 5374aaa [--rounds 3]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib import write_json

from qmoe.metrics.measure import git_commit

NEW = Path(__file__).resolve().parents[1]
SCRIPT = NEW / "experiments" / "host_overhead_cpu.py"
MEDIANS = ("wall_us_per_step", "python_calls_per_step", "torch_calls_per_step", "allocations_per_step")


def measure(tree: Path, commit: str, steps: int) -> dict:
    """One process of host_overhead_cpu.py on `tree`'s packages -> its JSON."""
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{NEW / 'experiments'}", "QMOE_GIT_COMMIT": commit}
    env.pop("TRITON_INTERPRET", None)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "host.json"
        cmd = [sys.executable, str(SCRIPT), "--steps", str(steps), "--out", str(out)]
        subprocess.run(cmd, cwd=tree, env=env, check=True, capture_output=True, text=True)
        return json.loads(out.read_text())


def summary(runs: list[dict]) -> dict:
    row = {key: statistics.median(r["model"][key] for r in runs) for key in MEDIANS}
    ops = runs[0]["ops_us_per_call"]
    row["ops_us_per_call"] = {op: statistics.median(r["ops_us_per_call"][op] for r in runs) for op in ops}
    row["torch_calls_by_op"] = runs[0]["model"]["torch_calls_by_op"]  # counts: the same in every round
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("old", type=Path, help="the old tree (a directory with kernels/, qmoe/, tests/)")
    parser.add_argument("--old-commit", required=True, help="the commit the old tree holds")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default="results/host_overhead_cpu_ab.json")
    args = parser.parse_args()
    t0 = time.time()
    new_commit = git_commit() or "unknown"
    trees = {"old": (args.old.resolve(), args.old_commit), "new": (NEW, new_commit)}
    runs = {"old": [], "new": []}
    for r in range(args.rounds):
        for name, (tree, commit) in trees.items():
            runs[name].append(measure(tree, commit, args.steps))
            print(f"round {r + 1} {name}: {runs[name][-1]['model']['wall_us_per_step']:.0f} us a step", flush=True)
    rows = {name: {"commit": trees[name][1], **summary(runs[name])} for name in trees}
    write_json(args.out, "ab_host_cpu", "cpu", rounds=args.rounds, steps=args.steps, rows=rows,
               runs=runs, seconds=time.time() - t0)  # fmt: skip
    print(f"\n{'':24} {'old ' + trees['old'][1]:>16} {'new ' + new_commit:>24}")
    for key in (*MEDIANS, *(f"ops_us_per_call.{op}" for op in rows["old"]["ops_us_per_call"])):
        section, _, op = key.partition(".")
        old, new = (rows[n][section][op] if op else rows[n][key] for n in ("old", "new"))
        print(f"{key:<40} {old:10.1f} {new:10.1f}  ({new / old - 1:+.1%})")


if __name__ == "__main__":
    main()
