#!/usr/bin/env bash
# One device call on an nvidia-h200-x2 machine: the single-GPU stages run side by side on the two GPUs, then the
# tensor-parallel bench on both. Each part writes its log and results tarball under $OUT/<part>.
#   GPU 0: e2e (bench_e2e: the decode loop, batch 1/8/32, prefill 4096, reference runners, FP8 row, profile)
#   GPU 1: the kernel GPU tests, the runtime and FP8 model GPU tests, bench_sampling, bench_fp8 (gemv, moe)
#   both:  bench_tp (TP2 check, all-reduce in a graph, 35B TP2, ablation at TP2, 122B TP2 batch 1 / 32)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/qmoe_out}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
gpu1_tests() {
  python3 -m pytest -q -m gpu -n 4 --timeout 200 -p no:cacheprovider tests/test_runtime_gpu.py tests/test_fp8_model.py \
    tests/test_checkpoint_fp8.py
}
export -f gpu1_tests
(CUDA_VISIBLE_DEVICES=0 OUT=$OUT/gpu0 STAGE_TIMEOUT=${E2E_TIMEOUT:-370} bash experiments/h200_session.sh e2e >/dev/null 2>&1) &
(
  export CUDA_VISIBLE_DEVICES=1
  OUT=$OUT/gpu1 STAGE_TIMEOUT=100 bash experiments/h200_session.sh kernel_tests
  mkdir -p "$OUT/gpu1" && timeout 80 bash -c gpu1_tests >"$OUT/gpu1/model_tests.log" 2>&1
  OUT=$OUT/gpu1 STAGE_TIMEOUT=90 bash experiments/h200_session.sh bench_sampling
  OUT=$OUT/gpu1 STAGE_TIMEOUT=95 bash experiments/h200_session.sh bench_fp8
) >/dev/null 2>&1 &
wait
OUT=$OUT/tp STAGE_TIMEOUT=${TP_TIMEOUT:-180} bash experiments/h200_session.sh tp >/dev/null 2>&1
for part in gpu0 gpu1 tp; do
  echo "##### $part"
  grep -E "^(=== |met |MISS |[0-9]+ (passed|failed))|passed|failed|Error" "$OUT/$part/session.log" | tail -25
done
tail -3 "$OUT/gpu1/model_tests.log"
