#!/usr/bin/env bash
# session 7, call 7 (nvidia-h200-x2): the working tree (k8v4 split counts from 4 waves): S=32k decode grid of both
# shapes, all presets (GPU 0); GPU tests (GPU 1)
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/r; mkdir -p $R/bench
pack() { tar czf "$OUT/r.tgz" -C $R . ; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" >> $R/gpu.txt
(CUDA_VISIBLE_DEVICES=1 timeout 240 python3 -m pytest -m gpu tests -q -n 10 -p no:cacheprovider -rfE --tb=short --timeout 150 > $R/gpu_tests.log 2>&1) &
TESTS=$!
export CUDA_VISIBLE_DEVICES=0
timeout 170 python3 -m eval.bench_kernels --batches 1 4 16 --lengths 32768 --presets 4bit k8v4 k3v4 3bit --skip prefill store tune \
    --tag kernels_bench_session7 --out-dir $R/bench > $R/bench/log.txt 2>&1
grep -E "^\| (1|4|16) \| 32768" $R/bench/log.txt | tail -12; pack
wait $TESTS
grep -E "FAILED|ERROR|passed|failed" $R/gpu_tests.log | tail -20; pack
