#!/usr/bin/env bash
# session 6, call 4: Nsight Compute profile of the committed decode kernel (B=16 and B=1, S=32k, 4bit plain)
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 CUDA_VISIBLE_DEVICES=0
R=/tmp/r; mkdir -p $R
pack() { tar czf "$OUT/r.tgz" -C $R . ; }
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
which ncu; ncu --version | tail -1
for b in 16 1; do
  timeout 200 ncu --clock-control none --set full --import-source yes -k regex:_attn_kernel --launch-skip 2 --launch-count 1 \
      --export $R/b$b -f python3 -m eval.profile_decode --preset 4bit --batch $b --length 32768 > $R/ncu_b$b.txt 2>&1
  el "ncu b$b rc $?"
  timeout 60 ncu -i $R/b$b.ncu-rep --page source --print-source sass --csv > $R/b${b}_source.csv 2> $R/b${b}_source.err
  el "source b$b rc $? $(wc -c < $R/b${b}_source.csv)"
  grep -E "Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Issued Warp|No Eligible|Warp Cycles Per Issued|Stall|Memory Throughput|DRAM Throughput|Compute \(SM\)" $R/ncu_b$b.txt | head -30
  pack
done
