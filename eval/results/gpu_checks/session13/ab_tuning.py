"""A/B of unified_attention tuning variants on one pool per point, alternated; outputs checked vs defaults."""
import json, math, sys, torch
import torch.nn.functional as F
sys.path.insert(0, ".")
from eval.bench_kernels import make_config, _fill_pool, _flush_buffer, time_ms, _key_offset
from tq_hf.kernels import unified_attention
from tq_hf.layout import BlockLayout

POINTS = eval(sys.argv[1])   # [(b, s, hq, hk, d, preset), ...]
VARIANTS = eval(sys.argv[2])  # {name: tuning}
ROUNDS = int(sys.argv[3]) if len(sys.argv) > 3 else 2
flush = _flush_buffer(); res = []
for b, s, hq, hk, d, preset in POINTS:
    q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.float16)
    k = torch.randn(b, hk, s, d, device="cuda", dtype=torch.float16); v = torch.randn_like(k)
    sdpa = 1.0 if ROUNDS == 0 else time_ms(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), 30, True, flush); del k, v
    layout = BlockLayout(make_config(preset), hk, d)
    mu = _key_offset(layout)
    pool, table = _fill_pool(layout, b, s, key_offset=mu)
    seq = torch.full((b,), s, device="cuda", dtype=torch.int32)
    outs = {n: torch.full_like(q, float("nan")) for n in VARIANTS}
    times = {n: [] for n in VARIANTS}
    if ROUNDS == 0:  # warm the compile cache only
        for n, tun in VARIANTS.items():
            try:
                unified_attention(q, pool, layout, table, seq, 1 / math.sqrt(d), max_seq_len=s, out=outs[n], tuning=tun, key_offset=mu)
            except Exception as e:  # noqa
                print(f"warm {b} {s} {preset} {n}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        torch.cuda.synchronize(); continue
    for r in range(ROUNDS):
        for n, tun in VARIANTS.items():
            try:
                ms = time_ms(lambda: unified_attention(q, pool, layout, table, seq, 1 / math.sqrt(d), max_seq_len=s,
                                                       out=outs[n], tuning=tun, key_offset=mu), 30, True, flush)
            except Exception as e:  # noqa
                print(f"{b} {s} {preset} {n}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True); ms = float("nan")
            times[n].append(ms)
    base = outs[next(iter(VARIANTS))].float()
    for n in VARIANTS:
        diff = (outs[n].float() - base).abs().max().item()
        t = times[n]
        print(f"B={b:2d} S={s} {hq}/{hk}/{d} {preset:5s} {n:14s} " + " / ".join(f"{x:.4f}" for x in t)
              + f" ms  x{min(t)/sdpa:.3f} fp16 ({sdpa:.4f})  maxdiff {diff:.2e}", flush=True)
        res.append(dict(B=b, S=s, Hq=hq, Hk=hk, D=d, preset=preset, variant=n, tuning=VARIANTS[n], ms=t, sdpa_ms=sdpa, maxdiff=diff))
    del pool, table
json.dump(res, open(sys.argv[4] if len(sys.argv) > 4 else "/tmp/ab.json", "w"), indent=1)
