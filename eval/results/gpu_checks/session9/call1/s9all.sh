#!/usr/bin/env bash
# next session, ONE call (nvidia-h200-x2, ~8 min), run from main's checkout with carry [".scratch"]: the three prepared
# branches (worktrees under .scratch/wt_*; refresh them with `git -C .scratch/wt_X checkout --detach exp/X` first)
#   GPU 1: the kernel GPU tests of each branch (tests/kernels -m gpu)
#   GPU 0: decode grid A/B main vs sign-magnitude (alternated twice), then the 'slices' sweep in warp-slices and in both
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/r; mkdir -p $R
pack() { tar czf "$OUT/r.tgz" -C $R . ; }
MAIN=$PWD
(export CUDA_VISIBLE_DEVICES=1
 for b in warp-slices sign-magnitude-codes slices-and-sign-magnitude; do
   (cd .scratch/wt_$b && timeout 150 python3 -m pytest -m gpu tests/kernels -q -n 8 -p no:cacheprovider -rfE --tb=short --timeout 120 \
      > $R/gpu_tests_$b.log 2>&1)
 done) &
TESTS=$!
export CUDA_VISIBLE_DEVICES=0
for round in 1 2; do
  for tree in $MAIN $MAIN/.scratch/wt_sign-magnitude-codes; do
    name=$(basename $tree)_$round
    (cd $tree && timeout 100 python3 -m eval.bench_kernels --batches 1 4 16 --lengths 32768 --presets 4bit k8v4 \
       --skip prefill store tune --out-dir $R/grid_$name --tag grid > /dev/null 2>&1)
    grep -E "^\| (1|4|16) \| 32768 \| 32/8" $R/grid_$name/grid.md | sed "s|^|$name |"
  done
done | tee $R/grid_ab.log; pack
for b in slices-and-sign-magnitude warp-slices; do
  (cd .scratch/wt_$b && timeout 150 python3 -m eval.bench_decode_variants --sweep slices --points 1x32768,4x32768,16x32768 \
     --presets 4bit,k8v4 --out $R/slices_$b > $R/slices_$b.log 2>&1)
  echo "== $b"; grep -E "^\|" $R/slices_$b/table.md | head -60
done; pack
wait $TESTS
for b in warp-slices sign-magnitude-codes slices-and-sign-magnitude; do echo "== tests $b"; grep -E "FAILED|ERROR|passed|failed" $R/gpu_tests_$b.log | tail -12; done; pack
