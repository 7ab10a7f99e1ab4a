"""Fused sampling (kernels/sampling/triton.py) over a family of logit shapes vs torch, V = 248320, CUDA graphs.

Shapes (`make_logits`; the README lists them): "flat" N(0, 1); "llm" (background N(0, 2^2), 64 candidates
lifted by 20 .. 6: a few tokens carry most of the mass); "peaked" (3 tokens 40 above a N(0, 1) background:
the mass is in 3 tokens, the 50th largest logit sits in the flat tail); "zipf" (p ~ rank^-1.1 over a random
permutation); "ties" (N(0, 2^2) rounded to integers: thousands of exact ties at every cut); "masked" (99 % of
the vocabulary at -inf, the rest llm-like); "llm_T0.05" / "llm_T5" (llm rows at temperature 0.05 / 5).
Modes: top-k 50 + top-p 0.9 (the target mode) on every shape; top-k 1 / 1000 / V, top-p 0.5 / 0.95 / 0.999,
min-p 0.05 alone on "llm" (typical) and "flat" (the widest kept sets) at B = 1 and 256; greedy through
`fused.greedy` against torch.argmax. B in {1, 8, 64, 256}; fp32 logits, and bf16 for the target mode and greedy.

Before timing, every case is checked on the GPU: greedy and top-k 1 tokens equal the argmax, sampled tokens lie
in the kept set of the float64 reference filter (kernels/sampling/naive.py), and no row is left unfinished by the
radix rounds. Where each row finished goes to the JSON ("paths": launch 2's list, "regather": launch 3's gather
from launch 2's bracket, the radix rounds, the race alone; "radix_rows", "max_rounds"): the target mode should
never take the rounds. A failed check aborts (exit 1).

Each call is timed inside one CUDA graph of many calls on inputs rotated over > 200 MB (logits come from HBM,
not L2); the copy ceiling is measured in the same run. The JSON reports per B the typical ("llm") and the
worst shape of the target mode, the worst case of every mode run at that B (the family's cliff), and every target
met / missed with the factor.

    PYTHONPATH=. python experiments/bench_sampling.py [--out results/bench_sampling.json] [--quick] [--target-only]
        [--batch B ...]
    (--quick: B = 1 and 256; --batch: those B; --target-only: greedy and the target mode, no other modes or bins
    sweep. A line per
    case as it finishes, and the JSON so far after each case, "complete": false until the end: a run cut short by a
    time limit still leaves its rows)
    TRITON_INTERPRET=1 PYTHONPATH=. python experiments/bench_sampling.py --vocab 256 --quick --out /tmp/b.json
    (a CPU smoke run of the script itself: the interpreter's times mean nothing)
"""

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
from benchlib import L2_FLUSH_BYTES, copy_bandwidth_gbs, print_targets, target, time_calls, write_json

from kernels.sampling import naive
from kernels.sampling import triton as fused

VOCAB = 248_320
BATCHES = (1, 8, 64, 256)
TARGET_MODE = "topk50_topp0.9"
MODES = {  # name -> (top_k, top_p, min_p); temperature comes with the shape
    TARGET_MODE: (50, 0.9, 0.0),
    "topk1": (1, 1.0, 0.0),
    "topk1000": (1000, 1.0, 0.0),
    "topkV": (VOCAB, 1.0, 0.0),
    "topp0.5": (0, 0.5, 0.0),
    "topp0.95": (0, 0.95, 0.0),
    "topp0.999": (0, 0.999, 0.0),
    "minp0.05": (0, 1.0, 0.05),
}
SHAPES = {"flat": 1.0, "llm": 1.0, "peaked": 1.0, "zipf": 1.0, "ties": 1.0, "masked": 1.0, "llm_T0.05": 0.05}
SHAPES["llm_T5"] = 5.0  # shape -> temperature
TARGET_US = {1: (20.0, 40.0), 256: (150.0, 300.0)}  # B -> (typical, worst) for the target mode, fp32
GREEDY_VS_ARGMAX = 1.2
BINS_SWEEP = (4, 16, 64)  # radix thresholds per round (GPU default: 16 below B = 64, 4 from it)
RADIX_CASES = (("topp0.95", "flat"), ("topk1000", "llm"))  # cases whose rows take the radix rounds
BF16_VS_FP32 = 1.2
RUNTIME_S = 180.0
PATHS = {  # how the rows of a case finished (fused.S_PATH): the launch that drew their token
    "list": fused.PATH_LIST.value,  # launch 2's speculative list held the cut
    "regather": fused.PATH_REGATHER.value,  # launch 3, from a gather between launch 2's counted thresholds
    "radix": fused.PATH_RADIX.value,  # the radix rounds, then the race
    "race": fused.PATH_RACE.value,  # the race alone (no filter, or min-p over > CAP tokens)
}
GRAPH_US = 30_000  # calls per CUDA graph: at most this much work (the runtime stays < 3 min on slow cases)


def make_logits(B: int, V: int, shape: str, dtype, device: str, seed: int) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    kind = shape.split("_")[0]
    if kind == "flat":
        x = torch.randn(B, V, device=device, generator=g)
    elif kind in ("llm", "masked"):
        x = torch.randn(B, V, device=device, generator=g) * 2
        cand = torch.randint(0, V, (B, 64), device=device, generator=g)
        x.scatter_add_(1, cand, torch.linspace(20, 6, 64, device=device).expand(B, -1))
        if kind == "masked":  # keep the candidates and 1 % of the rest
            keep = torch.rand(B, V, device=device, generator=g) < 0.01
            keep.scatter_(1, cand, True)
            x = x.masked_fill(~keep, float("-inf"))
    elif kind == "peaked":
        x = torch.randn(B, V, device=device, generator=g)
        x.scatter_add_(
            1, torch.randint(0, V, (B, 3), device=device, generator=g), torch.full((B, 3), 40.0, device=device)
        )
    elif kind == "zipf":
        rank = torch.rand(B, V, device=device, generator=g).argsort(-1).float() + 1
        x = -1.1 * rank.log()
    elif kind == "ties":
        x = (torch.randn(B, V, device=device, generator=g) * 2).round()
    else:
        raise ValueError(shape)
    return x.to(dtype)


def torch_sort_sample(logits, temperature, top_k, top_p, min_p):
    """The usual torch sampler: sort, top-k by rank, top-p by cumulative mass, min-p, then an exponential race."""
    logits = logits.float() / temperature[:, None]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[1], device=logits.device)
    k = torch.where(top_k > 0, top_k, logits.shape[1])
    sorted_logits = sorted_logits.masked_fill(rank >= k[:, None], float("-inf"))
    probs = sorted_logits.softmax(-1)
    before = probs.cumsum(-1) - probs  # mass strictly above each sorted position
    drop = (before >= top_p[:, None]) | (probs < min_p[:, None] * probs[:, :1])
    probs = probs.masked_fill(drop, 0.0)
    drawn = (probs / torch.empty_like(probs).exponential_()).argmax(-1)
    return order.gather(1, drawn[:, None])[:, 0]


def check(mode: str, logits, tokens, temperature, top_k, top_p, min_p) -> str | None:
    """None if the tokens are right: argmax for greedy / top-k 1, else in the float64 kept set."""
    if mode in ("greedy", "topk1"):
        ok = torch.equal(tokens, naive.greedy(logits))
    else:
        probs = torch.softmax(logits.double() / temperature.double()[:, None], -1)
        keep = naive.filter_probs(probs, top_k, top_p.double(), min_p.double())
        ok = bool(((tokens >= 0) & keep[torch.arange(len(tokens), device=tokens.device), tokens.clamp(min=0)]).all())
    return None if ok else f"{mode}: tokens {tokens[:8].tolist()} not in the reference's kept set / argmax"


def eager_us(fn, x) -> float:
    """One eager call's µs after a warm-up: slow cases get fewer calls per graph (they do not fit in L2 anyway)."""
    fn(x)
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn(x)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e6


def bench_case(mode: str, shape: str, B: int, V: int, dtype, device: str, baseline: bool, bins=None) -> list[dict]:
    """Rows of one case: "triton" (and the torch baseline), or "triton_bins{N}" (the radix rounds with N bins)."""
    nbytes = B * V * dtype.itemsize
    copies = min(200, math.ceil(L2_FLUSH_BYTES / nbytes)) if device == "cuda" else 1
    n = max(copies, 4) if device == "cuda" else 1
    inputs = [make_logits(B, V, shape, dtype, device, seed=i) for i in range(copies)]
    full = lambda v, dt: torch.full((B,), v, dtype=dt, device=device)
    top_k, top_p, min_p = MODES.get(mode, (0, 1.0, 0.0))
    temperature = 0.0 if mode == "greedy" else SHAPES[shape]
    params = (full(temperature, torch.float32), full(min(top_k, V), torch.int64), full(top_p, torch.float32))
    params += (full(min_p, torch.float32),)
    seed, step = full(0, torch.int64), torch.arange(B, device=device)
    if mode == "greedy":
        impls = {"triton": fused.greedy}
        if baseline:
            impls["torch.argmax"] = lambda x: x.argmax(-1)
    else:
        impls = {"triton": lambda x: fused.sample(x, *params, seed, step)}
        if bins:
            impls = {"triton": lambda x: fused.launch(x, *params, seed, step, bins=bins)}
        if baseline:
            impls["torch_sort"] = lambda x: torch_sort_sample(x, *params)
    error = check(mode, inputs[0], impls["triton"](inputs[0]), *params)
    radix = {}
    if mode != "greedy":  # which rows took the radix rounds, how many rounds, and that every one finished
        state = torch.empty(B, fused.N_STATE.value, dtype=torch.int64, device=device)
        fused.launch(inputs[0], *params, seed, step, state=state, bins=bins)
        phase, path = state[:, fused.S_PHASE.value], state[:, fused.S_PATH.value]
        rounds = state[:, fused.S_ROUNDS_K.value] + state[:, fused.S_ROUNDS_P.value]
        paths = {name: int((path == value).sum()) for name, value in PATHS.items()}
        radix = {
            "radix_rows": paths["radix"],
            "max_rounds": int(rounds.max()),
            "paths": paths,
            "max_listed": int(state[:, fused.S_LISTED.value].max()),
        }  # the fullest list (tokens >= its threshold)
        if ((phase == fused.PHASE_TOP_K.value) | (phase == fused.PHASE_TOP_P.value)).any():
            error = error or f"{mode}: rows left unfinished by the radix rounds"
    if error:
        sys.exit(f"correctness check failed before timing ({shape}, B={B}, {dtype}): {error}")
    rows = []
    for impl, fn in impls.items():
        calls = n if device != "cuda" else min(n, max(4, int(GRAPH_US / eager_us(fn, inputs[0]))))
        us, method = time_calls(lambda i, fn=fn: fn(inputs[i % copies]), calls, device)
        rows.append(
            {"mode": mode, "B": B, "dtype": str(dtype).removeprefix("torch."), "logits": shape}
            | {"impl": f"triton_bins{bins}" if bins and impl == "triton" else impl}
            | {"us": us, "timing": method, "logits_MB": nbytes / 1e6}
            | radix
        )
    return rows


def cases(batches, target_only=False):
    """(mode, shape, B, dtype, baseline?) in the order they run."""
    for B in batches:
        for dtype in (torch.float32, torch.bfloat16):
            yield "greedy", "llm", B, dtype, True
            for shape in SHAPES if dtype == torch.float32 else ("llm", "flat"):
                yield TARGET_MODE, shape, B, dtype, shape == "llm"
        if B in (1, 256) and not target_only:
            for mode in MODES:
                if mode != TARGET_MODE:
                    for shape in ("llm", "flat"):
                        yield mode, shape, B, torch.float32, False


def planned_runs(batches, target_only=False):
    """(mode, shape, B, dtype, baseline?, radix bins or None) of every case, in the order they run: cases(), then
    (not target_only) the rounds' bins sweep: fewer launches against more work a round."""
    runs = [(mode, shape, B, dtype, baseline, None) for mode, shape, B, dtype, baseline in cases(batches, target_only)]
    if not target_only:
        runs += [(mode, shape, B, torch.float32, False, bins) for B in batches if B in (1, 256)
                 for mode, shape in RADIX_CASES for bins in BINS_SWEEP]  # fmt: skip
    return runs


def find(rows, **key):
    return next((r for r in rows if all(r[k] == v for k, v in key.items())), None)


def summarise(rows, batches):
    """Per B: typical (llm) and worst shape of the target mode (fp32), and the target rows."""
    summary, targets = {}, []
    for B in batches:
        mine = [r for r in rows if r["impl"] == "triton" and r["mode"] == TARGET_MODE and r["B"] == B]
        fp32 = [r for r in mine if r["dtype"] == "float32"]
        typical, worst = find(fp32, logits="llm"), max(fp32, key=lambda r: r["us"])
        greedy, argmax = find(rows, mode="greedy", B=B, dtype="float32", impl="triton"), None
        argmax = find(rows, mode="greedy", B=B, dtype="float32", impl="torch.argmax")
        sort = find(rows, mode=TARGET_MODE, B=B, dtype="float32", logits="llm", impl="torch_sort")
        family = [r for r in rows if r["impl"] == "triton" and r["mode"] != "greedy" and r["B"] == B]
        worst_any = max(family, key=lambda r: r["us"])  # over every mode and shape run at this B
        summary[B] = {
            "typical_us": typical["us"],
            "worst_us": worst["us"],
            "worst_shape": worst["logits"],
            "worst_any_us": worst_any["us"],
            "worst_any_case": f"{worst_any['mode']} {worst_any['logits']} {worst_any['dtype']}",
            "torch_sort_us": sort["us"],
            "greedy_us": greedy["us"],
            "argmax_us": argmax["us"],
        }
        if B in TARGET_US:
            typ, wst = TARGET_US[B]
            targets.append(target(f"{TARGET_MODE} B={B} fp32 typical (llm) us", typical["us"], typ, True))
            targets.append(target(f"{TARGET_MODE} B={B} fp32 worst ({worst['logits']}) us", worst["us"], wst, True))
            targets.append(target(f"greedy B={B} fp32: triton / torch.argmax", greedy["us"] / argmax["us"], 1.2, True))
        for shape in ("llm", "flat"):
            bf16, base = find(mine, dtype="bfloat16", logits=shape), find(fp32, logits=shape)
            if bf16 and base:  # a run cut short may not have reached them (its not_run lists them)
                ratio = bf16["us"] / base["us"]
                targets.append(target(f"{TARGET_MODE} B={B} {shape}: bf16 / fp32", ratio, BF16_VS_FP32, True))
    return summary, targets


def summarise_cut_run(path: Path, cut_after: float):
    """per_batch and targets of a run cut by its time limit after `cut_after` seconds, from the rows it wrote (the
    environment, commit and command stay the run's own), and the cases it did not reach."""
    doc = json.loads(path.read_text())
    rows = doc["rows"]
    for r in rows:
        r["floor_us"] = r["logits_MB"] * 1e3 / doc["copy_gbs"]
    batches = tuple(dict.fromkeys(r["B"] for r in rows))
    doc["per_batch"], doc["targets"] = summarise(rows, batches)
    if cut_after > RUNTIME_S:  # else the whole run's time is unknown: no verdict either way
        doc["targets"].append(target("benchmark runtime s (cut short: at least)", cut_after, RUNTIME_S, True))
    ran = {(r["mode"], r["logits"], r["B"], r["dtype"], r["impl"]) for r in rows}
    planned = [(m, s, B, str(d).removeprefix("torch."), f"triton_bins{bins}" if bins else "triton")
               for m, s, B, d, _, bins in planned_runs(batches, "--target-only" in doc["command"])]  # fmt: skip
    doc["not_run"] = [" ".join(map(str, c)) for c in planned if c not in ran]
    doc["summarised"] = "offline (--summarise) from the rows of a run cut short; complete stays false"
    path.write_text(json.dumps(doc, indent=2, default=str))
    print_targets(doc["targets"])
    print(f"not run: {doc['not_run']}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/bench_sampling.json")
    parser.add_argument("--quick", action="store_true", help="B = 1 and 256 only")
    parser.add_argument("--batch", type=int, nargs="+", choices=BATCHES, help="these B only (a device call each: "
                        "the whole family did not finish in 230 s)")  # fmt: skip
    parser.add_argument("--target-only", action="store_true", help="greedy and the target mode only (no other modes,"
                        " no bins sweep)")  # fmt: skip
    parser.add_argument("--vocab", type=int, default=VOCAB, help="smaller only for CPU smoke runs of the script")
    parser.add_argument("--summarise", metavar="JSON", help="summarise the rows of a run that was cut short (its "
                        "JSON, complete false) into per_batch and targets, in place; runs nothing")  # fmt: skip
    parser.add_argument("--cut-after", type=float, help="with --summarise: the seconds the run had when it was cut")
    args = parser.parse_args()
    if args.summarise:
        path = Path(args.summarise)
        problem = (
            f"--summarise: no file {path}" if not path.is_file()
            else "--summarise needs --cut-after SECONDS (how long the cut run had)" if args.cut_after is None
            else f"--summarise: {path} is not a bench_sampling run cut short (complete is not false)"
            if json.loads(path.read_text()).get("complete", True) is not False else None
        )  # fmt: skip
        if problem:
            print(problem, file=sys.stderr)
            sys.exit(2)
        return summarise_cut_run(path, args.cut_after)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    V = args.vocab
    batches = tuple(args.batch) if args.batch else (1, 256) if args.quick else BATCHES
    start = time.perf_counter()
    copy_gbs = copy_bandwidth_gbs(device)
    rows = []
    for mode, shape, B, dtype, baseline, bins in planned_runs(batches, args.target_only):
        new = bench_case(mode, shape, B, V, dtype, device, baseline, bins=bins)
        rows += new
        for r in new:
            print(
                f"{r['mode']:<16} {r['logits']:<10} B={r['B']:<4} {r['dtype']:<9} {r['impl']:<14} {r['us']:>10.1f} us"
            )
        # what has run so far, should the run be cut short (the final write below replaces it)
        write_json(args.out, "bench_sampling", device, V=V, copy_gbs=copy_gbs, rows=rows, complete=False)
    for r in rows:
        r["floor_us"] = r["logits_MB"] * 1e3 / copy_gbs  # one read of the logits at the copy rate
    summary, targets = summarise(rows, batches)
    seconds = time.perf_counter() - start
    targets.append(target("benchmark runtime s", seconds, RUNTIME_S, True))
    write_json(
        args.out, "bench_sampling", device, V=V, copy_gbs=copy_gbs, per_batch=summary, rows=rows, targets=targets,
        seconds=seconds, checked="greedy / top-k 1 == argmax, sampled tokens in the float64 kept set", complete=True,
        target_only=args.target_only,
    )  # fmt: skip

    print(f"V = {V} on {device}, copy ceiling {copy_gbs:.0f} GB/s; us per call (CUDA graph, logits from HBM)")
    print(f"{'mode':>15} {'shape':>10} {'B':>4} {'dtype':>9} {'triton':>9} {'baseline':>9} {'floor':>7}  paths")
    for r in (r for r in rows if r["impl"] == "triton"):
        base = next(
            (b for b in rows if b["impl"] != "triton" and all(b[k] == r[k] for k in ("mode", "B", "dtype", "logits"))),
            None,
        )
        base_s = f"{base['us']:9.1f}" if base else f"{'-':>9}"
        print(
            f"{r['mode']:>15} {r['logits']:>10} {r['B']:>4} {r['dtype']:>9}",
            f"{r['us']:9.1f} {base_s} {r['floor_us']:7.1f}  {r.get('paths', '-')}",
        )
    print(f"{'B':>4} {'typical':>9} {'worst':>9} {'(shape)':>10} {'torch sort':>10} {'greedy':>8} {'argmax':>8}",
          "  worst of every mode")  # fmt: skip
    for B, s in summary.items():
        print(
            f"{B:>4} {s['typical_us']:9.1f} {s['worst_us']:9.1f} {s['worst_shape']:>10} {s['torch_sort_us']:10.1f} "
            f"{s['greedy_us']:8.1f} {s['argmax_us']:8.1f}   {s['worst_any_us']:.1f} ({s['worst_any_case']})"
        )
    sweep = [r for r in rows if r["impl"].startswith("triton_bins")]
    print("radix cases, fp32, by radix bins per round (GPU default: 16 below B = 64, 4 from it):")
    for r in sweep:
        print(
            f"  B={r['B']:>3} {r['mode']:>9} {r['logits']:>7} {r['impl']:>14} {r['us']:9.1f} us  "
            f"radix rows {r['radix_rows']}, rounds {r['max_rounds']}"
        )
    print_targets(targets)
    print(f"-> {args.out} ({seconds:.0f} s)")


if __name__ == "__main__":
    main()
