#!/usr/bin/env bash
# session 8, call 8: k8v4-all generate at B=1 (diagnosis), GPU tests of the tree to commit (GPU 1)
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/r; mkdir -p $R
pack() { tar czf "$OUT/r.tgz" -C $R . ; }
(CUDA_VISIBLE_DEVICES=1 timeout 250 python3 -m pytest -m gpu tests -q -n 10 -p no:cacheprovider -rfE --tb=short --timeout 200 > $R/gpu_tests.log 2>&1) &
TESTS=$!
export CUDA_VISIBLE_DEVICES=0
timeout 150 python3 .scratch/k8v4_layer.py 2>&1 | grep -v Warn | tee $R/k8v4_layer.log; pack
timeout 150 python3 -m eval.speed --points 1x32768 --caches fp16,4bit-all,k8v4-all --new-tokens 32 --repeats 2 \
    --time-budget 120 --out $R/speed 2>&1 | grep -v Warning | tail -8 | tee $R/speed.log; pack
wait $TESTS
grep -E "FAILED|ERROR|passed|failed" $R/gpu_tests.log | tail -30; pack
