#!/usr/bin/env bash
# session 11 call 2 (nvidia-h200-x2), from the v3-planes checkout with carry [".scratch"]:
#   .  = v3-planes (3-bit value planes), .scratch/wt_v3k = v3-keyplanes (+ the 3bit keys as planes), .scratch/wt_main = main db1ce59
#   GPU 1: GPU kernel tests of both branches; GPU 0: 3bit decode + store, the three trees alternated twice; a register sweep
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/r; mkdir -p $R
pack() { tar czf "$OUT/r.tgz" -C $R . ; }
bench() {  # dir tag
  (cd $1 && timeout 150 python3 -m eval.bench_kernels --batches 1 16 --lengths 32768 --presets 3bit \
     --skip prefill tune --out-dir $R/$2 --tag $2 > $R/$2.log 2>&1)
}
(export CUDA_VISIBLE_DEVICES=1
 timeout 200 python3 -m pytest -m gpu tests/kernels -q -n 8 -p no:cacheprovider -rfE --tb=short --timeout 150 > $R/gpu_tests_v3.log 2>&1
 (cd .scratch/wt_v3k && timeout 200 python3 -m pytest -m gpu tests/kernels -q -n 8 -p no:cacheprovider -rfE --tb=short \
    --timeout 150 > $R/gpu_tests_v3k.log 2>&1)
 (cd .scratch/wt_v3k && PRESET=3bit B=16 FORMATS=plain,defaults OUTJSON=$R/regs_v3k_b16.json timeout 200 python3 ../regs_sweep.py > $R/regs_v3k_b16.log 2>&1)
) &
SIDE=$!
export CUDA_VISIBLE_DEVICES=0
for r in 1 2; do
  bench .scratch/wt_main main_r$r; bench . v3_r$r; bench .scratch/wt_v3k v3k_r$r
  pack
done
wait $SIDE
for f in main_r1 v3_r1 v3k_r1 main_r2 v3_r2 v3k_r2; do
  echo "== $f"; grep -E "^\| (1|16) \| 32768 \|" $R/$f/*.md; grep -iE "store" $R/$f/*.md | head -4; done
grep -E "FAILED|ERROR|passed|failed" $R/gpu_tests_*.log | tail -8; grep -E "ms = " $R/regs_v3k_b16.log; pack
