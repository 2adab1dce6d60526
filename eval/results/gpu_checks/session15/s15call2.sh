#!/usr/bin/env bash
# session 15 call 2 (nvidia-h200-x2): the branch (head pairs under the levers, 16-bit exact tiles, the block-table
#   prefetch with pairs) against main (fb46d78, a copy in .scratch/main), trees alternated twice.
#   GPU 1: the GPU tests of the branch; GPU 0: the A/B
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/r; mkdir -p $R
S=eval/results/gpu_checks/session15
(export CUDA_VISIBLE_DEVICES=1
 timeout 300 python3 -m pytest -m gpu tests -q -n 10 -p no:cacheprovider -rfE --tb=short --timeout 250 > $R/gpu_tests.log 2>&1
) &
SIDE=$!
export CUDA_VISIBLE_DEVICES=0
P="[(16,32768),(4,32768),(1,32768),(16,131072)]"
VM="{'main':{}}"
VB="{'branch':{},'no_bt':{'bt_next':False},'one_head':{'head_pairs':1}}"
for r in 1 2; do
  (cd .scratch/main && timeout 200 python3 ../../eval/results/gpu_checks/session14/ab_levers.py "$P" "$VM" 1 $R/ab_main_r$r.json > $R/ab_main_r$r.log 2>&1); echo "main r$r rc=$?"
  timeout 260 python3 eval/results/gpu_checks/session14/ab_levers.py "$P" "$VB" 1 $R/ab_branch_r$r.json > $R/ab_branch_r$r.log 2>&1; echo "branch r$r rc=$?"
done
wait $SIDE
grep -E "FAILED|ERROR|passed|failed" $R/gpu_tests.log | tail -12
for f in $R/ab_*_r*.log; do echo "== $f"; grep -v Warn $f; done
cp $R/*.json $R/*.log $OUT/ 2>/dev/null
