"""H200: the warp-split transposed prototype vs the production decode (4bit plain, 32/8/128) and fp16 SDPA."""
import json, sys
sys.path.insert(0, "."); sys.path.insert(0, ".scratch/ws")
import torch
import torch.nn.functional as F
from eval.bench_kernels import _fill_pool, _flush_buffer, time_ms, make_config
from tq_hf.layout import BlockLayout
from tq_hf import reference
from tq_hf.kernels import unified_attention
from tq_hf.kernels.reduce import reduce_site
from tq_hf.kernels.key_lut import config_lut_bytes, lut_words_asm
import wsdecode

torch.manual_seed(0)
flush = _flush_buffer()
hq, hk, d = 32, 8, 128
cfg = make_config("4bit")
lay = BlockLayout(cfg, hk, d)
codec = reference.key_codec(cfg, d, "cuda")
(l0, l1), unit = config_lut_bytes(cfg, d)
lut = lut_words_asm((l0, l1))
tab = (codec.code_centroids / unit).half()
rot2 = wsdecode.split_rotation(codec.rotation)
scale = d ** -0.5
rows = []
points = [tuple(map(int, p.split('x'))) for p in (sys.argv[2] if len(sys.argv) > 2 else '16x32768,16x131072,8x32768,4x32768').split(',')]
variants = json.loads(sys.argv[1]) if len(sys.argv) > 1 else [
    {"tpw": 32, "maxnreg": 168, "num_stages": 3, "splits": 1.0},
    {"tpw": 32, "maxnreg": 168, "num_stages": 3, "splits": 2.0},
    {"tpw": 32, "maxnreg": 168, "num_stages": 3, "splits": 0.5},
    {"tpw": 32, "maxnreg": None, "num_stages": 3, "splits": 1.0},
    {"tpw": 32, "maxnreg": 168, "num_stages": 2, "splits": 1.0},
]
for b, s in points:
    pool, table = _fill_pool(lay, b, s)
    seq = torch.full((b,), s, device="cuda", dtype=torch.int64)
    q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.float16)
    out = torch.empty_like(q)
    call = lambda: unified_attention(q, pool, lay, table, seq, scale, max_seq_len=s, out=out)
    base = time_ms(call, 50, True, flush)
    ref = out.float().clone()
    kd = torch.randn(b, hk, s, d, device="cuda", dtype=torch.float16)
    vd = torch.randn_like(kd)
    sdpa = time_ms(lambda: F.scaled_dot_product_attention(q, kd, vd, scale=scale, enable_gqa=True), 50, True, flush)
    del kd, vd
    # the production split count as the reference point
    programs = b * hk // 2
    kv_tiles = s // 128
    base_ns = min(-(-3 * 132 // programs), kv_tiles, 128)
    base_ns = 1 << (base_ns.bit_length() - 1)
    rows.append(dict(b=b, s=s, variant="production", ms=base, sdpa=sdpa, ratio=base / sdpa, diff=0.0))
    for v in variants:
        if v.get('reduce_only'):
            pass
        ns = max(1, int(base_ns * v["splits"]))
        w = v.get("w", 4)
        pout = torch.full((b * hk * ns * 8, d), float("nan"), device="cuda")
        plse = torch.full((b * hk * ns * 8,), float("nan"), device="cuda")
        o2 = torch.full_like(q, float("nan"))
        qt = torch.empty(b * hk * 4 * (d // 4) * 8, device="cuda", dtype=torch.float16)
        rs = torch.empty(b * hk // 2 * 8, device="cuda")
        cnt = torch.zeros(b * hk // 2, dtype=torch.int32, device="cuda")
        red = reduce_site(b, hk, hq // hk, 1, ns, 8, d, d)
        def run():
            wsdecode.launch(q, rot2, scale, unit, pool, lay, table, seq, ns, lut, tab, tpw=v["tpw"], maxnreg=v["maxnreg"],
                            num_stages=v["num_stages"], pout=pout, plse=plse, sacc=v.get("sacc", 1), w=w, qpre=v.get("qpre", False), qt=qt, rs=rs,
                            **({"out": o2, "cnt": cnt} if v.get("fuse") else {}))
            if not v.get("noreduce") and not v.get("fuse"):
                red(pout, plse, o2, *o2.stride()[:3], ns)
        try:
            ms = time_ms(run, 50, True, flush)
            if v.get("noreduce"):
                red(pout, plse, o2, *o2.stride()[:3], ns)
            diff = (o2.float() - ref).abs().max().item()
            if v.get("fuse"):
                o2.fill_(float('nan')); run(); diff = max(diff, (o2.float() - ref).abs().max().item(), float(cnt.abs().sum().item()))
        except Exception as e:  # noqa: BLE001
            print("FAILED", v, repr(e)[:300]); continue
        rows.append(dict(b=b, s=s, variant=json.dumps(v), ns=ns, ms=ms, sdpa=sdpa, ratio=ms / sdpa, diff=diff))
        print(rows[-1], flush=True)
    del pool
    torch.cuda.empty_cache()
print("| B | S | variant | ms | x fp16 | max diff |")
print("|---|---|---|---|---|---|")
for r in rows:
    print(f"| {r['b']} | {r['s']} | {r['variant']} {r.get('ns', '')} | {r['ms']:.4f} | {r['ratio']:.3f} | {r['diff']:.1e} |")
json.dump(rows, open("/tmp/ws_rows.json", "w"))
import os, shutil
if os.environ.get("OUT"):
    shutil.copy("/tmp/ws_rows.json", os.path.join(os.environ["OUT"], "ws_rows.json"))
