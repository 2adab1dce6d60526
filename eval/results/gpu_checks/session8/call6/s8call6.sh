#!/usr/bin/env bash
# session 8, call 6: warps x splits, second round, at small/mid batch
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/r; mkdir -p $R
pack() { tar czf "$OUT/r.tgz" -C $R . ; }
export CUDA_VISIBLE_DEVICES=0
timeout 300 python3 -m eval.bench_decode_variants --sweep warps2 --points 1x32768,2x32768,4x32768,8x32768 --presets 4bit,k8v4 \
   --out $R/warps2 > $R/warps2.log 2>&1
tail -3 $R/warps2.log; grep -E "^\|" $R/warps2/table.md | head -100; pack
