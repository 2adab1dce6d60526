#!/usr/bin/env bash
# session 17 call 11 (nvidia-h200): the one-warp kernel's tuning levers at B=16, alternated twice on one pool per point
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
V="{'default': {'warp_split': True}, 'row pairs': {'warp_split': True, 'row_pairs': True}, '4 stages': {'warp_split': True, 'num_stages': 4}, '2 stages': {'warp_split': True, 'num_stages': 2}, '64-token tiles': {'warp_split': True, 'block_n': 64}}"
timeout 300 python3 -m eval.bench_decode_variants --presets 4bit --points 16x32768,16x131072 \
  --rounds 2 --out $OUT/levers --variants "$V" > $OUT/levers.log 2>&1; echo "rc=$?"
grep -E "^\| [0-9]" $OUT/levers/table.md
