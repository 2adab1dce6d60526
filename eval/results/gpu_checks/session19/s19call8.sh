#!/usr/bin/env bash
# session 19 call 8 (nvidia-h200): split counts of the unified kernel's decode at B >= 24 (the launcher gives one split
# once B x KV heads >= SMs: k8v4 B=32 S=32k took 256 programs of 4 warps, 0.61x fp16 against 0.48x at B=16)
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
timeout 420 python -m eval.bench_decode_variants --presets k8v4,k3v4,3bit,k8v4+defaults,4bit+defaults \
  --points 32x32768,64x32768,24x32768,32x8192 --rounds 2 --reps 60 --out $OUT/splits \
  --variants "{'default': {}, '2 splits': {'num_splits': 2}, '4 splits': {'num_splits': 4}}" > $OUT/splits.log 2>&1
echo "splits rc=$?"; tail -62 $OUT/splits/table.md
