#!/usr/bin/env bash
# session 9 call 4 (nvidia-h200-x2): the store's sign-magnitude bucketing. GPU 1: kernel GPU tests + store tests
# of the working tree; GPU 0: prefill incl. store and the decode step's store, tree vs b86f6cd (.scratch/base) vs
# the tree before this change (.scratch/wt_prev = main HEAD), alternated twice
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/r; mkdir -p $R
pack() { tar czf "$OUT/r.tgz" -C $R . ; }
MAIN=$PWD
(CUDA_VISIBLE_DEVICES=1 timeout 250 python3 -m pytest -m gpu tests/kernels -q -n 8 -p no:cacheprovider -rfE --tb=short --timeout 200 > $R/gpu_tests.log 2>&1
 CUDA_VISIBLE_DEVICES=1 timeout 100 python3 -m pytest tests/kernels/test_kernel_store.py -q -p no:cacheprovider -rfE --tb=short > $R/store_tests_cuda.log 2>&1) &
TESTS=$!
export CUDA_VISIBLE_DEVICES=0
for round in 1 2; do
  for tree in $MAIN $MAIN/.scratch/wt_prev $MAIN/.scratch/base; do
    name=$(basename $tree)_$round
    (cd $tree && timeout 100 python3 -m eval.bench_kernels --presets 4bit k8v4 k3v4 --prefill-lengths 8192 16384 \
       --skip decode tune --out-dir $R/prefill_$name --tag prefill > /dev/null 2>&1)
    grep -E "^\| (8192|16384) \|.*exact" $R/prefill_$name/prefill.md | sed "s|^|$name |"
    grep -E "^- " $R/prefill_$name/prefill.md | sed "s|^|$name |"
  done
done | tee $R/prefill_ab.log; pack
wait $TESTS
grep -E "FAILED|ERROR|passed|failed" $R/gpu_tests.log $R/store_tests_cuda.log | tail -15; pack
