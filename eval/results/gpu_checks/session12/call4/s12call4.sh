#!/usr/bin/env bash
# session 12 call 4 (nvidia-h200-x2), from main's checkout with carry [".scratch"]. Worktree (refresh first):
#   .scratch/wt_had2 = exp/hadamard-all
#   GPU 1: the branch's GPU tests; GPU 0: main vs branch decode S=32k B=1/16 (4bit+opts, k8v4+opts, k3v4, 3bit
#   plain and +opts) and compressed-mode prefill 8k, alternated twice
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/r; mkdir -p $R
(export CUDA_VISIBLE_DEVICES=1
 cd .scratch/wt_had2 && timeout 280 python3 -m pytest -m gpu tests -q -n 10 -p no:cacheprovider -rfE --tb=short --timeout 200 > $R/gpu_tests_had.log 2>&1
) &
SIDE=$!
export CUDA_VISIBLE_DEVICES=0
run() {  # tag dir block_size
  (cd $2 && timeout 140 python3 -m eval.bench_kernels --batches 1 16 --lengths 32768 \
     --presets 4bit+opts k8v4+opts k3v4 k3v4+opts 3bit 3bit+opts --prefill-lengths 8192 --prefill-presets 4bit k3v4 3bit \
     --block-size $3 --skip store tune --out-dir $R/$1 --tag $1 > $R/$1.log 2>&1)
}
for r in 1 2; do run main_r$r . 16; run had_r$r .scratch/wt_had2 16; done
wait $SIDE
for f in main_r1 had_r1 main_r2 had_r2; do echo "== $f"; grep -E "^\| (1|16|8192) " $R/$f/*.md; done
grep -E "FAILED|ERROR|passed|failed" $R/gpu_tests_had.log | tail -8
tar czf "$OUT/r.tgz" -C $R .
