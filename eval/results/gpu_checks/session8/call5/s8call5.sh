#!/usr/bin/env bash
# session 8, call 5: fewer warps per decode program (1-2) sweep
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/r; mkdir -p $R
pack() { tar czf "$OUT/r.tgz" -C $R . ; }
export CUDA_VISIBLE_DEVICES=0
timeout 280 python3 -m eval.bench_decode_variants --sweep warps --points 16x32768,4x32768,1x32768 --presets 4bit,k8v4 \
   --out $R/warps > $R/warps.log 2>&1
tail -3 $R/warps.log; grep -E "^\|" $R/warps/table.md | head -70; pack
