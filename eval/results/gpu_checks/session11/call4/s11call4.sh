#!/usr/bin/env bash
# session 11 call 4 (nvidia-h200-x2), the v3-planes tree (3-bit value planes at 128/256 in 32-row tiles + the 3bit key planes):
#   GPU 1: all GPU tests; GPU 0: the grid for 3bit and k3v4, prefill at 8k and the decode step's store for 3bit/k3v4/4bit
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/r; mkdir -p $R
pack() { tar czf "$OUT/r.tgz" -C $R . ; }
(export CUDA_VISIBLE_DEVICES=1
 timeout 280 python3 -m pytest -m gpu tests -q -n 10 -p no:cacheprovider -rfE --tb=short --timeout 200 > $R/gpu_tests.log 2>&1
) &
SIDE=$!
export CUDA_VISIBLE_DEVICES=0
timeout 400 python3 -m eval.bench_kernels --batches 1 16 --lengths 1024 4096 16384 32768 131072 --presets 3bit k3v4 \
  --prefill-lengths 8192 --prefill-presets 3bit k3v4 4bit --skip tune --out-dir $R/grid --tag kernels_bench_session11_3bit > $R/grid.log 2>&1
pack
wait $SIDE
cat $R/grid/*.md
grep -E "FAILED|ERROR|passed|failed" $R/gpu_tests.log | tail -8; pack
