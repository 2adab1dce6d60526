#!/usr/bin/env bash
# session 7, call 3 (nvidia-h200-x2): split partials merged in the attention kernel (working tree):
# merge vs reduction-kernel A/B (ab_merge.py), host cost, kernel decode grid at S=32k, generate();
# GPU tests on GPU 1
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/r; mkdir -p $R/bench
pack() { tar czf "$OUT/r.tgz" -C $R . ; }
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" >> $R/gpu.txt
(CUDA_VISIBLE_DEVICES=1 timeout 240 python3 -m pytest -m gpu tests -q -n 10 -p no:cacheprovider -rfE --tb=short --timeout 150 > $R/gpu_tests.log 2>&1) &
TESTS=$!
export CUDA_VISIBLE_DEVICES=0
timeout 150 python3 .scratch/ab_merge.py 2>&1 | grep -v Warning | tee $R/ab_merge.txt; el ab; pack
timeout 100 python3 .scratch/host_launch.py 2>&1 | grep -v Warning | tee $R/host.txt; el host; pack
timeout 170 python3 -m eval.bench_kernels --batches 1 4 16 --lengths 32768 --presets 4bit k8v4 k3v4 3bit --skip prefill store tune \
    --tag kernels_bench_session7 --out-dir $R/bench > $R/bench/log.txt 2>&1
grep -E "^\| (1|4|16) \| 32768" $R/bench/log.txt | tail -12; el bench; pack
timeout 200 python3 -m eval.speed --points 1x32768,16x32768 --caches fp16,4bit-all,k8v4-all --new-tokens 32 --repeats 2 \
    --time-budget 160 --out $R/speed 2>&1 | grep -v Warning | tail -12 | tee $R/speed.log; el speed; pack
wait $TESTS
grep -E "FAILED|ERROR|passed|failed" $R/gpu_tests.log | tail -20; el tests; pack
