#!/usr/bin/env bash
# session 15 call 7 (nvidia-h200-x2): head pairs with the levers uncapped (exp/pairs-regs).
#   GPU 1: the GPU tests; GPU 0: the decode grid of the presets as TurboQuantCache runs them (+defaults)
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/r; mkdir -p $R
(export CUDA_VISIBLE_DEVICES=1
 timeout 300 python3 -m pytest -m gpu tests -q -n 10 -p no:cacheprovider -rfE --tb=short --timeout 250 > $R/gpu_tests.log 2>&1
) &
SIDE=$!
export CUDA_VISIBLE_DEVICES=0
timeout 400 python3 -m eval.bench_kernels --batches 1 16 --lengths 1024 4096 16384 32768 131072 \
  --presets 4bit+defaults k8v4+defaults k3v4+defaults 3bit+defaults --skip prefill store tune \
  --out-dir $R/grid --tag kernels_bench_session15_defaults_r2 > $R/grid_defaults.log 2>&1; echo "defaults rc=$?"
wait $SIDE
grep -E "FAILED|ERROR|passed|failed" $R/gpu_tests.log | tail -12
grep -hE "^\| (1|16) \| (32768|131072) \|" $R/grid/*.md | head -12
cp $R/grid/* $R/gpu_tests.log $R/grid_defaults.log $OUT/
