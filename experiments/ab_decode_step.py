"""The 35B-A3B decode step timed with op groups taken from other versions of their kernel files, in one process.

A kernel change that looks right in SASS can still make the step slower (results/probe_decode_latency.json): only
the graphed step, timed beside the version it replaces on the same card in the same process, decides. Each
`--variant NAME:GROUP=FILE[,GROUP=FILE]` loads FILE (e.g. `git show HEAD~1:kernels/moe/triton.py > old.py`) as
the op module of GROUP (moe, linear, gdn, attention, norm), with the checkout's launch tables (share_tuned_state);
the variant `current` (the checkout's kernels) always runs. Rounds alternate the variants (A B A B ...), each round
a fresh capture timed by tune_decode_loop.replay_ms, so drift between rounds shows as spread, not as a difference.

    PYTHONPATH=. python experiments/ab_decode_step.py --variant base:moe=.ab/moe_base.py [--weights fp8]
        [--rounds 3] [--replays 100] [--cache-len 144] [--out results/ab_decode_step.json]
"""

import argparse
import importlib.util
import statistics
import time

import torch
from benchlib import ceilings, write_json
from tune_decode_loop import PROMPT_POS, capture_step, decode_model, replay_ms


def load_module(name: str, path: str):
    """FILE as a module named `name` (it imports the rest of kernels/ as the checkout has it)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Module-level tuned state: a kernel file reads its launch table relative to itself (kernels/<group>/configs/), so a
# copy under .ab/ found none and ran the op's default configs (at M = 1 the MoE's two 2-wave grids: +220 us a step,
# results/ab_decode_rank.json). A variant shares the checkout's tables: what differs between variants is code.
TUNED_STATE = ("CONFIG_TABLE", "DECODE_OPTIONS", "PREFILL_OPTIONS")


def share_tuned_state(variant, group: str) -> None:
    """Give `variant` (a copy of kernels/<group>/triton.py) the checkout's tables and options, in place."""
    checkout = importlib.import_module(f"kernels.{group}.triton")
    for name in TUNED_STATE:
        mine, theirs = getattr(variant, name, None), getattr(checkout, name, None)
        if isinstance(mine, dict) and isinstance(theirs, dict):
            mine.clear()
            mine.update(theirs)
    if hasattr(getattr(variant, "get_config", None), "cache_clear"):
        variant.get_config.cache_clear()


def parse_variant(text: str) -> tuple[str, dict]:
    name, _, groups = text.partition(":")
    if not name or not groups:
        raise SystemExit(f"--variant takes NAME:GROUP=FILE[,GROUP=FILE], got {text!r}")
    files = dict(g.split("=", 1) for g in groups.split(","))
    modules = {group: load_module(f"ab_{name}_{group}", path) for group, path in files.items()}
    for group, module in modules.items():
        share_tuned_state(module, group)
    return name, modules


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", action="append", default=[], help="NAME:GROUP=FILE[,GROUP=FILE]")
    parser.add_argument("--weights", default="auto", choices=("auto", "fp8"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--replays", type=int, default=100)
    parser.add_argument("--cache-len", type=int, default=PROMPT_POS + 16, help="cache positions (run.py's: 4608)")
    parser.add_argument("--out", default="results/ab_decode_step.json")
    args = parser.parse_args()
    t0 = time.time()
    ceil = ceilings("cuda")
    model, floor_ms = decode_model(args.weights, ceil["copy_gbs"], args.cache_len)
    current = model.ops
    variants = {"current": {}, **dict(parse_variant(v) for v in args.variant)}
    times = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, groups in variants.items():
            model.ops = {**current, **groups}
            times[name].append(replay_ms(capture_step(model), args.replays))
            print(f"  {name:<12} {times[name][-1]:.4f} ms", flush=True)
    model.ops = current
    rows = {
        n: dict(step_ms=ts, median_ms=statistics.median(ts), spread_ms=max(ts) - min(ts)) for n, ts in times.items()
    }
    write_json(args.out, "ab_decode_step", "cuda", ceilings=ceil, floor_ms=floor_ms, weights=args.weights,
               cache_len=args.cache_len,
               variants={n: {g: getattr(m, "__file__", None) for g, m in groups.items()} for n, groups in
                         variants.items()}, rows=rows, seconds=time.time() - t0)  # fmt: skip
    torch.cuda.synchronize()
    print(f"\nfloor {floor_ms:.3f} ms ({args.weights} weights)")
    print(f"{'variant':<12} {'median ms':>10} {'spread':>8}")
    for name, row in rows.items():
        print(f"{name:<12} {row['median_ms']:>10.4f} {row['spread_ms']:>8.4f}")


if __name__ == "__main__":
    main()
