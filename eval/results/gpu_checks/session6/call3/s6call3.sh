#!/usr/bin/env bash
# session 6, call 3 (nvidia-h200-x2): GPU tests with the state machines' boundary-aware history check; the replay; seeds.
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/r; mkdir -p $R
pack() { tar czf "$OUT/r.tgz" -C $R . ; }
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" >> $R/gpu.txt
(CUDA_VISIBLE_DEVICES=1 timeout 240 python3 -m pytest -m gpu tests -q -n 10 -p no:cacheprovider -rfE --tb=short --timeout 150 > $R/gpu_tests.log 2>&1) &
TESTS=$!
export CUDA_VISIBLE_DEVICES=0
timeout 100 python3 .scratch/replay6.py cuda > $R/replay6.log 2>&1; echo "rc $?" >> $R/replay6.log; tail -2 $R/replay6.log; el replay
for seed in 1 2 3 4 5 6 7 8; do
  (timeout 200 python3 -m pytest -m gpu tests/test_reliability.py -q -p no:cacheprovider --hypothesis-seed=$seed -rfE --tb=short > $R/machines_seed$seed.log 2>&1) &
done
wait
for seed in 1 2 3 4 5 6 7 8; do echo "seed $seed: $(tail -1 $R/machines_seed$seed.log)"; done; el seeds
grep -E "FAILED|ERROR|passed|failed" $R/gpu_tests.log | tail -20; el tests; pack
