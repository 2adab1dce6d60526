#!/usr/bin/env bash
# session 11 call 5: 3bit causal prefill at 8k in compressed mode, main (db1ce59, with this tree's bench script for
# --prefill-presets) and the v3-planes tree, alternated
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/r; mkdir -p $R
for r in 1 2; do
  (cd .scratch/wt_main && timeout 120 python3 -m eval.bench_kernels_pp --prefill-lengths 8192 --prefill-presets 3bit k3v4 \
     --skip decode store tune --out-dir $R/main_r$r --tag main_r$r > $R/main_r$r.log 2>&1)
  timeout 120 python3 -m eval.bench_kernels --prefill-lengths 8192 --prefill-presets 3bit k3v4 --skip decode store tune \
     --out-dir $R/br_r$r --tag br_r$r > $R/br_r$r.log 2>&1
done
for f in main_r1 br_r1 main_r2 br_r2; do echo "== $f"; grep -E "^\| 8192" $R/$f/*.md; done
tar czf "$OUT/r.tgz" -C $R .
