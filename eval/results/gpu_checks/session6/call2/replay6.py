"""Replay the session-5 call-6 failing GpuPlainMachine example step by step (device from argv: cuda, or
interp = Triton interpreter with GPU launch choices)."""
import os, sys
mode = sys.argv[1] if len(sys.argv) > 1 else "cuda"
if mode == "interp":
    os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
import torch
import tq_hf.ops as ops
from tq_hf.kernels import attention as A
if mode == "interp":
    ops.use_kernels = lambda t: True
    A._tuned_for_gpu = lambda d: True
import test_reliability as R

class Data:
    def __init__(self, vals): self.vals = list(vals)
    def draw(self, strategy, label=None): return self.vals.pop(0)

class M(R.PlainMachine):
    device = "cuda" if mode == "cuda" else "cpu"
    attention_tol = dict(atol=2e-2, rtol=2e-2)
    exact_storage = False

torch.set_grad_enabled(False)
s = M()
def inv():
    s.pool_accounting_is_exact(); s.same_history_and_attention()
inv()
steps = [("forward", [11, 1, [10]])] + [("repeat", 1)] * 4 + [("crop", [False, 1])] * 3 + [("repeat", 2), ("forward", [15])]
for name, arg in steps:
    if name == "forward": s.forward(Data(arg))
    elif name == "crop": s.crop(Data(arg))
    else: s.batch_repeat_interleave(arg)
    print("ok", name, arg, flush=True)
    inv()
print("replay passed")
