#!/usr/bin/env bash
# session 16 call 10 (nvidia-h200): generate() B=1 S=32k 4bit decode ms/token, the tree before this session's
# host-side changes (.scratch/base) and HEAD (persistent slot buffer; ring and lengths in the store), alternated.
set -uo pipefail
export HF_HUB_OFFLINE=1
HP=$PWD/eval/results/gpu_checks/session16/host_profile.py
for T in .scratch/base .; do
  echo "== $T"; PYTHONPATH=$T timeout 45 python3 $HP 4bit-all 24 noprof 2>&1 | grep "ms/token"
done
