#!/usr/bin/env bash
# session 17 call 7 (nvidia-h200-x2): the one-warp split decode (tq_hf/kernels/decode_warps.py) as landed.
#   GPU 1: the GPU tests (pytest -m gpu tests), then the unified kernel vs the one-warp kernel at S=32k/128k
#   GPU 0: the decode grid for 4bit (the only preset whose launch changed), then B=8/4 A/B
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/r; mkdir -p $R
(export CUDA_VISIBLE_DEVICES=1
 timeout 330 python3 -m pytest -m gpu tests -q -n 10 -p no:cacheprovider -rfE --tb=short --timeout 280 > $R/gpu_tests.log 2>&1
 V="{'unified': {'warp_split': False}, 'one-warp': {'warp_split': True}}"
 timeout 200 python3 -m eval.bench_decode_variants --presets 4bit --points 16x32768,16x131072,8x32768,32x32768 \
   --rounds 2 --out $R/ab_warps --variants "$V" > $R/ab_warps.log 2>&1; echo "ab rc=$?" >> $R/ab_warps.log
) &
SIDE=$!
export CUDA_VISIBLE_DEVICES=0
timeout 330 python3 -m eval.bench_kernels --batches 1 16 --lengths 1024 4096 16384 32768 131072 \
  --presets 4bit --skip prefill store tune --out-dir $R/grid --tag kernels_bench_session17_decode \
  > $R/grid.log 2>&1; echo "grid rc=$?"
V="{'unified': {'warp_split': False}, 'one-warp': {'warp_split': True}}"
timeout 150 python3 -m eval.bench_decode_variants --presets 4bit --points 4x32768,2x32768 \
  --rounds 2 --out $R/ab_small --variants "$V" > $R/ab_small.log 2>&1; echo "ab_small rc=$?"
wait $SIDE
grep -E "FAILED|ERROR|passed|failed" $R/gpu_tests.log | tail -12
grep -hE "^\| (1|16) \| (32768|131072) \|" $R/grid/*.md | head -12
for f in $R/ab_warps/table.md $R/ab_small/table.md; do grep -E "^\| [0-9]" $f; done
cp -r $R/* $OUT/
