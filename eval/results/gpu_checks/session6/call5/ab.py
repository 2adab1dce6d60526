"""A/B timing of the decode kernel of the tree in the cwd: 4bit plain / all levers at B=16, B=1 (S=32k) and
k8v4 plain at B=16, default launch and num_stages=3; outputs saved to compare across trees."""
import sys, os, math, json
sys.path.insert(0, os.getcwd())
import torch
import torch.nn.functional as F
from eval.bench_kernels import _flush_buffer, time_ms
from eval.bench_decode_variants import _lever_call, LEVERS
from tq_hf.config import TurboQuantConfig
from tq_hf.layout import BlockLayout
tag, outdir = sys.argv[1], sys.argv[2]
os.makedirs(outdir, exist_ok=True)
flush = _flush_buffer()
hq, hk, d, s = 32, 8, 128, 32768
res = {}
for b in (16, 1):
    torch.manual_seed(1)
    q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.float16)
    k = torch.randn(b, hk, s, d, device="cuda", dtype=torch.float16); v = torch.randn_like(k)
    sdpa = time_ms(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), 30, True, flush)
    del k, v
    for preset, lever in (("4bit", "plain (no levers)"), ("4bit", "all (4bit defaults + centering)"), ("k8v4", "plain (no levers)")):
        if preset == "k8v4" and b == 1:
            continue
        overrides, prefix, ring = LEVERS[lever]
        opts = {"key_centering": False, "value_rotation": False, **overrides}
        cfg = TurboQuantConfig.from_preset(preset, block_size=16, exact_prefix_tokens=prefix, recent_window=ring, **opts)
        layout = BlockLayout(cfg, hk, d)
        for tname, tuning in (("default", {}), ("stages3", {"num_stages": 3})):
            torch.manual_seed(2)
            try:
                call, out = _lever_call(q, layout, b, s, prefix, ring, tuning=tuning)
                call(); torch.cuda.synchronize()
                ms = time_ms(call, 30, True, flush)
            except Exception as exc:
                print(f"{tag} B={b} {preset} {lever} {tname}: {type(exc).__name__}: {str(exc)[:150]}", flush=True)
                continue
            key = f"B{b}_{preset}_{lever.split()[0]}_{tname}"
            torch.save(out.cpu(), f"{outdir}/{tag}_{key}.pt")
            res[key] = (ms, sdpa)
            print(f"{tag} B={b} {preset} {lever[:5]} {tname}: {ms:.4f} ms = x{ms / sdpa:.3f} fp16 ({sdpa:.4f}), finite {bool(torch.isfinite(out).all())}", flush=True)
            del call, out
            torch.cuda.empty_cache()
json.dump(res, open(f"{outdir}/{tag}.json", "w"))
