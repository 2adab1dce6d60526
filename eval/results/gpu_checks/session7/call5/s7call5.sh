#!/usr/bin/env bash
# session 7, call 5 (nvidia-h200-x2): what the query-rotation prologue costs (a probe tree without it, timing only)
# vs HEAD, alternated; the split-count sweep at B=1/4 for 4bit and k8v4 (HEAD)
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/r; mkdir -p $R
pack() { tar czf "$OUT/r.tgz" -C $R . ; }
ROOT=$(pwd)
export CUDA_VISIBLE_DEVICES=0
(CUDA_VISIBLE_DEVICES=1 timeout 200 python3 -m eval.bench_decode_variants --sweep splits --points 1x32768,4x32768 --presets 4bit,k8v4 \
   --out $R/splits > $R/splits.log 2>&1) &
SW=$!
for round in 1 2; do
  timeout 80 python3 .scratch/probe_time.py head$round 2>&1 | grep -v Warning | tee -a $R/probe.log
  (cd .scratch/probe && timeout 80 python3 $ROOT/.scratch/probe_time.py probe$round) 2>&1 | grep -v Warning | tee -a $R/probe.log
done
pack
wait $SW
grep -E "^\|" $R/splits/*.md | head -60; pack
