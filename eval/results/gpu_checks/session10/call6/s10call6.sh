#!/usr/bin/env bash
# session 10 call 6 (nvidia-h200): the k3v4 store, main (code planes) vs 72956de (.scratch/wt_prev), alternated twice
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
for r in 1 2; do
  TAG="planes r$r" timeout 60 python3 .scratch/store3.py 2>&1 | grep store
  (cd .scratch/wt_prev && TAG="prev r$r" timeout 60 python3 ../store3.py 2>&1 | grep store)
done | tee $OUT/store3.log
