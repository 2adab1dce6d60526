#!/usr/bin/env bash
# session 16 call 8 (nvidia-h200-x2): the final tree. GPU 1: the GPU tests; GPU 0: k8v4 with its levers at small
# batch, the launcher's new 16-token ring tiles (default) against 32 (the previous default), alternated.
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/r; mkdir -p $R
(export CUDA_VISIBLE_DEVICES=1
 timeout 330 python3 -m pytest -m gpu tests -q -n 10 -p no:cacheprovider -rfE --tb=short --timeout 280 > $R/gpu_tests.log 2>&1
) &
SIDE=$!
export CUDA_VISIBLE_DEVICES=0
timeout 200 python3 -m eval.bench_decode_variants --presets k8v4+defaults,4bit+defaults --points 1x32768,2x32768,4x32768 \
  --rounds 2 --out $R/ring16 --variants "{'default': {}, 'ring tiles of 32': {'ring_n': 32}}" > $R/ring16.log 2>&1
echo "ring16 rc=$?"
wait $SIDE
grep -E "FAILED|ERROR|passed|failed" $R/gpu_tests.log | tail -12
grep -E "^\| [0-9]" $R/ring16/table.md
cp -r $R/* $OUT/
