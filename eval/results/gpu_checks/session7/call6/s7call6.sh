#!/usr/bin/env bash
# session 7, call 6 (nvidia-h200-x2): the 4-bit query rotation with fp16 R (working tree) vs HEAD (.scratch/base),
# alternated twice; k8v4 split counts; GPU tests of the working tree on GPU 1
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/r; mkdir -p $R
pack() { tar czf "$OUT/r.tgz" -C $R . ; }
ROOT=$(pwd)
(CUDA_VISIBLE_DEVICES=1 timeout 240 python3 -m pytest -m gpu tests -q -n 10 -p no:cacheprovider -rfE --tb=short --timeout 150 > $R/gpu_tests.log 2>&1) &
TESTS=$!
export CUDA_VISIBLE_DEVICES=0
for round in 1 2; do
  (cd .scratch/base && timeout 80 python3 $ROOT/.scratch/probe_time.py head$round) 2>&1 | grep -v Warning | tee -a $R/rot16.log
  timeout 80 python3 .scratch/probe_time.py rot16_$round 2>&1 | grep -v Warning | tee -a $R/rot16.log
done
pack
timeout 120 python3 .scratch/k8v4_splits.py 2>&1 | grep -v Warning | tee $R/k8v4_splits.log
pack
wait $TESTS
grep -E "FAILED|ERROR|passed|failed" $R/gpu_tests.log | tail -20; pack
