#!/usr/bin/env bash
# session 12 call 6 (nvidia-h200-x2), from main's checkout with carry [".scratch"]. Worktree (refresh first):
#   .scratch/wt_had2 = exp/hadamard-all (3-bit keys in 64-row tiles back on R)
#   GPU 1: the branch's GPU tests, the final branch
#   GPU 0: main vs branch decode S=32k B=1/16 (4bit+opts, k3v4+opts, 3bit+opts), alternated twice
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/r; mkdir -p $R
(export CUDA_VISIBLE_DEVICES=1
 cd .scratch/wt_had2 && timeout 200 python3 -m pytest -m gpu tests -q -n 10 -p no:cacheprovider -rfE --tb=short --timeout 150 > $R/gpu_tests_had.log 2>&1
) &
SIDE=$!
export CUDA_VISIBLE_DEVICES=0
run() {  # tag dir timeout
  (cd $2 && timeout $3 python3 -m eval.bench_kernels --batches 1 16 --lengths 32768 \
     --presets 4bit+opts k3v4+opts 3bit+opts --skip prefill store tune --out-dir $R/$1 --tag $1 > $R/$1.log 2>&1)
}
run main_r1 . 120; run had_r1 .scratch/wt_had2 120; run main_r2 . 80; run had_r2 .scratch/wt_had2 80
wait $SIDE
for f in main_r1 had_r1 main_r2 had_r2; do echo "== $f"; grep -E "^\| (1|16) " $R/$f/*.md; done
grep -E "FAILED|ERROR|passed|failed" $R/gpu_tests_had.log | tail -8
tar czf "$OUT/r.tgz" -C $R .
