#!/usr/bin/env bash
# session 16 call 2 (nvidia-h200-x2): the recent window's tiles shared out over the splits (ring_spread) when the batch
# fills the GPU (no exact program), against the last split walking them all (the previous behaviour).
#   GPU 0: the A/B (4bit and k8v4 as TurboQuantCache runs them); GPU 1: the GPU tests, then the presets' grid.
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/r; mkdir -p $R
(export CUDA_VISIBLE_DEVICES=1
 timeout 300 python3 -m pytest -m gpu tests -q -n 10 -p no:cacheprovider -rfE --tb=short --timeout 250 > $R/gpu_tests.log 2>&1
 timeout 280 python3 -m eval.bench_kernels --batches 1 16 --lengths 32768 131072 \
  --presets 4bit+defaults k8v4+defaults k3v4+defaults 3bit+defaults --skip prefill store tune \
  --out-dir $R/grid --tag kernels_bench_session16_defaults > $R/grid_defaults.log 2>&1; echo "grid rc=$?" >> $R/grid_defaults.log
) &
SIDE=$!
export CUDA_VISIBLE_DEVICES=0
timeout 500 python3 -m eval.bench_decode_variants --presets 4bit+defaults,k8v4+defaults --points 16x32768,12x32768,16x131072 \
  --rounds 3 --out $R/spread --variants "{'ring shared out (default)': {}, 'ring on the last split': {'ring_spread': False}}" \
  > $R/spread.log 2>&1; echo "spread rc=$?"
wait $SIDE
grep -E "FAILED|ERROR|passed|failed" $R/gpu_tests.log | tail -12
grep -E "^\|" $R/spread/table.md | head -3; grep -E "^\| (16|12) " $R/spread/table.md
tail -1 $R/grid_defaults.log; grep -hE "^\| (1|16) \| (32768|131072) \|" $R/grid/*.md | head -20
cp -r $R/spread $R/grid $R/gpu_tests.log $R/spread.log $R/grid_defaults.log $OUT/
