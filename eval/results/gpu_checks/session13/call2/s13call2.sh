#!/usr/bin/env bash
# session 13 call 2: Nsight Compute on the decode kernel (B=16 S=32k 4bit, k8v4; B=1 4bit; fp16 SDPA SpeedOfLight)
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
echo "ncu: $NCU"; $NCU --version | tail -1
R=$OUT; 
prof() {  # name b s preset
  timeout 200 $NCU --clock-control none --kernel-name _attn_kernel --launch-skip 2 --launch-count 1 --set full \
    --import-source yes -f -o $R/$1 python3 .scratch/ncu_decode.py $2 $3 $4 > $R/$1.log 2>&1
  echo "$1 rc=$?"; tail -3 $R/$1.log
  $NCU --import $R/$1.ncu-rep --page details > $R/$1.details.txt 2>&1
  $NCU --import $R/$1.ncu-rep --page source --csv --print-source sass > $R/$1.sass.csv 2>&1
  $NCU --import $R/$1.ncu-rep --page source --csv --print-source cuda > $R/$1.src.csv 2>&1
  ls -la $R/$1.*
}
prof b16_4bit 16 32768 4bit
prof b16_k8v4 16 32768 k8v4
prof b1_4bit 1 32768 4bit
timeout 120 $NCU --clock-control none --section SpeedOfLight --section Occupancy --launch-count 30 -f -o $R/fp16 \
   python3 .scratch/ncu_decode.py 16 32768 fp16 > $R/fp16.log 2>&1; echo "fp16 rc=$?"
$NCU --import $R/fp16.ncu-rep --page details > $R/fp16.details.txt 2>&1
for f in b16_4bit b16_k8v4 b1_4bit; do echo "== $f"; grep -E "Duration|DRAM Throughput|Issue Slots Busy|Issued Warp|No Eligible|Achieved Occupancy|Registers Per|Executed Ipc Active|One or More Eligible|Warp Cycles Per Issued" $R/$f.details.txt | head -14; done
grep -E "flash|Duration|DRAM Throughput" $R/fp16.details.txt | tail -12
