#!/usr/bin/env bash
# session 15 call 4 (nvidia-h200): where the presets' defaults (+defaults: centering, value rotation, exact prefix and
#   ring) lose against their plain format: the exact program, the ring's tile length, the k8v4 register cap
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
S=eval/results/gpu_checks/session15
P="[('4bit',16,32768),('4bit',1,32768),('k8v4',16,32768),('k8v4',1,32768)]"
V="{'4bit':{'default':{},'exact_prog':{'exact_program':True},'no_exact_prog':{'exact_program':False},'ring16':{'ring_n':16},'ring64':{'ring_n':64}},
 'k8v4':{'default':{},'r128':{'maxnreg':128},'r168':{'maxnreg':168},'no_exact_prog':{'exact_program':False},'exact_prog':{'exact_program':True}}}"
timeout 500 python3 $S/ab_defaults.py "$P" "$V" 3 $OUT/ab_defaults.json 2>&1 | grep -v Warn | tee $OUT/ab_defaults.log
