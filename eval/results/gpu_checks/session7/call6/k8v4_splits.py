"""k8v4 decode at S=32k: the launcher's split count (waves 8) vs the count of a waves-4 rule, alternated twice."""
import os, sys
sys.path.insert(0, os.getcwd())
import torch
from eval.bench_decode_variants import _lever_call
from eval.bench_kernels import time_ms, _flush_buffer
from tq_hf.config import TurboQuantConfig
from tq_hf.layout import BlockLayout
flush = _flush_buffer()
cfg = TurboQuantConfig.from_preset("k8v4", block_size=16, exact_prefix_tokens=0, recent_window=0, key_centering=False, value_rotation=False)
layout = BlockLayout(cfg, 8, 128)
for b, alt in ((1, 64), (4, 16), (16, 4)):
    q = torch.randn(b, 32, 1, 128, device="cuda", dtype=torch.float16)
    torch.manual_seed(0); c0, o0 = _lever_call(q, layout, b, 32768, 0, 0)
    torch.manual_seed(0); c1, o1 = _lever_call(q, layout, b, 32768, 0, 0, num_splits=alt)
    t0, t1 = [], []
    for _ in range(2):
        t0.append(time_ms(c0, 100, True, flush)); t1.append(time_ms(c1, 100, True, flush))
    c0(); c1(); torch.cuda.synchronize()
    print(f"k8v4 B={b:2d} S=32k: launcher {min(t0):.4f} ms, {alt} splits {min(t1):.4f} ms, max|diff| {float((o0.float()-o1.float()).abs().max()):.1e}", flush=True)
    del c0, c1; torch.cuda.empty_cache()
