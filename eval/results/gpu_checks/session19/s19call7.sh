#!/usr/bin/env bash
# session 19 call 7 (nvidia-h200): the GPU tests on the final tree; 4bit decode at B=2-32, S=32k over the default
# 64-token blocks (B=32 had measured 0.3046 -> 0.3145-0.3224 ms with session 18's Hadamard prologue)
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
timeout 330 python -m pytest -m gpu tests -q -n 10 -p no:cacheprovider --timeout 300 > $OUT/gpu_tests.log 2>&1
echo "tests rc=$?"; tail -3 $OUT/gpu_tests.log
timeout 150 python3 -m eval.bench_kernels --batches 2 4 8 32 --lengths 32768 --presets 4bit k8v4 \
  --skip prefill store tune --out-dir $OUT/batches --tag kernels_bench_session19_batches > $OUT/batches.log 2>&1
echo "batches rc=$?"; grep -hE "^\| (2|4|8|32) \|" $OUT/batches/*.md
