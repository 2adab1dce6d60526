#!/usr/bin/env bash
# session 15 call 3 (nvidia-h200-x2): the grid on the branch (head pairs under the levers).
#   GPU 0: the grid (plain format) + prefill + store; GPU 1: the presets as TurboQuantCache uses them (+defaults)
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/r; mkdir -p $R
(export CUDA_VISIBLE_DEVICES=1
 timeout 560 python3 -m eval.bench_kernels --batches 1 16 --lengths 1024 4096 16384 32768 131072 \
   --presets 4bit+defaults k8v4+defaults k3v4+defaults 3bit+defaults --skip prefill store tune \
   --out-dir $R/grid --tag kernels_bench_session15_defaults > $R/grid_defaults.log 2>&1; echo "defaults rc=$?"
) &
SIDE=$!
export CUDA_VISIBLE_DEVICES=0
timeout 560 python3 -m eval.bench_kernels --batches 1 16 --lengths 1024 4096 16384 32768 131072 --presets 4bit k8v4 k3v4 3bit \
  --prefill-lengths 8192 16384 --out-dir $R/grid --tag kernels_bench_session15 > $R/grid.log 2>&1; echo "grid rc=$?"
wait $SIDE
grep -hE "^\| (1|16) \| (32768|131072) \|" $R/grid/*.md | head -24
grep -hiE "prefill|store step" $R/grid.log | tail -12
cp $R/grid/* $OUT/
cp $R/grid.log $R/grid_defaults.log $OUT/
