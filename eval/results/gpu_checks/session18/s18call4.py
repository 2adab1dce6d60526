"""Session 18 call 4: why the balanced halves (call 3) were slower. 32/8/128 4bit plain, B=16, S=32k and 128k.

Variants (two alternated rounds): HEAD f074835's kernel; the new kernel without the launch-order remap (splits
from program_id as in HEAD, Hadamard prologue); the new kernel (remap) at old_share 24, 28, 32, 36. Then raw
%globaltimer stamps (start, after the prologue, after the walk, end), %smid, %warpid, split and sequence of
every program for remap 32, remap 37 and no remap, saved to s18call4.json.

    PYTHONPATH=. python eval/results/gpu_checks/session18/s18call4.py
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
KDIR = Path(decode_warps.__file__).parent
SRC = (KDIR / "decode_warps.py").read_text()
REMAP = """    lin = tl.program_id(0) + num_splits * (tl.program_id(1) + npairs * tl.program_id(2))
    teams = npairs * tl.num_programs(2)
    split = lin // teams
    hp = lin % teams % npairs
    b = lin % teams // npairs
"""
NOREMAP = "    split = tl.program_id(0)\n    hp = tl.program_id(1)\n    b = tl.program_id(2)\n"
HELPERS = '''

@triton.jit
def _now(dep):
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer; // $1", "=l,r", [dep], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def _sreg(dep, REG: tl.constexpr):
    return tl.inline_asm_elementwise("mov.u32 $0, " + REG + "; // $1", "=r,r", [dep], dtype=tl.int32,
                                     is_pure=False, pack=1)
'''
NST = 8


def _sub(src: str, old: str, new: str) -> str:
    assert src.count(old) == 1, old
    return src.replace(old, new)


def timed(src: str) -> str:
    t = _sub(src, "\n\n@triton.jit\ndef _query_rows", HELPERS + "\n\n@triton.jit\ndef _query_rows")
    t = _sub(t, "    OLD_SHARE: tl.constexpr,", "    OLD_SHARE: tl.constexpr, TS: tl.constexpr = 0,")
    t = _sub(t, "    U: tl.constexpr = D // 4\n    seq_len", "    t_a = _now(b)\n    U: tl.constexpr = D // 4\n    seq_len")
    t = _sub(t, "    m_i = tl.full((NR,), -float(\"inf\"), tl.float32)\n",
             "    t_b = _now(tl.max(rsc, 0).to(tl.int32, bitcast=True))\n    m_i = tl.full((NR,), -float(\"inf\"), tl.float32)\n")
    t = _sub(t, "    # this split's normalised partial",
             "    t_c = _now(tl.max(l_i, 0).to(tl.int32, bitcast=True))\n    # this split's normalised partial")
    tail = "    tl.store(dst + (2 * uu + 1 + D // 2)[:, None], a3 * hi + bias_out, mask=om)\n"
    stamps = ["t_a", "t_b", "t_c", "t_d", "_sreg(b, '%smid').to(tl.int64)", "_sreg(b, '%warpid').to(tl.int64)",
              "split.to(tl.int64)", "b.to(tl.int64)"]
    return _sub(t, tail, tail + "    t_d = _now(b)\n"
                f"    tsp = tl.full((), TS, tl.int64).to(tl.pointer_type(tl.int64)) + (tl.program_id(0) + num_splits * (tl.program_id(1) + npairs * tl.program_id(2))) * {NST}\n"
                + "".join(f"    tl.store(tsp + {i}, {x})\n" for i, x in enumerate(stamps)))


def module(name: str, src: str):
    (KDIR / f"_s18_{name}.py").write_text(src)
    return importlib.import_module(f"tq_hf.kernels._s18_{name}")._warp_kernel


def main() -> None:
    out_dir = Path(os.environ.get("OUT", "/tmp/s18c4"))
    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy(HERE / "proto" / "dw_head.py", KDIR / "_s18_head.py")
    head = importlib.import_module("tq_hf.kernels._s18_head")._warp_kernel
    noremap = module("noremap", _sub(SRC, REMAP, NOREMAP))
    timed_remap = module("timed_remap", timed(SRC))
    timed_noremap = module("timed_noremap", timed(_sub(SRC, REMAP, NOREMAP)))
    flush = _flush_buffer()
    hq, hk, d = 32, 8, 128
    layout = BlockLayout(make_config("4bit"), hk, d)
    rows, raw = [], {}
    for b, s in ((16, 32768), (16, 131072)):
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

        def patched(tuning, kernel, drop=(), extra=None):
            runner(tuning)()
            plan = next(p for p in reversed(list(attention._PLANS.values())) if p.kernel is decode_warps._warp_kernel)
            plan.kernel, plan.attention = kernel, None
            plan.constants = {k2: v2 for k2, v2 in plan.constants.items() if k2 not in drop} | (extra or {})
            return plan

        patched({"warp_split": True, "num_stages": 3, "old_share": 32}, head, ("HADAMARD", "OLD_SHARE"))
        patched({"warp_split": True, "old_share": 32, "probe": "no remap"}, noremap)
        variants = {"HEAD f074835": {"warp_split": True, "num_stages": 3, "old_share": 32},
                    "no remap, equal": {"warp_split": True, "old_share": 32, "probe": "no remap"}}
        variants.update({f"remap, old_share {x}": {"warp_split": True, "old_share": x} for x in (24, 28, 32, 36)})
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
                rows.append(dict(B=b, S=s, variant=name, round=rnd, ms=ms, sdpa=sdpa, ratio=ms / sdpa, rel_diff=err))
                print(f"B={b} S={s} r{rnd} {name:22s} {ms:.4f} ms x{ms / sdpa:.3f} fp16 ({sdpa:.4f}) rel diff {err:.1e}",
                      flush=True)
        for name, kernel, share in (("remap 32", timed_remap, 32), ("remap 37", timed_remap, 37),
                                    ("no remap", timed_noremap, 32)):
            tuning = {"warp_split": True, "old_share": share, "probe": name}  # a plan of its own (key unused)
            plan = patched(tuning, kernel)
            nprog = plan.grid[0] * plan.grid[1] * plan.grid[2]
            ts = torch.zeros(nprog * NST, dtype=torch.int64, device="cuda")
            plan.constants = dict(plan.constants, TS=ts.data_ptr())
            plan.attention = None
            call = runner(tuning)
            runs = []
            for i in range(4):
                flush.zero_()
                ts.zero_()
                call()
                torch.cuda.synchronize()
                if i:
                    runs.append(ts.view(nprog, NST).cpu().tolist())
            t = torch.tensor(runs[-1], dtype=torch.float64)
            rel = (t[:, :4] - t[:, 0].min()) / 1e3
            young = t[:, 5] >= 4
            print(f"timers B={b} S={s} {name}: end p50/max old {rel[~young, 3].median():.1f}/{rel[~young, 3].max():.1f}"
                  f" young {rel[young, 3].median():.1f}/{rel[young, 3].max():.1f}; prologue p50 "
                  f"{(rel[:, 1] - rel[:, 0]).median():.2f} us", flush=True)
            raw[f"{b}x{s} {name}"] = runs
        del pool, table
        torch.cuda.empty_cache()
    (out_dir / "s18call4.json").write_text(json.dumps({"rows": rows, "raw": raw}))
    print("\n| B | S | variant | ms r0 | ms r1 | x fp16 | rel diff |\n|---|---|---|---|---|---|---|")
    for key in dict.fromkeys((r["B"], r["S"], r["variant"]) for r in rows):
        rr = [r for r in rows if (r["B"], r["S"], r["variant"]) == key]
        print(f"| {key[0]} | {key[1]} | {key[2]} | " + " | ".join(f"{r['ms']:.4f}" for r in rr)
              + f" | {statistics.mean(r['ratio'] for r in rr):.3f} | {rr[0]['rel_diff']:.1e} |")


if __name__ == "__main__":
    sys.exit(main())
