#!/usr/bin/env bash
# next session, call 1 (nvidia-h200-x2), from main's checkout with carry [".scratch"]. Worktrees (refresh first):
#   .scratch/wt_win = exp/k3-windows   (git -C .scratch/wt_win checkout --detach exp/k3-windows)
#   .scratch/wt_rot = exp/rot-fp16x3   (git -C .scratch/wt_rot checkout --detach exp/rot-fp16x3)
#   GPU 1: both branches' kernel GPU tests; GPU 0: each branch vs main, alternated twice
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/r; mkdir -p $R
pack() { tar czf "$OUT/r.tgz" -C $R . ; }
bench() {  # dir tag presets batches
  (cd $1 && timeout 120 python3 -m eval.bench_kernels --batches $4 --lengths 32768 --presets $3 \
     --skip prefill store tune --out-dir $R/$2 --tag $2 > $R/$2.log 2>&1)
}
(export CUDA_VISIBLE_DEVICES=1
 for w in wt_win wt_rot; do
   (cd .scratch/$w && timeout 200 python3 -m pytest -m gpu tests/kernels -q -n 8 -p no:cacheprovider -rfE --tb=short \
      --timeout 150 > $R/gpu_tests_$w.log 2>&1)
 done) &
SIDE=$!
export CUDA_VISIBLE_DEVICES=0
for r in 1 2; do
  bench . main_k3_r$r k3v4 "1 16"; bench .scratch/wt_win win_r$r k3v4 "1 16"
  bench . main_4b_r$r "4bit" "1 4 16"; bench .scratch/wt_rot rot_r$r "4bit" "1 4 16"
  pack
done
wait $SIDE
for f in main_k3_r1 win_r1 main_k3_r2 win_r2 main_4b_r1 rot_r1 main_4b_r2 rot_r2; do
  echo "== $f"; grep -E "^\| (1|4|16) \| 32768 \| 32/8" $R/$f/*.md; done
grep -E "FAILED|ERROR|passed|failed" $R/gpu_tests_*.log | tail -8; pack
