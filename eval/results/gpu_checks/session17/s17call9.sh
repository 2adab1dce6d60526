#!/usr/bin/env bash
# session 17 call 9 (nvidia-h200): the one-warp kernel with its query tiles converted before the walk (HEAD) vs the
# unified kernel, alternated twice on one pool per point
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
V="{'unified': {'warp_split': False}, 'one-warp': {'warp_split': True}}"
timeout 240 python3 -m eval.bench_decode_variants --presets 4bit --points 16x32768,16x131072,8x32768,32x32768 \
  --rounds 2 --out $OUT/ab_warps --variants "$V" > $OUT/ab_warps.log 2>&1; echo "ab rc=$?"
grep -E "^\| [0-9]" $OUT/ab_warps/table.md
