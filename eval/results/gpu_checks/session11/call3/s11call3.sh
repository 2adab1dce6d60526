#!/usr/bin/env bash
# session 11 call 3 (nvidia-h200-x2), from the v3-planes checkout (value planes at 128/256 in 32-row tiles, 3bit key
# planes, the k3v4 head_dim 64 window) with carry [".scratch"]; .scratch/wt_main = main db1ce59
#   GPU 1: all GPU tests of this tree; GPU 0: k3v4 + 3bit decode at 32k, main and this tree alternated twice, then the prefill
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/r; mkdir -p $R
pack() { tar czf "$OUT/r.tgz" -C $R . ; }
bench() {  # dir tag
  (cd $1 && timeout 150 python3 -m eval.bench_kernels --batches 1 16 --lengths 32768 --presets k3v4 3bit \
     --skip prefill store tune --out-dir $R/$2 --tag $2 > $R/$2.log 2>&1)
}
(export CUDA_VISIBLE_DEVICES=1
 timeout 280 python3 -m pytest -m gpu tests -q -n 10 -p no:cacheprovider -rfE --tb=short --timeout 200 > $R/gpu_tests.log 2>&1
) &
SIDE=$!
export CUDA_VISIBLE_DEVICES=0
for r in 1 2; do
  bench .scratch/wt_main main_r$r; bench . br_r$r
  pack
done
(timeout 200 python3 -m eval.bench_kernels --batches 16 --lengths 32768 --presets 3bit k3v4 --prefill-lengths 8192 \
   --skip decode tune --out-dir $R/prefill --tag prefill > $R/prefill.log 2>&1)
wait $SIDE
for f in main_r1 br_r1 main_r2 br_r2; do
  echo "== $f"; grep -E "^\| (1|16) \| 32768 \|" $R/$f/*.md; done
grep -E "^\| 8192|store|Store" $R/prefill/*.md | head -12
grep -E "FAILED|ERROR|passed|failed" $R/gpu_tests.log | tail -8; pack
