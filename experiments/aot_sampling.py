"""What the H200 would run for the fused sampler, from the CPU: the sampling kernels compiled ahead of time for
sm_90 with the local Triton (experiments/aot_sm90.py's helpers: ptxas -v with Triton's flags, cuobjdump SASS),
at the launch parameters of B = 1 and B = 256 (V = 248,320, fp32 logits, the defaults of kernels/sampling/triton
.launch). Per kernel: registers, spills, shared memory, programs per SM and waves of its grid
(aot_decode_sass.occupancy), and each loop of the SASS (a predicated backward branch): instructions, barriers,
global loads and atomics. Only timing can say what these cost (`experiments/profile_sampling.py`,
`bench_sampling.py`); this says what changed between commits without a GPU (run it in a worktree of the other
commit).

    python experiments/aot_sampling.py [--out results/aot_sampling.json]
    python experiments/aot_sampling.py --front-end   (seconds: Triton's front end only, for the CPU tests)

`--front-end` runs only Triton's front end (Python to Triton IR, as for sm_90) on the same kernels and exits 1 if
one fails: the CPU interpreter runs kernels that this rejects (a name rebound to another type inside an `if`), and
the first device call of session 14 died of one (tests/test_kernels_front_end.py runs it).
"""

import argparse
import inspect
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aot_sm90 as aot  # noqa: E402
from aot_decode_sass import SMS, occupancy  # noqa: E402
from benchlib import write_json  # noqa: E402

from kernels.launch import cdiv, next_power_of_2  # noqa: E402
from kernels.sampling import triton as fused  # noqa: E402

V = 248_320
NUM_WARPS = 8  # every sampling launch on the GPU but launches 2a (tiles) and 2b (gather_count)
TILE_WARPS = inspect.signature(fused.launch).parameters["tile_warps"].default
COUNT_WARPS = inspect.signature(fused.launch).parameters["count_warps"].default
WARPS = {"tiles": TILE_WARPS, "gather_count": COUNT_WARPS}  # kernels_at's names -> num_warps; else NUM_WARPS
INT_POINTERS = {"top_k_ptr": "*i64", "seed_ptr": "*i64", "step_ptr": "*i64", "part_i_ptr": "*i32",
                "search_i_ptr": "*i32", "buf_idx_ptr": "*i32", "counter_ptr": "*i32", "out_ptr": "*i64",
                "state_i_ptr": "*i64", "round_cnt_ptr": "*i32", "race_i_ptr": "*i32",
                "tile_list_ptr": "*i32", "cut_ptr": "*i32", "arrivals_ptr": "*i32", "part_idx_ptr": "*i32",
                "cand_ptr": "*fp64"}  # fmt: skip


def signature(kernel, constexprs: dict):
    """The kernel's arguments as launch() passes them: pointers 16-byte aligned (fp32 unless listed), V and the
    row stride divisible by 16 (Triton specializes them so), other ints unspecialized (do_not_specialize)."""
    fn = aot.fn_of(kernel)
    args = {}
    for name in fn.arg_names:
        if name in constexprs:
            continue
        if name.endswith("_ptr"):
            args[name] = (INT_POINTERS.get(name, "*fp32"), True)
        else:
            args[name] = ("i32", name in ("V", "stride_row"))
    return aot.spec(kernel, args, constexprs)


def launch_params(B: int) -> dict:
    """launch()'s defaults on the GPU at this B (block, split, bins, cap, groups, the resolve plan)."""
    block = min(2048, next_power_of_2(V))
    split = min(fused.SPLIT_MAX, cdiv(2048, B), cdiv(V, block))
    bins = 16 if B < 64 else 4
    persistent, split_r = fused.resolve_plan(B, split, SMS)
    return {"B": B, "block": block, "block_c": min(block, 128 * COUNT_WARPS),
            "block_r": min(block, max(16, 4096 // bins)), "split": split, "bins": bins, "cap": 1024, "nt": 8,
            "groups": fused.group_count(split, block), "tiles": fused.tiles_pay_off(B, split, SMS),
            "resolve_persistent": persistent, "resolve_split": split_r}  # fmt: skip


def count_programs(p: dict) -> int:
    """Launch 2b's grid: its items, at most 8 warps' worth of programs per SM."""
    return min(SMS * (8 // COUNT_WARPS), p["B"] * p["split"])


def kernels_at(p: dict) -> dict:
    """name -> (kernel, constexprs, programs in its grid) of the launches at these parameters (launch 3: both
    forms)."""
    tile = min(fused.TILE_TOKENS, p["block_c"])
    g = {"G": p["groups"], "TILE": tile}
    tiles = {"N_TILES": next_power_of_2(cdiv(V, tile)), "NS": fused.TILES_PER_LOAD}
    gather = {"R": 1, "BLOCK": p["block_c"], "CAP": p["cap"], "LOG_CAP": 10, "NT": p["nt"], "LOG_NT": 3,
              "SPLIT": next_power_of_2(p["split"]), "PDL": True, "G": p["groups"],
              "ITEMS": next_power_of_2(cdiv(p["B"] * p["split"], count_programs(p)))}  # fmt: skip
    from_tiles = {"R": 1, "CAP": p["cap"], "LOG_CAP": 10, "SPLIT": next_power_of_2(p["split"]), "PDL": True, **g,
                  **tiles}  # fmt: skip
    resolve = {"R": 1, "BLOCK": p["block"], "BLOCK_R": p["block_r"], "NB": p["bins"], "CAP": p["cap"],
               "LOG_CAP": 10, "SPLIT": next_power_of_2(p["resolve_split"]), "PERSISTENT": p["resolve_persistent"],
               "GRID": False, "PDL": True}  # fmt: skip
    grid = resolve | {"SPLIT": next_power_of_2(p["split"]), "PERSISTENT": False, "GRID": True}  # launch(grid_steps=)
    programs, programs_r = p["B"] * p["split"], p["B"] * p["resolve_split"]  # one row per program on the GPU
    _, greedy_split, _ = fused.argmax_chunks(p["B"], V, True, p["block"])  # launch_greedy's
    return {
        "stats": (
            fused._stats_kernel,
            {"R": 1, "BLOCK": p["block"], "PDL": True, **g, "TILE": tile if p["tiles"] else 0},
            programs,
        ),
        "tiles": (fused._tiles_kernel, from_tiles, p["B"]),  # launched only where p["tiles"]
        "gather_count": (fused._gather_count_kernel, gather, count_programs(p)),
        "resolve": (fused._resolve_kernel, resolve, programs_r),
        "resolve_grid": (fused._resolve_kernel, grid, min(SMS, programs)),
        "greedy": (  # the greedy entry point (one GPU)
            fused._greedy_kernel,
            {"BLOCK": p["block"], "SPLIT": next_power_of_2(greedy_split), "PDL": True},
            p["B"] * greedy_split,
        ),
        # a vocab-parallel rank's launch (qmoe/parallel/sampling.py), greedy and sampled, at the greedy's chunking
        **{
            name: (
                fused._shard_candidates_kernel,
                {"BLOCK": p["block"], "SPLIT": next_power_of_2(split), "RACE": race, "PDL": True},
                p["B"] * split,
            )
            for name, race in (("shard_greedy", False), ("shard_race", True))
            for split in [greedy_split]
        },
    }


def loops(sass: str) -> list[dict]:
    """Each loop of the SASS (a predicated backward branch; an unconditional one is code layout, a jump back from
    a block placed out of line): its body's instructions, barriers, global loads and atomics."""
    ins = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", sass, re.M)]
    at = {a: i for i, (a, _) in enumerate(ins)}
    out = []
    for i, (a, text) in enumerate(ins):
        m = re.search(r"^@!?U?P\w+\s+BRA\s.*?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) <= a and int(m.group(1), 16) in at:
            body = [t for _, t in ins[at[int(m.group(1), 16)] : i + 1]]
            out.append({"instructions": len(body), "barriers": sum("BAR.SYNC" in t for t in body),
                        "global_loads": sum("LDG" in t for t in body),
                        "atomics": sum(("ATOMG" in t) or ("RED." in t) for t in body)})  # fmt: skip
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/aot_sampling.json")
    parser.add_argument("--front-end", action="store_true", help="Triton's front end only; exit 1 on an error")
    args = parser.parse_args()
    if args.front_end:
        kernels = {(B, name): launch for B in (1, 256) for name, launch in kernels_at(launch_params(B)).items()}
        aot.front_end_exit(
            {
                f"B={B:<4} {name}": (signature(kernel, constexprs), WARPS.get(name, NUM_WARPS))
                for (B, name), (kernel, constexprs, _) in kernels.items()
            }
        )
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for B in (1, 256):
            p = launch_params(B)
            for name, (kernel, constexprs, programs) in kernels_at(p).items():
                warps = WARPS.get(name, NUM_WARPS)
                r = aot.report(f"{name}_B{B}", (signature(kernel, constexprs), warps, 1), Path(tmp))
                sass = (Path(tmp) / f"{name}_B{B}.sass").read_text()
                fill = occupancy(r["registers"], r["shared_bytes"], warps, programs)
                row = {"B": B, "kernel": name, "registers": r["registers"], "spill_bytes": r["spill_store_bytes"],
                       "shared_bytes": r["shared_bytes"], **fill, "sass_instructions": r["sass_instructions"],
                       "loops": loops(sass), "launch": p}  # fmt: skip
                rows.append(row)
                print(f"B={B:<4} {name:<13} {r['registers']:>4} regs {fill['programs_per_sm']} / SM "
                      f"{fill['waves']} waves  spill {r['spill_store_bytes']}"
                      f"  loops {[(lp['instructions'], lp['barriers']) for lp in row['loops']]}")  # fmt: skip
    target = "sm_90, compiled ahead of time on the CPU (ptxas and flags of Triton; experiments/aot_sm90.py)"
    write_json(args.out, "aot_sampling", "cpu", target=target, rows=rows)


if __name__ == "__main__":
    main()
