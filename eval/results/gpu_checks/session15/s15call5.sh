#!/usr/bin/env bash
# session 15 call 5 (nvidia-h200): the final branch: GPU tests, then k8v4's register cap with its defaults at B=1-2
#   (the new default against the uncapped one before it) and the plain format unchanged
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
S=eval/results/gpu_checks/session15
timeout 300 python3 -m pytest -m gpu tests -q -n 12 -p no:cacheprovider -rfE --tb=short --timeout 250 > $OUT/gpu_tests.log 2>&1
grep -E "FAILED|ERROR|passed|failed" $OUT/gpu_tests.log | tail -12
P="[('k8v4',1,32768),('k8v4',2,32768)]"
V="{'k8v4':{'default':{},'uncapped':{'maxnreg':None}}}"
timeout 200 python3 $S/ab_defaults.py "$P" "$V" 3 $OUT/ab_k8v4_cap.json 2>&1 | grep -v Warn | tee $OUT/ab_k8v4_cap.log
