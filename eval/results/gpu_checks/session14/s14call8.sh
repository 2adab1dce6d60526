#!/usr/bin/env bash
# session 14 call 8 (one H200): Nsight Compute of the final decode (main), B=16 S=32k 4bit (two KV heads per program) and B=1 4bit
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/r; mkdir -p $R
for pb in 4bit:16 4bit:1; do
  p=${pb%%:*}_b${pb##*:}
  timeout 120 ncu --clock-control none --set full -k regex:_attn_kernel --launch-skip 2 --launch-count 1 -f -o $R/$p \
    python3 -m eval.profile_decode --preset ${pb%%:*} --batch ${pb##*:} --length 32768 > $R/$p.log 2>&1; echo "$p rc=$?"
  ncu --import $R/$p.ncu-rep --page details > $R/$p.details.txt 2>&1
  ncu --import $R/$p.ncu-rep --page source --csv --print-source sass > $R/$p.csv 2>&1
  python3 -m eval.profile_decode --stalls $R/$p.csv > $R/$p.stalls.txt 2>&1
  grep -E "Duration|DRAM Throughput|Issue Slots Busy|Eligible Warps|Active Warps Per|Registers Per|Dynamic Shared|Warp Cycles Per Issued" $R/$p.details.txt
  head -40 $R/$p.stalls.txt
done
rm -f $R/*.ncu-rep $R/*.csv
tar czf "$OUT/r.tgz" -C $R .
