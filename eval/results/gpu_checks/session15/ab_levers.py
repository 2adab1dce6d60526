"""A/B of tuning variants under the 4bit format levers (centering, value rotation, exact prefix, ring), alternated."""
import json, math, sys, torch
import torch.nn.functional as F
sys.path.insert(0, ".")
from eval.bench_kernels import _flush_buffer, time_ms
from eval.bench_decode_variants import _lever_call
from tq_hf.config import TurboQuantConfig
from tq_hf.layout import BlockLayout

POINTS = eval(sys.argv[1])   # [(b, s), ...] at 32/8/128
LEVERS = {"plain": ({}, 0, 0), "opts": ({"key_centering": True, "value_rotation": True}, 0, 0),
          "all": ({"key_centering": True, "value_rotation": True}, 4, 128)}
VARIANTS = eval(sys.argv[2])
ROUNDS = int(sys.argv[3])
flush = _flush_buffer(); res = []
for b, s in POINTS:
    q = torch.randn(b, 32, 1, 128, device="cuda", dtype=torch.float16)
    k = torch.randn(b, 8, s, 128, device="cuda", dtype=torch.float16); v = torch.randn_like(k)
    sdpa = time_ms(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), 30, True, flush); del k, v
    for lever, (over, prefix, ring) in LEVERS.items():
        cfg = TurboQuantConfig.from_preset("4bit", block_size=16, exact_prefix_tokens=prefix, recent_window=ring,
                                           **{"key_centering": False, "value_rotation": False, **over})
        layout = BlockLayout(cfg, 8, 128)
        torch.manual_seed(0)
        calls = {}
        for n, tun in VARIANTS.items():
            torch.manual_seed(0)
            calls[n] = _lever_call(q, layout, b, s, prefix, ring, tuning=tun)
        times = {n: [] for n in VARIANTS}
        for r in range(ROUNDS):
            for n, (call, out) in calls.items():
                times[n].append(time_ms(call, 30, True, flush))
        base = calls[next(iter(VARIANTS))][1].float()
        for n, (call, out) in calls.items():
            diff = (out.float() - base).abs().max().item()
            t = times[n]
            print(f"B={b:2d} S={s} {lever:5s} {n:10s} " + " / ".join(f"{x:.4f}" for x in t)
                  + f" ms  x{min(t)/sdpa:.3f} fp16 ({sdpa:.4f})  maxdiff {diff:.2e}", flush=True)
            res.append(dict(B=b, S=s, lever=lever, variant=n, tuning=VARIANTS[n], ms=t, sdpa_ms=sdpa, maxdiff=diff))
        del calls; torch.cuda.empty_cache()
json.dump(res, open(sys.argv[4], "w"), indent=1)
