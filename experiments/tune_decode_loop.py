"""The 35B-A3B batch-1 decode step, measured whole, with one thing changed at a time (H200, random bf16 weights).

A standalone tuner (tune_gemv.py, tune_moe.py) picks each kernel's config alone, with inputs rotated past L2.
In the decode loop the kernels run back to back under Programmatic Dependent Launch: a kernel's programs start
while its producer finishes and load their first weight tile before they wait, so the best config in the loop
can differ (e.g. a K block covering the whole row streams every weight byte of a program before the wait).
This script measures the step itself:

1. Parts: the step with one op group replaced by a function that launches nothing (its output a zero buffer or
   a view of its input): MoE, DeltaNet, attention, the layers' dense projections (lm_head kept), sampling; and
   the step with PDL off. step - step_without_part = what the part costs in the loop, overlap included.
2. In-loop coordinate descent over M = 1 launch configs, one shape at a time (lm_head, DeltaNet in_proj, the
   N = 2048, K = 4096 out projections, attention qkv, the MoE input projection, MoE up, MoE down; with
   --weights fp8 the FP8 ones of these, from FP8 candidate lists with wider steps, and no mixers, but for a model
   with no bf16 run, the 122B, also its bf16 projections and mixers): each
   candidate replaces the table's entry, the step is captured and timed; the best so far stays for the next
   shape. `--write-tables` writes the winners into kernels/{linear,moe}/configs/<GPU>.json. Then the mixers'
   DECODE_OPTIONS (attention's splits and warps, DeltaNet's value splits and warps), reported in the JSON only
   (the launchers' rules are code: a winner becomes a rule by hand).

Timing: one decode step (the model's eager forward + greedy sample on Triton ops, as the CUDA-native runner's
graph holds it) captured in a CUDA graph, replayed `--replays` times back to back, median of 3 such runs
(ms per step). The step reads its 5.9 GB of active weights from HBM every replay (50 MB of L2).

    PYTHONPATH=. python experiments/tune_decode_loop.py [--out results/tune_decode_loop.json] [--write-tables]
        [--weights fp8 --out results/tune_decode_loop_fp8.json] [--skip-descent: parts only] [--step-only]
        [--only gdn_in out_proj moe_up ...: the descent over these entries alone]
        [--model qwen35_moe_122b --weights fp8: the 122B-A10B FP8 step (its shapes' FP8 candidates)]
"""

import argparse
import json
import os
import time

import torch
from bench_e2e import TRITON_GROUPS, config
from benchlib import GREEDY, ceilings, event_median_us, write_json

from kernels.attention import triton as attention_triton
from kernels.gdn import fused_recurrent
from kernels.linear import triton as linear_triton
from kernels.moe import triton as moe_triton
from kernels.tuned import gpu_config_path
from qmoe.app import get_model
from qmoe.metrics.measure import active_weight_bytes
from qmoe.runtime.generate import sampling_tensors
from qmoe.settings import validate

PROMPT_POS = 128
# M = 1 GEMV candidates (BLOCK_N, BLOCK_K, num_warps, num_stages[, PERSISTENT programs per SM]); the table's entry
# is always measured first
PERSISTENT_CANDIDATES = {
    2048: [(1, 2048, 4, 1, 8), (2, 2048, 4, 1, 4), (2, 2048, 4, 1, 6), (4, 2048, 4, 1, 2), (4, 2048, 4, 1, 3),
           (4, 2048, 4, 1, 4), (8, 2048, 8, 1, 2), (2, 2048, 2, 1, 8)],
    4096: [(1, 4096, 4, 1, 4), (1, 4096, 4, 1, 6), (2, 4096, 4, 1, 2), (2, 4096, 4, 1, 3), (2, 4096, 4, 1, 4),
           (4, 4096, 8, 1, 2), (1, 4096, 2, 1, 8)],
}  # fmt: skip
# (BLOCK_N, BLOCK_K, num_warps, num_stages, 0, maxnreg): the out-projections' table entry (4 x 2048, 4 warps) takes
# 132 registers (sm_90), 3 programs per SM, so its 512 programs run in two waves; capped at 128 (127, no spill) they
# fit one (experiments/aot_decode_sass.py)
CAPPED_CANDIDATES = {4096: [(4, 2048, 4, 1, 0, 128), (8, 2048, 8, 1, 0, 128), (8, 1024, 4, 1, 0, 128)]}
GEMV_CANDIDATES = {
    2048: [(4, 2048, 4, 1), (2, 2048, 4, 1), (8, 2048, 8, 1), (8, 1024, 4, 1), (2, 1024, 4, 1), (4, 512, 4, 2),
           *PERSISTENT_CANDIDATES[2048]],
    4096: [(4, 4096, 8, 1), (2, 4096, 4, 1), (1, 4096, 4, 1), (4, 2048, 4, 1), (2, 2048, 4, 1), (8, 1024, 4, 2),
           *PERSISTENT_CANDIDATES[4096], *CAPPED_CANDIDATES[4096]],
    # 122B-A10B's bf16 projections (lm_head, the MoE input projection), tuned in its FP8 run (main)
    3072: [(4, 1024, 4, 1), (4, 1024, 4, 3), (2, 1024, 4, 3), (8, 1024, 4, 1), (8, 1024, 8, 2), (2, 2048, 4, 1),
           (4, 2048, 4, 1), (8, 512, 4, 2), (16, 512, 8, 2), (1, 4096, 4, 1)],
}  # fmt: skip
# (BLOCK_N, BLOCK_K, num_warps, num_stages[, maxnreg]): at 8 x 512 the up kernel takes 130 registers (sm_90), 3
# programs per SM, so its 512 programs run in two waves; capped at 128 they fit one (in the step: within noise,
# results/tune_decode_loop_capped.json)
# (with each program ranking only up to its slot, _kth_expert, the capped 8-row tiles again at other steps)
MOE_UP_CANDIDATES = [(4, 1024, 4, 2), (4, 2048, 8, 1), (8, 1024, 8, 2), (16, 512, 8, 2), (2, 2048, 4, 1),
                     (8, 2048, 8, 1), (4, 512, 4, 2), (8, 512, 4, 2, 128), (8, 512, 4, 1, 128), (8, 1024, 4, 1, 128),
                     (8, 256, 4, 3, 128), (16, 256, 4, 2, 128)]  # fmt: skip
MOE_DOWN_CANDIDATES = [(2, 512, 4, 2), (8, 256, 4, 3), (4, 512, 4, 2), (8, 512, 8, 2), (2, 256, 4, 3),
                       (1, 512, 4, 2), (4, 128, 4, 4), (4, 256, 4, 2)]  # fmt: skip
# FP8 weights (--weights fp8): a column is one byte, so the steps are wider for the same bytes per program
# the persistent ones: the table's FP8 DeltaNet and attention in-projections (8 x 1024, 4 x 2048) run their 1,544
# and 2,304 programs in 2 and 3 waves at 7 per SM; persistent at 1 x 2048 on 8 per SM (64 registers), one wave
# (experiments/aot_decode_sass.py's occupancy)
# (1 x 2048 on 8 per SM lost at 2f2dfcc: 2 KB rows keep half the bf16 one's bytes in flight; the 4 KB and 8 KB row
# blocks that still fit one wave lost too at 616263e: 2 x 2048 at 80 registers 6 per SM, 4 x 2048 on 8 warps 3,
# 2 x 2048 on 8 warps 4). The tiled entries' grids take 2 waves (8 x 1024: 72 registers, 7 per SM, 1,544 programs
# for the DeltaNet in-projection); capped, 16 x 1024 fits one at 80 registers (6 per SM, 88 B spill), 8 x 1024 runs 8
# per SM at 64 (experiments/aot_decode_sass.py's compile)
FP8_GEMV_CANDIDATES = {
    2048: [(4, 2048, 4, 1), (2, 2048, 4, 1), (8, 2048, 8, 1), (4, 1024, 4, 1), (8, 1024, 4, 1), (16, 512, 4, 1),
           (8, 512, 4, 2), (1, 2048, 4, 1, 8), (2, 2048, 4, 1, 4), (1, 2048, 4, 1, 6), (2, 2048, 4, 1, 6),
           (4, 2048, 8, 1, 3), (2, 2048, 8, 1, 4), (16, 1024, 4, 1, 0, 80), (8, 1024, 4, 1, 0, 64),
           (16, 1024, 4, 1, 0, 96)],
    4096: [(4, 4096, 4, 1), (2, 4096, 4, 1), (4, 2048, 4, 1), (8, 2048, 4, 1), (2, 2048, 4, 1), (4, 1024, 4, 2),
           (1, 4096, 4, 1, 4), (2, 4096, 4, 1, 3)],
    # 122B-A10B (--model qwen35_moe_122b): K 3072 (the in-projections), 8192 (the out-projections)
    3072: [(4, 1024, 4, 1), (8, 1024, 4, 1), (2, 1024, 4, 1), (16, 512, 4, 1), (8, 512, 4, 2), (4, 2048, 4, 1),
           (2, 2048, 4, 1), (4, 4096, 4, 1), (8, 1024, 4, 1, 0, 64), (16, 1024, 4, 1, 0, 80), (16, 1024, 4, 1, 0, 96),
           (32, 512, 8, 1), (16, 1024, 8, 1), (32, 1024, 8, 1, 0, 128), (16, 512, 4, 2, 0, 96), (8, 1024, 4, 1, 0, 96)],
    8192: [(2, 2048, 4, 1), (4, 2048, 4, 1), (1, 4096, 4, 1), (2, 4096, 4, 1), (4, 4096, 8, 1), (4, 1024, 4, 2),
           (8, 1024, 4, 1), (2, 2048, 4, 1, 0, 64), (1, 8192, 4, 1), (1, 4096, 8, 1), (2, 4096, 8, 1), (1, 2048, 4, 2)],
}  # fmt: skip
FP8_MOE_UP_CANDIDATES = [(8, 1024, 4, 2), (4, 2048, 4, 1), (8, 2048, 8, 1), (16, 1024, 8, 2), (4, 1024, 4, 2),
                         (16, 512, 8, 2), (8, 1024, 4, 2, 128), (8, 2048, 4, 1, 128), (32, 512, 8, 2),
                         (16, 512, 8, 3), (16, 256, 8, 3), (16, 512, 4, 2)]  # fmt: skip
FP8_MOE_DOWN_CANDIDATES = [(4, 512, 4, 2), (8, 512, 4, 2), (2, 512, 4, 2), (8, 256, 4, 3), (4, 256, 4, 3),
                           (2, 256, 4, 3), (4, 128, 4, 4), (8, 128, 4, 4)]  # fmt: skip
# the mixers' DECODE_OPTIONS: attention's split count (num_splits() gives 3 at this cache) and warps, DeltaNet's value
# splits per head and warps; {} is the launcher's own choice
ATTENTION_CANDIDATES = [{"splits": s, "num_warps": w} for s in (1, 2, 3, 4) for w in (4, 8)]
GDN_CANDIDATES = [{"splits": s, "num_warps": w} for s in (1, 2, 4, 8) for w in (2, 4, 8)]


class Patched:
    """An op module with some functions replaced; everything else forwards to the module."""

    def __init__(self, module, **functions):
        self._module, self.__dict__["functions"] = module, functions
        self.__name__ = module.__name__

    def __getattr__(self, name):
        return self.functions[name] if name in self.functions else getattr(self._module, name)


ZEROS: dict = {}


def zeros(shape, dtype, device) -> torch.Tensor:
    """A zero buffer made once per (shape, dtype) outside the graph; nothing writes it."""
    key = (tuple(shape), dtype)
    if key not in ZEROS:
        ZEROS[key] = torch.zeros(shape, dtype=dtype, device=device)
    return ZEROS[key]


def without(model, ops: dict, part: str) -> dict:
    """ops (the model's, on Triton) with `part` launching nothing."""
    ops, device, vocab = dict(ops), model.device, model.config.vocab_size
    if part == "moe":
        ops["moe"] = Patched(ops["moe"], moe_block=lambda rows, *args: rows)
    elif part == "gdn":
        ops["gdn"] = Patched(ops["gdn"], gated_delta_net=lambda qkv, z, *args: zeros(z.shape, z.dtype, device))
    elif part == "attention":

        def attention(q, gate, *args):
            return zeros((*q.shape[:2], q.shape[2] * q.shape[3]), q.dtype, device)

        ops["attention"] = Patched(ops["attention"], gated_attention=attention)
    elif part == "dense":
        real = ops["linear"].linear

        def linear(x, weight, scale=None):
            if weight.shape[0] == vocab:  # lm_head stays
                return real(x, weight, scale)
            return zeros((*x.shape[:-1], weight.shape[0]), x.dtype, device)

        def add_rms_norm_linear(x, residual, norm_weight, eps, weight, scale=None):
            return zeros((*x.shape[:-1], weight.shape[0]), x.dtype, device), x, x

        ops["linear"] = Patched(ops["linear"], linear=linear, add_rms_norm_linear=add_rms_norm_linear)
    elif part == "sampling":
        token = lambda logits, *params: zeros(logits.shape[:1], torch.long, device)  # noqa: E731
        ops["sampling"] = Patched(ops["sampling"], sample=token)
    elif part != "none":
        raise ValueError(part)
    return ops


# the step's M = 1 projection shapes, by the fused weight of layer 0 (DeltaNet) or 3 (attention) that has each
PROJECTIONS = {
    "lm_head": "lm_head.weight",
    "gdn_in": "layers.0.linear_attn.in_proj",
    "out_proj": "layers.0.linear_attn.out_proj.weight",  # attention's o_proj has the same shape
    "attn_qkv": "layers.3.self_attn.qkv_proj",
    "moe_in": "layers.0.mlp.in_proj",
}


def named_tensors(model) -> dict:
    """The model's parameters and buffers by name (the fused projections are buffers, the others parameters)."""
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def projection_weights(model) -> dict:
    """PROJECTIONS -> the model's weights [N, K]."""
    tensors = named_tensors(model)
    return {what: tensors[name] for what, name in PROJECTIONS.items()}


def decode_model(weights: str, copy_gbs: float, cache_len: int = PROMPT_POS + 16, name: str = "qwen35_moe") -> tuple:
    """The model `name` (35B-A3B by default; random weights; "fp8": model.weights=fp8) on Triton ops, greedy, with
    caches of cache_len positions for the step at PROMPT_POS -> (model, the step's floor in ms: its active weight
    bytes at copy_gbs). The attention's split count follows the cache length: 3 at the default, 64 at 4608."""
    cfg = config(f"model={name}", f"model.weights={weights}")
    model = get_model(cfg, validate(cfg), progress=False).model
    model.set_kernels({g: "triton" for g in TRITON_GROUPS}, greedy=True)
    model.setup_caches(1, cache_len)
    fp8 = frozenset(n for n, p in model.named_parameters() if p.dtype == torch.float8_e4m3fn)
    return model, active_weight_bytes(model.config, model.dtype, fp8) / (copy_gbs * 1e9) * 1e3


def capture_step(model) -> torch.cuda.CUDAGraph:
    """One decode step at position PROMPT_POS (forward + greedy sample), warmed up and captured in a CUDA graph."""
    device = model.device
    tokens = torch.zeros((1, 1), dtype=torch.long, device=device)
    input_pos = torch.full((1,), PROMPT_POS, dtype=torch.long, device=device)
    params = sampling_tensors(GREEDY, 1, device)
    sample_step = torch.zeros(1, dtype=torch.long, device=device)

    def step():
        return model.sample(model(tokens, input_pos), step=sample_step, **params)

    with torch.no_grad():
        for _ in range(2):
            step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
    graph.inputs = tokens, input_pos, params, sample_step  # replays read them: they live as long as the graph
    graph.replay()
    torch.cuda.synchronize()
    return graph


def replay_ms(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """Median ms per replay of `graph`: `replays` back to back, median of 3 such runs."""
    return event_median_us(lambda: [graph.replay() for _ in range(replays)], 3) / replays / 1e3


def step_ms(model, replays: int) -> float:
    """capture_step's graph -> replay_ms."""
    return replay_ms(capture_step(model), replays)


def gemv_config(c) -> dict:
    persistent = {linear_triton.PERSISTENT_KEY: c[4]} if len(c) > 4 and c[4] else {}
    cap = {linear_triton.MAXNREG_KEY: c[5]} if len(c) > 5 else {}
    return dict(BLOCK_M=1, BLOCK_N=c[0], BLOCK_K=c[1], SPLIT_K=1, num_warps=c[2], num_stages=c[3], **persistent, **cap)


def moe_part(c) -> dict:
    cap = {linear_triton.MAXNREG_KEY: c[4]} if len(c) > 4 else {}  # a launch option: registers per thread
    return dict(BLOCK_N=c[0], BLOCK_K=c[1], num_warps=c[2], num_stages=c[3], **cap)


def set_gemv(key: str, cfg: dict) -> None:
    linear_triton.CONFIG_TABLE.setdefault(key, {})["1"] = cfg
    linear_triton._PLANS.clear()


def set_moe(key: str, cfg: dict) -> None:
    moe_triton.CONFIG_TABLE.setdefault(key, {})["1"] = cfg
    moe_triton.get_config.cache_clear()


def set_options(module, options: dict) -> None:
    """A mixer's DECODE_OPTIONS (kernels/attention/triton.py, kernels/gdn/fused_recurrent.py), in place."""
    module.DECODE_OPTIONS.clear()
    module.DECODE_OPTIONS.update(options)


def descend(model, replays, rows, what, key, current, candidates, apply) -> dict:
    """Try each candidate for one table entry in the loop; keep the fastest (the current entry first)."""
    best_cfg, best_ms = current, None
    for cfg in [current, *[c for c in candidates if c != current]]:
        apply(key, cfg)
        try:
            ms = step_ms(model, replays)
        except Exception as e:  # noqa: BLE001 - a config that does not compile (resources) is reported, not fatal
            rows.append({"what": what, "key": key, "config": cfg, "error": f"{type(e).__name__}: {e}"[:300]})
            continue
        rows.append({"what": what, "key": key, "config": cfg, "step_ms": ms})
        print(f"  {what:<14} {json.dumps(cfg):<100} {ms:.4f} ms", flush=True)
        if best_ms is None or ms < best_ms:
            best_cfg, best_ms = cfg, ms
    apply(key, best_cfg)
    return best_cfg


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/tune_decode_loop.json")
    parser.add_argument("--replays", type=int, default=100)
    parser.add_argument("--write-tables", action="store_true")
    parser.add_argument("--skip-descent", action="store_true")
    parser.add_argument("--step-only", action="store_true", help="time the whole step only (no parts, no descent)")
    entries = [*PROJECTIONS, "moe_up", "moe_down", "attention", "gdn"]
    parser.add_argument("--only", nargs="+", choices=entries, default=entries, help="descend over these entries only")
    fp8_help = "fp8: the FP8 model's step; the descent then covers its FP8 projections and experts"
    parser.add_argument("--weights", default="auto", choices=("auto", "fp8"), help=fp8_help)
    models = ("qwen35_moe", "qwen35_moe_122b")
    parser.add_argument("--model", default=models[0], choices=models, help="qwen35_moe_122b: with --weights fp8")
    args = parser.parse_args()
    if args.model != models[0] and args.weights != "fp8":
        parser.error(f"--model {args.model} fits one H200 only with --weights fp8")
    t0 = time.time()
    ceil = ceilings("cuda")
    model, floor_ms = decode_model(args.weights, ceil["copy_gbs"], name=args.model)
    out = dict(model=args.model, ceilings=ceil, floor_ms=floor_ms, position=PROMPT_POS, replays=args.replays)

    def save():
        write_json(args.out, "tune_decode_loop", "cuda", **out, seconds=time.time() - t0)

    full_ops = model.ops
    parts = {}
    if args.step_only:
        out["step_ms"] = [step_ms(model, args.replays) for _ in range(3)]
        save()
        print(f"step {' '.join(f'{ms:.4f}' for ms in out['step_ms'])} ms (floor {floor_ms:.3f})")
        return
    for part in ("none", "moe", "gdn", "attention", "dense", "sampling"):
        model.ops = without(model, full_ops, part)
        parts[part] = step_ms(model, args.replays)
        print(f"without {part:<10} {parts[part]:.4f} ms", flush=True)
    model.ops = full_ops
    os.environ["QMOE_PDL"] = "0"
    parts["pdl_off"] = step_ms(model, args.replays)
    os.environ.pop("QMOE_PDL")
    out["parts_ms"] = parts
    out["part_cost_ms"] = {p: parts["none"] - ms for p, ms in parts.items() if p not in ("none", "pdl_off")}
    save()
    if args.skip_descent:
        return
    H, cfg_m = model.config.hidden_size, model.config
    E, I = cfg_m.num_experts, cfg_m.moe_intermediate_size
    params = named_tensors(model)
    fp8_run = args.weights == "fp8"  # then only what the FP8 model holds in FP8 (the bf16 rest is the bf16 run's),
    bf16_too = args.model != models[0]  # but a model with no bf16 run (too large for one GPU) tunes its bf16 rest
    rows, chosen = [], {"linear": {}, "moe": {}}
    for what, weight in projection_weights(model).items():
        (N, K), dtype = weight.shape, weight.dtype
        fp8 = dtype == torch.float8_e4m3fn
        if (fp8_run != fp8 and not bf16_too) or what not in args.only:
            continue
        key = linear_triton.shape_key(N, K, dtype)
        current = linear_triton.get_config(1, N, K, dtype, 132)
        candidates = (FP8_GEMV_CANDIDATES if fp8 else GEMV_CANDIDATES)[K]
        best = descend(model, args.replays, rows, what, key, current, [gemv_config(c) for c in candidates], set_gemv)
        chosen["linear"][key] = best
        out.update(descent=rows, chosen=chosen)
        save()
    w13 = params["layers.0.mlp.experts.gate_up_proj"].dtype
    key = moe_triton.shape_key(E, H, I, w13)
    current = moe_triton.get_config(1, E, H, I, w13)
    up_list, down_list = (
        (FP8_MOE_UP_CANDIDATES, FP8_MOE_DOWN_CANDIDATES) if fp8_run else (MOE_UP_CANDIDATES, MOE_DOWN_CANDIDATES)
    )
    best = current
    if "moe_up" in args.only:
        up_cfgs = [{**current, "up": moe_part(c)} for c in up_list]
        best = descend(model, args.replays, rows, "moe_up", key, current, up_cfgs, set_moe)
    if "moe_down" in args.only:
        down_cfgs = [{**best, "down": moe_part(c)} for c in down_list]
        best = descend(model, args.replays, rows, "moe_down", key, best, down_cfgs, set_moe)
    chosen["moe"][key] = best
    mixers = () if fp8_run and not bf16_too else (("attention", attention_triton, ATTENTION_CANDIDATES),
                                                  ("gdn", fused_recurrent, GDN_CANDIDATES))  # fmt: skip
    for what, module, candidates in mixers:
        if what not in args.only:
            continue
        chosen[what] = descend(model, args.replays, rows, what, what, {}, candidates,
                               lambda _, options, m=module: set_options(m, options))  # fmt: skip
        out.update(descent=rows, chosen=chosen)
        save()
    out["final_ms"] = step_ms(model, args.replays)
    out.update(descent=rows, chosen=chosen)
    save()
    if args.write_tables:
        name = torch.cuda.get_device_name()
        for module, entries in ((linear_triton, chosen["linear"]), (moe_triton, chosen["moe"])):
            path = gpu_config_path(module.CONFIG_DIR, name)
            table = json.loads(path.read_text()) if path.exists() else {}
            for key, cfg in entries.items():
                table.setdefault(key, {})["1"] = cfg
            path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print(f"\nfloor {floor_ms:.3f} ms; step {parts['none']:.4f} ms (PDL off {parts['pdl_off']:.4f}); "
          f"after descent {out['final_ms']:.4f} ms")  # fmt: skip
    print(f"{'part':<10} {'in-loop ms':>10}")
    for p, ms in out["part_cost_ms"].items():
        print(f"{p:<10} {ms:>10.4f}")


if __name__ == "__main__":
    main()
