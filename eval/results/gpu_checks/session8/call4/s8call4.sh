#!/usr/bin/env bash
# session 8, call 4: the prologue's query-rotation loop (coords per step x pipeline stages) sweep
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/r; mkdir -p $R
pack() { tar czf "$OUT/r.tgz" -C $R . ; }
export CUDA_VISIBLE_DEVICES=0
timeout 250 python3 -m eval.bench_decode_variants --sweep rotation --points 1x32768,4x32768,16x32768 --presets 4bit \
   --out $R/rotation > $R/rotation.log 2>&1
tail -3 $R/rotation.log; grep -E "^\|" $R/rotation/table.md | head -50; pack
