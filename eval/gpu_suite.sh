#!/usr/bin/env bash
# One device call that checks and times everything on a CUDA GPU; logs and results go to $OUT
# (or ./out). Usage: bash eval/gpu_suite.sh [seconds for the tests] [seconds for generate speed] [seconds for the soak]
# Every step writes as it goes (full test log, speed results after each run, soak report at its
# time limit), so a step cut by its limit still leaves its figures.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
# the GPU tests compile many kernel variants: spread them over 8 workers (pytest-xdist)
timeout "${1:-170}" python3 -m pytest -m gpu tests -q -n 8 -p no:cacheprovider -rfE --tb=short > "$OUT/gpu_tests.log" 2>&1
tail -15 "$OUT/gpu_tests.log"
python3 -m eval.bench_kernels --batches 1 16 --lengths 4096 32768 131072 --presets 4bit k8v4 k3v4 3bit \
    --prefill-lengths 8192 16384 --tag kernels_bench_final --out-dir "$OUT" 2>&1 | tail -45
timeout $(( ${2:-150} + 60 )) python3 -m eval.speed --preset-set full --points 16x32768,1x32768,8x8192 \
    --caches fp16,4bit-all,k8v4-all,quanto-int4 --time-budget "${2:-150}" --out "$OUT/speed" > "$OUT/speed.log" 2>&1
tail -15 "$OUT/speed/table.md"
python3 -m eval.soak --device cuda --ops 10000 --max-seconds "${3:-150}" --model random:llama-3.1-8b,layers=2 \
    --batch 4 --out "$OUT/soak/results.json" > "$OUT/soak.log" 2>&1
tail -c 600 "$OUT/soak.log"
