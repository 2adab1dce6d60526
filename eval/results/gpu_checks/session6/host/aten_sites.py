"""Every aten op of one decode layer (kernel launches stubbed) with the tq_hf line that issued it."""
import sys, traceback, collections, torch
from torch.utils._python_dispatch import TorchDispatchMode
import os
exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "host_overhead.py")).read().split("for preset_kw in")[0].replace(
    "B, S_LEN, HK, HQ, D, LAYERS = 8, 8192, 8, 32, 128, 8", "B, S_LEN, HK, HQ, D, LAYERS = 1, 4096, 8, 32, 128, 1"))
class Log(TorchDispatchMode):
    def __init__(self): super().__init__(); self.sites = collections.Counter()
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        fr = [f for f in traceback.extract_stack() if "tq_hf" in f.filename or "masking_utils" in f.filename]
        site = f"{fr[-1].filename.split('/')[-1]}:{fr[-1].lineno} {fr[-1].line[:70]}" if fr else "?"
        self.sites[(site, str(func))] += 1
        return func(*args, **(kwargs or {}))
import os
kw = eval(os.environ.get("KW", "dict()"))
cache = TurboQuantCache(cfg, tq_config=TurboQuantConfig.from_preset("4bit", full_precision_layers=(), **kw))
k = torch.randn(B, HK, S_LEN, D, dtype=torch.float16)
cache.update(k, k, 0)
kd = torch.randn(B, HK, 1, D, dtype=torch.float16); q = torch.randn(B, HQ, 1, D, dtype=torch.float16)
def step():
    s = cache.get_seq_length(0)
    mask = turboquant_mask(batch_size=B, q_length=1, kv_length=s + 1, q_offset=s, kv_offset=0, mask_function=causal_mask_function,
                           attention_mask=None, device="cpu")
    key, value = cache.update(kd, kd, 0)
    turboquant_attention_forward(mod, q, key, value, mask, scaling=0.088)
for _ in range(3): step()
with Log() as log:
    step()
tot = sum(log.sites.values())
print("aten ops in one layer's step:", tot)
for (site, op), c in sorted(log.sites.items()):
    print(f"{c:3d} {op:32s} {site}")
