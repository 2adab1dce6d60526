#!/usr/bin/env bash
# session 10 call 2 (nvidia-h200-x2), from branch k3-planes' checkout with carry [".scratch"]:
#   GPU 1: every GPU test of the branch (3-bit keys in code planes, their lookup)
#   GPU 0: k3v4/3bit decode + prefill, the branch vs main (.scratch/wt_main), alternated; register caps
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/r; mkdir -p $R
pack() { tar czf "$OUT/r.tgz" -C $R . ; }
sweep() {  # preset batch formats
  PRESET=$1 B=$2 FORMATS=$3 OUTJSON=$R/regs_$1_b$2.json timeout 150 python3 .scratch/regs_sweep.py 2>&1 | grep -v Warn \
    > $R/regs_$1_b$2.log
}
bench() {  # dir tag extra-args
  (cd $1 && timeout 200 python3 -m eval.bench_kernels --batches 1 16 --lengths 32768 --presets k3v4 3bit \
     --out-dir $R/$2 --tag $2 ${@:3} > $R/$2.log 2>&1)
}
(export CUDA_VISIBLE_DEVICES=1
 timeout 280 python3 -m pytest -m gpu tests -q -n 10 -p no:cacheprovider -rfE --tb=short --timeout 200 \
   > $R/gpu_tests.log 2>&1) &
SIDE=$!
export CUDA_VISIBLE_DEVICES=0
bench . planes_r1 --prefill-lengths 8192 --skip tune; pack
bench .scratch/wt_main main_r1 --prefill-lengths 8192 --skip tune; pack
bench . planes_r2 --skip prefill store tune
bench .scratch/wt_main main_r2 --skip prefill store tune; pack
sweep k3v4 16 plain,defaults; sweep 3bit 16 plain; pack
sweep k8v4 4 plain; pack
wait $SIDE
for f in planes_r1 main_r1 planes_r2 main_r2; do echo "== $f"; grep -E "^\| *(1|16) \|.*(k3v4|3bit)|prefill|store" $R/$f/*.md 2>/dev/null | head -24; done
cat $R/regs_*.log
grep -E "FAILED|ERROR|passed|failed" $R/gpu_tests.log | tail -15; pack
