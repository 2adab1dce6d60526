#!/usr/bin/env bash
# session 16 call 1 (nvidia-h200-x2): time four KV heads per decode program (tuning head_pairs=4) against the pairs.
#   GPU 1: the GPU tests (incl. test_decode_key_lookup_variants_gpu's head_pairs=4 case); GPU 0: the A/B.
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/r; mkdir -p $R
(export CUDA_VISIBLE_DEVICES=1
 timeout 330 python3 -m pytest -m gpu tests -q -n 10 -p no:cacheprovider -rfE --tb=short --timeout 280 > $R/gpu_tests.log 2>&1
) &
SIDE=$!
export CUDA_VISIBLE_DEVICES=0
timeout 420 python3 -m eval.bench_decode_variants --presets 4bit,4bit+defaults --points 16x32768,4x32768,1x32768 --rounds 2 \
  --out $R/quads --variants "{'default': {}, 'four heads, 2 stages, uncapped': {'head_pairs': 4, 'num_stages': 2, 'maxnreg': None}, \
'four heads, 2 stages, 168': {'head_pairs': 4, 'num_stages': 2}, 'four heads, 3 stages, uncapped': {'head_pairs': 4, 'maxnreg': None}, \
'four heads, BLOCK_N 64, uncapped': {'head_pairs': 4, 'block_n': 64, 'maxnreg': None}}" > $R/quads.log 2>&1; echo "quads rc=$?"
wait $SIDE
grep -E "FAILED|ERROR|passed|failed" $R/gpu_tests.log | tail -12
tail -40 $R/quads.log
cp -r $R/quads $R/gpu_tests.log $R/quads.log $OUT/
