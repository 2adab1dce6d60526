#!/usr/bin/env bash
# session 9 call 5 (nvidia-h200-x2), the final main (466c885): GPU 1: the whole GPU suite, then the kernels' CPU-design
# tests on CUDA; GPU 0: the kernel bench at S=32k with prefill and store
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/r; mkdir -p $R/bench
pack() { tar czf "$OUT/r.tgz" -C $R . ; }
(export CUDA_VISIBLE_DEVICES=1
 timeout 250 python3 -m pytest -m gpu tests -q -n 10 -p no:cacheprovider -rfE --tb=short --timeout 200 > $R/gpu_tests.log 2>&1
 timeout 200 python3 -m pytest -m "not gpu" tests/kernels -q -n 8 -p no:cacheprovider -rfE --tb=line > $R/kernels_cpu_tests_on_cuda.log 2>&1) &
TESTS=$!
export CUDA_VISIBLE_DEVICES=0
timeout 200 python3 -m eval.bench_kernels --batches 1 16 --lengths 32768 --presets 4bit k8v4 --prefill-lengths 8192 16384 \
   --skip tune --tag kernels_bench_session9_final --out-dir $R/bench > $R/bench/log.txt 2>&1; echo "bench rc $?"
pack
wait $TESTS
grep -E "FAILED|ERROR|passed|failed" $R/gpu_tests.log $R/kernels_cpu_tests_on_cuda.log | tail -20
grep -E "^\||^- " $R/bench/*.md | head -40
pack
