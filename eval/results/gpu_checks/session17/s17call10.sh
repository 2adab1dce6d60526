#!/usr/bin/env bash
# session 17 call 10 (nvidia-h200-x2): the one-warp kernel with the lookup's table word in a register (HEAD)
#   GPU 1: the attention GPU tests (unified + one-warp), then unified vs one-warp, alternated twice
#   GPU 0: the decode grid for 4bit (32/8/128 B=16 takes the one-warp kernel)
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/r10; mkdir -p $R
(export CUDA_VISIBLE_DEVICES=1
 timeout 240 python3 -m pytest -m gpu tests/kernels/test_kernel_decode_warps.py tests/kernels/test_kernel_attention.py \
   -q -n 8 -p no:cacheprovider -rfE --tb=short --timeout 200 > $R/gpu_tests.log 2>&1
 V="{'unified': {'warp_split': False}, 'one-warp': {'warp_split': True}}"
 timeout 200 python3 -m eval.bench_decode_variants --presets 4bit --points 16x32768,16x131072,8x32768,32x32768 \
   --rounds 2 --out $R/ab_warps --variants "$V" > $R/ab_warps.log 2>&1; echo "ab rc=$?" >> $R/ab_warps.log
) &
SIDE=$!
export CUDA_VISIBLE_DEVICES=0
timeout 330 python3 -m eval.bench_kernels --batches 1 16 --lengths 1024 4096 16384 32768 131072 \
  --presets 4bit --skip prefill store tune --out-dir $R/grid --tag kernels_bench_session17_decode \
  > $R/grid.log 2>&1; echo "grid rc=$?"
wait $SIDE
grep -E "FAILED|ERROR|passed|failed" $R/gpu_tests.log | tail -12
grep -hE "^\| 16 \|" $R/grid/*.md | head -12
grep -E "^\| [0-9]" $R/ab_warps/table.md
mkdir -p $OUT/call10 && cp $R/*.log $OUT/call10/ && cp -r $R/ab_warps $OUT/call10/ && cp $R/grid/* $OUT/
