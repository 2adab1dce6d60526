"""Session 18 call 3: the one-warp split decode with the Hadamard prologue and the balanced halves, against HEAD's.

Variants over one pool per point (CUDA-graph replays, L2 flushed, medians, two alternated rounds): HEAD f074835's
kernel (proto/dw_head.py: R read from L2 in every program, equal splits), and the new kernel at old_share 32
(H built in registers, equal splits), 36, 37 (the default), 38, 40, 42; fp16 SDPA in the same run.

    PYTHONPATH=. python eval/results/gpu_checks/session18/s18call3.py
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
POINTS = [(16, 32768), (16, 131072), (8, 32768), (32, 32768), (16, 1024)]
SHARES = [32, 36, 37, 38, 40, 42]


def head_kernel():
    dst = Path(decode_warps.__file__).parent / "_s18_head.py"
    shutil.copy(HERE / "proto" / "dw_head.py", dst)
    return importlib.import_module("tq_hf.kernels._s18_head")._warp_kernel


def main() -> None:
    out_dir = Path(os.environ.get("OUT", "/tmp/s18c3"))
    out_dir.mkdir(parents=True, exist_ok=True)
    head = head_kernel()
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

        # HEAD's kernel through a plan of its own (its constants lack HADAMARD and OLD_SHARE)
        head_tuning = {"warp_split": True, "old_share": 32, "num_stages": 3}
        runner(head_tuning)()
        plan = next(p for p in reversed(list(attention._PLANS.values())) if p.kernel is decode_warps._warp_kernel)
        plan.kernel, plan.attention = head, None
        plan.constants = {k2: v2 for k2, v2 in plan.constants.items() if k2 not in ("HADAMARD", "OLD_SHARE")}
        variants = {"HEAD f074835": head_tuning, "default (37 here)": {}}
        variants.update({f"old_share {x}": {"warp_split": True, "old_share": x} for x in SHARES})
        base = None
        for rnd in range(2):
            for name, tuning in variants.items():
                call = runner(tuning)
                out.fill_(float("nan"))
                call()
                torch.cuda.synchronize()
                if base is None:
                    base = out.float().clone()
                err = float((out.float() - base).norm() / base.norm())
                ms = time_ms(call, 300, True, flush)
                rows.append(dict(B=b, S=s, variant=name, round=rnd, ms=ms, sdpa=sdpa, ratio=ms / sdpa, rel_diff=err,
                                 finite=bool(out.isfinite().all())))
                print(f"B={b} S={s} r{rnd} {name:18s} {ms:.4f} ms x{ms / sdpa:.3f} fp16 ({sdpa:.4f}) "
                      f"rel diff {err:.1e}", flush=True)
        del pool, table
        torch.cuda.empty_cache()
    (out_dir / "s18call3.json").write_text(json.dumps(rows, indent=1))
    print("\n| B | S | variant | ms r0 | ms r1 | x fp16 | rel diff vs HEAD |\n|---|---|---|---|---|---|---|")
    for key in dict.fromkeys((r["B"], r["S"], r["variant"]) for r in rows):
        rr = [r for r in rows if (r["B"], r["S"], r["variant"]) == key]
        print(f"| {key[0]} | {key[1]} | {key[2]} | " + " | ".join(f"{r['ms']:.4f}" for r in rr)
              + f" | {statistics.mean(r['ratio'] for r in rr):.3f} | {rr[0]['rel_diff']:.1e} |")


if __name__ == "__main__":
    sys.exit(main())
