#!/usr/bin/env bash
# session 13 call 5 (nvidia-h200-x2): vmid_chain, bt_next + stages on exp/meta-words
#   GPU 1: the branch's GPU tests; GPU 0: A/B default vs meta_words off across presets and batches, then ncu of B=16
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/r; mkdir -p $R
(export CUDA_VISIBLE_DEVICES=1
 timeout 280 python3 -m pytest -m gpu tests -q -n 10 -p no:cacheprovider -rfE --tb=short --timeout 200 > $R/gpu_tests.log 2>&1
) &
SIDE=$!
export CUDA_VISIBLE_DEVICES=0
V='{"default": {}, "vm": {"vmid_chain": True}, "bt3": {"bt_next": True, "num_stages": 3}, "bt3vm": {"bt_next": True, "num_stages": 3, "vmid_chain": True}, "bt4vm": {"bt_next": True, "num_stages": 4, "vmid_chain": True}}'
P='[(16, 32768, 32, 8, 128, "4bit"), (16, 32768, 32, 8, 128, "k8v4"), (16, 32768, 32, 8, 128, "k3v4"), (16, 32768, 32, 8, 128, "3bit"), (16, 131072, 32, 8, 128, "4bit"), (4, 32768, 32, 8, 128, "k8v4"), (1, 32768, 32, 8, 128, "k3v4")]'
python3 - "$P" > $R/points.txt <<'PY'
import sys; [print(repr([p])) for p in eval(sys.argv[1])]
PY
i=0; while read -r pt; do i=$((i+1)); timeout 200 python3 .scratch/ab_tuning.py "$pt" "$V" 0 > $R/warm_$i.log 2>&1 & done < $R/points.txt
wait $(jobs -p | grep -v "^$SIDE$") 2>/dev/null; echo warmed; grep -h -i fail $R/warm_*.log | head
timeout 300 python3 .scratch/ab_tuning.py "$P" "$V" 2 $R/ab.json 2>&1 | tee $R/ab.log | grep -v Warn
wait $SIDE
grep -E "FAILED|ERROR|passed|failed" $R/gpu_tests.log | tail -8
rm -f $R/*.ncu-rep
tar czf "$OUT/r.tgz" -C $R .
