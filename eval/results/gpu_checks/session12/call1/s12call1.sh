#!/usr/bin/env bash
# next session, call 1 (nvidia-h200-x2), from main's checkout with carry [".scratch"]. Worktree (refresh first):
#   .scratch/wt_pb = exp/v3-prefill-bytes  (git -C .scratch/wt_pb checkout --detach exp/v3-prefill-bytes)
#   GPU 1: the branch's GPU tests (3bit prefill back in 64-row tiles, 2 accumulators); GPU 0: 3bit/k3v4 prefill at 8k
#   and 3bit decode at 32k, main and the branch alternated twice
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/r; mkdir -p $R
(export CUDA_VISIBLE_DEVICES=1
 cd .scratch/wt_pb && timeout 280 python3 -m pytest -m gpu tests -q -n 10 -p no:cacheprovider -rfE --tb=short --timeout 200 > $R/gpu_tests_pb.log 2>&1
) &
SIDE=$!
export CUDA_VISIBLE_DEVICES=0
for r in 1 2; do
  for t in main:. pb:.scratch/wt_pb; do
    (cd ${t#*:} && timeout 150 python3 -m eval.bench_kernels --batches 1 16 --lengths 32768 --presets 3bit \
       --prefill-lengths 8192 --prefill-presets 3bit k3v4 --skip store tune --out-dir $R/${t%%:*}_r$r --tag ${t%%:*}_r$r \
       > $R/${t%%:*}_r$r.log 2>&1)
  done
done
wait $SIDE
for f in main_r1 pb_r1 main_r2 pb_r2; do echo "== $f"; grep -E "^\| (1|16|8192) " $R/$f/*.md; done
grep -E "FAILED|ERROR|passed|failed" $R/gpu_tests_pb.log | tail -8
tar czf "$OUT/r.tgz" -C $R .
