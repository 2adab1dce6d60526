#!/usr/bin/env bash
# next session, call 1 (nvidia-h200-x2), from main's checkout with carry [".scratch"]. Worktree (refresh first):
#   .scratch/wt_hst = exp/hadamard-store  (git worktree add --detach .scratch/wt_hst exp/hadamard-store, or
#   git -C .scratch/wt_hst checkout --detach exp/hadamard-store)
#   GPU 1: the branch's GPU tests (the store's codes against reference.py at real sizes, 64-token tiles);
#   GPU 0: main vs branch prefill (exact and compressed mode, 8k/16k) and the decode-step store, alternated twice
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/r; mkdir -p $R
(export CUDA_VISIBLE_DEVICES=1
 cd .scratch/wt_hst && timeout 280 python3 -m pytest -m gpu tests -q -n 10 -p no:cacheprovider -rfE --tb=short --timeout 200 > $R/gpu_tests_hst.log 2>&1
) &
SIDE=$!
export CUDA_VISIBLE_DEVICES=0
for r in 1 2; do
  for t in main:. hst:.scratch/wt_hst; do
    (cd ${t#*:} && timeout 150 python3 -m eval.bench_kernels --prefill-lengths 8192 16384 --prefill-presets 4bit k8v4 k3v4 3bit \
       --skip decode tune --out-dir $R/${t%%:*}_r$r --tag ${t%%:*}_r$r > $R/${t%%:*}_r$r.log 2>&1)
  done
done
wait $SIDE
for f in main_r1 hst_r1 main_r2 hst_r2; do echo "== $f"; grep -E "^\| (8192|16384) |^- " $R/$f/*.md; done
grep -E "FAILED|ERROR|passed|failed" $R/gpu_tests_hst.log | tail -8
tar czf "$OUT/r.tgz" -C $R .
