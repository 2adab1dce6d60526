#!/usr/bin/env bash
# session 19 call 6 (nvidia-h200): generate() end to end at the layout's default block size (64 tokens at head_dim
# 128), the command of session 15 call 8 (random-init Llama-3.1-8B shapes, 8 layers)
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
timeout 260 python3 -m eval.speed --points 16x32768,1x32768 --caches fp16,4bit-all,k8v4-all --new-tokens 32 --repeats 2 \
  --time-budget 200 --out $OUT/speed > $OUT/speed.log 2>&1; echo "speed rc=$?"
grep -E "^\| (1|16) " $OUT/speed/table.md
