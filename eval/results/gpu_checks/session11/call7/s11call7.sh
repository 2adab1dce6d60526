#!/usr/bin/env bash
# session 11 call 7 (nvidia-h200-x2): branch v3-words (the 3-bit value planes as 16-bit words, decoded by a mask-only
# asm) vs main 0e7962c (.scratch/wt_main). GPU 1: all GPU tests of the branch, then its register sweep; GPU 0: 3bit decode
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/r7; mkdir -p $R
(export CUDA_VISIBLE_DEVICES=1
 timeout 280 python3 -m pytest -m gpu tests -q -n 10 -p no:cacheprovider -rfE --tb=short --timeout 200 > $R/gpu_tests.log 2>&1
 PRESET=3bit B=16 FORMATS=plain,defaults OUTJSON=$R/regs_b16.json timeout 150 python3 .scratch/regs_sweep.py > $R/regs_b16.log 2>&1
) &
SIDE=$!
export CUDA_VISIBLE_DEVICES=0
for r in 1 2; do
  (cd .scratch/wt_main && timeout 120 python3 -m eval.bench_kernels --batches 1 16 --lengths 32768 --presets 3bit \
     --skip prefill store tune --out-dir $R/main_r$r --tag main_r$r > $R/main_r$r.log 2>&1)
  timeout 120 python3 -m eval.bench_kernels --batches 1 16 --lengths 32768 --presets 3bit --skip prefill store tune \
     --out-dir $R/br_r$r --tag br_r$r > $R/br_r$r.log 2>&1
done
wait $SIDE
for f in main_r1 br_r1 main_r2 br_r2; do echo "== $f"; grep -E "^\| (1|16) \| 32768" $R/$f/*.md; done
grep -E "ms = " $R/regs_b16.log
grep -E "FAILED|ERROR|passed|failed" $R/gpu_tests.log | tail -8
tar czf "$OUT/r.tgz" -C $R .
