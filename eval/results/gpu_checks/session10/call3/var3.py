"""session 10 call 3: 3-bit decode variants at S=32k 32/8/128 (env PRESET, B, FORMATS): the launcher's defaults,
the planes' gather instead of the lookup (key_lut False), register caps."""
import os, sys, json
sys.path.insert(0, os.getcwd())
import torch
import torch.nn.functional as F
from eval.bench_decode_variants import _lever_call, _time_against
from eval.bench_kernels import _flush_buffer, time_ms
from tq_hf.config import TurboQuantConfig
from tq_hf.layout import BlockLayout

b, s, hq, hk, d = int(os.environ.get("B", "16")), 32768, 32, 8, 128
preset = os.environ.get("PRESET", "3bit")
flush = _flush_buffer()
q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.float16)
k = torch.randn(b, hk, s, d, device="cuda", dtype=torch.float16)
v = torch.randn_like(k)
sdpa = time_ms(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), 40, True, flush)
del k, v
print(f"fp16 SDPA {sdpa:.4f} ms", flush=True)
rows = []
formats = {"plain": ({"value_rotation": False, "key_centering": False}, 0, 0), "defaults": ({}, 4, 128)}
for fmt in os.environ.get("FORMATS", "plain").split(","):
    over, prefix, ring = formats[fmt]
    cfg = TurboQuantConfig.from_preset(preset, block_size=16, exact_prefix_tokens=prefix, recent_window=ring, **over)
    layout = BlockLayout(cfg, hk, d)
    baseline = None
    for name, tuning in [("defaults", {}), ("gather", {"key_lut": False}), ("maxnreg 128", {"maxnreg": 128}),
                         ("gather, maxnreg 128", {"key_lut": False, "maxnreg": 128}), ("defaults (again)", {}),
                         ("gather (again)", {"key_lut": False})]:
        torch.manual_seed(0)
        call, out = _lever_call(q, layout, b, s, prefix, ring, tuning=tuning)
        ms, diff, baseline = _time_against(call, out, baseline, 40, flush)
        rows.append(dict(format=fmt, variant=name, ms=ms, ratio=ms / sdpa, max_abs_diff=diff, finite=bool(torch.isfinite(out).all())))
        print(f"{preset} B={b} S=32k {fmt}: {name}: {ms:.4f} ms = x{ms / sdpa:.2f} fp16, max|diff| {diff:.2e}, finite {rows[-1]['finite']}", flush=True)
        torch.cuda.empty_cache()
json.dump(dict(sdpa_ms=sdpa, rows=rows), open(os.environ.get("OUTJSON", "/tmp/var3.json"), "w"), indent=1)
