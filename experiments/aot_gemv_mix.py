"""What the M = 1 dense GEMV's K loop issues per weight, bf16 against fp8, from sm_90 SASS built on the CPU.

A GEMV at copy bandwidth must also issue its instructions in time: at 4.2 TB/s the H200's ~33.5 T lane-instructions
per second (132 SMs x 4 schedulers x 32 lanes x 1.98 GHz) leave ~8 per weight byte, so a loop that spends as many
instructions per weight on fp8 (1 byte) as on bf16 (2 bytes) has half bf16's headroom. For each 35B-A3B decode
projection this compiles the dense GEMV with the H200 table's M = 1 entry for bf16 and for float8_e4m3fn weights,
the in-projections with their fused add + RMSNorm (experiments/aot_sm90.py: Triton's own ptxas and flags, no GPU),
and reports the loop that loads the weights (the longest backward branch around LDGs): its instructions per
thread, the weights one thread takes per iteration (BLOCK_N x BLOCK_K / threads: the K step of `_linear_kernel`,
or one row tile of the persistent GEMV whose BLOCK_K is all of K), instructions per weight and per weight byte,
and its opcode mix (conversions, FMUL / FFMA / FADD, SHFL: the cross-thread sums). Static counts of one iteration:
it measures no time (tune_decode_loop and bench_gemv do).

    PYTHONPATH=. python experiments/aot_gemv_mix.py [--out results/aot_gemv_mix.json]
"""

import argparse
import collections
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import aot_sm90  # noqa: E402  (sets up sys.path and the compile helpers)
import torch  # noqa: E402
import triton  # noqa: E402
from aot_decode_sass import SMS, build, h200_entry  # noqa: E402

from kernels.fp8 import FP8  # noqa: E402
from kernels.linear import triton as linear  # noqa: E402

# (N, K, the add + RMSNorm prologue fused in as the model runs it)
SHAPES = {"gdn_in": (12352, 2048, True), "attn_qkv": (9216, 2048, True), "out_proj": (2048, 4096, False),
          "moe_in": (1281, 2048, True)}  # fmt: skip
INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]+)([^;]*);")
MIX = ("F2FP", "HADD2.F32", "FMUL", "FFMA", "FADD", "SHFL", "LDG")


def weight_loop(sass: str) -> list[str]:
    """The opcodes of the longest loop (backward branch) that contains a global load, in order: the K loop (the
    norm prologue's loop over the row is the other one with loads)."""
    code = [(int(addr, 16), op, rest) for addr, op, rest in INSTRUCTION.findall(sass)]
    loops = []
    for addr, op, rest in code:
        target = re.search(r"0x([0-9a-f]+)", rest) if op.startswith("BRA") else None
        if target and int(target.group(1), 16) < addr:
            body = [o for a, o, _ in code if int(target.group(1), 16) <= a <= addr]
            if any(o.startswith("LDG") for o in body):
                loops.append(body)
    return max(loops, key=len) if loops else []


def mix(dtype: torch.dtype, N: int, K: int, norm: bool) -> dict:
    entry = h200_entry(linear, linear.shape_key(N, K, dtype))
    fp8 = dtype == FP8
    _, _, _, meta = linear.make_plan(1, N, K, entry, fp8=fp8, num_sms=SMS)
    warps, stages, cap = meta.pop("num_warps"), meta.pop("num_stages"), meta.pop("maxnreg", None)
    kernel = linear._gemv_persistent_kernel if meta.pop("PERSISTENT", False) else linear._linear_kernel
    names = aot_sm90.fn_of(kernel).arg_names
    meta = {k: v for k, v in meta.items() if k in names}
    types = {"w_ptr": "*fp8e4nv" if fp8 else "*bf16", "s_ptr": "*fp32" if fp8 else "*bf16", "xs_ptr": "*fp32"}
    fn, sig, const, attrs = build(kernel, {**meta, "NORM": norm, "PDL": True}, types)
    compiled = triton.compile(triton.compiler.ASTSource(fn, sig, const, attrs), target=aot_sm90.TARGET,
                              options={"num_warps": warps, "num_stages": stages, "maxnreg": cap})  # fmt: skip
    loop = weight_loop(aot_sm90.sass_of(compiled.asm["cubin"]))
    weights = meta.get("BLOCK_N", 1) * min(meta["BLOCK_K"], K) // (warps * 32)
    counts = collections.Counter(next((m for m in MIX if op.startswith(m)), "other") for op in loop)
    return {
        "kernel": kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__,
        "config": {**meta, "num_warps": warps},
        "loop_instructions": len(loop),
        "weights_per_thread": weights,
        "per_weight": len(loop) / weights,
        "per_byte": len(loop) / weights / dtype.itemsize,
        "mix": dict(counts),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/aot_gemv_mix.json")
    args = parser.parse_args()
    rows = {
        f"{name} {dt}": mix(dtype, N, K, norm)
        for name, (N, K, norm) in SHAPES.items()
        for dt, dtype in (("bf16", torch.bfloat16), ("fp8", FP8))
    }
    commit = aot_sm90.subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout
    env = {"commit": commit.strip(), "triton": triton.__version__, "target": "sm_90 (ptxas from the Triton wheel)"}
    Path(args.out).write_text(json.dumps({**env, "rows": rows}, indent=1) + "\n")
    print(f"{'projection':<16} {'kernel':<24} {'loop':>5} {'w/thread':>8} {'per w':>6} {'per B':>6}  mix")
    for name, r in rows.items():
        mix_text = " ".join(f"{k} {v}" for k, v in sorted(r["mix"].items(), key=lambda kv: -kv[1]))
        print(f"{name:<16} {r['kernel']:<24} {r['loop_instructions']:>5} {r['weights_per_thread']:>8} "
              f"{r['per_weight']:>6.1f} {r['per_byte']:>6.1f}  {mix_text}")  # fmt: skip


if __name__ == "__main__":
    main()
