#!/usr/bin/env bash
# One device call that checks and times everything on a CUDA GPU; logs and results go to $OUT
# (or ./out), packed after every step into $OUT/results.tgz (the device tool returns at most 8
# files), so a step cut by its limit still leaves its figures.
# Usage: bash eval/gpu_suite.sh [seconds for the tests] [seconds for generate speed] [seconds for the soak]
# With 2 GPUs the soak runs on the second one, alongside the rest (its timings then share the host).
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
R=$(mktemp -d); mkdir -p "$R/speed" "$R/soak" "$R/levers" "$R/variants"
pack() { tar czf "$OUT/results.tgz" -C "$R" . ; }
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$R/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$R/gpu.txt"
GPUS=$(nvidia-smi -L | wc -l)
SOAK_GPU=$(( GPUS > 1 ? 1 : 0 ))
run_soak() {
    CUDA_VISIBLE_DEVICES=$SOAK_GPU python3 -m eval.soak --device cuda --ops 10000 --max-seconds "${3:-150}" \
        --model random:llama-3.1-8b,layers=2 --batch 4 --out "$R/soak/results.json" > "$R/soak/log.txt" 2>&1
}
if (( GPUS > 1 )); then run_soak "$@" & SOAK=$!; fi
# the GPU tests compile many kernel variants: spread them over workers (pytest-xdist), names as they fail
CUDA_VISIBLE_DEVICES=0 timeout "${1:-200}" python3 -m pytest -m gpu tests -q -n 12 -p no:cacheprovider -rfE --tb=short \
    --timeout 180 > "$R/gpu_tests.log" 2>&1
grep -E "FAILED|ERROR|passed|failed" "$R/gpu_tests.log" | tail -15; pack
CUDA_VISIBLE_DEVICES=0 timeout 150 python3 -m eval.bench_decode_variants --sweep levers --out "$R/levers" > "$R/levers/log.txt" 2>&1
grep "B=" "$R/levers/log.txt"; pack
CUDA_VISIBLE_DEVICES=0 python3 -m eval.bench_kernels --batches 1 16 --lengths 4096 32768 131072 --presets 4bit k8v4 k3v4 3bit \
    --prefill-lengths 8192 16384 --tag kernels_bench --out-dir "$R" 2>&1 | tail -45; pack
CUDA_VISIBLE_DEVICES=0 timeout $(( ${2:-150} + 60 )) python3 -m eval.speed --preset-set full --points 16x32768,1x32768,8x8192 \
    --caches fp16,4bit-all,k8v4-all,quanto-int4 --time-budget "${2:-150}" --out "$R/speed" > "$R/speed/log.txt" 2>&1
tail -15 "$R/speed/table.md"; pack
if (( GPUS > 1 )); then wait "$SOAK"; else run_soak "$@"; fi
tail -c 600 "$R/soak/log.txt"; pack
