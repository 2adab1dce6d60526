#!/usr/bin/env bash
# session 16 call 9 (nvidia-h200): the store writing the exact ring and the row lengths in its launch. The store's
# tests on CUDA (all of tests/kernels/test_kernel_store.py runs there), the cache through the kernels vs the reference
# path (tests/test_generate.py -m gpu), then the B=1 host profile (fp16 vs 4bit, generate()).
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
timeout 150 python3 -m pytest -q -n 8 -p no:cacheprovider -rfE --tb=short tests/kernels/test_kernel_store.py \
  "tests/test_generate.py" -m "gpu or not gpu" -k "not interpreter" > $OUT/tests.log 2>&1; echo "tests rc=$?"
grep -E "FAILED|ERROR|passed|failed" $OUT/tests.log | tail -8
PYTHONPATH=. timeout 100 python3 eval/results/gpu_checks/session16/host_profile.py fp16,4bit-all 48 > $OUT/host_profile.log 2>&1
echo "profile rc=$?"; grep -E "ms/token" $OUT/host_profile.log
