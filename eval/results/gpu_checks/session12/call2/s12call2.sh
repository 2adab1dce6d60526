#!/usr/bin/env bash
# session 12 call 2 (nvidia-h200-x2), from main's checkout with carry [".scratch"]. Worktree (refresh first):
#   .scratch/wt_p32 = exp/pool32
#   GPU 1: the branch's GPU tests; GPU 0: main vs branch decode S=32k (4 presets, B=1/16), alternated twice,
#   then the branch at cache blocks of 32/64 tokens (vs 16) for 4bit/k8v4
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/r; mkdir -p $R
(export CUDA_VISIBLE_DEVICES=1
 cd .scratch/wt_p32 && timeout 280 python3 -m pytest -m gpu tests -q -n 10 -p no:cacheprovider -rfE --tb=short --timeout 200 > $R/gpu_tests_p32.log 2>&1
) &
SIDE=$!
export CUDA_VISIBLE_DEVICES=0
for r in 1 2; do
  for t in main:. p32:.scratch/wt_p32; do
    (cd ${t#*:} && timeout 120 python3 -m eval.bench_kernels --batches 1 16 --lengths 32768 --presets 4bit k8v4 k3v4 3bit \
       --skip prefill store tune --out-dir $R/${t%%:*}_r$r --tag ${t%%:*}_r$r > $R/${t%%:*}_r$r.log 2>&1)
  done
done
for bs in 64 32 16 64; do
  (cd .scratch/wt_p32 && timeout 100 python3 -m eval.bench_kernels --batches 1 16 --lengths 32768 --presets 4bit k8v4 \
     --block-size $bs --skip prefill store tune --out-dir $R/bs$bs --tag bs$bs > $R/bs$bs.log 2>&1)
done
wait $SIDE
for f in main_r1 p32_r1 main_r2 p32_r2 bs16 bs32 bs64; do echo "== $f"; grep -E "^\| (1|16) " $R/$f/*.md; done
grep -E "FAILED|ERROR|passed|failed" $R/gpu_tests_p32.log | tail -8
tar czf "$OUT/r.tgz" -C $R .
