#!/usr/bin/env bash
# session 16 call 4 (nvidia-h200): decode variants at 9/3/64 (SmolLM2's attention shape), where every preset is
# slower than fp16 SDPA: the 4-bit code words and lookup (on at head_dim 128 only), register caps, tiles, splits.
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/r; mkdir -p $R
timeout 300 python3 -m eval.bench_decode_variants --shape 9/3/64 --presets 4bit,4bit+defaults,k8v4 \
  --points 16x32768,4x32768,1x32768 --rounds 2 --out $R/d64 --variants "{'default': {}, \
'words': {'key_lut': True, 'key_words': True}, 'words, 128 registers': {'key_lut': True, 'key_words': True, 'maxnreg': 128}, \
'words, BLOCK_N 128': {'key_lut': True, 'key_words': True, 'block_n': 128}, 'meta pairs': {'meta_pairs': True}, \
'3 stages': {'num_stages': 3}}" > $R/d64.log 2>&1; echo "d64 rc=$?"
timeout 200 python3 -m eval.bench_decode_variants --shape 9/3/64 --sweep splits --presets 4bit,k8v4 --points 1x32768,4x32768 \
  --out $R/d64_splits > $R/d64_splits.log 2>&1; echo "splits rc=$?"
grep -E "^\| (16|4|1) " $R/d64/table.md | grep -v "error" | sort -t'|' -k2,2n -k4,4 | head -80
grep -E "^\| (1|4) " $R/d64_splits/table.md | head -40
grep -ciE "error" $R/d64/table.md
cp -r $R/d64 $R/d64_splits $R/d64.log $R/d64_splits.log $OUT/
