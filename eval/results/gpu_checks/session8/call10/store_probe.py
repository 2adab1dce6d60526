"""Store of one decode step (B tokens, 8 KV heads, D=128): GPU time per variant (CUDA graph, L2 flushed), and one
launch for Nsight Compute to profile (--ncu)."""
import os, sys, math
sys.path.insert(0, os.getcwd())
import torch
from eval.bench_kernels import _flush_buffer, time_ms
from tq_hf.config import TurboQuantConfig
from tq_hf.layout import BlockLayout
from tq_hf.kernels import store_kv

flush = _flush_buffer()
NCU = "--ncu" in sys.argv  # only the 4bit plain B=16 store, for Nsight Compute
for opts in ({},) if NCU else ({}, {"key_centering": True, "value_rotation": True}):
    for preset in ("4bit",) if NCU else ("4bit", "k8v4"):
        cfg = TurboQuantConfig.from_preset(preset, block_size=16, **{"key_centering": False, "value_rotation": False, **opts})
        layout = BlockLayout(cfg, 8, 128)
        pool = layout.allocate(32768 * 16 // 16 + 64, "cuda")
        for b in (16,) if NCU else (1, 16, 32):
            k = torch.randn(b, 8, 128, device="cuda", dtype=torch.float16)
            v = torch.randn_like(k)
            slots = torch.arange(b, device="cuda") * 2048 + 777
            mu = torch.randn(b, 8, 128, device="cuda") if cfg.key_centering else None
            for tuning in ({}, {"num_warps": 4}, {"num_warps": 8}, {"num_warps": 16}, {}):
                if "--ncu" in sys.argv and tuning:
                    continue
                try:
                    ms = time_ms(lambda: store_kv(pool, layout, k, v, slots, key_offset=mu, tuning=tuning), 40, True, flush)
                    print(f"{preset} {'levers' if opts else 'plain'} B={b} {tuning or 'defaults'}: {ms * 1e3:.1f} us", flush=True)
                except Exception as e:
                    print(f"{preset} B={b} {tuning}: {type(e).__name__} {e}"[:200], flush=True)
