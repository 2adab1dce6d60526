"""Session 18 call 5: the one-warp decode with the Hadamard prologue against HEAD's and the unified kernel.

32/8/128 4bit plain, one pool per point, CUDA-graph replays, L2 flushed, medians, two alternated rounds:
HEAD f074835's one-warp kernel (proto/dw_head.py: R's halves read in every program), the new one-warp kernel
(tuning warp_split=True), the unified kernel (warp_split=False); fp16 SDPA in the same run.

    PYTHONPATH=. python eval/results/gpu_checks/session18/s18call5.py
"""

from __future__ import annotations

import importlib
import json
import math
import os
import shutil
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from eval.bench_kernels import _fill_pool, _flush_buffer, make_config, time_ms
from tq_hf.kernels import attention, decode_warps, unified_attention
from tq_hf.layout import BlockLayout

HERE = Path(__file__).parent
POINTS = [(1, 32768), (2, 32768), (4, 32768), (8, 32768), (16, 32768), (32, 32768), (16, 1024), (16, 4096),
          (16, 16384), (16, 131072), (1, 131072), (4, 131072)]


def main() -> None:
    out_dir = Path(os.environ.get("OUT", "/tmp/s18c5"))
    out_dir.mkdir(parents=True, exist_ok=True)
    kdir = Path(decode_warps.__file__).parent
    shutil.copy(HERE / "proto" / "dw_head.py", kdir / "_s18_head.py")
    head = importlib.import_module("tq_hf.kernels._s18_head")._warp_kernel
    flush = _flush_buffer()
    hq, hk, d = 32, 8, 128
    layout = BlockLayout(make_config("4bit"), hk, d)
    rows = []
    for b, s in POINTS:
        q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.float16)
        k = torch.randn(b, hk, s, d, device="cuda", dtype=torch.float16)
        v = torch.randn_like(k)
        sdpa = time_ms(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), 300, True, flush)
        del k, v
        pool, table = _fill_pool(layout, b, s)
        seq = torch.full((b,), s, device="cuda", dtype=torch.int32)
        out = torch.full_like(q, float("nan"))

        def runner(tuning):
            def call():
                return unified_attention(q, pool, layout, table, seq, 1 / math.sqrt(d), max_seq_len=s, out=out,
                                         tuning=tuning)
            return call

        head_tuning = {"warp_split": True, "probe": "HEAD"}  # a plan of its own (the key is unused)
        runner(head_tuning)()
        plan = next(p for p in reversed(list(attention._PLANS.values())) if p.kernel is decode_warps._warp_kernel)
        plan.kernel, plan.attention = head, None
        plan.constants = {k2: v2 for k2, v2 in plan.constants.items() if k2 != "HADAMARD"}
        variants = {"unified": {"warp_split": False}, "one-warp HEAD": head_tuning, "one-warp new": {"warp_split": True},
                    "launcher default": None}
        base = None
        for rnd in range(2):
            for name, tuning in variants.items():
                call = runner(tuning)
                out.fill_(float("nan"))
                call()
                torch.cuda.synchronize()
                base = out.float().clone() if base is None else base
                err = float((out.float() - base).norm() / base.norm())
                ms = time_ms(call, 300, True, flush)
                rows.append(dict(B=b, S=s, variant=name, round=rnd, ms=ms, sdpa=sdpa, ratio=ms / sdpa, rel_diff=err,
                                 finite=bool(out.isfinite().all())))
                print(f"B={b} S={s} r{rnd} {name:16s} {ms:.4f} ms x{ms / sdpa:.3f} fp16 ({sdpa:.4f}) rel diff vs "
                      f"unified {err:.1e}", flush=True)
        del pool, table
        torch.cuda.empty_cache()
    (out_dir / "s18call5.json").write_text(json.dumps(rows, indent=1))
    print("\n| B | S | fp16 SDPA ms | variant | ms r0 | ms r1 | x fp16 | rel diff vs unified |\n|---|---|---|---|---|---|---|---|")
    for key in dict.fromkeys((r["B"], r["S"], r["variant"]) for r in rows):
        rr = [r for r in rows if (r["B"], r["S"], r["variant"]) == key]
        print(f"| {key[0]} | {key[1]} | {rr[0]['sdpa']:.4f} | {key[2]} | " + " | ".join(f"{r['ms']:.4f}" for r in rr)
              + f" | {statistics.mean(r['ratio'] for r in rr):.3f} | {rr[0]['rel_diff']:.1e} |")


if __name__ == "__main__":
    sys.exit(main())
