"""Offline sm_90a compile of the prototype: shared, registers, spills, loop instruction counts."""
import os, re, subprocess, sys
sys.path.insert(0, "."); sys.path.insert(0, ".scratch/ws")
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tq_hf.config import TurboQuantConfig
from tq_hf.layout import BlockLayout
from tq_hf.kernels.key_lut import config_lut_bytes, lut_words_asm
import wsdecode

TPW = int(os.environ.get("TPW", 32)); W = int(os.environ.get("W", 4)); ST = int(os.environ.get("ST", 3))
REG = int(os.environ.get("REG", 0)) or None
cfg = TurboQuantConfig.from_preset("4bit", block_size=16, key_centering=False, value_rotation=False, exact_prefix_tokens=0, recent_window=0)
lay = BlockLayout(cfg, 8, 128)
lut = lut_words_asm(config_lut_bytes(cfg, 128)[0])
fn = wsdecode._ws_kernel
sig = dict(q_ptr="*fp16", s_qb="i32", s_qh="i32", s_ql="i32", rot_ptr="*fp16", Lq="i32", sm_scale="fp32", qt_ptr="*fp16", rs_ptr="*fp32", pool_ptr="*u8", bt_ptr="*i32", s_bt="i32", seq_ptr="*i64", pout_ptr="*fp32",
           plse_ptr="*fp32", tab_ptr="*fp16", num_splits="i32", block_bytes="i32", plane_bytes="i32")
const = dict(KEY_UNIT=config_lut_bytes(cfg, 128)[1], LUT=lut, PTX=True, D=128, DP=128, T=16, KB=lay.key_bytes, VB=lay.value_bytes, META=lay.metadata_offset, W=W, TPW=TPW,
             NR=8, RH=4, RHO=8, G=4, HP=2, HALF=7.5, SACC=int(os.environ.get("SACC", 1)), BIG=False, QPRE=bool(int(os.environ.get("QPRE", 0))))
for k in const: sig[k] = "constexpr"
names = list(sig)
attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in ('q_ptr', 's_qb', 's_qh', 'rot_ptr', 'qt_ptr', 'rs_ptr', 'pool_ptr', 'bt_ptr', 'seq_ptr', 'pout_ptr', 'plse_ptr', 'tab_ptr', 'block_bytes', 'plane_bytes')}
opts = dict(num_warps=W, num_stages=ST, **({"maxnreg": REG} if REG else {}))
k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs), target=GPUTarget("cuda", 90, 32), options=opts)
dump = os.environ.get("DUMP", "/work/scratch/ws")
open(dump + ".ptx", "w").write(k.asm["ptx"]); open(dump + ".cubin", "wb").write(k.asm["cubin"])
ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
r = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", dump + ".ptx", "-o", "/dev/null"] + (["--maxrregcount", str(REG)] if REG else []), capture_output=True, text=True)
print(f"TPW={TPW} W={W} stages={ST} maxnreg={REG} shared={k.metadata.shared}", re.sub(r"\s+", " ", r.stderr)[-200:])
