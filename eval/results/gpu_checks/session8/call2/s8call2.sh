#!/usr/bin/env bash
# session 8, call 2 (nvidia-h200-x2): prerotate / PDL sweep on GPU 0; all GPU tests (new: test_prerotate_and_pdl_gpu) on GPU 1
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/r; mkdir -p $R
pack() { tar czf "$OUT/r.tgz" -C $R . ; }
(CUDA_VISIBLE_DEVICES=1 timeout 280 python3 -m pytest -m gpu tests -q -n 10 -p no:cacheprovider -rfE --tb=short --timeout 200 > $R/gpu_tests.log 2>&1) &
TESTS=$!
export CUDA_VISIBLE_DEVICES=0
timeout 280 python3 -m eval.bench_decode_variants --sweep pdl --points 1x32768,4x32768,16x32768 --presets 4bit,k8v4 \
   --out $R/pdl > $R/pdl.log 2>&1
tail -5 $R/pdl.log; grep -E "^\|" $R/pdl/table.md | head -50; pack
wait $TESTS
grep -E "FAILED|ERROR|passed|failed" $R/gpu_tests.log | tail -30; pack
