#!/usr/bin/env bash
# session 7, call 2 (nvidia-h200-x2): plan caches + direct launches (working tree) vs HEAD (.scratch/base):
# host cost per call/layer (host_launch.py, alternated twice) and generate() at B=1/B=16 S=32k on GPU 0;
# GPU tests of the working tree on GPU 1
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/r; mkdir -p $R
pack() { tar czf "$OUT/r.tgz" -C $R . ; }
ROOT=$(pwd)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt
(CUDA_VISIBLE_DEVICES=1 timeout 240 python3 -m pytest -m gpu tests -q -n 10 -p no:cacheprovider -rfE --tb=short --timeout 150 > $R/gpu_tests.log 2>&1) &
TESTS=$!
export CUDA_VISIBLE_DEVICES=0
for round in 1 2; do
  echo "== base round $round" | tee -a $R/host.log
  (cd .scratch/base && timeout 100 python3 $ROOT/.scratch/host_launch.py) 2>&1 | grep -v Warning | tee -a $R/host.log
  echo "== new round $round" | tee -a $R/host.log
  timeout 100 python3 .scratch/host_launch.py 2>&1 | grep -v Warning | tee -a $R/host.log
done
pack
SP="--points 1x32768,16x32768 --caches fp16,4bit-all --new-tokens 32 --repeats 2 --time-budget 120"
timeout 170 python3 -m eval.speed $SP --out $R/speed_new 2>&1 | grep -v Warning | tail -12 | tee $R/speed_new.log
pack
(cd .scratch/base && timeout 170 python3 -m eval.speed $SP --out $R/speed_base) 2>&1 | grep -v Warning | tail -12 | tee $R/speed_base.log
pack
wait $TESTS
grep -E "FAILED|ERROR|passed|failed" $R/gpu_tests.log | tail -20; pack
