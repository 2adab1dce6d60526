#!/usr/bin/env bash
# session 13 call 8 (nvidia-h200-x2): final exp/meta-words: GPU tests (GPU 1); levers sweep main vs branch (GPU 0)
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/r; mkdir -p $R
(export CUDA_VISIBLE_DEVICES=1
 timeout 200 python3 -m pytest -m gpu tests -q -n 10 -p no:cacheprovider -rfE --tb=short --timeout 180 > $R/gpu_tests.log 2>&1) &
SIDE=$!
export CUDA_VISIBLE_DEVICES=0
for t in main:.scratch/wt_main branch:.; do
  (cd ${t#*:} && timeout 170 python3 -m eval.bench_decode_variants --sweep levers --points 16x32768,1x32768 --presets 4bit,k8v4 \
     --reps 30 --out $R/levers_${t%%:*} > $R/levers_${t%%:*}.log 2>&1); echo "${t%%:*} rc=$?"
done
wait $SIDE
grep -E "FAILED|ERROR|passed|failed" $R/gpu_tests.log | tail -8
for t in main branch; do echo "== $t"; cat $R/levers_$t/table.md 2>/dev/null | grep -E "^\|" | cut -c1-160; done
tar czf "$OUT/r.tgz" -C $R .
