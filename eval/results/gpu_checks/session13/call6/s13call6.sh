#!/usr/bin/env bash
# session 13 call 6 (nvidia-h200-x2): exp/meta-words with its defaults (meta_words, vmid_chain, bt_next + 3 stages)
#   GPU 0: the grid; GPU 1: the GPU tests, then A/B of the remaining small-batch choices
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/r; mkdir -p $R
(export CUDA_VISIBLE_DEVICES=1
 timeout 200 python3 -m pytest -m gpu tests -q -n 10 -p no:cacheprovider -rfE --tb=short --timeout 180 > $R/gpu_tests.log 2>&1
 V='{"default": {}, "vm": {"vmid_chain": True}, "mw": {"meta_words": True}}'
 timeout 150 python3 .scratch/ab_tuning.py '[(1, 32768, 32, 8, 128, "4bit"), (4, 32768, 32, 8, 128, "4bit"), (1, 32768, 32, 8, 128, "k8v4"), (16, 32768, 32, 8, 128, "4bit+opts")]' "$V" 2 $R/ab.json > $R/ab.log 2>&1
) &
SIDE=$!
export CUDA_VISIBLE_DEVICES=0
timeout 480 python3 -m eval.bench_kernels --batches 1 16 --lengths 1024 4096 16384 32768 131072 --presets 4bit k8v4 k3v4 3bit \
  --prefill-lengths 8192 16384 --out-dir $R/grid --tag kernels_bench_session13 > $R/grid.log 2>&1; echo "grid rc=$?"
wait $SIDE
grep -E "FAILED|ERROR|passed|failed" $R/gpu_tests.log | tail -8
grep -v Warn $R/ab.log
grep -E "^\| (1|16) \| 32768 \|" $R/grid/*.md | head -20
tar czf "$OUT/r.tgz" -C $R .
