#!/usr/bin/env bash
# next session, call 1 (nvidia-h200-x2, ~8 min), from main's checkout with carry [".scratch"]:
#   GPU 1: kernel GPU tests of branch exp/fp8-register-cap (worktree .scratch/wt_fp8cap: refresh with
#          `git -C .scratch/wt_fp8cap checkout --detach exp/fp8-register-cap`; merge it if they pass), then two sweeps
#   GPU 0: register caps for the other uncapped decode variants (offline SASS, session 9: k3v4/3bit at B=16 use
#          255 registers even plain; every preset with its levers at B=1/4 uses 255 and spills)
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/r; mkdir -p $R
pack() { tar czf "$OUT/r.tgz" -C $R . ; }
sweep() {  # preset batch formats
  PRESET=$1 B=$2 FORMATS=$3 OUTJSON=$R/regs_$1_b$2.json timeout 140 python3 .scratch/regs_sweep.py 2>&1 | grep -v Warn \
    > $R/regs_$1_b$2.log
}
(export CUDA_VISIBLE_DEVICES=1
 (cd .scratch/wt_fp8cap && timeout 250 python3 -m pytest -m gpu tests/kernels -q -n 8 -p no:cacheprovider -rfE --tb=short \
    --timeout 200 > $R/gpu_tests_fp8cap.log 2>&1)
 sweep 4bit 1 defaults; sweep k8v4 1 defaults) &
SIDE=$!
export CUDA_VISIBLE_DEVICES=0
sweep k3v4 16 plain,defaults; pack
sweep 3bit 16 plain,defaults; pack
sweep 4bit 4 defaults; sweep k8v4 4 defaults; pack
wait $SIDE
cat $R/regs_*.log
grep -E "FAILED|ERROR|passed|failed" $R/gpu_tests_fp8cap.log | tail -12; pack
