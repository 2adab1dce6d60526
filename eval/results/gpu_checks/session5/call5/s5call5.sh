#!/usr/bin/env bash
# session 5, call 5 (nvidia-h200-x2): the final code: GPU tests on GPU 1; levers sweep and generate() on GPU 0.
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/r; mkdir -p $R/levers $R/speed
pack() { tar czf "$OUT/r.tgz" -C $R . ; }
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" >> $R/gpu.txt
(CUDA_VISIBLE_DEVICES=1 timeout 220 python3 -m pytest -m gpu tests -q -n 10 -p no:cacheprovider -rfE --tb=short --timeout 150 > $R/gpu_tests.log 2>&1) &
TESTS=$!
export CUDA_VISIBLE_DEVICES=0
timeout 80 python3 -m eval.bench_decode_variants --sweep levers --out $R/levers > $R/levers/log.txt 2>&1
grep "B=" $R/levers/log.txt | cut -c1-130; el levers; pack
timeout 230 python3 -m eval.speed --preset-set full --points 16x32768,1x32768 --caches fp16,4bit-all,k8v4-all \
    --time-budget 170 --out $R/speed > $R/speed/log.txt 2>&1
tail -12 $R/speed/table.md; el speed; pack
wait $TESTS
grep -E "FAILED|ERROR|passed|failed" $R/gpu_tests.log | tail -20; el tests; pack
