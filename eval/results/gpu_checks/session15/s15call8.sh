#!/usr/bin/env bash
# session 15 call 8 (nvidia-h200): generate() end to end on main (random-init Llama-3.1-8B shapes, 8 layers)
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
timeout 220 python3 -m eval.speed --points 16x32768,1x32768 --caches fp16,4bit-all,k8v4-all --new-tokens 32 --repeats 2 \
  --time-budget 170 --out $OUT/speed > $OUT/speed.log 2>&1; echo "speed rc=$?"
grep -E "^\| (1|16) " $OUT/speed/table.md
