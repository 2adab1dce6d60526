"""A/B of tuning variants on presets as TurboQuantCache runs them (+defaults: every lever, exact prefix and ring),
rounds alternated. argv: points [(preset, b, s)], variants {preset: {name: tuning}}, rounds, out json."""
import ast, json, math, sys, torch
import torch.nn.functional as F
sys.path.insert(0, ".")
from eval.bench_kernels import _fill_pool, _flush_buffer, _key_offset, exact_buffers, make_config, time_ms
from tq_hf.kernels import unified_attention
from tq_hf.layout import BlockLayout

POINTS, VARIANTS, ROUNDS = ast.literal_eval(sys.argv[1]), ast.literal_eval(sys.argv[2]), int(sys.argv[3])
flush = _flush_buffer(); res = []
for preset, b, s in POINTS:
    q = torch.randn(b, 32, 1, 128, device="cuda", dtype=torch.float16)
    k = torch.randn(b, 8, s, 128, device="cuda", dtype=torch.float16); v = torch.randn_like(k)
    sdpa = time_ms(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), 30, True, flush); del k, v
    cfg = make_config(preset + "+defaults"); layout = BlockLayout(cfg, 8, 128)
    torch.manual_seed(0)
    mu = _key_offset(layout); pool, table = _fill_pool(layout, b, s, key_offset=mu)
    extra = exact_buffers(layout, b, cfg.exact_prefix_tokens, cfg.recent_window)
    seq = torch.full((b,), s, device="cuda", dtype=torch.int32)
    outs, times = {}, {n: [] for n in VARIANTS[preset]}
    for r in range(ROUNDS):
        for n, tun in VARIANTS[preset].items():
            out = outs.setdefault(n, torch.full_like(q, float("nan")))
            call = lambda: unified_attention(q, pool, layout, table, seq, 1 / math.sqrt(128), max_seq_len=s, out=out,
                                             key_offset=mu, tuning=tun, **extra)
            times[n].append(time_ms(call, 30, True, flush))
    base = next(iter(outs.values())).float()
    for n, t in times.items():
        diff = (outs[n].float() - base).abs().max().item()
        print(f"{preset:5s} B={b:2d} S={s} {n:12s} " + " / ".join(f"{x:.4f}" for x in t)
              + f" ms  x{min(t)/sdpa:.3f} fp16 ({sdpa:.4f})  maxdiff {diff:.2e}", flush=True)
        res.append(dict(preset=preset, B=b, S=s, variant=n, tuning=VARIANTS[preset][n], ms=t, sdpa_ms=sdpa, maxdiff=diff))
    del pool, table, extra; torch.cuda.empty_cache()
json.dump(res, open(sys.argv[4], "w"), indent=1)
