#!/usr/bin/env bash
# session 16 call 6 (nvidia-h200-x2): head_dim 64 defaults (4-bit code words on 256-token tiles in 168 registers;
# FP8 keys' token pairs) where the batch fills the GPU (unmeasured in calls 4-5), the GPU tests, the decode grids.
#   GPU 0: A/B new vs old defaults at 9/3/64 B=48 and 32/8/64 B=16, then the issue's decode grid (plain presets)
#   GPU 1: the GPU tests, then the presets as TurboQuantCache runs them (+defaults) at S=32k/128k
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/r; mkdir -p $R
(export CUDA_VISIBLE_DEVICES=1
 timeout 330 python3 -m pytest -m gpu tests -q -n 10 -p no:cacheprovider -rfE --tb=short --timeout 280 > $R/gpu_tests.log 2>&1
 timeout 250 python3 -m eval.bench_kernels --batches 1 16 --lengths 32768 131072 \
  --presets 4bit+defaults k8v4+defaults k3v4+defaults 3bit+defaults --skip prefill store tune \
  --out-dir $R/grid_defaults --tag kernels_bench_session16_defaults > $R/grid_defaults.log 2>&1; echo "defaults rc=$?" >> $R/grid_defaults.log
) &
SIDE=$!
export CUDA_VISIBLE_DEVICES=0
V="{'new default': {}, 'old default (gather)': {'key_lut': False, 'maxnreg': None}}"
for SH in 9/3/64:48x32768:fill_9_3_64 32/8/64:16x32768:fill_32_8_64; do
  IFS=: read -r SHAPE POINT NAME <<< "$SH"
  timeout 150 python3 -m eval.bench_decode_variants --shape $SHAPE --presets 4bit,4bit+defaults --points $POINT \
    --rounds 2 --out $R/$NAME --variants "$V" > $R/$NAME.log 2>&1; echo "$NAME rc=$?"
done
timeout 330 python3 -m eval.bench_kernels --batches 1 16 --lengths 1024 4096 16384 32768 131072 \
  --presets 4bit k8v4 k3v4 3bit --skip prefill store tune --out-dir $R/grid --tag kernels_bench_session16_decode \
  > $R/grid.log 2>&1; echo "grid rc=$?"
wait $SIDE
grep -E "FAILED|ERROR|passed|failed" $R/gpu_tests.log | tail -12
for f in $R/fill_*/table.md; do head -1 $f; grep -E "^\| [0-9]" $f; done
grep -hE "^\| (1|16) \| (32768|131072) \|" $R/grid/*.md | head -12
tail -1 $R/grid_defaults.log; grep -hE "^\| (1|16) \| (32768|131072) \|" $R/grid_defaults/*.md | head -12
cp -r $R/* $OUT/
