"""Driver for ncu: decode attention at B, S (32/8/128) for the presets named in argv; 3 launches each."""
import math, sys, torch
import torch.nn.functional as F
sys.path.insert(0, ".")
from eval.bench_kernels import make_config, _fill_pool, _key_offset
from tq_hf.kernels import unified_attention
from tq_hf.layout import BlockLayout

b, s = int(sys.argv[1]), int(sys.argv[2])
hq, hk, d = 32, 8, 128
q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.float16)
for preset in sys.argv[3:]:
    if preset == "fp16":
        k = torch.randn(b, hk, s, d, device="cuda", dtype=torch.float16)
        v = torch.randn_like(k)
        for _ in range(3):
            F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        torch.cuda.synchronize(); del k, v
        continue
    cfg = make_config(preset)
    layout = BlockLayout(cfg, hk, d)
    mu = _key_offset(layout)
    pool, table = _fill_pool(layout, b, s, key_offset=mu)
    seq = torch.full((b,), s, device="cuda", dtype=torch.int32)
    out = torch.empty_like(q)
    for _ in range(3):
        unified_attention(q, pool, layout, table, seq, 1 / math.sqrt(d), max_seq_len=s, out=out, key_offset=mu)
    torch.cuda.synchronize()
    print(preset, "ok", flush=True)
    del pool, table
