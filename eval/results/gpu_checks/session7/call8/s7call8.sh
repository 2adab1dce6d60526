#!/usr/bin/env bash
# session 7, call 8 (nvidia-h200-x2): launches on the pool's device (device_of): the 2-GPU test, and all GPU tests
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/r; mkdir -p $R
pack() { tar czf "$OUT/r.tgz" -C $R . ; }
(CUDA_VISIBLE_DEVICES=1 timeout 170 python3 -m pytest -m gpu tests -q -n 12 -p no:cacheprovider -rfE --tb=short --timeout 150 > $R/gpu_tests.log 2>&1) &
TESTS=$!
timeout 120 python3 -m pytest -m gpu tests/kernels/test_fast_launch.py -q -p no:cacheprovider -rfE --tb=short -v 2>&1 | tail -15 | tee $R/two_gpu.log
pack
wait $TESTS
grep -E "FAILED|ERROR|passed|failed" $R/gpu_tests.log | tail -20; pack
