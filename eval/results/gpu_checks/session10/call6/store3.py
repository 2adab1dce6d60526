"""session 10 call 6: the k3v4 store (code planes vs the previous bit stream): a decode step's 16 tokens and an
8k-token prefill, 32/8/128, CUDA-graph replays with the L2 flushed (eval.bench_kernels.time_ms)."""
import os, sys
sys.path.insert(0, os.getcwd())
import torch
from eval.bench_kernels import _flush_buffer, time_ms
from tq_hf.config import TurboQuantConfig
from tq_hf.kernels import store_kv
from tq_hf.layout import BlockLayout

flush = _flush_buffer()
hk, d = 8, 128
for preset in ("k3v4", "4bit"):
    layout = BlockLayout(TurboQuantConfig.from_preset(preset, block_size=16), hk, d)
    for n in (16, 8192):
        pool = layout.allocate(n // 16 + 1, "cuda")
        k = torch.randn(n, hk, d, device="cuda", dtype=torch.float16)
        v = torch.randn_like(k)
        slots = torch.arange(n, device="cuda")
        ms = time_ms(lambda: store_kv(pool, layout, k, v, slots), 40, True, flush)
        print(f"{os.environ.get('TAG', '?')} {preset} store of {n} tokens: {ms * 1000:.1f} us", flush=True)
