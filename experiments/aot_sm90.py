"""Compile the FP8 x FP8 prefill kernels ahead of time for sm_90 (H200) with the local Triton, no GPU needed, and
report what the H200 would run: registers and spills (ptxas -v on Triton's PTX, with the ptxas and flags Triton
itself uses; CompiledKernel.n_spills needs a driver), the wgmma instructions and their operand types (PTX; QGMMA in
SASS), the fp8 conversions (cvt.rn.satfinite.e4m3x2), the IEEE divisions (div.rn) and the SASS instruction mix.
Shapes: the activation pre-pass (kernels/fp8.quantize_activations) on bf16 [4096, 2048]; linear (X_FP8: fp8
activations with their scales, bf16 output) at the 35B gdn_in (N 12352, K 2048); the MoE sorted kernels (A_FP8) at
the 35B experts; the default tiles (linear.FP8_PREFILL_CONFIG, moe.DEFAULT_CONFIGS["prefill_fp8"]) unless
--linear / --moe give "BLOCK_M,BLOCK_N,num_warps,num_stages" (BLOCK_K is 128 on these paths).

    python experiments/aot_sm90.py
        [--only quantize_activations linear_prefill_fp8 moe_up_sorted_fp8 moe_down_sorted_fp8]
        [--linear 64,256,8,3] [--moe 64,128,8,3] [--out DIR]   (DIR/<kernel>.{ptx,sass,json})
"""

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns when unset; 1 is its (and 3.6's) default
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton._C.libtriton import ir  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import CUDABackend, get_ptxas  # noqa: E402

from kernels.linear import triton as lin  # noqa: E402
from kernels.moe import triton as moe  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
BIN = Path(triton.__file__).parent / "backends/nvidia/bin"  # cuobjdump


def fn_of(kernel):
    return getattr(kernel, "fn", kernel)  # @fast_launch wraps the JITFunction


def spec(kernel, args: dict, constexprs: dict):
    """args: name -> (type, divisible by 16) in the kernel's parameter order; constexprs: name -> value."""
    fn = fn_of(kernel)
    names = fn.arg_names
    signature, attrs = {}, {}
    for i, name in enumerate(names):
        if name in constexprs:
            signature[name] = "constexpr"
        else:
            ty, div16 = args[name]
            signature[name] = ty
            if div16:
                attrs[(i,)] = [["tt.divisibility", 16]]
    missing = set(names) - set(signature)
    assert not missing, missing
    return fn, signature, constexprs, attrs


def linear_prefill(cfg=None):
    """_linear_kernel with X_FP8 (fp8 x and its scales from the pre-pass) at gdn_in (N 12352, K 2048), bf16 output,
    FP8_PREFILL_CONFIG."""
    cfg = cfg or lin.FP8_PREFILL_CONFIG
    M, N, K = 4096, 12352, 2048
    _, _, _, meta = lin.make_plan(M, N, K, cfg, fp8=True, fp8_x=True)
    num_warps, num_stages = meta.pop("num_warps"), meta.pop("num_stages")
    p, b = "*bf16", True
    args = {
        "x_ptr": ("*fp8e4nv", b), "w_ptr": ("*fp8e4nv", b), "out_ptr": (p, b), "s_ptr": ("*fp32", b),
        "M": ("i32", False), "N": ("i32", False), "K": ("i32", True), "stride_xm": ("i32", True),
        "stride_wn": ("i32", True), "stride_sn": ("i32", True), "k_per_split": ("i32", True), "SPLIT": ("i32", False),
        "res_ptr": ("*fp8e4nv", b), "nw_ptr": ("*fp8e4nv", b), "normed_ptr": ("*fp8e4nv", b),
        "hidden_ptr": ("*fp8e4nv", b), "stride_rm": ("i32", True), "eps": ("fp32", False), "xs_ptr": ("*fp32", b),
        "stride_xsm": ("i32", True),
    }  # fmt: skip
    return spec(lin._linear_kernel, args, {**meta, "NORM": False, "PDL": True}), num_warps, num_stages


def quantize_prepass(block_m=None):
    """kernels/fp8._quantize_activations_kernel on bf16 x [4096, 2048] (the 35B hidden size)."""
    from kernels import fp8

    args = {"x_ptr": ("*bf16", True), "q_ptr": ("*fp8e4nv", True), "s_ptr": ("*fp32", True), "M": ("i32", False),
            "K": ("i32", True), "stride_xm": ("i32", True)}  # fmt: skip
    const = {"BLOCK_M": block_m or fp8.QUANTIZE_BLOCK_M, "EVEN_K": True, "PDL": True}
    return spec(fp8._quantize_activations_kernel, args, const), 4, 1


def moe_sorted(which: str, cfg=None):
    """_moe_{up,down}_sorted_kernel with fp8 experts at the 35B shape (E 256, H 2048, I 512, top-8), bf16."""
    cfg = cfg or moe.DEFAULT_CONFIGS["prefill_fp8"]
    part = cfg[which]
    p, b = "*bf16", True
    common = {"sorted_ptr": ("*i32", b), "ends_ptr": ("*i32", b), "P": ("i32", False), "E": ("i32", True),
              "H": ("i32", True), "I": ("i32", True)}  # fmt: skip
    const = {"BLOCK_E": 256, "BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": part["BLOCK_N"], "BLOCK_K": part["BLOCK_K"],
             "A_FP8": True, "SUB_TILES": cfg.get("SUB_TILES", 0)}  # fmt: skip
    f8, f32 = ("*fp8e4nv", b), ("*fp32", b)
    if which == "up":  # fp8 x (the pre-pass's) and its scales in, bf16 h out
        args = {"x_ptr": f8, "w13_ptr": f8, "h_ptr": (p, b), "w13_s_ptr": f32, "xs_ptr": f32, **common}
        const["TOP_K"] = 8
        kernel = moe._moe_up_sorted_kernel
    else:
        args = {"h_ptr": f8, "w2_ptr": f8, "out_ptr": (p, b), "weights_ptr": f32, "w2_s_ptr": f32, "hs_ptr": f32,
                **common}  # fmt: skip
        kernel = moe._moe_down_sorted_kernel
    fn = fn_of(kernel)
    const = {k: v for k, v in const.items() if k in fn.arg_names}
    return spec(kernel, args, const), part["num_warps"], part["num_stages"]


def front_end_error(spec_: tuple, num_warps: int) -> str | None:
    """Triton's front end (the kernel's Python to Triton IR, as for sm_90: no LLVM, no ptxas; about a second) on
    spec's (fn, signature, constexprs, attrs) -> None, or the error: its innermost call's source position and its
    cause. The CPU interpreter runs code that this rejects (a name rebound to another type inside an `if`)."""
    fn, signature, constexprs, attrs = spec_
    backend = CUDABackend(TARGET)
    options = backend.parse_options({"num_warps": num_warps})
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    source = triton.compiler.ASTSource(fn, signature, constexprs, attrs)
    try:
        source.make_ir(TARGET, options, backend.get_codegen_implementation(options), backend.get_module_map(), context)
    except Exception as e:  # CompilationError: one per call level, the cause last
        chain = [e]
        while chain[-1].__cause__ is not None:
            chain.append(chain[-1].__cause__)
        return f"{chain[-2] if len(chain) > 1 else ''}\n{chain[-1]!r}"
    return None


def front_end_exit(kernels: dict) -> None:
    """front_end_error on {name: (spec, num_warps)}, a line each, then the errors; exits 1 if one failed, else 0."""
    errors = {}
    for name, (spec_, num_warps) in kernels.items():
        errors[name] = front_end_error(spec_, num_warps)
        print(f"{name:<54} front end {'FAILED' if errors[name] else 'ok'}")
    print("\n".join(f"{name}: {error}" for name, error in errors.items() if error))
    sys.exit(1 if any(errors.values()) else 0)


def ptxas_report(ptx: str) -> dict:
    arch = re.search(r"\.target\s+(\S+)", ptx).group(1)
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.ptx"
        src.write_text(ptx)
        # the ptxas and flags Triton itself runs for sm_90 (triton/backends/nvidia/compiler.py make_cubin)
        cmd = [get_ptxas(90).path, "-lineinfo", "-v", "--regAllocOptLevel=2", f"--gpu-name={arch}", str(src), "-o",
               str(Path(d) / "k.cubin")]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    text = out.stdout + out.stderr
    regs = int(re.search(r"Used (\d+) registers", text).group(1))
    spill_st = int(re.search(r"(\d+) bytes spill stores", text).group(1))
    spill_ld = int(re.search(r"(\d+) bytes spill loads", text).group(1))
    stack = int(re.search(r"(\d+) bytes stack frame", text).group(1))
    return {"arch": arch, "registers": regs, "spill_store_bytes": spill_st, "spill_load_bytes": spill_ld,
            "stack_frame_bytes": stack, "ptxas": text.strip()}  # fmt: skip


def sass_of(cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(BIN / "cuobjdump"), "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout  # fmt: skip


def report(name, build, out_dir: Path) -> dict:
    (fn, signature, constexprs, attrs), num_warps, num_stages = build
    src = triton.compiler.ASTSource(fn, signature, constexprs, attrs)
    c = triton.compile(src, target=TARGET, options={"num_warps": num_warps, "num_stages": num_stages})
    ptx = c.asm["ptx"]
    sass = sass_of(c.asm["cubin"])
    wgmma = collections.Counter(re.findall(r"wgmma\.mma_async\.\S+", ptx))
    opcodes = collections.Counter(
        re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)", sass, re.M)
    )
    row = {
        "kernel": fn.__name__, "constexprs": {k: v for k, v in constexprs.items()}, "num_warps": num_warps,
        "num_stages": num_stages, "shared_bytes": c.metadata.shared, **ptxas_report(ptx),
        "ptx_wgmma": dict(wgmma), "ptx_cvt_e4m3x2": len(re.findall(r"cvt\.rn\.satfinite\.e4m3x2\.f32", ptx)),
        "ptx_div_rn_f32": len(re.findall(r"div\.rn\.f32", ptx)), "ptx_div_full": len(re.findall(r"div\.full", ptx)),
        "sass_gmma": sum(v for k, v in opcodes.items() if k.startswith(("HGMMA", "QGMMA"))),
        "sass_gmma_kinds": sorted(set(re.findall(r"[HQ]GMMA\.\S+", sass))),
        "sass_mufu_rcp": opcodes.get("MUFU.RCP", 0), "sass_fchk": opcodes.get("FCHK", 0),
        "sass_instructions": sum(opcodes.values()), "sass_top": dict(opcodes.most_common(25)),
    }  # fmt: skip
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.ptx").write_text(ptx)
    (out_dir / f"{name}.sass").write_text(sass)
    (out_dir / f"{name}.json").write_text(json.dumps(row, indent=1))
    return row


def tile(text: str | None, kind: str):
    if text is None:
        return None
    bm, bn, warps, stages = (int(v) for v in text.split(","))
    if kind == "linear":
        return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, SPLIT_K=1, num_warps=warps, num_stages=stages)
    leg = {"BLOCK_N": bn, "BLOCK_K": 128, "num_warps": warps, "num_stages": stages}
    return {"BLOCK_M": bm, "up": leg, "down": leg}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    builds = ["quantize_activations", "linear_prefill_fp8", "moe_up_sorted_fp8", "moe_down_sorted_fp8"]
    parser.add_argument("--only", nargs="*", default=builds, choices=builds)
    parser.add_argument("--linear", help="BLOCK_M,BLOCK_N,num_warps,num_stages for linear (default: its config)")
    parser.add_argument("--moe", help="BLOCK_M,BLOCK_N,num_warps,num_stages for both MoE kernels")
    parser.add_argument("--out", default=tempfile.gettempdir() + "/qmoe_aot_sm90")
    args = parser.parse_args()
    lin_cfg, moe_cfg = tile(args.linear, "linear"), tile(args.moe, "moe")
    make = {
        "quantize_activations": quantize_prepass,
        "linear_prefill_fp8": lambda: linear_prefill(lin_cfg),
        "moe_up_sorted_fp8": lambda: moe_sorted("up", moe_cfg),
        "moe_down_sorted_fp8": lambda: moe_sorted("down", moe_cfg),
    }
    for name in args.only:
        row = report(name, make[name](), Path(args.out))
        short = {k: v for k, v in row.items() if k not in ("ptxas", "sass_top", "constexprs")}
        print(name, json.dumps(short))
        print("   top SASS:", row["sass_top"])


if __name__ == "__main__":
    main()
