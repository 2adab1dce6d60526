#!/usr/bin/env bash
# session 8, call 9: what the decode-step store costs and where (store_kv variants; Nsight Compute of the 4bit store, B=16)
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 CUDA_VISIBLE_DEVICES=0
R=/tmp/r; mkdir -p $R
pack() { tar czf "$OUT/r.tgz" -C $R . ; }
timeout 120 python3 .scratch/store_probe.py 2>&1 | grep -v Warn | tee $R/store_probe.log; pack
timeout 150 ncu --clock-control none --set full --import-source yes -k regex:_store_kernel --launch-skip 3 --launch-count 1 \
      --export $R/store -f python3 .scratch/store_probe.py --ncu > $R/ncu_store.txt 2>&1
echo "ncu rc $?"
timeout 60 ncu -i $R/store.ncu-rep --page source --print-source sass --csv > $R/store_source.csv 2> $R/store_source.err
grep -E "Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Issued Warp|No Eligible|Warp Cycles Per Issued|Stall|Block Size|Grid Size|Local" $R/ncu_store.txt | head -40
rm -f $R/store.ncu-rep; pack
