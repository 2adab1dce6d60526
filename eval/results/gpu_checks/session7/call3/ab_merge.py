"""A/B in one process: split partials merged in the attention kernel (merge) vs the reduction kernel
(tuning merge=False), S=32k decode, 32/8/128, 4bit plain and 4bit defaults levers, k8v4; CUDA-graph replays, L2 flushed."""
import os, sys, math
sys.path.insert(0, os.getcwd())
import torch
from eval.bench_decode_variants import _lever_call, LEVERS
from eval.bench_kernels import time_ms, _flush_buffer
from tq_hf.config import TurboQuantConfig
from tq_hf.layout import BlockLayout

flush = _flush_buffer()
print(f"{'case':40s} {'B':>3s} {'merge ms':>9s} {'reduce ms':>9s} {'ratio':>6s} {'max|diff|':>9s}")
for preset, lever in (("4bit", "plain (no levers)"), ("4bit", "all (4bit defaults + centering)"), ("k8v4", "plain (no levers)")):
    overrides, prefix, ring = LEVERS[lever]
    cfg = TurboQuantConfig.from_preset(preset, block_size=16, exact_prefix_tokens=prefix, recent_window=ring,
                                       **{"key_centering": False, "value_rotation": False, **overrides})
    layout = BlockLayout(cfg, 8, 128)
    for b in (1, 4, 16):
        q = torch.randn(b, 32, 1, 128, device="cuda", dtype=torch.float16)
        torch.manual_seed(0)
        call_m, out_m = _lever_call(q, layout, b, 32768, prefix, ring, tuning={"merge": True})
        torch.manual_seed(0)
        call_r, out_r = _lever_call(q, layout, b, 32768, prefix, ring, tuning={"merge": False})
        tm, tr = [], []
        for _ in range(2):
            tm.append(time_ms(call_m, 100, True, flush)); tr.append(time_ms(call_r, 100, True, flush))
        call_m(); call_r(); torch.cuda.synchronize()
        diff = float((out_m.float() - out_r.float()).abs().max())
        m, r = min(tm), min(tr)
        print(f"{preset + ' ' + lever[:20]:40s} {b:3d} {m:9.4f} {r:9.4f} {m / r:6.3f} {diff:9.2e}", flush=True)
        del call_m, call_r
        torch.cuda.empty_cache()
