#!/usr/bin/env bash
# session 8, call 3: prerotate (fixed 2-D grid) sweep on GPU 0; the kernel GPU tests on GPU 1
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/r; mkdir -p $R
pack() { tar czf "$OUT/r.tgz" -C $R . ; }
(CUDA_VISIBLE_DEVICES=1 timeout 250 python3 -m pytest -m gpu tests/kernels -q -n 10 -p no:cacheprovider -rfE --tb=short --timeout 200 > $R/gpu_tests.log 2>&1) &
TESTS=$!
export CUDA_VISIBLE_DEVICES=0
timeout 250 python3 -m eval.bench_decode_variants --sweep pdl --points 1x32768,4x32768,16x32768 --presets 4bit \
   --out $R/pdl > $R/pdl.log 2>&1
tail -3 $R/pdl.log; grep -E "^\|" $R/pdl/table.md | head -50; pack
wait $TESTS
grep -E "FAILED|ERROR|passed|failed" $R/gpu_tests.log | tail -30; pack
