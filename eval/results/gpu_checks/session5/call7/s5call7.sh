#!/usr/bin/env bash
# session 5, call 7: the GPU state machine test_plain (failed once in call 6) under the same hypothesis seeds,
# for the code of call 6 (GPU 0) and of call 5 (.scratch/c5: three walk loops, store in one program; GPU 1).
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/r; mkdir -p $R
pack() { tar czf "$OUT/r.tgz" -C $R . ; }
T=tests/test_reliability.py
for seed in 1 2 3 4 5 6 7 8; do
  (CUDA_VISIBLE_DEVICES=0 timeout 170 python3 -m pytest -q -p no:cacheprovider $T -k "TestGpuMachines and test_plain" --hypothesis-seed=$seed > $R/new_$seed.log 2>&1) &
  (cd .scratch/c5 && CUDA_VISIBLE_DEVICES=1 timeout 170 python3 -m pytest -q -p no:cacheprovider $T -k "TestGpuMachines and test_plain" --hypothesis-seed=$seed > $R/old_$seed.log 2>&1) &
done
wait
for f in $R/new_*.log $R/old_*.log; do echo "$(basename $f): $(grep -E 'passed|failed' $f | tail -1)"; done
grep -h "AssertionError: step" $R/*.log | cut -c1-200 | head
pack
