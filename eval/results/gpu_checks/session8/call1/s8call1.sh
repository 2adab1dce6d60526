#!/usr/bin/env bash
# next session, call 1 (nvidia-h200-x2), branch exp/l2-prefetch: does prefetching each program's first blocks into L2
# before the prologue (tuning l2_prefetch) speed decode? sweep on GPU 0; the L2-prefetch GPU tests + all GPU tests on GPU 1
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/r; mkdir -p $R
pack() { tar czf "$OUT/r.tgz" -C $R . ; }
(CUDA_VISIBLE_DEVICES=1 timeout 240 python3 -m pytest -m gpu tests -q -n 10 -p no:cacheprovider -rfE --tb=short --timeout 150 > $R/gpu_tests.log 2>&1) &
TESTS=$!
export CUDA_VISIBLE_DEVICES=0
timeout 300 python3 -m eval.bench_decode_variants --sweep prefetch --points 1x32768,4x32768,16x32768 --presets 4bit,k8v4 \
   --out $R/prefetch > $R/prefetch.log 2>&1
grep -E "^\|" $R/prefetch/*.md | head -40; pack
timeout 100 python3 .scratch/host_launch2.py 2>&1 | grep -v Warning | tee $R/host.log; pack
timeout 200 python3 -m eval.speed --points 1x32768,16x32768 --caches fp16,4bit-all,k8v4-all --new-tokens 32 --repeats 2 \
    --time-budget 160 --out $R/speed 2>&1 | grep -v Warning | tail -10 | tee $R/speed.log; pack
wait $TESTS
grep -E "FAILED|ERROR|passed|failed" $R/gpu_tests.log | tail -20; pack
