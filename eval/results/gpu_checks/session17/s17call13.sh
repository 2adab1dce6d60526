#!/usr/bin/env bash
# session 17 call 13 (nvidia-h200): the one-warp kernel with the preset's levers (forced by tuning): its GPU tests,
# then unified vs one-warp on the 4bit preset as TurboQuantCache runs it, alternated twice
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
timeout 150 python3 -m pytest -m gpu tests/kernels/test_kernel_decode_warps.py -q -n 6 -p no:cacheprovider -rfE \
  --tb=short --timeout 140 > $OUT/gpu_tests.log 2>&1; echo "tests rc=$?"
V="{'unified': {'warp_split': False}, 'one-warp': {'warp_split': True}}"
timeout 150 python3 -m eval.bench_decode_variants --presets 4bit+defaults --points 16x32768,8x32768 \
  --rounds 2 --out $OUT/ab_defaults --variants "$V" > $OUT/ab_defaults.log 2>&1; echo "ab rc=$?"
grep -E "FAILED|ERROR|passed|failed" $OUT/gpu_tests.log | tail -8
grep -E "^\| [0-9]" $OUT/ab_defaults/table.md
