#!/usr/bin/env bash
# session 14 call 7 (nvidia-h200-x2): main after the HP=1 register fix and head pairs at every batch.
#   GPU 0: the grid; GPU 1: GPU tests, then B=1-4 A/B of the defaults against one head per program
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/r; mkdir -p $R
(export CUDA_VISIBLE_DEVICES=1
 timeout 230 python3 -m pytest -m gpu tests -q -n 10 -p no:cacheprovider -rfE --tb=short --timeout 200 > $R/gpu_tests.log 2>&1
 P="[(1,32768,32,8,128,'4bit'),(2,32768,32,8,128,'4bit'),(1,32768,32,8,128,'k8v4')]"
 V="{'default':{},'one_head':{'head_pairs':1,'key_words':False,'block_n':256,'maxnreg':None,'meta_pairs':True,'meta_words':False,'vmid_chain':False,'bt_next':False}}"
 timeout 150 python3 .scratch/ab_tuning.py "$P" "$V" 0 > $R/warm.log 2>&1
 timeout 150 python3 .scratch/ab_tuning.py "$P" "$V" 2 $R/ab_small.json > $R/ab_small.log 2>&1
) &
SIDE=$!
export CUDA_VISIBLE_DEVICES=0
timeout 470 python3 -m eval.bench_kernels --batches 1 16 --lengths 1024 4096 16384 32768 131072 --presets 4bit k8v4 k3v4 3bit \
  --prefill-lengths 8192 16384 --out-dir $R/grid --tag kernels_bench_session14 > $R/grid.log 2>&1; echo "grid rc=$?"
wait $SIDE
grep -E "FAILED|ERROR|passed|failed" $R/gpu_tests.log | tail -8
grep -v Warn $R/ab_small.log
grep -E "^\| (1|16) \| (32768|131072) \|" $R/grid/*.md | head -24
tar czf "$OUT/r.tgz" -C $R .
