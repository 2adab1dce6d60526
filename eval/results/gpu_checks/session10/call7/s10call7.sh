#!/usr/bin/env bash
# session 10 call 7 (nvidia-h200): the k3v4 store with natural-order buckets + plane shuffles (branch k3-store),
# vs 72956de (.scratch/wt_prev), alternated twice; then every GPU test
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
for r in 1 2; do
  TAG="planes-shuffle r$r" timeout 60 python3 .scratch/store3.py 2>&1 | grep store
  (cd .scratch/wt_prev && TAG="prev r$r" timeout 60 python3 ../store3.py 2>&1 | grep store)
done | tee $OUT/store3.log
timeout 200 python3 -m pytest -m gpu tests -q -n 10 -p no:cacheprovider -rfE --tb=short \
  2>&1 | tail -4 | tee $OUT/gpu_store_tests.log
