#!/usr/bin/env bash
# session 6, call 1 (nvidia-h200-x2): tokens-on-M walk sweep, levers with it, GPU tests, the call-6 failure replay.
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/r; mkdir -p $R/tokens $R/lookups
pack() { tar czf "$OUT/r.tgz" -C $R . ; }
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" >> $R/gpu.txt
(export CUDA_VISIBLE_DEVICES=1; timeout 100 python3 .scratch/replay6.py cuda > $R/replay6.log 2>&1; echo "rc $?" >> $R/replay6.log;
 timeout 230 python3 -m pytest -m gpu tests -q -n 10 -p no:cacheprovider -rfE --tb=short --timeout 150 > $R/gpu_tests.log 2>&1) &
TESTS=$!
export CUDA_VISIBLE_DEVICES=0
timeout 170 python3 -m eval.bench_decode_variants --sweep tokens --points 16x32768,1x32768 --reps 30 --out $R/tokens > $R/tokens/log.txt 2>&1
grep "B=" $R/tokens/log.txt | cut -c1-150; el tokens; pack
timeout 150 python3 -m eval.bench_decode_variants --sweep lookups --points 16x32768,1x32768 --reps 30 --out $R/lookups > $R/lookups/log.txt 2>&1
grep "B=" $R/lookups/log.txt | grep -E "defaults:|tokens|defaults, value" | cut -c1-170; el lookups; pack
wait $TESTS
tail -5 $R/replay6.log
grep -E "FAILED|ERROR|passed|failed" $R/gpu_tests.log | tail -20; el tests; pack
