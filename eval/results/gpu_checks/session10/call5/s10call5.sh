#!/usr/bin/env bash
# session 10 call 5 (nvidia-h200-x2), branch k3-cap with carry [".scratch"]:
#   GPU 1: every GPU test (the k3v4 batch-filling test under the 128-register cap is new)
#   GPU 0: the grid for k3v4 (code planes + cap), then k8v4 register caps at B=2/8
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/r; mkdir -p $R
pack() { tar czf "$OUT/r.tgz" -C $R . ; }
sweep() { PRESET=$1 B=$2 FORMATS=$3 OUTJSON=$R/regs_$1_b$2.json timeout 120 python3 .scratch/regs_sweep.py 2>&1 | grep -v Warn > $R/regs_$1_b$2.log; }
(export CUDA_VISIBLE_DEVICES=1
 timeout 280 python3 -m pytest -m gpu tests -q -n 10 -p no:cacheprovider -rfE --tb=short --timeout 200 \
   > $R/gpu_tests.log 2>&1) &
SIDE=$!
export CUDA_VISIBLE_DEVICES=0
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt 2>&1
timeout 260 python3 -m eval.bench_kernels --batches 1 16 --lengths 1024 4096 16384 32768 131072 --presets k3v4 \
  --prefill-lengths 8192 --skip tune --out-dir $R --tag kernels_bench_session10_k3v4 > $R/bench.log 2>&1; pack
sweep k8v4 8 plain,defaults; pack
wait $SIDE
grep -E "^\| (1|16) \|" $R/kernels_bench_session10_k3v4.md | head -12
cat $R/regs_*.log
grep -E "FAILED|ERROR|passed|failed" $R/gpu_tests.log | tail -15; pack
