#!/usr/bin/env bash
# session 8, call 10 (the tree to commit: decode-step stores with 8 warps): store variants 4/8/16 warps at B=1/16/32;
# the bench's store-step section; all GPU tests
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 CUDA_VISIBLE_DEVICES=0
R=/tmp/r; mkdir -p $R
pack() { tar czf "$OUT/r.tgz" -C $R . ; }
timeout 100 python3 .scratch/store_probe.py 2>&1 | grep -v Warn | tee $R/store_probe.log; pack
timeout 100 python3 -m eval.bench_kernels --skip decode prefill tune --out-dir $R/bench --tag kernels_bench_session8_store > $R/bench.log 2>&1
grep -E "store step" $R/bench.log; pack
timeout 200 python3 -m pytest -m gpu tests -q -n 10 -p no:cacheprovider -rfE --tb=short --timeout 150 > $R/gpu_tests.log 2>&1
grep -E "FAILED|ERROR|passed|failed" $R/gpu_tests.log | tail -20; pack
