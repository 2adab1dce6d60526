"""Small-batch decode variants (metadata pairs, pipeline stages, tiles, splits) at S=32k, plain and all levers."""
import sys, os, json
sys.path.insert(0, os.getcwd())
import torch
import torch.nn.functional as F
from eval.bench_kernels import _flush_buffer, time_ms
from eval.bench_decode_variants import _lever_call, LEVERS
from tq_hf.config import TurboQuantConfig
from tq_hf.layout import BlockLayout
outdir = sys.argv[1]; os.makedirs(outdir, exist_ok=True)
VARIANTS = {
    "defaults": {},
    "no pairs, 2 stages (before)": {"meta_pairs": False, "num_stages": 2},
    "no pairs, 3 stages": {"meta_pairs": False, "num_stages": 3},
    "no pairs, 4 stages": {"meta_pairs": False, "num_stages": 4},
    "pairs, 2 stages": {"meta_pairs": True, "num_stages": 2},
    "pairs, 4 stages": {"meta_pairs": True, "num_stages": 4},
    "pairs, 3 stages, BLOCK_N 128": {"meta_pairs": True, "num_stages": 3, "block_n": 128},
    "pairs, 4 stages, BLOCK_N 128": {"meta_pairs": True, "num_stages": 4, "block_n": 128},
    "pairs, 3 stages, 16 splits": {"meta_pairs": True, "num_stages": 3, "num_splits": 16},
    "pairs, 3 stages, 64 splits": {"meta_pairs": True, "num_stages": 3, "num_splits": 64},
}
flush = _flush_buffer()
hq, hk, d, s = 32, 8, 128, 32768
rows = []
for b in [int(x) for x in sys.argv[2].split(",")]:
    torch.manual_seed(1)
    q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.float16)
    k = torch.randn(b, hk, s, d, device="cuda", dtype=torch.float16); v = torch.randn_like(k)
    sdpa = time_ms(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), 30, True, flush)
    del k, v
    for lever in ("plain (no levers)", "all (4bit defaults + centering)"):
        overrides, prefix, ring = LEVERS[lever]
        opts = {"key_centering": False, "value_rotation": False, **overrides}
        cfg = TurboQuantConfig.from_preset("4bit", block_size=16, exact_prefix_tokens=prefix, recent_window=ring, **opts)
        layout = BlockLayout(cfg, hk, d)
        base = None
        for name, var in VARIANTS.items():
            tuning = {k: v for k, v in var.items() if k != "num_splits"}
            torch.manual_seed(2)
            try:
                call, out = _lever_call(q, layout, b, s, prefix, ring, tuning=tuning, num_splits=var.get("num_splits"))
                call(); torch.cuda.synchronize()
                ms = time_ms(call, 30, True, flush)
            except Exception as exc:
                print(f"B={b} {lever[:5]} {name}: {type(exc).__name__}: {str(exc)[:150]}", flush=True)
                continue
            base = out.clone() if base is None else base
            diff = float((out.float() - base.float()).abs().max())
            rows.append(dict(B=b, lever=lever, variant=name, ms=ms, sdpa=sdpa, diff=diff))
            print(f"B={b} {lever[:5]} {name}: {ms:.4f} ms = x{ms / sdpa:.3f} fp16 ({sdpa:.4f}), max|diff| {diff:.1e}, finite {bool(torch.isfinite(out).all())}", flush=True)
            del call, out
            torch.cuda.empty_cache()
json.dump(rows, open(f"{outdir}/ab2.json", "w"), indent=1)
