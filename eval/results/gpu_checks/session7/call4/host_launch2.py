"""Host cost of one decode step's launches on the GPU (no sync between calls): unified_attention (B=1, S=32k,
plain and all levers), store_kv of one token, and a whole layer through TurboQuantCache.update + the
attention function; host us per call vs GPU us per call."""
import os, sys, time, math
sys.path.insert(0, os.getcwd())
import torch
from eval.bench_decode_variants import _lever_call, LEVERS
from tq_hf.config import TurboQuantConfig
from tq_hf.layout import BlockLayout
from tq_hf.kernels import store_kv
from tq_hf import TurboQuantCache
from tq_hf.attention import turboquant_attention_forward, turboquant_mask
from transformers import LlamaConfig
from transformers.masking_utils import causal_mask_function

def host_and_gpu(fn, n=200):
    for _ in range(5): fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n): fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) / n * 1e6, (t2 - t0) / n * 1e6

q = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.float16)
for lever in ("plain (no levers)", "all (4bit defaults + centering)"):
    overrides, prefix, ring = LEVERS[lever]
    cfg = TurboQuantConfig.from_preset("4bit", block_size=16, exact_prefix_tokens=prefix, recent_window=ring,
                                       **{"key_centering": False, "value_rotation": False, **overrides})
    layout = BlockLayout(cfg, 8, 128)
    call, out = _lever_call(q, layout, 1, 32768, prefix, ring)
    h, w = host_and_gpu(call)
    print(f"unified_attention B=1 S=32k {lever[:5]}: host {h:.1f} us/call, wall {w:.1f} us/call (host-bound if close)", flush=True)
    pool = layout.allocate(4096, "cuda")
    k = torch.randn(1, 8, 128, device="cuda", dtype=torch.float16)
    slots = torch.tensor([5], device="cuda")
    h, w = host_and_gpu(lambda: store_kv(pool, layout, k, k, slots))
    print(f"store_kv 1 token {lever[:5]}: host {h:.1f} us/call, wall {w:.1f}", flush=True)
lc = LlamaConfig(num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=8, head_dim=128, hidden_size=4096)
lc._attn_implementation = "turboquant"
mod = type("Attn", (), {"is_causal": True, "training": False, "num_key_value_groups": 4})()
for name, kw in (("4bit defaults", {}), ("4bit plain", dict(exact_prefix_tokens=0, recent_window=0, value_rotation=False, key_centering=False))):
    cache = TurboQuantCache(lc, tq_config=TurboQuantConfig.from_preset("4bit", full_precision_layers=(), **kw))
    kv = torch.randn(1, 8, 32768, 128, device="cuda", dtype=torch.float16)
    for i in range(8):
        cache.update(kv, kv, i)
    del kv
    kd = torch.randn(1, 8, 1, 128, device="cuda", dtype=torch.float16)
    def step():
        s = cache.get_seq_length(0)
        mask = turboquant_mask(batch_size=1, q_length=1, kv_length=s + 1, q_offset=s, kv_offset=0,
                               mask_function=causal_mask_function, attention_mask=None, device="cuda")
        for i in range(8):
            key, value = cache.update(kd, kd, i)
            turboquant_attention_forward(mod, q, key, value, mask, scaling=0.088)
    for n in (3, 50):
        h, w = host_and_gpu(step, n=n)
        print(f"decode step x{n}, 8 layers, {name}: host {h / 8:.1f} us/layer, wall {w / 8:.1f} us/layer", flush=True)
    del cache
    torch.cuda.empty_cache()
