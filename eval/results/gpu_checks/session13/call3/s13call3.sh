#!/usr/bin/env bash
# session 13 call 3: metadata as pair words + deeper pipelining (num_stages) on exp/meta-words; warm compiles in parallel, then time
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=$OUT
V16='{"default": {}, "mw": {"meta_words": True}, "s5": {"num_stages": 5}, "mw+s5": {"meta_words": True, "num_stages": 5}, "mw+s4": {"meta_words": True, "num_stages": 4}, "mw+s3": {"meta_words": True, "num_stages": 3}}'
V1='{"default": {}, "s4": {"num_stages": 4}, "s5": {"num_stages": 5}, "mw+s5": {"meta_pairs": False, "meta_words": True, "num_stages": 5}}'
P16='[(16, 32768, 32, 8, 128, "4bit"), (16, 32768, 32, 8, 128, "k8v4")]'
P1='[(1, 32768, 32, 8, 128, "4bit"), (1, 32768, 32, 8, 128, "k8v4")]'
P64='[(16, 32768, 9, 3, 64, "4bit")]'
t0=$(date +%s)
for pt in "(16, 32768, 32, 8, 128, \"4bit\")" "(16, 32768, 32, 8, 128, \"k8v4\")"; do
  timeout 200 python3 .scratch/ab_tuning.py "[$pt]" "$V16" 0 > $R/warm_$RANDOM.log 2>&1 &
done
timeout 200 python3 .scratch/ab_tuning.py '[(1, 32768, 32, 8, 128, "4bit"), (1, 32768, 32, 8, 128, "k8v4")]' "$V1" 0 > $R/warm_b1.log 2>&1 &
timeout 200 python3 .scratch/ab_tuning.py '[(16, 32768, 9, 3, 64, "4bit")]' "$V16" 0 > $R/warm_64.log 2>&1 &
wait; echo "warm $(( $(date +%s) - t0 )) s"; cat $R/warm_*.log | grep -i fail | head
timeout 150 python3 .scratch/ab_tuning.py "$P16" "$V16" 2 $R/b16.json 2>&1 | tee $R/b16.log | grep -v Warn
timeout 80 python3 .scratch/ab_tuning.py "$P1" "$V1" 2 $R/b1.json 2>&1 | tee $R/b1.log | grep -v Warn
timeout 80 python3 .scratch/ab_tuning.py "$P64" "$V16" 2 $R/d64.json 2>&1 | tee $R/d64.log | grep -v Warn
echo "total $(( $(date +%s) - t0 )) s"
