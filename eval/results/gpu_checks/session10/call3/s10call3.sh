#!/usr/bin/env bash
# session 10 call 3 (nvidia-h200-x2), branch k3-planes (planes only at D = 128/256) with carry [".scratch"]:
#   GPU 1: every GPU test; GPU 0: k3v4/3bit decode, the branch vs main alternated; 3-bit variants (gather vs lookup, caps)
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/r; mkdir -p $R
pack() { tar czf "$OUT/r.tgz" -C $R . ; }
bench() {  # dir tag extra-args
  (cd $1 && timeout 150 python3 -m eval.bench_kernels --batches 1 16 --lengths 32768 --presets k3v4 3bit \
     --out-dir $R/$2 --tag $2 ${@:3} > $R/$2.log 2>&1)
}
var3() { PRESET=$1 B=$2 FORMATS=$3 OUTJSON=$R/var3_$1_b$2.json timeout 150 python3 .scratch/var3.py 2>&1 | grep -v Warn > $R/var3_$1_b$2.log; }
(export CUDA_VISIBLE_DEVICES=1
 timeout 280 python3 -m pytest -m gpu tests -q -n 10 -p no:cacheprovider -rfE --tb=short --timeout 200 \
   > $R/gpu_tests.log 2>&1) &
SIDE=$!
export CUDA_VISIBLE_DEVICES=0
bench . planes_r1 --skip prefill store tune
bench .scratch/wt_main main_r1 --skip prefill store tune
bench . planes_r2 --skip prefill store tune; pack
var3 3bit 16 plain,defaults; var3 3bit 1 plain,defaults; pack
var3 k3v4 1 plain,defaults; pack
wait $SIDE
for f in planes_r1 main_r1 planes_r2; do echo "== $f"; grep -E "^\| (1|16) \| 32768" $R/$f/*.md | head -6; done
cat $R/var3_*.log
grep -E "FAILED|ERROR|passed|failed" $R/gpu_tests.log | tail -15; pack
