#!/usr/bin/env bash
# session 9 call 2 (nvidia-h200-x2): main with sign-magnitude codes + 8-warp stores
#   GPU 1: the whole GPU test suite; GPU 0: the full kernel grid, then the store step
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/r; mkdir -p $R/bench $R/store
pack() { tar czf "$OUT/r.tgz" -C $R . ; }
(CUDA_VISIBLE_DEVICES=1 timeout 280 python3 -m pytest -m gpu tests -q -n 10 -p no:cacheprovider -rfE --tb=short --timeout 200 > $R/gpu_tests.log 2>&1) &
TESTS=$!
export CUDA_VISIBLE_DEVICES=0
timeout 330 python3 -m eval.bench_kernels --batches 1 16 --lengths 1024 4096 16384 32768 131072 --presets 4bit k8v4 k3v4 3bit \
   --prefill-lengths 8192 16384 --tag kernels_bench_session9 --out-dir $R/bench > $R/bench/log.txt 2>&1; echo "bench rc $?"
pack
timeout 60 python3 -m eval.bench_kernels --skip decode prefill tune --out-dir $R/store --tag kernels_bench_session9_store > $R/store/log.txt 2>&1; echo "store rc $?"
wait $TESTS
grep -E "FAILED|ERROR|passed|failed" $R/gpu_tests.log | tail -15
cat $R/bench/*.md | head -80; grep -A8 -i "store" $R/store/*.md | head -30
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt; python3 -c "import torch,triton,transformers;print(torch.__version__,triton.__version__,transformers.__version__)" >> $R/gpu.txt
pack
