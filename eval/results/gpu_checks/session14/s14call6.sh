#!/usr/bin/env bash
# session 14 call 6 (nvidia-h200-x2): main after the three merges. GPU 0: the grid; GPU 1: GPU tests, then an
# A/B of head pairs at B=1-2 (not the default there: unmeasured)
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/r; mkdir -p $R
(export CUDA_VISIBLE_DEVICES=1
 timeout 230 python3 -m pytest -m gpu tests -q -n 10 -p no:cacheprovider -rfE --tb=short --timeout 200 > $R/gpu_tests.log 2>&1
 P="[(2,32768,32,8,128,'4bit'),(1,32768,32,8,128,'4bit')]"
 HP="'key_words':True,'head_pairs':2,'meta_pairs':False,'meta_words':True,'vmid_chain':True,'bt_next':True,'block_n':128,'maxnreg':168,'num_warps':4"
 V="{'default':{},'pairs':{$HP}}"
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
