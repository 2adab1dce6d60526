#!/usr/bin/env bash
# session 18 call 9 (nvidia-h200): the landed tree (85282e1): the decode grid (plain presets), then the presets
# as TurboQuantCache runs them (+defaults) at S=32k
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=$OUT
timeout 330 python3 -m eval.bench_kernels --batches 1 16 --lengths 1024 4096 16384 32768 131072 \
  --presets 4bit k8v4 k3v4 3bit --skip prefill store tune --out-dir $R/grid --tag kernels_bench_session18_decode \
  > $R/grid.log 2>&1; echo "grid rc=$?"
timeout 170 python3 -m eval.bench_kernels --batches 1 16 --lengths 32768 \
  --presets 4bit+defaults k8v4+defaults k3v4+defaults 3bit+defaults --skip prefill store tune \
  --out-dir $R/grid_defaults --tag kernels_bench_session18_defaults > $R/grid_defaults.log 2>&1; echo "defaults rc=$?"
grep -hE "^\| (1|16) \| (32768|131072) \|" $R/grid/*.md | head -12
grep -hE "^\| (1|16) \| 32768 \|" $R/grid_defaults/*.md | head -6
