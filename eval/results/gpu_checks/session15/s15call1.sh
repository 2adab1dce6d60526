#!/usr/bin/env bash
# session 15 call 1 (nvidia-h200-x2): head pairs under the 4bit preset's levers (branch exp/pairs-levers).
#   GPU 1: the GPU tests; GPU 0: A/B of one head per program (main's choice there) against head pairs with the
#   levers, with and without the block-table prefetch / 3 stages, at B=1/4/16 S=32k
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/r; mkdir -p $R
S=eval/results/gpu_checks/session15
(export CUDA_VISIBLE_DEVICES=1
 timeout 300 python3 -m pytest -m gpu tests -q -n 10 -p no:cacheprovider -rfE --tb=short --timeout 250 > $R/gpu_tests.log 2>&1
) &
SIDE=$!
export CUDA_VISIBLE_DEVICES=0
P="[(16,32768),(4,32768),(1,32768)]"
V="{'one':{'head_pairs':1},'pairs':{},'pairs_bt':{'bt_next':True},'pairs_s3':{'num_stages':3}}"
timeout 400 python3 eval/results/gpu_checks/session14/ab_levers.py "$P" "$V" 3 $R/ab_pairs_levers.json > $R/ab.log 2>&1; echo "ab rc=$?"
wait $SIDE
grep -E "FAILED|ERROR|passed|failed" $R/gpu_tests.log | tail -12
grep -v Warn $R/ab.log
cp $R/*.json $R/*.log $OUT/ 2>/dev/null
