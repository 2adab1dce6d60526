#!/usr/bin/env bash
# session 7, call 4 (nvidia-h200): split partials merged in the attention kernel (working tree) vs de9ba00 (.scratch/base,
# reduction kernel): host/wall time of a decode layer (3 steps: below the launch queue's depth; 50 steps), alternated
# twice; generate() B=1 S=32k for both
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/r; mkdir -p $R
pack() { tar czf "$OUT/r.tgz" -C $R . ; }
ROOT=$(pwd)
for round in 1 2; do
  echo "== base (reduction kernel) round $round" | tee -a $R/host.log
  (cd .scratch/base && timeout 100 python3 $ROOT/.scratch/host_launch2.py) 2>&1 | grep -v Warning | tee -a $R/host.log
  echo "== merge round $round" | tee -a $R/host.log
  timeout 100 python3 .scratch/host_launch2.py 2>&1 | grep -v Warning | tee -a $R/host.log
done
pack
SP="--points 1x32768 --caches fp16,4bit-all,k8v4-all --new-tokens 32 --repeats 2 --time-budget 100"
(cd .scratch/base && timeout 130 python3 -m eval.speed $SP --out $R/speed_base) 2>&1 | grep -E "^\| 1 " | tee $R/speed_base.log
timeout 130 python3 -m eval.speed $SP --out $R/speed_merge 2>&1 | grep -E "^\| 1 " | tee $R/speed_merge.log
pack
