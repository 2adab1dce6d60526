"""session 9 call 8 (then PRESET/B from the environment): decode at B=16 S=32k with its preset's format levers (value rotation, exact prefix + ring)
under register caps: the launcher leaves k8v4 uncapped (184-253 registers with the levers, offline SASS)."""
import math, sys, os, json
sys.path.insert(0, os.getcwd())
import torch
import torch.nn.functional as F
from eval.bench_decode_variants import _lever_call, _time_against
from eval.bench_kernels import _flush_buffer, time_ms
from tq_hf.config import TurboQuantConfig
from tq_hf.layout import BlockLayout

b, s, hq, hk, d = int(os.environ.get("B", "16")), 32768, 32, 8, 128
preset = os.environ.get("PRESET", "k8v4")
flush = _flush_buffer()
q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.float16)
k = torch.randn(b, hk, s, d, device="cuda", dtype=torch.float16)
v = torch.randn_like(k)
sdpa = time_ms(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), 40, True, flush)
del k, v
print(f"fp16 SDPA {sdpa:.4f} ms", flush=True)
rows = []
FORMATS = os.environ.get("FORMATS", "plain,rotation,defaults").split(",")
for fmt, (over, prefix, ring) in {"plain": ({"value_rotation": False, "key_centering": False}, 0, 0), "value rotation (+ the preset's centering)": ({}, 0, 0),
                                  "preset defaults (rotation, prefix 4, ring 128)": ({}, 4, 128)}.items():
    short = {"plain": "plain", "value": "rotation", "preset": "defaults"}[fmt.split()[0]]
    if short not in FORMATS:
        continue
    cfg = TurboQuantConfig.from_preset(preset, block_size=16, exact_prefix_tokens=prefix, recent_window=ring, **over)
    layout = BlockLayout(cfg, hk, d)
    baseline = None
    for name, tuning in [("defaults", {}), ("maxnreg 128", {"maxnreg": 128}), ("maxnreg 168", {"maxnreg": 168}), ("maxnreg 192", {"maxnreg": 192}),
                         ("defaults (again)", {}), ("maxnreg 128 (again)", {"maxnreg": 128})]:
        torch.manual_seed(0)
        call, out = _lever_call(q, layout, b, s, prefix, ring, tuning=tuning)
        ms, diff, baseline = _time_against(call, out, baseline, 40, flush)
        rows.append(dict(format=fmt, variant=name, ms=ms, ratio=ms / sdpa, max_abs_diff=diff, finite=bool(torch.isfinite(out).all())))
        print(f"{preset} B={b} S=32k {fmt}: {name}: {ms:.4f} ms = x{ms / sdpa:.2f} fp16, max|diff| {diff:.2e}, finite {rows[-1]['finite']}", flush=True)
        torch.cuda.empty_cache()
json.dump(dict(sdpa_ms=sdpa, rows=rows), open(os.environ.get("OUTJSON", "/tmp/k8v4_regs.json"), "w"), indent=1)
