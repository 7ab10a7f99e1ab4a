#!/usr/bin/env bash
# Two source trees timed alternately on one GPU, in separate processes: OLD (e.g. `git archive <commit> | tar -x -C
# x_old`, carried to the device) and the checkout, rounds of old then new. For changes outside the op files that
# experiments/ab_decode_step.py swaps (the model's forward, the runner). Each process writes under $OUT.
#   bash experiments/ab_trees.sh OLD_DIR step [ROUNDS]  # tune_decode_loop.py --step-only: the graphed step, ms
#   bash experiments/ab_trees.sh OLD_DIR run [ROUNDS]   # run.py's 35B copy-free loop, prompt 128, 128 new tokens
# (extra run.py overrides in $RUN_ARGS, e.g. model.weights=fp8). Results: results/ab_run_decode.json.
set -uo pipefail
old=$(cd "$1" && pwd) mode=$2 rounds=${3:-2} new=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-/tmp/qmoe_out}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$new/.triton_cache}
site=/tmp/site  # h200_session.sh installs the carried wheels there
for r in $(seq "$rounds"); do
  for v in old new; do
    dir=$new; [ "$v" = old ] && dir=$old
    cd "$dir" || exit 2
    export PYTHONPATH=$site:$dir:$dir/experiments
    if [ "$mode" = step ]; then
      timeout 200 python3 experiments/tune_decode_loop.py --step-only --out "$OUT/step_${v}_$r.json" 2>&1 | tail -1 | sed "s/^/$v $r: /"
    else
      timeout 300 python3 run.py model=qwen35_moe runtime=cuda_native prompt.length=128 generation.max_new_tokens=128 \
        logger=none ${RUN_ARGS:-} hydra.run.dir="$OUT/run_${v}_$r" >/dev/null 2>&1
      python3 -c "import json; d = json.load(open('$OUT/run_${v}_$r/results.json'))['latency']['decode_ms']
print('$v $r: decode p50 %.4f ms, p90 %.4f' % (d['p50'], d['p90']))"
    fi
  done
done
