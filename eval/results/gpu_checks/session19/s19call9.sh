#!/usr/bin/env bash
# session 19 call 9 (nvidia-h200): the unified decode's split count also at B x KV heads >= SMs: the GPU tests of
# the split paths, then the presets at B=24-64, S=32k, with the launcher's new choice
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
timeout 150 python -m pytest -m gpu tests/kernels -k "batch_filling or decode_32k or split or head_dim_64_decode" -q \
  -n 10 -p no:cacheprovider --timeout 140 > $OUT/gpu_tests.log 2>&1
echo "tests rc=$?"; tail -2 $OUT/gpu_tests.log
timeout 210 python3 -m eval.bench_kernels --batches 24 32 48 64 --lengths 32768 \
  --presets k8v4 k3v4 3bit k8v4+defaults 4bit+defaults --skip prefill store tune --out-dir $OUT/batches \
  --tag kernels_bench_session19_large_batch > $OUT/batches.log 2>&1
echo "batches rc=$?"; grep -hE "^\| (24|32|48|64) \|" $OUT/batches/*.md
