"""Session-5 call-6 failure, localised: the GPU machine and a CPU machine (reference path) replay the same
steps in lockstep (same generator); at the failing forward, compare per layer the dequantized history
(store) and the kernel's attention against reference.paged_attention over the GPU pool's own bytes."""
import os, sys
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
import torch
import test_reliability as R
from tq_hf import ops, reference

class Data:
    def __init__(self, vals): self.vals = list(vals)
    def draw(self, strategy, label=None): return self.vals.pop(0)

seen = []
orig = R.turboquant_attention_forward
def spy(module, q, k, v, mask, **kw):
    seen.append(q.detach().clone())
    return orig(module, q, k, v, mask, **kw)
R.turboquant_attention_forward = spy

if os.environ.get("INTERP"):
    from tq_hf.kernels import attention as A
    ops.use_kernels = lambda t: True; A._tuned_for_gpu = lambda d: True
class G(R.PlainMachine):
    device = "cpu" if os.environ.get("INTERP") else "cuda"; attention_tol = dict(atol=2e-2, rtol=2e-2); exact_storage = False
class C(R.PlainMachine):
    device = "cpu"; attention_tol = dict(atol=2e-2, rtol=2e-2); exact_storage = False

torch.set_grad_enabled(False)
steps = [("forward", [11, 1, [10]])] + [("repeat", 1)] * 4 + [("crop", [False, 1])] * 3 + [("repeat", 2), ("forward", [15])]
ms = {"gpu": G(), "cpu": C()}
for tag, s in list(ms.items()):
    s.pool_accounting_is_exact(); s.same_history_and_attention()
    for name, arg in steps:
        seen.clear()
        try:
            if name == "forward": s.forward(Data(arg))
            elif name == "crop": s.crop(Data(arg))
            else: s.batch_repeat_interleave(arg)
            s.pool_accounting_is_exact(); s.same_history_and_attention()
        except AssertionError as e:
            print(tag, "FAILED at", name, arg, str(e)[:200])
    print(tag, "done; queries seen in last forward:", len(seen))
    ms[tag + "_q"] = list(seen)
g, c = ms["gpu"], ms["cpu"]
for i in (1, 0):
    lg, lc = g.cache.layers[i], c.cache.layers[i]
    kg, vg = lg.dequantized(); kc, vc = lc.dequantized()
    print(f"layer {i}: kv_start gpu {lg.kv_start.tolist() if lg.kv_start is not None else None} cpu {lc.kv_start.tolist() if lc.kv_start is not None else None}",
          "seq", lg.seq_lens.tolist(), "len", lg.length)
    print(f"  history keys max|diff| {float((kg.cpu() - kc).abs().max()):.3e}, values {float((vg.cpu() - vc).abs().max()):.3e}")
    kd = (kg.cpu() - kc).abs().amax(dim=(1, 3)); print("  key diff by (row, pos) > 1e-3:", (kd > 1e-3).nonzero().tolist()[:20])
    vd = (vg.cpu() - vc).abs().amax(dim=(1, 3)); print("  value diff by (row, pos) > 1e-3:", (vd > 1e-3).nonzero().tolist()[:20])
    q = ms["gpu_q"][i]
    pool = lg.pool
    out = ops.paged_attention(q, pool, lg.layout, lg.block_table, lg.seq_lens, R.SCALE, kv_start=lg.kv_start,
                              max_seq_len=lg.length, key_offset=lg.key_offset)
    want = reference.paged_attention(q.cpu().float(), pool.cpu(), lg.layout, lg.block_table.cpu(), lg.seq_lens.cpu(), R.SCALE,
                                     kv_start=None if lg.kv_start is None else lg.kv_start.cpu())
    d = (out.cpu().float() - want).abs()
    print(f"  kernel vs reference on the GPU pool's bytes: max|diff| {float(d.max()):.3e}; (b, h, i) over 2e-2:",
          (d.amax(-1) > 2e-2).nonzero().tolist()[:20])
    for tuning in ({"block_n": 64}, {"block_n": 32}, {"num_warps": 8}, {"num_stages": 1}, {"block_m": 16}):
        from tq_hf.kernels import unified_attention
        o2 = unified_attention(q, pool, lg.layout, lg.block_table, lg.seq_lens, R.SCALE, kv_start=lg.kv_start,
                               max_seq_len=lg.length, tuning=tuning)
        print(f"  tuning {tuning}: max|diff| {float((o2.cpu().float() - want).abs().max()):.3e}")
