#!/usr/bin/env bash
# session 6, call 7 (nvidia-h200-x2): the committed code: GPU tests (GPU 1); S=32k kernel bench and levers (GPU 0)
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/r; mkdir -p $R/bench $R/levers
pack() { tar czf "$OUT/r.tgz" -C $R . ; }
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" >> $R/gpu.txt
git log --oneline -1 >> $R/gpu.txt 2>/dev/null
(CUDA_VISIBLE_DEVICES=1 timeout 260 python3 -m pytest -m gpu tests -q -n 10 -p no:cacheprovider -rfE --tb=short --timeout 150 > $R/gpu_tests.log 2>&1) &
TESTS=$!
export CUDA_VISIBLE_DEVICES=0
timeout 230 python3 -m eval.bench_kernels --batches 1 16 --lengths 32768 --presets 4bit k8v4 k3v4 3bit --prefill-lengths 8192 16384 \
    --skip tune --tag kernels_bench --out-dir $R/bench > $R/bench/log.txt 2>&1
grep -E "^\| (1|16) \| 32768|store" $R/bench/log.txt | tail -24; el bench; pack
timeout 80 python3 -m eval.bench_decode_variants --sweep levers --points 16x32768,1x32768 --out $R/levers > $R/levers/log.txt 2>&1
grep "B=" $R/levers/log.txt | cut -c1-130; el levers; pack
wait $TESTS
grep -E "FAILED|ERROR|passed|failed" $R/gpu_tests.log | tail -20; el tests; pack
