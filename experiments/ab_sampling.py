"""The fused sampler (top-k 50 + top-p 0.9) timed with other versions of kernels/sampling/triton.py, in one process.

The sampler's launch-2 time moved by 2.6x between two commits whose algorithm is the same (profile_sampling at
9415e55 and 0e75ebe, B = 1: 17 against 44 us), in device calls minutes apart: only versions timed beside each other
on the same card decide. Each `--variant NAME:FILE` loads FILE (e.g. `git show 9415e55:kernels/sampling/triton.py
> .ab/sampling_9415e55.py`) with its custom ops renamed (`qmoe::` -> `qmoe_ab_NAME::`, so both register); FILE
`current` is the checkout's module, and `:KNOB=INT,...` passes launch() knobs (`grid:current:grid_steps=1`). The
variant `current` (the checkout's, default knobs) always runs. Rounds alternate the variants (A B A B ...), each a
CUDA-graph timing (benchlib.time_calls, inputs rotated past L2), so drift between rounds shows as spread, not as a
difference.
Each row also says how its rows finished (S_PATH) and, where the version has it, how many tokens its lists held.
On the device the variant files travel with `carry` (.ab/ is ignored by git); stage `ab_sampling` of
h200_session.sh passes $AB_SAMPLING.

    PYTHONPATH=. python experiments/ab_sampling.py --variant old:.ab/sampling_9415e55.py [--batch 1 256]
        [--shapes llm ties] [--modes topk50_topp0.9 topp0.95] [--rounds 3] [--out results/ab_sampling.json]
"""

import argparse
import importlib.util
import math
import re
import statistics
import time
from pathlib import Path

import torch
from bench_sampling import L2_FLUSH_BYTES, MODES, SHAPES, TARGET_MODE, VOCAB, make_logits
from benchlib import time_calls, write_json

from kernels.sampling import triton as current
from qmoe.runtime.generate import sampling_tensors
from qmoe.settings import SamplingSettings


def settings(mode: str, shape: str) -> SamplingSettings:
    """bench_sampling's MODES entry at the shape's temperature."""
    top_k, top_p, min_p = MODES[mode]
    return SamplingSettings(temperature=SHAPES[shape], top_k=top_k, top_p=top_p, min_p=min_p, seed=0)


def load_variant(name: str, path: str):
    """FILE as a module, its custom ops under the namespace qmoe_ab_NAME (Triton reads kernel source from a file,
    so the renamed copy is written beside it)."""
    source = Path(path).read_text().replace('"qmoe::', f'"qmoe_ab_{name}::')
    renamed = Path(path).with_name(f"{Path(path).stem}_as_{name}.py")
    renamed.write_text(source)
    spec = importlib.util.spec_from_file_location(f"ab_sampling_{name}", renamed)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse_variant(text: str):
    """NAME:FILE[:KNOB=INT,...] -> (name, (module, knobs passed to its launch))."""
    name, _, rest = text.partition(":")
    path, _, knob_text = rest.partition(":")
    if not re.fullmatch(r"\w+", name) or not path:
        raise SystemExit(f"--variant takes NAME:FILE[:KNOB=INT,...] (NAME: letters, digits, _), got {text!r}")
    knobs = {k: int(v) for k, v in (kv.split("=", 1) for kv in knob_text.split(",") if kv)}
    module = current if path == "current" else load_variant(name, path)
    return name, (module, knobs)


def finished_by(module, logits, params, knobs) -> dict:
    """How the rows of one call finished: {path: rows}, and the largest list (S_LISTED) where the version has it."""
    state = torch.empty(logits.shape[0], module.N_STATE.value, dtype=torch.int64, device=logits.device)
    module.launch(logits, *params, state=state, **knobs)
    paths = {int(p): int((state[:, module.S_PATH.value] == p).sum()) for p in state[:, module.S_PATH.value].unique()}
    listed = int(state[:, module.S_LISTED.value].max()) if hasattr(module, "S_LISTED") else None
    return {"paths": paths, "max_listed": listed}


def ab_rows(variants: dict, B: int, mode: str, shape: str, args, device: str) -> list[dict]:
    """Every variant timed on one (B, mode, shape), rounds alternating the variants."""
    copies = min(200, math.ceil(L2_FLUSH_BYTES / (B * args.vocab * 4))) if device == "cuda" else 1
    inputs = [make_logits(B, args.vocab, shape, torch.float32, device, seed=i) for i in range(copies)]
    params = (*sampling_tensors(settings(mode, shape), B, device).values(), torch.arange(B, device=device))
    if MODES[mode][0] > args.vocab:  # top-k V at a smaller --vocab
        params[1].clamp_(max=args.vocab)
    times = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, (module, knobs) in variants.items():
            call = lambda i, m=module, k=knobs, xs=inputs, p=params: m.launch(xs[i % len(xs)], *p, **k)  # noqa: E731
            us, method = time_calls(call, copies, device)
            times[name].append(us)
    rows = []
    for name, (module, knobs) in variants.items():
        row = {"B": B, "mode": mode, "shape": shape, "variant": name, "us": statistics.median(times[name]),
               "rounds_us": times[name], "timing": method, "knobs": knobs,
               **finished_by(module, inputs[0], params, knobs)}  # fmt: skip
        rows.append(row)
        print(
            f"B={B:<4} {mode:<15} {shape:<6} {name:<12} {row['us']:8.1f} us  rounds "
            f"{[round(t, 1) for t in times[name]]}  paths {row['paths']}  max listed {row['max_listed']}"
        )
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", action="append", default=[], help="NAME:FILE (repeatable)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 256])
    parser.add_argument("--shapes", nargs="+", default=["llm", "ties"], choices=[s for s in SHAPES if "_T" not in s])
    parser.add_argument("--modes", nargs="+", default=[TARGET_MODE], choices=list(MODES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--out", default="results/ab_sampling.json")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    variants = {"current": (current, {})} | dict(parse_variant(v) for v in args.variant)
    t0 = time.time()
    rows = []
    for B in args.batch:
        for mode in args.modes:
            for shape in args.shapes:
                rows += ab_rows(variants, B, mode, shape, args, device)
                # after every case: a device call cut by its limit keeps what it measured
                write_json(args.out, "ab_sampling", device, variants={n: m.__file__ for n, (m, _) in variants.items()},
                           modes={m: MODES[m] for m in args.modes}, rows=rows, seconds=time.time() - t0)  # fmt: skip


if __name__ == "__main__":
    main()
