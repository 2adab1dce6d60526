#!/usr/bin/env bash
# session 7, call 1 (nvidia-h200): host cost of unified_attention's pieces at B=1 S=32k
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
lscpu | grep -E "Model name|^CPU\(s\)"
timeout 200 python3 .scratch/host_pieces.py 2>&1 | grep -v Warning | tee $OUT/host_pieces.txt
