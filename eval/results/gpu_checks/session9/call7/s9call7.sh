#!/usr/bin/env bash
# session 9 call 7 (nvidia-h200-x2): the fused split reduction (tuning fused_reduce). GPU 1: kernel GPU tests;
# GPU 0: --sweep fused (alternated) at B=1/4/16, S=32k, 4bit and k8v4
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/r; mkdir -p $R
pack() { tar czf "$OUT/r.tgz" -C $R . ; }
(CUDA_VISIBLE_DEVICES=1 timeout 230 python3 -m pytest -m gpu tests/kernels -q -n 8 -p no:cacheprovider -rfE --tb=short --timeout 200 > $R/gpu_tests.log 2>&1) &
TESTS=$!
CUDA_VISIBLE_DEVICES=0 timeout 230 python3 -m eval.bench_decode_variants --sweep fused --points 1x32768,4x32768,16x32768 \
   --presets 4bit,k8v4 --out $R/fused > $R/fused.log 2>&1; echo "sweep rc $?"
grep -E "^\|" $R/fused/table.md; pack
wait $TESTS
grep -E "FAILED|ERROR|passed|failed" $R/gpu_tests.log | tail -15; pack
