"""Why is generate() B=1 S=32k k8v4-all ~2x 4bit-all (session 8 call 1)? One decode layer's host and wall time
per preset with the defaults (the cache's levers), and the GPU time of that layer's kernels (CUDA graph)."""
import os, sys, time
sys.path.insert(0, os.getcwd())
import torch
from tq_hf.config import TurboQuantConfig
from tq_hf import TurboQuantCache
from tq_hf.attention import turboquant_attention_forward, turboquant_mask
from transformers import LlamaConfig
from transformers.masking_utils import causal_mask_function

def host_and_gpu(fn, n=50):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n): fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) / n * 1e6, (t2 - t0) / n * 1e6

lc = LlamaConfig(num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=8, head_dim=128, hidden_size=4096)
lc._attn_implementation = "turboquant"
mod = type("Attn", (), {"is_causal": True, "training": False, "num_key_value_groups": 4})()
q = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.float16)
for rnd in range(2):
    for preset in ("4bit", "k8v4"):
        cache = TurboQuantCache(lc, tq_config=TurboQuantConfig.from_preset(preset, full_precision_layers=()))
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
        h, w = host_and_gpu(step)
        from torch.profiler import profile, ProfilerActivity
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step(); torch.cuda.synchronize()
        kern = sorted([e for e in prof.key_averages() if e.device_time_total > 0], key=lambda e: -e.device_time_total)[:8]
        print(f"round {rnd} {preset} defaults: host {h / 8:.1f} us/layer, wall {w / 8:.1f} us/layer", flush=True)
        print("   GPU:", "; ".join(f"{e.key[:50]} x{e.count} {e.device_time_total / e.count:.1f}us" for e in kern), flush=True)
        del cache
        torch.cuda.empty_cache()
