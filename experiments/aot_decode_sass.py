"""The latency structure of the 35B-A3B decode kernels as the H200 would run them, from sm_90 SASS built on the CPU.

A batch-1 decode kernel is short: after its PDL wait, what it costs is mostly the chain of dependent L2/HBM round
trips and block barriers before its loads are in flight. This script compiles the decode kernels at the 35B shapes
and their tuned H200 launch configs for sm_90 (experiments/aot_sm90.py: Triton's own ptxas and flags, no GPU) and
reports, per kernel: registers, spills, shared memory, the global loads issued before the PDL wait (ACQBULK), those
issued after it before any block barrier (they go out together), the block barriers (BAR.SYNC) the kernel passes
after the wait before its last global load is issued (a load behind a barrier waits for whatever the barrier's
threads waited on), and the sequence of global loads (LDG), stores (STG), atomics and barriers after the wait, runs
of one opcode counted (LDGx8); the code of loops that do not run at these shapes counts too (the sequences show
where), and the occupancy those registers and that shared memory allow: programs per SM and the waves the kernel's
grid takes on the H200's 132 SMs (a grid of 512 programs at 3 per SM runs a second wave of 116: the out-projections
and MoE up before their register caps). It measures no time: it shows the order in which a kernel issues its
memory traffic, which only the step's
timing on the GPU (experiments/tune_decode_loop.py, profile_decode_loop.py) can judge. (A top-k that cut the MoE
up kernel's barriers before its expert loads from 15 to 1 made the step 38 us slower:
results/probe_decode_latency.json.)

    PYTHONPATH=. python experiments/aot_decode_sass.py [--out results/aot_decode_sass.json]
"""

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import aot_sm90  # noqa: E402  (sets up sys.path and the compile helpers)
import torch  # noqa: E402
import triton  # noqa: E402

from kernels.attention import triton as attention  # noqa: E402
from kernels.gdn import fused_recurrent  # noqa: E402
from kernels.linear import triton as linear  # noqa: E402
from kernels.moe import triton as moe  # noqa: E402
from kernels.tuned import gpu_config_path  # noqa: E402

OPS = re.compile(r"/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?((?:LDG|STG|ATOMG|RED\.|BAR|ACQBULK)[A-Z0-9_.]*)")


def signature(kernel, constexprs: dict, types: dict, default: str = "*bf16") -> dict:
    """Every non-constexpr argument -> (type, divisible by 16): pointers `types.get(name, default)`, ints i32
    (divisible unless a stride that the model passes as 1 or an odd size), eps and scales fp32."""
    args = {}
    for name in aot_sm90.fn_of(kernel).arg_names:
        if name in constexprs:
            continue
        if name.endswith("_ptr"):
            args[name] = (types.get(name, default), True)
        elif name in ("eps", "scale_log2"):
            args[name] = ("fp32", False)
        else:
            args[name] = ("i32", name not in ("M", "N", "SPLIT", "stride_pe", "E"))
    return args


def h200_entry(module, key: str) -> dict:
    """The H200 table's M = 1 entry (the tables load only on their GPU: read it here)."""
    path = gpu_config_path(module.CONFIG_DIR, "NVIDIA H200")
    return json.loads(path.read_text())[key]["1"]


SMS = 132  # the H200's
SM_REGISTERS, SM_WARPS, SM_PROGRAMS, SM_SHARED = 65536, 64, 32, 228 * 1024  # sm_90 limits per SM
REGISTER_UNIT = 256  # registers are allocated per warp in units of 256


def occupancy(registers: int, shared: int, num_warps: int, programs: int) -> dict:
    """Programs per SM that the registers, warps and shared memory of one program allow, and the waves of a grid
    of `programs` over SMS SMs (1 KB of shared memory per program is the system's)."""
    per_warp = -(-registers * 32 // REGISTER_UNIT) * REGISTER_UNIT
    per_sm = min(SM_REGISTERS // (per_warp * num_warps), SM_WARPS // num_warps, SM_PROGRAMS,
                 SM_SHARED // (shared + 1024))  # fmt: skip
    return {"programs": programs, "programs_per_sm": per_sm, "waves": -(-programs // (per_sm * SMS))}


def kernels_35b() -> dict:
    """name -> (kernel, constexprs, pointer types, num_warps, num_stages, maxnreg, programs) at the 35B shapes, H200
    configs."""
    table = h200_entry(moe, moe.shape_key(256, 2048, 512, torch.bfloat16))
    up, down = table["up"], table["down"]
    att = dict(attention._decode_config(8, 256, 4, torch.bfloat16))
    att_warps, att_stages = att.pop("num_warps"), att.pop("num_stages")
    rows = {}
    for what, (N, K, norm) in {"gdn_in": (12352, 2048, True), "attn_qkv": (9216, 2048, True),
                               "out_proj": (2048, 4096, False), "moe_in": (1281, 2048, True)}.items():  # fmt: skip
        (programs, *_), _, _, meta = linear.make_plan(
            1, N, K, h200_entry(linear, linear.shape_key(N, K, torch.bfloat16)), num_sms=SMS
        )  # fmt: skip
        proj_warps, proj_stages, proj_cap = meta.pop("num_warps"), meta.pop("num_stages"), meta.pop("maxnreg", None)
        kernel = linear._gemv_persistent_kernel if meta.pop("PERSISTENT", False) else linear._linear_kernel
        meta = {k: v for k, v in meta.items() if k in aot_sm90.fn_of(kernel).arg_names}
        rows[f"{what} (N {N}, K {K}{', + add, RMSNorm' if norm else ''})"] = (
            kernel, {**meta, "NORM": norm, "PDL": True, "ROUND_X": False}, {"xs_ptr": "*fp32"}, proj_warps,
            proj_stages, proj_cap, programs,
        )  # fmt: skip
    return rows | {
        "moe up (routing + expert gate/up GEMV)": (
            moe._moe_up_gemv_kernel,
            dict(TOP_K=8, BLOCK_TOP=8, BLOCK_E=256, BLOCK_N=up["BLOCK_N"], BLOCK_K=up["BLOCK_K"], SUB_K=128,
                 EVEN_K=True, EXPERTS_FP8=False, EP=False, PDL=True),
            {"weights_ptr": "*fp32", "ids_ptr": "*i32"}, up["num_warps"], up["num_stages"], up.get("maxnreg"),
            triton.cdiv(512, up["BLOCK_N"]) * 8,
        ),
        "moe down (experts + shared + combine GEMV)": (
            moe._moe_down_gemv_kernel,
            dict(TOP_K=8, BLOCK_TOP=8, BLOCK_N=down["BLOCK_N"], BLOCK_K=down["BLOCK_K"], SUB_K=128, BLOCK_S=512,
                 EXPERTS_FP8=False, SHARED_FP8=False, EP=False, PDL=True),
            {"weights_ptr": "*fp32", "ids_ptr": "*i32"}, down["num_warps"], down["num_stages"], down.get("maxnreg"),
            triton.cdiv(2048, down["BLOCK_N"]),
        ),
        "DeltaNet decode (conv, gates, state update, gated norm)": (
            fused_recurrent._decode_kernel,
            dict(NK=16, G=2, DK=128, DV=128, KW=4, KP=4, BK=128, BV=128, SV=1, PDL=True),
            {"state_ptr": "*fp32", "readers_ptr": "*i32", "norm_arrivals_ptr": "*i32", "sumsq_ptr": "*fp32"},
            4, 1, None, 32,
        ),
        "attention decode (norm + RoPE, split-K, merge, gate)": (
            attention._decode_kernel,
            dict(HQ=16, HKV=2, G=8, D=256, HALF=32, NUM_SPLITS=4, PDL=True, **att),
            {"o_part_ptr": "*fp32", "lse_part_ptr": "*fp32", "arrivals_ptr": "*i32", "pos_ptr": "*i64",
             "inv_freq_ptr": "*fp32"},
            att_warps, att_stages, None, 2 * 4,
        ),
    }  # fmt: skip


def compressed(ops: list[str]) -> str:
    runs: list[list] = []
    for op in ops:
        if runs and runs[-1][0] == op:
            runs[-1][1] += 1
        else:
            runs.append([op, 1])
    return " ".join(f"{op}x{n}" if n > 1 else op for op, n in runs)


def build(kernel, constexprs, types) -> tuple:
    """aot_sm90.spec of a kernel at these constexprs (those the kernel does not take are dropped: older versions)."""
    names = aot_sm90.fn_of(kernel).arg_names
    constexprs = {k: v for k, v in constexprs.items() if k in names}
    return aot_sm90.spec(kernel, signature(kernel, constexprs, types), constexprs)


def report(kernel, constexprs, types, num_warps, num_stages, maxnreg, programs) -> dict:
    fn, sig, const, attrs = build(kernel, constexprs, types)
    c = triton.compile(triton.compiler.ASTSource(fn, sig, const, attrs), target=aot_sm90.TARGET,
                       options={"num_warps": num_warps, "num_stages": num_stages, "maxnreg": maxnreg})  # fmt: skip
    regs = aot_sm90.ptxas_report(c.asm["ptx"])
    ops = OPS.findall(aot_sm90.sass_of(c.asm["cubin"]))
    after = ops[ops.index("ACQBULK") + 1 :] if "ACQBULK" in ops else ops
    last_load = max((i for i, o in enumerate(after) if o.startswith("LDG")), default=-1)
    return {
        "num_warps": num_warps, "num_stages": num_stages, "maxnreg": maxnreg, "registers": regs["registers"],
        "spill_bytes": regs["spill_store_bytes"] + regs["spill_load_bytes"], "shared_bytes": c.metadata.shared,
        **occupancy(regs["registers"], c.metadata.shared, num_warps, programs),
        "loads_before_wait": sum(o.startswith("LDG") for o in ops[: len(ops) - len(after)]),
        "loads_with_the_wait": sum(o.startswith("LDG") for o in after[: next(
            (i for i, o in enumerate(after) if o.startswith("BAR")), len(after))]),
        "barriers_before_last_load": sum(o.startswith("BAR") for o in after[:last_load]),
        "barriers_after_wait": sum(o.startswith("BAR") for o in after),
        "sequence_after_wait": compressed(after),
    }  # fmt: skip


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/aot_decode_sass.json")
    parser.add_argument("--front-end", action="store_true", help="Triton's front end only (seconds); exit 1 on an "
                        "error (tests/test_kernels_front_end.py)")  # fmt: skip
    args = parser.parse_args()
    if args.front_end:
        aot_sm90.front_end_exit(
            {
                name: (build(kernel, constexprs, types), num_warps)
                for name, (kernel, constexprs, types, num_warps, *_) in kernels_35b().items()
            }
        )
    rows = {name: report(*spec) for name, spec in kernels_35b().items()}
    env = {"triton": triton.__version__, "target": "sm_90 (ptxas from the Triton wheel)"}
    commit = aot_sm90.subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout
    Path(args.out).write_text(json.dumps({"commit": commit.strip(), **env, "kernels": rows}, indent=1) + "\n")
    print(f"{'kernel':<54} {'regs':>4} {'spill':>5} {'per SM':>6} {'grid':>5} {'waves':>5} {'loads: before wait':>18} "
          f"{'with it':>7} {'barriers before last load':>25}")  # fmt: skip
    for name, r in rows.items():
        print(f"{name:<54} {r['registers']:>4} {r['spill_bytes']:>5} {r['programs_per_sm']:>6} {r['programs']:>5} "
              f"{r['waves']:>5} {r['loads_before_wait']:>18} {r['loads_with_the_wait']:>7} "
              f"{r['barriers_before_last_load']:>25}")  # fmt: skip


if __name__ == "__main__":
    main()
