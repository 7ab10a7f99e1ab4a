"""What finding the vocab-parallel Triton sampler's cuts costs one rank, per way (qmoe/parallel/sampling.py): the
search (`searched_cuts`), each rank's k best logits (`candidate_cuts`, k = 20 and 50) and no filter (`uncut`), on
one rank's slice of the 35B's vocabulary at TP2 (124,160 logits), batch 1 and 32, top-p 0.9 (not for `uncut`).

Per way and batch: the torch ops it dispatches that are not views (a GPU runs a kernel for each), the collectives it
calls (counted as called: one process, so they move nothing), and its time, CUDA graph replay on a GPU (the
collectives are the identity in one process: this is the ops' time alone) or wall clock on the CPU.

    PYTHONPATH=.:experiments python experiments/sampler_cuts.py [--out results/sampler_cuts_<device>.json]
"""

import argparse
from collections import Counter

import torch
from benchlib import time_calls, write_json
from torch.utils._python_dispatch import TorchDispatchMode

from qmoe.parallel import sampling

VOCAB_SLICE = 248_320 // 2  # the 35B's vocabulary at TP2
VIEWS = ("view", "slice", "select", "expand", "permute", "squeeze", "alias", "detach", "t.default", "transpose",
         "split", "unbind", "as_strided", "lift_fresh", "reshape")  # fmt: skip


class CountOps(TorchDispatchMode):
    """Counts the dispatched ops that are not views."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += not any(v in str(func) for v in VIEWS)
        return func(*args, **(kwargs or {}))


def count_collectives() -> Counter:
    """Wrap the sampling module's collectives: each call counted by kind (in one process they return at once)."""
    calls = Counter()
    for name in ("all_reduce", "all_gather"):
        original = getattr(sampling, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        setattr(sampling, name, counted)
    return calls


def ways(B: int, device: str) -> dict:
    """{name: a call finding one way's cuts} over one rank's slice [B, VOCAB_SLICE] at T = 0.8."""
    x = (torch.randn(B, VOCAB_SLICE, generator=torch.Generator().manual_seed(0)) * 2).to(device)
    c = sampling.exp2_scale(torch.full((B,), 0.8, device=device))
    top_p = torch.full((B,), 0.9, device=device)
    k20, k50 = (torch.full((B,), k, device=device) for k in (20, 50))
    return {
        "search (top-k 50 + top-p)": lambda: sampling.searched_cuts(x, c, k50, top_p),
        "candidates (top-k 20 + top-p)": lambda: sampling.candidate_cuts(x, c, k20, top_p, 20),
        "candidates (top-k 50 + top-p)": lambda: sampling.candidate_cuts(x, c, k50, top_p, 50),
        "none (no filter)": lambda: sampling.uncut(x),
    }


def measure(name: str, fn, B: int, device: str, calls: Counter) -> dict:
    calls.clear()
    with CountOps() as counted:
        fn()
    collectives = dict(calls)
    us, how = time_calls(lambda i: fn(), 20, device)
    print(f"B {B:3d}  {name:<30} {counted.ops:4d} ops  collectives {collectives}  {us:9.1f} us ({how})")
    return {"way": name, "batch": B, "ops": counted.ops, "collectives": collectives, "us": us, "timed_by": how}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    calls = count_collectives()
    rows = [measure(name, fn, B, device, calls) for B in (1, 32) for name, fn in ways(B, device).items()]
    write_json(args.out or f"results/sampler_cuts_{device}.json", "sampler_cuts", device, rows=rows)


if __name__ == "__main__":
    main()
