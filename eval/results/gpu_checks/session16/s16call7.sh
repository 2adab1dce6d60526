#!/usr/bin/env bash
# session 16 call 7 (nvidia-h200): small-batch decode with the presets' levers (the exact prefix and ring in an
# exact program of their own): ring tile lengths, no exact program, split counts; 32/8/128 and 9/3/64.
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/r; mkdir -p $R
V="{'default': {}, 'ring tiles of 64': {'ring_n': 64}, 'ring tiles of 128': {'ring_n': 128}, \
'ring tiles of 16': {'ring_n': 16}, 'no exact program': {'exact_program': False}, \
'half the splits': {'split_factor': 0.5}, 'twice the splits': {'split_factor': 2}}"
for SH in 32/8/128:1x32768,2x32768,1x131072:b1_128 9/3/64:1x32768,1x131072:b1_64; do
  IFS=: read -r SHAPE POINTS NAME <<< "$SH"
  timeout 200 python3 -m eval.bench_decode_variants --shape $SHAPE --presets 4bit+defaults,k8v4+defaults \
    --points $POINTS --rounds 2 --out $R/$NAME --variants "$V" > $R/$NAME.log 2>&1; echo "$NAME rc=$?"
  grep -E "^\| [0-9]" $R/$NAME/table.md | grep "round 2"
done
cp -r $R/* $OUT/
