#!/usr/bin/env bash
# session 13 call 4 (nvidia-h200-x2): exp/meta-words with meta_words on by default (decode, head_dim 128, no pairs)
#   GPU 1: the branch's GPU tests; GPU 0: A/B default vs meta_words off across presets and batches, then ncu of B=16
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/r; mkdir -p $R
(export CUDA_VISIBLE_DEVICES=1
 timeout 280 python3 -m pytest -m gpu tests -q -n 10 -p no:cacheprovider -rfE --tb=short --timeout 200 > $R/gpu_tests.log 2>&1
) &
SIDE=$!
export CUDA_VISIBLE_DEVICES=0
V='{"default": {}, "no mw": {"meta_words": False}, "s3": {"num_stages": 3}}'
P='[(16, 32768, 32, 8, 128, "4bit"), (16, 32768, 32, 8, 128, "k8v4"), (16, 32768, 32, 8, 128, "k3v4"), (16, 32768, 32, 8, 128, "3bit"), (16, 32768, 32, 8, 128, "4bit+opts"), (16, 131072, 32, 8, 128, "4bit"), (4, 32768, 32, 8, 128, "k8v4"), (4, 32768, 32, 8, 128, "k3v4"), (1, 32768, 32, 8, 128, "k8v4"), (1, 32768, 32, 8, 128, "k3v4")]'
python3 - "$P" > $R/points.txt <<'PY'
import sys; [print(repr([p])) for p in eval(sys.argv[1])]
PY
i=0; while read -r pt; do i=$((i+1)); timeout 200 python3 .scratch/ab_tuning.py "$pt" "$V" 0 > $R/warm_$i.log 2>&1 & done < $R/points.txt
wait $(jobs -p | grep -v "^$SIDE$") 2>/dev/null; echo warmed; grep -h -i fail $R/warm_*.log | head
timeout 300 python3 .scratch/ab_tuning.py "$P" "$V" 2 $R/ab.json 2>&1 | tee $R/ab.log | grep -v Warn
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
for p in 4bit k8v4; do
  timeout 100 $NCU --clock-control none --kernel-name _attn_kernel --launch-skip 2 --launch-count 1 --set full \
    -f -o $R/b16_$p python3 .scratch/ncu_decode.py 16 32768 $p > $R/ncu_$p.log 2>&1; echo "ncu $p rc=$?"
  $NCU --import $R/b16_$p.ncu-rep --page details > $R/b16_$p.details.txt 2>&1
  $NCU --import $R/b16_$p.ncu-rep --page source --csv --print-source sass > $R/b16_$p.sass.csv 2>&1
  grep -E "Duration|DRAM Throughput|Issue Slots Busy|No Eligible|Registers Per|Warp Cycles Per Issued|Dynamic Shared" $R/b16_$p.details.txt
done
wait $SIDE
grep -E "FAILED|ERROR|passed|failed" $R/gpu_tests.log | tail -8
rm -f $R/*.ncu-rep
tar czf "$OUT/r.tgz" -C $R .
