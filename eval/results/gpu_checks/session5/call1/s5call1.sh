#!/usr/bin/env bash
# session 5, call 1 (nvidia-h200-x2): 16-bit value words (ldmatrix.trans) + fp16-subnormal nibbles.
# GPU tests on GPU 1 alongside; before (e3f97b0, .scratch/old) / after kernel decode on GPU 0; lookups sweep.
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/r; mkdir -p $R/before $R/after $R/lookups $R/levers
pack() { tar czf "$OUT/r.tgz" -C $R . ; }
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" >> $R/gpu.txt
(CUDA_VISIBLE_DEVICES=1 timeout 200 python3 -m pytest -m gpu tests -q -n 10 -p no:cacheprovider -rfE --tb=short --timeout 150 > $R/gpu_tests.log 2>&1) &
TESTS=$!
export CUDA_VISIBLE_DEVICES=0
(cd .scratch/old && timeout 120 python3 -m eval.bench_kernels --batches 1 16 --lengths 32768 --presets 4bit k8v4 k3v4 3bit --skip prefill store tune --tag before --out-dir $R/before > $R/before/log.txt 2>&1)
tail -14 $R/before/log.txt; el before; pack
timeout 120 python3 -m eval.bench_kernels --batches 1 16 --lengths 32768 --presets 4bit k8v4 k3v4 3bit --skip prefill store tune --tag after --out-dir $R/after > $R/after/log.txt 2>&1
tail -14 $R/after/log.txt; el after; pack
timeout 150 python3 -m eval.bench_decode_variants --sweep lookups --points 16x32768,1x32768 --out $R/lookups > $R/lookups/log.txt 2>&1
grep "B=" $R/lookups/log.txt | cut -c1-150; el lookups; pack
wait $TESTS
grep -E "FAILED|ERROR|passed|failed" $R/gpu_tests.log | tail -20; el tests; pack
timeout 80 python3 -m eval.bench_decode_variants --sweep levers --out $R/levers > $R/levers/log.txt 2>&1
grep "B=" $R/levers/log.txt | cut -c1-130; el levers; pack
