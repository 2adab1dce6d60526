"""Session 19 call 2: decode over cache blocks of 16, 32 and 64 tokens, alternated in two rounds (plain presets).

Call 1 found the one-warp decode (4bit B=16 S=32k 32/8/128) 4% faster over 64-token blocks (0.1711 -> 0.1638 ms)
while a load-only kernel of the same walk reads the same bytes in 0.140-0.143 ms at either size. This times the
launcher's default decode at each point over pools of each block size (the benchmark's random block order,
eval.bench_kernels._fill_pool), next to fp16 SDPA, CUDA-graph replays, L2 flushed (time_ms).

    PYTHONPATH=. python eval/results/gpu_checks/session19/s19call2_ab.py
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from eval.bench_kernels import _flush_buffer, _fill_pool, make_config, time_ms
from tq_hf.kernels import unified_attention
from tq_hf.layout import BlockLayout

POINTS = [(16, 32768, (32, 8, 128)), (1, 32768, (32, 8, 128)), (16, 4096, (32, 8, 128)), (1, 4096, (32, 8, 128)),
          (16, 131072, (32, 8, 128)), (4, 32768, (32, 8, 128)), (16, 32768, (9, 3, 64)), (1, 32768, (9, 3, 64))]
PRESETS = ("4bit", "k8v4", "k3v4", "3bit")
BLOCKS = (16, 32, 64)


def main() -> None:
    out_dir = Path(os.environ.get("OUT", "/tmp/s19c2"))
    out_dir.mkdir(parents=True, exist_ok=True)
    flush = _flush_buffer()
    rows = []
    for b, s, (hq, hk, d) in POINTS:
        q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.float16)
        k = torch.randn(b, hk, s, d, device="cuda", dtype=torch.float16)
        v = torch.randn_like(k)
        sdpa = time_ms(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), 200, True, flush)
        del k, v
        presets = PRESETS if (b, s) in ((16, 32768), (1, 32768)) else ("4bit", "k8v4")
        for preset in presets:
            pools = {}
            for t in BLOCKS:
                layout = BlockLayout(make_config(preset, t), hk, d)
                pools[t] = (layout, *_fill_pool(layout, b, s))
            seq = torch.full((b,), s, device="cuda", dtype=torch.int32)
            out = torch.empty_like(q)
            times = {t: [] for t in BLOCKS}
            for _ in range(2):
                for t in BLOCKS:
                    layout, pool, table = pools[t]
                    times[t].append(time_ms(lambda: unified_attention(q, pool, layout, table, seq, 1 / math.sqrt(d),
                                                                      max_seq_len=s, out=out), 200, True, flush))
            row = dict(B=b, S=s, shape=f"{hq}/{hk}/{d}", preset=preset, sdpa=sdpa,
                       **{f"T{t}": times[t] for t in BLOCKS})
            rows.append(row)
            print(f"B={b:2d} S={s:6d} {hq}/{hk}/{d} {preset:5s} fp16 {sdpa:.4f} | "
                  + " | ".join(f"T={t}: {' / '.join(f'{x:.4f}' for x in times[t])} (x{min(times[t]) / sdpa:.3f})"
                               for t in BLOCKS), flush=True)
            del pools
            torch.cuda.empty_cache()
    (out_dir / "s19call2_ab.json").write_text(json.dumps(rows, indent=1))
    print("\n| B | S | shape | preset | fp16 ms | T=16 r1 / r2 | T=32 r1 / r2 | T=64 r1 / r2 | 64 vs 16 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        m16, m64 = sum(r["T16"]) / 2, sum(r["T64"]) / 2
        print(f"| {r['B']} | {r['S']} | {r['shape']} | {r['preset']} | {r['sdpa']:.4f} | "
              + " | ".join(f"{r[f'T{t}'][0]:.4f} / {r[f'T{t}'][1]:.4f}" for t in BLOCKS)
              + f" | {100 * (m64 / m16 - 1):+.1f}% |")


if __name__ == "__main__":
    main()
