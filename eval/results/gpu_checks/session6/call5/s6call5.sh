#!/usr/bin/env bash
# session 6 call 5: A/B of the metadata pair loads (working tree) vs HEAD (.scratch/base), alternating twice
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 CUDA_VISIBLE_DEVICES=0
R=/tmp/r; mkdir -p $R/pt
pack() { tar czf "$OUT/r.tgz" -C $R --exclude=pt . ; }
ROOT=$(pwd)
for round in 1 2; do
  (cd .scratch/base && timeout 150 python3 $ROOT/.scratch/ab.py base$round $R/pt) 2>&1 | grep -v Warning | tee -a $R/ab.log
  timeout 150 python3 .scratch/ab.py new$round $R/pt 2>&1 | grep -v Warning | tee -a $R/ab.log
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
