#!/usr/bin/env bash
# session 6, call 9 (nvidia-h200-x2): the key lookup's tables in registers (lane-mask zero) and the sign from the
# codes (working tree) vs HEAD (.scratch/base), alternating twice on GPU 0; GPU tests of the working tree on GPU 1
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/r; mkdir -p $R/pt
pack() { tar czf "$OUT/r.tgz" -C $R --exclude=pt . ; }
ROOT=$(pwd)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt
(CUDA_VISIBLE_DEVICES=1 timeout 200 python3 -m pytest -m gpu tests -q -n 10 -p no:cacheprovider -rfE --tb=short --timeout 150 > $R/gpu_tests.log 2>&1) &
TESTS=$!
export CUDA_VISIBLE_DEVICES=0
for round in 1 2; do
  (cd .scratch/base && timeout 100 python3 $ROOT/.scratch/ab.py base$round $R/pt) 2>&1 | grep -v Warning | tee -a $R/ab.log
  timeout 100 python3 .scratch/ab.py new$round $R/pt 2>&1 | grep -v Warning | tee -a $R/ab.log
done
python3 - <<'PY' | tee -a $R/ab.log
import glob, torch, os
for f in sorted(glob.glob("/tmp/r/pt/new1_*.pt")):
    g = f.replace("new1_", "base1_")
    if os.path.exists(g):
        a, b = torch.load(f).float(), torch.load(g).float()
        print(os.path.basename(f)[5:-3], "max|new-base|", float((a - b).abs().max()))
PY
pack
wait $TESTS
grep -E "FAILED|ERROR|passed|failed" $R/gpu_tests.log | tail -20; pack
