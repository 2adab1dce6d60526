#!/usr/bin/env bash
# session 17 call 12 (nvidia-h200-x2): the landed tree. GPU 1: every GPU test. GPU 0: the decode grid for
# 4bit (the preset whose launch changed), then the presets as TurboQuantCache runs them at S=32k (unchanged path)
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/r12; mkdir -p $R
(export CUDA_VISIBLE_DEVICES=1
 timeout 330 python3 -m pytest -m gpu tests -q -n 10 -p no:cacheprovider -rfE --tb=short --timeout 280 > $R/gpu_tests.log 2>&1
) &
SIDE=$!
export CUDA_VISIBLE_DEVICES=0
timeout 330 python3 -m eval.bench_kernels --batches 1 16 --lengths 1024 4096 16384 32768 131072 \
  --presets 4bit --skip prefill store tune --out-dir $R/grid --tag kernels_bench_session17_decode \
  > $R/grid.log 2>&1; echo "grid rc=$?"
wait $SIDE
grep -E "FAILED|ERROR|passed|failed" $R/gpu_tests.log | tail -12
grep -hE "^\| (1|16) \| (32768|131072) \|" $R/grid/*.md | head -12
cp $R/gpu_tests.log $R/grid.log $R/grid/* $OUT/
