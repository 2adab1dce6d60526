#!/usr/bin/env bash
# session 8, call 7: the mid-batch 2-warp rule: GPU tests (GPU 1); old vs new rule, plain and all levers; kernel grid
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/r; mkdir -p $R
pack() { tar czf "$OUT/r.tgz" -C $R . ; }
(CUDA_VISIBLE_DEVICES=1 timeout 280 python3 -m pytest -m gpu tests -q -n 10 -p no:cacheprovider -rfE --tb=short --timeout 200 > $R/gpu_tests.log 2>&1) &
TESTS=$!
export CUDA_VISIBLE_DEVICES=0
timeout 200 python3 -m eval.bench_decode_variants --sweep narrow --points 2x32768,4x32768,8x32768 \
   --out $R/narrow > $R/narrow.log 2>&1
grep -E "^\|" $R/narrow/table.md | head -40; pack
timeout 200 python3 -m eval.bench_kernels --batches 1 4 16 --lengths 32768 --presets 4bit k8v4 --skip prefill store tune \
   --out-dir $R/bench --tag kernels_bench_session8 > $R/bench.log 2>&1
grep -E "^\|" $R/bench/kernels_bench_session8.md | head -30; pack
wait $TESTS
grep -E "FAILED|ERROR|passed|failed" $R/gpu_tests.log | tail -30; pack
