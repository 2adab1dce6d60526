#!/usr/bin/env bash
# session 15 call 6 (nvidia-h200): the register cap of head pairs with the 4bit preset's levers (168 spills 108 bytes
#   per thread there, 3 registers through the loop; 192 and uncapped none, offline sm_90a), and plain at B=16
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
S=eval/results/gpu_checks/session15
P="[('4bit',16,32768),('4bit',4,32768),('4bit',1,32768),('4bit',16,131072)]"
V="{'4bit':{'r168':{},'r192':{'maxnreg':192},'r232':{'maxnreg':232},'free':{'maxnreg':None}}}"
timeout 300 python3 $S/ab_defaults.py "$P" "$V" 3 $OUT/ab_defaults_regs.json 2>&1 | grep -v Warn | tee $OUT/ab_defaults_regs.log
P="[(16,32768)]"
V="{'r168':{},'r192':{'maxnreg':192},'free':{'maxnreg':None}}"
timeout 200 python3 eval/results/gpu_checks/session14/ab_levers.py "$P" "$V" 2 $OUT/ab_levers_regs.json 2>&1 | grep -v Warn | tee $OUT/ab_levers_regs.log
