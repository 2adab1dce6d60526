#!/usr/bin/env bash
# session 16 call 5 (nvidia-h200): 9/3/64 decode, second round: the 4-bit code words with 256-token tiles under the
# levers (the launcher takes 128 with exact buffers) and register caps; FP8 keys' token-pair metadata with the levers.
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/r; mkdir -p $R
W="'key_lut': True, 'key_words': True"
timeout 260 python3 -m eval.bench_decode_variants --shape 9/3/64 --presets 4bit,4bit+defaults \
  --points 16x32768,4x32768,1x32768,16x131072 --rounds 2 --out $R/d64_4bit --variants "{'default': {}, \
'words, 128 registers': {$W, 'maxnreg': 128}, 'words, 168 registers': {$W, 'maxnreg': 168}, \
'words, BLOCK_N 256, 128 registers': {$W, 'block_n': 256, 'maxnreg': 128}, \
'words, BLOCK_N 256, 168 registers': {$W, 'block_n': 256, 'maxnreg': 168}, \
'words, BLOCK_N 256, uncapped': {$W, 'block_n': 256, 'maxnreg': None}}" > $R/d64_4bit.log 2>&1; echo "4bit rc=$?"
timeout 200 python3 -m eval.bench_decode_variants --shape 9/3/64 --presets k8v4,k8v4+defaults \
  --points 16x32768,4x32768,1x32768,16x131072 --rounds 2 --out $R/d64_k8v4 --variants "{'default': {}, \
'meta pairs': {'meta_pairs': True}, 'meta pairs, 128 registers': {'meta_pairs': True, 'maxnreg': 128}, \
'meta pairs, BLOCK_N 256': {'meta_pairs': True, 'block_n': 256}}" > $R/d64_k8v4.log 2>&1; echo "k8v4 rc=$?"
for f in $R/d64_4bit/table.md $R/d64_k8v4/table.md; do grep -E "^\| [0-9]" $f | grep "round 1" ; done
cp -r $R/d64_4bit $R/d64_k8v4 $R/*.log $OUT/
