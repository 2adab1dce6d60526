#!/usr/bin/env bash
# session 19 call 3 (nvidia-h200): the grid at the layout's default block size (64 tokens at head_dim 128,
# 16 at 64): decode (plain presets), prefill incl. the store, the decode step's store; then the presets as
# TurboQuantCache runs them (+defaults) at S=32k
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=$OUT
timeout 400 python3 -m eval.bench_kernels --batches 1 16 --lengths 1024 4096 16384 32768 131072 \
  --presets 4bit k8v4 k3v4 3bit --prefill-lengths 8192 16384 --skip tune --out-dir $R/grid \
  --tag kernels_bench_session19 > $R/grid.log 2>&1; echo "grid rc=$?"
timeout 150 python3 -m eval.bench_kernels --batches 1 16 --lengths 32768 \
  --presets 4bit+defaults k8v4+defaults k3v4+defaults 3bit+defaults --skip prefill store tune \
  --out-dir $R/grid_defaults --tag kernels_bench_session19_defaults > $R/grid_defaults.log 2>&1; echo "defaults rc=$?"
grep -hE "^\| (1|16) \| (32768|131072) \|" $R/grid/*.md | head -12
grep -hE "prefill|store" $R/grid/*.md | head -20
grep -hE "^\| (1|16) \| 32768 \|" $R/grid_defaults/*.md | head -6
