"""Decode time of the tree in cwd at S=32k 4bit plain, B=1/4/16 (CUDA graph, L2 flushed, min of 3 medians)."""
import os, sys, math
sys.path.insert(0, os.getcwd())
import torch
from eval.bench_decode_variants import _lever_call, LEVERS
from eval.bench_kernels import time_ms, _flush_buffer
from tq_hf.config import TurboQuantConfig
from tq_hf.layout import BlockLayout
flush = _flush_buffer()
tag = sys.argv[1]
overrides, prefix, ring = LEVERS["plain (no levers)"]
cfg = TurboQuantConfig.from_preset("4bit", block_size=16, exact_prefix_tokens=0, recent_window=0, key_centering=False, value_rotation=False, **overrides)
layout = BlockLayout(cfg, 8, 128)
for b in (1, 4, 16):
    q = torch.randn(b, 32, 1, 128, device="cuda", dtype=torch.float16)
    call, out = _lever_call(q, layout, b, 32768, 0, 0)
    t = min(time_ms(call, 100, True, flush) for _ in range(3))
    print(f"{tag:8s} B={b:2d} 4bit plain S=32k: {t:.4f} ms", flush=True)
    del call; torch.cuda.empty_cache()
