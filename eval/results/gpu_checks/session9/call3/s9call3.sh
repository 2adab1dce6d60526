#!/usr/bin/env bash
# session 9 call 3 (nvidia-h200-x2): generate() of main (GPU 0); prefill incl. store, main vs b86f6cd (before the
# sign-magnitude codes, .scratch/base), alternated twice (GPU 1)
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/r; mkdir -p $R
pack() { tar czf "$OUT/r.tgz" -C $R . ; }
MAIN=$PWD
(export CUDA_VISIBLE_DEVICES=1
 for round in 1 2; do
   for tree in $MAIN $MAIN/.scratch/base; do
     name=$(basename $tree)_$round
     (cd $tree && timeout 100 python3 -m eval.bench_kernels --presets 4bit k8v4 --prefill-lengths 8192 16384 \
        --skip decode tune --out-dir $R/prefill_$name --tag prefill > /dev/null 2>&1)
     grep -E "^\| (8192|16384) \|" $R/prefill_$name/prefill.md | sed "s|^|$name |"
     grep -E "^- " $R/prefill_$name/prefill.md | sed "s|^|$name |"
   done
 done > $R/prefill_ab.log 2>&1) &
AB=$!
export CUDA_VISIBLE_DEVICES=0
timeout 330 python3 -m eval.speed --points 1x32768,16x32768 --caches fp16,4bit-all,k8v4-all --new-tokens 32 --repeats 2 \
    --time-budget 300 --out $R/speed 2>&1 | grep -v Warning | tail -12 | tee $R/speed.log; pack
wait $AB
cat $R/prefill_ab.log; pack
