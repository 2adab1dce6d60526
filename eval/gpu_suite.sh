#!/usr/bin/env bash
# One device call that checks and times everything on a CUDA GPU; logs and results go to $OUT
# (or ./out). Usage: bash eval/gpu_suite.sh [seconds for the tests] [seconds for generate speed]
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
timeout "${1:-170}" python3 -m pytest -m gpu tests -q -x -p no:cacheprovider 2>&1 | tail -40 | tee "$OUT/gpu_tests.log"
python3 -m eval.bench_kernels --batches 1 16 --lengths 4096 32768 131072 --presets 4bit k8v4 k3v4 3bit \
    --prefill-lengths 8192 16384 --tag kernels_bench_final --out-dir "$OUT" 2>&1 | tail -45
python3 -m eval.speed --preset-set full --points 16x32768,1x32768,8x8192 --caches 4bit-all,k8v4-all \
    --time-budget "${2:-150}" --out "$OUT/speed" 2>&1 | tail -25
