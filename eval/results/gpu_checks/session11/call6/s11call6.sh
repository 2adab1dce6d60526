#!/usr/bin/env bash
# session 11 call 6 (nvidia-h200-x2): the value planes in 64-row tiles by the 0x6400 trick (subnormals only in <= 32-row tiles)
#   GPU 1: all GPU tests; GPU 0: 3bit/k3v4 prefill at 8k, main db1ce59 and this tree alternated; 3bit decode at 32k
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/r6; mkdir -p $R
(export CUDA_VISIBLE_DEVICES=1
 timeout 280 python3 -m pytest -m gpu tests -q -n 10 -p no:cacheprovider -rfE --tb=short --timeout 200 > $R/gpu_tests.log 2>&1
) &
SIDE=$!
export CUDA_VISIBLE_DEVICES=0
for r in 1 2; do
  (cd .scratch/wt_main && timeout 120 python3 -m eval.bench_kernels_pp --prefill-lengths 8192 --prefill-presets 3bit \
     --skip decode store tune --out-dir $R/main_r$r --tag main_r$r > $R/main_r$r.log 2>&1)
  timeout 120 python3 -m eval.bench_kernels --prefill-lengths 8192 --prefill-presets 3bit --skip decode store tune \
     --out-dir $R/br_r$r --tag br_r$r > $R/br_r$r.log 2>&1
done
timeout 120 python3 -m eval.bench_kernels --batches 1 16 --lengths 32768 --presets 3bit --skip prefill store tune \
     --out-dir $R/dec --tag dec > $R/dec.log 2>&1
wait $SIDE
for f in main_r1 br_r1 main_r2 br_r2 dec; do echo "== $f"; grep -E "^\| (8192|1 |16 )" $R/$f/*.md; done
grep -E "FAILED|ERROR|passed|failed" $R/gpu_tests.log | tail -8
tar czf "$OUT/r.tgz" -C $R .
