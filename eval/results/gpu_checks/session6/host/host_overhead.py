"""Host-side cost of one decode step per layer (kernel launches stubbed): Python time and aten ops."""
import time, torch, math
import tq_hf.kernels.attention as A
import tq_hf.kernels.store as S
from tq_hf import ops, TurboQuantCache, TurboQuantConfig
from tq_hf.attention import turboquant_attention_forward, turboquant_mask
from transformers import LlamaConfig
from transformers.masking_utils import causal_mask_function

class Stub:
    def __getitem__(self, grid):
        return lambda *a, **k: None
A._attn_kernel = Stub(); S._store_kernel = Stub()
A._tuned_for_gpu = lambda d: True
A.reduce_splits = lambda *a, **k: None
ops.use_kernels = lambda t: True
B, S_LEN, HK, HQ, D, LAYERS = 8, 8192, 8, 32, 128, 8
cfg = LlamaConfig(num_hidden_layers=LAYERS, num_attention_heads=HQ, num_key_value_heads=HK, head_dim=D, hidden_size=HQ * D)
cfg._attn_implementation = "turboquant"
class M(torch.nn.Module):
    is_causal = True
mod = M()
for preset_kw in [dict(), dict(exact_prefix_tokens=0, recent_window=0, value_rotation=False)]:
    cache = TurboQuantCache(cfg, tq_config=TurboQuantConfig.from_preset("4bit", full_precision_layers=(), **preset_kw))
    k = torch.randn(B, HK, S_LEN, D, dtype=torch.float16)
    for i in range(LAYERS):
        cache.update(k, k, i)
    del k
    kd = torch.randn(B, HK, 1, D, dtype=torch.float16); q = torch.randn(B, HQ, 1, D, dtype=torch.float16)
    def step():
        s = cache.get_seq_length(0)
        mask = turboquant_mask(batch_size=B, q_length=1, kv_length=s + 1, q_offset=s, kv_offset=0, mask_function=causal_mask_function,
                               attention_mask=None, device="cpu")
        for i in range(LAYERS):
            key, value = cache.update(kd, kd, i)
            turboquant_attention_forward(mod, q, key, value, mask, scaling=0.088)
    for _ in range(3): step()
    n = 50
    t0 = time.perf_counter()
    for _ in range(n): step()
    dt = (time.perf_counter() - t0) / n
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    ops_count = sum(e.count for e in prof.key_averages() if e.key.startswith("aten::") and e.cpu_time_total >= 0)
    top = sorted(prof.key_averages(), key=lambda e: -e.count)[:12]
    print(preset_kw or "defaults", f"host ms per step ({LAYERS} layers): {dt * 1e3:.2f} = {dt * 1e6 / LAYERS:.0f} us/layer; aten ops per step {ops_count}")
    print("   ", ", ".join(f"{e.key} {e.count}" for e in top))
