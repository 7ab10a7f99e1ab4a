#!/usr/bin/env bash
# Device calls on an nvidia-h200-x2 machine, one part per call (each fits the 600 s a call may run), in the order a
# session should spend them: the TP rows that answer the multi-GPU issue's targets first.
#   bash experiments/x2_session.sh tp      bench_tp: TP2 check, all-reduce in a graph, 35B TP2 (greedy, both
#                                          samplers' forms, sampled with and without top-k), 122B TP2 batch 1 / 32,
#                                          then the symmetric-memory all-reduces (last: a hang loses only them)
#   bash experiments/x2_session.sh tp_rest bench_tp: the copy-elision ablation at TP2, ledger vs profiler, EP
#                                          against TP inside the experts at batch 1 / 32, 397B dims at TP2
#   bash experiments/x2_session.sh single  the single-GPU stages side by side, one per GPU:
#                                          GPU 0: e2e (bench_e2e: the decode loop, batch 1/8/32, prefill 4096,
#                                          reference runners, FP8 row, profile); GPU 1: the kernel GPU tests, the
#                                          runtime and FP8 model GPU tests, bench_sampling, bench_fp8 (gemv, moe)
# Each part writes its log and results tarball under $OUT/<part>.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/qmoe_out}
part=${1:-tp}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
gpu1_tests() {
  python3 -m pytest -q -m gpu -n 4 --timeout 200 -p no:cacheprovider tests/test_runtime_gpu.py tests/test_fp8_model.py \
    tests/test_checkpoint_fp8.py
}
export -f gpu1_tests
case $part in
  tp) TP_ROWS=check,allreduce,35b,122b,symm_mem OUT=$OUT/tp STAGE_TIMEOUT=${TP_TIMEOUT:-540} \
        bash experiments/h200_session.sh tp >/dev/null 2>&1 ;;
  tp_rest) TP_ROWS=ablation,profile,layouts,397b OUT=$OUT/tp_rest STAGE_TIMEOUT=${TP_TIMEOUT:-540} \
        bash experiments/h200_session.sh tp >/dev/null 2>&1 ;;
  single)
    (CUDA_VISIBLE_DEVICES=0 OUT=$OUT/gpu0 STAGE_TIMEOUT=${E2E_TIMEOUT:-500} bash experiments/h200_session.sh e2e >/dev/null 2>&1) &
    (
      export CUDA_VISIBLE_DEVICES=1
      OUT=$OUT/gpu1 STAGE_TIMEOUT=100 bash experiments/h200_session.sh kernel_tests
      mkdir -p "$OUT/gpu1" && timeout 80 bash -c gpu1_tests >"$OUT/gpu1/model_tests.log" 2>&1
      OUT=$OUT/gpu1 STAGE_TIMEOUT=90 bash experiments/h200_session.sh bench_sampling
      OUT=$OUT/gpu1 STAGE_TIMEOUT=95 bash experiments/h200_session.sh bench_fp8
      OUT=$OUT/gpu1 STAGE_TIMEOUT=60 bash experiments/h200_session.sh sampler_cuts
    ) >/dev/null 2>&1 &
    wait ;;
  *) echo "unknown part $part (tp, tp_rest, single)"; exit 2 ;;
esac
for dir in "$OUT"/*/; do
  [ -f "$dir/session.log" ] || continue
  echo "##### $(basename "$dir")"
  grep -E "^(=== |met |MISS |[0-9]+ (passed|failed))|passed|failed|Error" "$dir/session.log" | tail -25
done
[ -f "$OUT/gpu1/model_tests.log" ] && tail -3 "$OUT/gpu1/model_tests.log"
exit 0
