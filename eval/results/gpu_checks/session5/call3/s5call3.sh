#!/usr/bin/env bash
# session 5, call 3 (nvidia-h200-x2): mask-free whole tiles (_pool_tile), exact prefix after the walk,
# BLOCK_N 256 + 128 registers with exact buffers at full batch. Tests on GPU 1 alongside; sweeps; full kernel grid.
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/r; mkdir -p $R/lookups $R/levers $R/splits $R/bench
pack() { tar czf "$OUT/r.tgz" -C $R . ; }
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" >> $R/gpu.txt
(CUDA_VISIBLE_DEVICES=1 timeout 220 python3 -m pytest -m gpu tests -q -n 10 -p no:cacheprovider -rfE --tb=short --timeout 150 > $R/gpu_tests.log 2>&1) &
TESTS=$!
export CUDA_VISIBLE_DEVICES=0
timeout 150 python3 -m eval.bench_decode_variants --sweep lookups --points 16x32768,1x32768 --out $R/lookups > $R/lookups/log.txt 2>&1
grep "B=" $R/lookups/log.txt | cut -c1-150; el lookups; pack
timeout 80 python3 -m eval.bench_decode_variants --sweep levers --out $R/levers > $R/levers/log.txt 2>&1
grep "B=" $R/levers/log.txt | cut -c1-130; el levers; pack
timeout 90 python3 -m eval.bench_decode_variants --sweep splits --points 1x32768,4x32768 --presets 4bit,k8v4 --out $R/splits > $R/splits/log.txt 2>&1
grep "B=" $R/splits/log.txt | cut -c1-130; el splits; pack
wait $TESTS
grep -E "FAILED|ERROR|passed|failed" $R/gpu_tests.log | tail -20; el tests; pack
timeout 240 python3 -m eval.bench_kernels --batches 1 16 --lengths 1024 4096 16384 32768 131072 --presets 4bit k8v4 k3v4 3bit \
    --prefill-lengths 8192 16384 --tag kernels_bench --out-dir $R/bench > $R/bench/log.txt 2>&1
tail -40 $R/bench/log.txt; el bench; pack
