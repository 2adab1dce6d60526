"""Session 18 call 1: where the one-warp split decode's fixed ~29 us goes (32/8/128 4bit plain, B=16).

Times (CUDA-graph replays, L2 flushed, medians, alternated in two rounds) the launcher's default decode, its
attention kernel alone, its reduction alone, and variants built from decode_warps.py's source with one change:
  lazy      the accumulators rescaled only in tiles where a column's running max rose (a warp-uniform branch)
  norot     the prologue's R loads replaced by an in-register identity (timing only: the output is unrotated)
  pdl       the reduction launched programmatically dependent (griddepcontrol.wait first)
  pdl+trig  ... and every attention program lets the reduction launch at its start (launch_dependents)
Then an instrumented kernel (%globaltimer at program start, after the prologue, after the walk, at the end) gives
the programs' start skew, prologue, walk and end spread.

    PYTHONPATH=. python eval/results/gpu_checks/session18/s18call1.py
"""

from __future__ import annotations

import importlib
import json
import math
import os
import re
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from eval.bench_kernels import _fill_pool, _flush_buffer, make_config, time_ms
from tq_hf.kernels import attention, decode_warps, reduce as reduce_mod, unified_attention
from tq_hf.kernels.fast_launch import LaunchSite
from tq_hf.layout import BlockLayout

KDIR = Path(decode_warps.__file__).parent
SRC = (KDIR / "decode_warps.py").read_text()
RSRC = (KDIR / "reduce.py").read_text()


def _sub(src: str, old: str, new: str) -> str:
    assert src.count(old) == 1, old
    return src.replace(old, new)


def variant_module(name: str, src: str):
    path = KDIR / f"_s18_{name}.py"
    path.write_text(src)
    return importlib.import_module(f"tq_hf.kernels._s18_{name}")


RESCALE = """    a0 = a0 * alpha[None, :]
    a1 = a1 * alpha[None, :]
    a2 = a2 * alpha[None, :]
    a3 = a3 * alpha[None, :]
"""
LAZY = """    if tl.max(m_new - m_i, 0) > 0:
        a0 = a0 * alpha[None, :]
        a1 = a1 * alpha[None, :]
        a2 = a2 * alpha[None, :]
        a3 = a3 * alpha[None, :]
"""
RLOADS = """        r_hi = tl.load(rot_ptr + coord[:, None] * D + dd[None, :])
        r_lo = tl.load(rot_ptr + D * D + coord[:, None] * D + dd[None, :])
"""
NOROT = """        r_hi = (coord[:, None] == dd[None, :]).to(tl.float16)
        r_lo = (coord[:, None] == dd[None, :] + 1).to(tl.float16)
"""
TRIG = "    split = tl.program_id(0)\n"
TIMER_HELPER = '''

@triton.jit
def _now(dep):
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer; // $1", "=l,r", [dep], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def _smid(dep):
    return tl.inline_asm_elementwise("mov.u32 $0, %smid; // $1", "=r,r", [dep], dtype=tl.int32,
                                     is_pure=False, pack=1)
'''


def make_variants():
    mods = {}
    mods["lazy"] = variant_module("lazy", _sub(SRC, RESCALE, LAZY))
    mods["norot"] = variant_module("norot", _sub(SRC, RLOADS, NOROT))
    mods["trig"] = variant_module("trig", _sub(SRC, TRIG, TRIG + "    tl.extra.cuda.gdc_launch_dependents()\n"))
    mods["lazy_trig"] = variant_module(
        "lazy_trig", _sub(_sub(SRC, RESCALE, LAZY), TRIG, TRIG + "    tl.extra.cuda.gdc_launch_dependents()\n"))
    t = _sub(SRC, "\n\n# The same runtime arguments", TIMER_HELPER + "\n\n# The same runtime arguments")
    t = _sub(t, "    HALF: tl.constexpr,\n):", "    HALF: tl.constexpr, TS: tl.constexpr = 0,\n):")
    t = _sub(t, "    b = tl.program_id(2)\n", "    b = tl.program_id(2)\n    t_a = _now(b)\n")
    t = _sub(t, "    m_i = tl.full((NR,), -float(\"inf\"), tl.float32)\n",
             "    t_b = _now(tl.max(rsc, 0).to(tl.int32, bitcast=True))\n"
             "    m_i = tl.full((NR,), -float(\"inf\"), tl.float32)\n")
    t = _sub(t, "    # this split's normalised partial", "    t_c = _now(tl.max(l_i, 0).to(tl.int32, bitcast=True))\n"
             "    # this split's normalised partial")
    t = t.rstrip("\n") + "\n"
    tail = "    tl.store(dst + (2 * uu + 1 + D // 2)[:, None], a3 * hi + bias_out, mask=om)\n"
    t = _sub(t, tail, tail + (
        "    t_d = _now(b)\n"
        "    tsp = tl.full((), TS, tl.int64).to(tl.pointer_type(tl.int64)) + ((b * npairs + hp) * num_splits + split) * 5\n"
        "    tl.store(tsp, t_a)\n    tl.store(tsp + 1, t_b)\n    tl.store(tsp + 2, t_c)\n    tl.store(tsp + 3, t_d)\n"
        "    tl.store(tsp + 4, _smid(b).to(tl.int64))\n"))
    mods["timers"] = variant_module("timers", t)
    r = _sub(RSRC, "    r = tl.program_id(0)  # row", "    tl.extra.cuda.gdc_wait()\n    r = tl.program_id(0)  # row")
    mods["reduce_pdl"] = variant_module("reduce_pdl", r)
    return mods


def main() -> None:
    out_dir = Path(os.environ.get("OUT", "/tmp/s18c1"))
    out_dir.mkdir(parents=True, exist_ok=True)
    mods = make_variants()
    flush = _flush_buffer()
    hq, hk, d = 32, 8, 128
    layout = BlockLayout(make_config("4bit"), hk, d)
    rows, timers = [], {}
    for b, s in ((16, 32768), (16, 1024), (8, 32768)):
        q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.float16)
        k = torch.randn(b, hk, s, d, device="cuda", dtype=torch.float16)
        v = torch.randn_like(k)
        sdpa = time_ms(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), 300, True, flush)
        del k, v
        pool, table = _fill_pool(layout, b, s)
        seq = torch.full((b,), s, device="cuda", dtype=torch.int32)
        out = torch.full_like(q, float("nan"))

        def call():
            return unified_attention(q, pool, layout, table, seq, 1 / math.sqrt(d), max_seq_len=s, out=out)

        call()
        torch.cuda.synchronize()
        base_out = out.clone()
        plan = next(p for p in reversed(list(attention._PLANS.values())) if p.kernel is decode_warps._warp_kernel)
        site0, reduce0, kernel0, consts0 = plan.attention, plan.reduce, plan.kernel, plan.constants
        rsite_pdl = LaunchSite(mods["reduce_pdl"]._reduce_kernel, reduce0.grid, dict(reduce0.kwargs, launch_pdl=True))
        noop = lambda *a: None  # noqa: E731

        def setup(name):
            plan.attention, plan.reduce, plan.kernel, plan.constants = site0, reduce0, kernel0, consts0
            if name == "attention only":
                plan.reduce = noop
            elif name == "reduce only":
                plan.attention = noop
            elif name in ("lazy", "norot"):
                plan.kernel, plan.attention = mods[name]._warp_kernel, None
            elif name == "pdl":
                plan.reduce = rsite_pdl
            elif name in ("pdl+trig", "lazy+pdl+trig"):
                plan.kernel, plan.attention = mods["trig" if name == "pdl+trig" else "lazy_trig"]._warp_kernel, None
                plan.reduce = rsite_pdl

        names = ["default", "attention only", "reduce only", "lazy", "norot", "pdl", "pdl+trig", "lazy+pdl+trig"]
        for rnd in range(2):
            for name in names:
                try:
                    setup(name)
                    out.fill_(float("nan"))
                    call()
                    torch.cuda.synchronize()
                    diff = float((out.float() - base_out.float()).abs().max())
                    ms = time_ms(call, 300, True, flush)
                    rows.append(dict(B=b, S=s, variant=name, round=rnd, ms=ms, sdpa=sdpa, ratio=ms / sdpa, diff=diff))
                    print(f"B={b} S={s} r{rnd} {name:14s} {ms:.4f} ms  x{ms / sdpa:.3f} fp16 ({sdpa:.4f})  "
                          f"max|diff| {diff:.2e}", flush=True)
                except Exception as exc:  # report and go on
                    print(f"B={b} S={s} {name}: {type(exc).__name__}: {str(exc)[:600]}", flush=True)
                finally:
                    if name in ("lazy", "norot", "pdl+trig", "lazy+pdl+trig"):
                        plan.attention = None  # the next setup restores site0
        # instrumented kernel
        try:
            setup("default")
            nprog = plan.grid[0] * plan.grid[1] * plan.grid[2]
            ts = torch.zeros(nprog * 5, dtype=torch.int64, device="cuda")
            plan.kernel, plan.attention = mods["timers"]._warp_kernel, None
            plan.constants = dict(consts0, TS=ts.data_ptr())
            stats = []
            for i in range(6):
                flush.zero_()
                ts.zero_()
                call()
                torch.cuda.synchronize()
                if i == 0:
                    continue
                t = ts.view(nprog, 5).cpu()
                t0 = t[:, 0].min()
                st = {"start_skew_us": (t[:, 0] - t0).double() / 1e3, "prologue_us": (t[:, 1] - t[:, 0]).double() / 1e3,
                      "walk_us": (t[:, 2] - t[:, 1]).double() / 1e3, "epilogue_us": (t[:, 3] - t[:, 2]).double() / 1e3,
                      "end_us": (t[:, 3] - t0).double() / 1e3}
                stats.append({k2: {"min": float(v2.min()), "p50": float(v2.median()), "p90": float(v2.quantile(0.9)),
                                   "max": float(v2.max())} for k2, v2 in st.items()})
                stats[-1]["sms"] = int(t[:, 4].unique().numel())
            timers[f"B={b} S={s}"] = stats
            for k2 in stats[0]:
                if k2 == "sms":
                    continue
                vals = {q2: statistics.median(x[k2][q2] for x in stats) for q2 in ("min", "p50", "p90", "max")}
                print(f"timers B={b} S={s} {k2:13s} " + "  ".join(f"{q2} {v3:8.2f}" for q2, v3 in vals.items()),
                      flush=True)
            print(f"timers B={b} S={s} SMs used {stats[0]['sms']}, programs {nprog}", flush=True)
        except Exception as exc:
            print(f"timers B={b} S={s}: {type(exc).__name__}: {str(exc)[:800]}", flush=True)
        plan.attention, plan.reduce, plan.kernel, plan.constants = None, reduce0, kernel0, consts0
        del pool, table
        torch.cuda.empty_cache()
    (out_dir / "s18call1.json").write_text(json.dumps({"rows": rows, "timers": timers}, indent=1))
    print("\n| B | S | variant | ms r0 | ms r1 | x fp16 | max|diff| |\n|---|---|---|---|---|---|---|")
    for key in dict.fromkeys((r["B"], r["S"], r["variant"]) for r in rows):
        rr = [r for r in rows if (r["B"], r["S"], r["variant"]) == key]
        ms = [f"{r['ms']:.4f}" for r in rr]
        print(f"| {key[0]} | {key[1]} | {key[2]} | {' | '.join(ms + [''] * (2 - len(ms)))} | "
              f"{statistics.mean(r['ratio'] for r in rr):.3f} | {rr[0]['diff']:.1e} |")


if __name__ == "__main__":
    sys.exit(main())
