#!/usr/bin/env bash
# session 11 call 8 (nvidia-h200-x2), main 9630a93 (3-bit value plane words) vs .scratch/wt_main (0e7962c):
#   GPU 1: 3bit B=16 S=32k with the preset's defaults, before/after alternated; GPU 0: the 3bit grid of main
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/r8; mkdir -p $R
(export CUDA_VISIBLE_DEVICES=1
 for r in 1 2; do
   (cd .scratch/wt_main && PRESET=3bit B=16 FORMATS=defaults OUTJSON=$R/before_r$r.json timeout 100 python3 ../regs_sweep.py > $R/before_r$r.log 2>&1)
   PRESET=3bit B=16 FORMATS=defaults OUTJSON=$R/after_r$r.json timeout 100 python3 .scratch/regs_sweep.py > $R/after_r$r.log 2>&1
 done) &
SIDE=$!
export CUDA_VISIBLE_DEVICES=0
timeout 300 python3 -m eval.bench_kernels --batches 1 16 --lengths 1024 4096 16384 32768 131072 --presets 3bit \
  --skip prefill store tune --out-dir $R/grid --tag kernels_bench_session11_3bit_words > $R/grid.log 2>&1
wait $SIDE
cat $R/grid/*.md | grep -E "^\|"
for f in before_r1 after_r1 before_r2 after_r2; do echo "== $f"; grep -E "ms = " $R/$f.log | grep -E ": defaults:|maxnreg 128:"; done
tar czf "$OUT/r.tgz" -C $R .
