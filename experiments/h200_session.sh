#!/usr/bin/env bash
# One device call on the H200: install the carried wheels (hydra-core, omegaconf), then run the named stages
# and pack results/ and the logs into $OUT. Usage: bash experiments/h200_session.sh STAGE [STAGE ...]
# Stages: env, hf_import, gpu_tests, kernel_tests (tests/kernel_ops only), tune_moe ($TUNE_MOE_ARGS), bench_moe ($BENCH_MOE_ARGS), tune_gemv, bench_gemv,
#         bench_sampling (its options in $SAMPLING_ARGS), profile_sampling, bench_gdn, tune_attention, bench_attention, bench_norm, bench_checkpoint, bench_fp8,
#         bench_checkpoint_fp8, bench_checkpoint_tp2 (tensor-parallel rank 0's load against the memory-mapped slices), probe_eager (experiments/probe_eager_in_process.py, its options in $PROBE_ARGS: --short), bench_fp8_moe_prefill (the FP8 experts' sorted prefill kernels at 4096 tokens), tune_moe_fp8 (the FP8 experts' decode tiles; its options in $TUNE_MOE_ARGS), runtime, e2e, profile, profile_model (eager host profile, prefill by part), profile_model_fp8 (the FP8 model's prefill by part), tune_moe_fp8_prefill (the FP8 x FP8 MoE prefill tiles, 35B), tune_fp8_prefill (pre-pass + linear FP8 x FP8 tiles vs cuBLAS bf16, 35B), tune_prefill (prefill's non-GEMM kernels), pdl, probe_moe_path (MoE decode vs grouped paths at M = 2..64), moe_packing (the prefill MoE's padding), prefill_runner (the runner's TTFT against the model's prefill, its GPU gaps), barrier (grid barrier vs PDL chain), fp8_probe (FP8 GEMV designs), host (eager host time per op call), loop (in-loop part costs), profile_loop / profile_loop_fp8 / profile_loop_122b_fp8 (the graphed step kernel by kernel, bf16 / FP8 weights, the 122B FP8 step), ab / ab_fp8 (the step with
#         the op files of $AB_VARIANTS, experiments/ab_decode_step.py), ab_sampling (the sampler's versions in $AB_SAMPLING,
#         experiments/ab_sampling.py; carry .ab), ab_eager (the eager reference runner, kernels=triton, of the tree
#         $AB_OLD (default x_old; carry it) against the checkout: experiments/ab_trees.sh), tune_loop (+ in-loop config
#         descent, tables written), tune_loop_fp8 (the same for the FP8 model), tune_loop_122b_fp8 (the 122B FP8 model's), run_122b_fp8 (122B-A10B FP8 on one GPU), some_tests (the GPU tests of $TESTS), tp (needs 2 GPUs: nvidia-h200-x2).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/qmoe_out}
SAMPLING_ARGS=${SAMPLING_ARGS:-}
for wheel in hydra_core omegaconf antlr4_python3_runtime; do  # the image lacks them; an sdist is not installed
  ls .whl/"$wheel"-*.whl >/dev/null 2>&1 || { echo "no .whl/$wheel-*.whl: carry .whl (pip download; antlr4 4.9.3 is an sdist: pip wheel it)"; exit 2; }
done
mkdir -p "$OUT" results
if [ ! -d /tmp/site ] && ls .whl/*.whl >/dev/null 2>&1; then  # installed once per machine (parallel sessions)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
# Triton's compile cache in the tree (.triton_cache, git-ignored), packed into $OUT/triton_cache.tgz at the end: unpack
# it into the checkout and pass it in `carry`, and the next call finds the kernels this one compiled (a kernel whose
# source changed compiles again: the cache is keyed on it). Compiles take minutes of a call under triton 3.6.
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton_cache}
log="$OUT/session.log"
# Pass QMOE_GIT_COMMIT=<the commit that runs>: the device's .git can be the session's start while the tree is newer
# (seen 2026-12-03: rev-parse printed f22f8bf for 09dba6c's code). Unset, the results say HEAD-dirty.
status=()
run_stage() {
  local name=$1; shift
  local t0=$SECONDS
  echo "=== $name: $*" | tee -a "$log"
  timeout "${STAGE_TIMEOUT:-590}" "$@" >>"$log" 2>&1
  local rc=$?
  status+=("$(printf '%-18s rc=%-3s %4ss' "$name" "$rc" "$((SECONDS - t0))")")
  # pack after every stage: a later stage that runs out of time loses nothing already measured
  tar czf "$OUT/results.tar.gz" results kernels/moe/configs kernels/linear/configs 2>/dev/null
}
for stage in "$@"; do
  case $stage in
    env) run_stage env python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name())" ;;
    gpu_tests) run_stage gpu_tests python3 -m pytest -q -m gpu -n 8 --timeout 400 -p no:cacheprovider tests ;;
    kernel_tests) run_stage kernel_tests python3 -m pytest -q -m gpu -n 8 --timeout 300 -p no:cacheprovider tests/kernel_ops ;;
    hf_import) run_stage hf_import python3 -c "import traceback
from qmoe.model.hf import transformers_qwen35_moe
try:
    print(transformers_qwen35_moe())
except Exception as e:
    traceback.print_exc()
    c = e.__cause__
    while c is not None:
        print('CAUSE', type(c).__name__, c)
        c = c.__cause__" ;;
    tune_moe) run_stage tune_moe python3 experiments/tune_moe.py ${TUNE_MOE_ARGS:-} ;;
    tune_moe_fp8) run_stage tune_moe_fp8 python3 experiments/tune_moe.py --weights fp8 ${TUNE_MOE_ARGS:-} ;;
    bench_moe) run_stage bench_moe python3 experiments/bench_moe.py ${BENCH_MOE_ARGS:-} ;;
    tune_gemv) run_stage tune_gemv python3 experiments/tune_gemv.py ;;
    bench_gemv) run_stage bench_gemv python3 experiments/bench_gemv.py ;;
    bench_sampling) run_stage bench_sampling python3 experiments/bench_sampling.py $SAMPLING_ARGS ;;
    profile_sampling) STAGE_TIMEOUT=200 run_stage profile_sampling python3 experiments/profile_sampling.py ;;
    bench_gdn) run_stage bench_gdn python3 experiments/bench_gdn.py ;;
    tune_attention) run_stage tune_attention python3 experiments/tune_attention.py ;;
    bench_attention) run_stage bench_attention python3 experiments/bench_attention.py ;;
    bench_norm) run_stage bench_norm python3 experiments/bench_norm.py ;;
    bench_checkpoint) run_stage bench_checkpoint python3 experiments/bench_checkpoint_load.py --device cuda ;;
    bench_fp8) run_stage bench_fp8 python3 experiments/bench_fp8.py --sections ${FP8_SECTIONS:-gemv moe} ;;
    bench_fp8_moe_prefill) STAGE_TIMEOUT=300 run_stage bench_fp8_moe_prefill python3 experiments/bench_fp8.py --sections moe_prefill --out results/bench_fp8_moe_prefill.json ;;
    bench_checkpoint_tp2) STAGE_TIMEOUT=240 run_stage bench_checkpoint_tp2 python3 experiments/bench_checkpoint_load.py --device cuda --tp 2 --out results/bench_checkpoint_load_tp2.json ;;
    sampler_cuts) STAGE_TIMEOUT=120 run_stage sampler_cuts python3 experiments/sampler_cuts.py ;;
    probe_eager) STAGE_TIMEOUT=330 run_stage probe_eager python3 experiments/probe_eager_in_process.py ${PROBE_ARGS:-} ;;
    bench_checkpoint_fp8) run_stage bench_checkpoint_fp8 python3 experiments/bench_checkpoint_load.py --device cuda --quant fp8_block ;;
    runtime) STAGE_TIMEOUT=290 run_stage runtime python3 experiments/runtime_acceptance.py ;;
    e2e) STAGE_TIMEOUT=${E2E_TIMEOUT:-330} run_stage e2e python3 experiments/bench_e2e.py ;;
    profile) run_stage profile python3 experiments/bench_e2e.py --profile-only ;;
    tune_prefill) STAGE_TIMEOUT=300 run_stage tune_prefill python3 experiments/tune_prefill.py ;;
    profile_model) STAGE_TIMEOUT=300 run_stage profile_model python3 experiments/profile_model.py ;;
    profile_model_fp8) STAGE_TIMEOUT=300 run_stage profile_model_fp8 python3 experiments/profile_model.py --weights fp8 --sections prefill --out results/profile_model_fp8.json ;;
    tune_moe_fp8_prefill) STAGE_TIMEOUT=300 run_stage tune_moe_fp8_prefill python3 experiments/tune_moe.py --shapes 35B --prefill --weights fp8 --m ${MOE_M:-4096} ;;
    tune_fp8_prefill) STAGE_TIMEOUT=240 run_stage tune_fp8_prefill python3 experiments/tune_fp8_prefill.py --out results/tune_fp8_prefill.json ;;
    pdl) STAGE_TIMEOUT=200 run_stage pdl python3 experiments/bench_pdl.py ;;
    fp8_probe) STAGE_TIMEOUT=200 run_stage fp8_probe python3 experiments/fp8_gemv_probe.py ;;
    prefill_runner) STAGE_TIMEOUT=240 run_stage prefill_runner python3 experiments/profile_prefill_runner.py ;;
    probe_moe_path) STAGE_TIMEOUT=300 run_stage probe_moe_path python3 experiments/probe_moe_batch_path.py ;;
    moe_packing) STAGE_TIMEOUT=120 run_stage moe_packing python3 experiments/probe_moe_packing.py ;;
    barrier) STAGE_TIMEOUT=120 run_stage barrier python3 experiments/probe_grid_barrier.py ;;
    host) STAGE_TIMEOUT=120 run_stage host python3 experiments/host_overhead.py ;;
    loop) STAGE_TIMEOUT=200 run_stage loop python3 experiments/tune_decode_loop.py --skip-descent ;;
    profile_loop) STAGE_TIMEOUT=200 run_stage profile_loop python3 experiments/profile_decode_loop.py ;;
    profile_loop_fp8) STAGE_TIMEOUT=200 run_stage profile_loop_fp8 python3 experiments/profile_decode_loop.py --weights fp8 --out results/profile_decode_loop_fp8.json ;;
    profile_loop_122b_fp8) STAGE_TIMEOUT=300 run_stage profile_loop_122b_fp8 python3 experiments/profile_decode_loop.py --model qwen35_moe_122b --weights fp8 --out results/profile_decode_loop_122b_fp8.json ;;
    ab) STAGE_TIMEOUT=200 run_stage ab python3 experiments/ab_decode_step.py $AB_VARIANTS ;;
    ab_sampling) STAGE_TIMEOUT=450 run_stage ab_sampling python3 experiments/ab_sampling.py $AB_SAMPLING ;;
    ab_eager) STAGE_TIMEOUT=480 RUN_ARGS="runtime=reference kernels=triton generation.max_new_tokens=32" run_stage ab_eager bash experiments/ab_trees.sh "${AB_OLD:-x_old}" run 2 ;;
    ab_fp8) STAGE_TIMEOUT=200 run_stage ab_fp8 python3 experiments/ab_decode_step.py --weights fp8 --out results/ab_decode_step_fp8.json $AB_VARIANTS ;;
    tune_loop) run_stage tune_loop python3 experiments/tune_decode_loop.py --write-tables ;;
    tune_loop_122b_fp8) STAGE_TIMEOUT=420 run_stage tune_loop_122b_fp8 python3 experiments/tune_decode_loop.py --model qwen35_moe_122b --weights fp8 --replays 50 --write-tables --out results/tune_decode_loop_122b_fp8.json ;;
    tune_loop_fp8) run_stage tune_loop_fp8 python3 experiments/tune_decode_loop.py --weights fp8 --write-tables --out results/tune_decode_loop_fp8.json ;;
    run_122b_fp8) STAGE_TIMEOUT=400 run_stage run_122b_fp8 bash -c "python3 run.py model=qwen35_moe_122b runtime=cuda_native model.weights=fp8 prompt.length=128 generation.max_new_tokens=128 logger=none hydra.run.dir=/tmp/run_122b_fp8 && cp /tmp/run_122b_fp8/results.json results/run_122b_fp8_decode.json" ;;
    some_tests) run_stage some_tests python3 -m pytest -q -m gpu -n 8 --timeout 300 -p no:cacheprovider ${TESTS:-tests/kernel_ops} ;;
    tp) run_stage tp python3 -m torch.distributed.run --nproc-per-node 2 experiments/bench_tp.py --rows ${TP_ROWS:-check,allreduce,35b,122b,ablation,profile,layouts,397b,symm_mem} ;;
    *) echo "unknown stage $stage" | tee -a "$log" ;;
  esac
done
if [ -d "$TRITON_CACHE_DIR" ] && [ "$(du -sm "$TRITON_CACHE_DIR" | cut -f1)" -le 48 ]; then  # carry's 64 MiB
  tar czf "$OUT/triton_cache.tgz" -C "$TRITON_CACHE_DIR" .
fi
tail -c 6000 "$log"
printf '%s\n' "${status[@]}"
