"""Session 18 call 2: raw per-program timestamps of the one-warp split decode (32/8/128 4bit plain).

%globaltimer at program start, after the query load, after the rotation's MMAs, after the prologue, halfway
through the walk, after the walk, at the end; %smid and %warpid. Raw rows go to s18call2.json (analysed offline).

    PYTHONPATH=. python eval/results/gpu_checks/session18/s18call2.py
"""

from __future__ import annotations

import importlib
import json
import math
import os
import sys
from pathlib import Path

import torch

from eval.bench_kernels import _fill_pool, _flush_buffer, make_config, time_ms
from tq_hf.kernels import attention, decode_warps, unified_attention
from tq_hf.layout import BlockLayout

KDIR = Path(decode_warps.__file__).parent
SRC = (KDIR / "decode_warps.py").read_text()
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
NSTAMP = 9


def _sub(src: str, old: str, new: str) -> str:
    assert src.count(old) == 1, old
    return src.replace(old, new)


def timed_source() -> str:
    t = _sub(SRC, "\n\n@triton.jit\ndef _rotated_query", HELPERS + "\n\n@triton.jit\ndef _rotated_query")
    t = _sub(t, "    q_hi = q.to(tl.float16)\n",
             "    t_q = _now(tl.max(q_big, 0).to(tl.int32, bitcast=True))\n    q_hi = q.to(tl.float16)\n")
    t = _sub(t, "    qdiv = tl.where(qmax > 0, qmax, 1.0)\n",
             "    t_r = _now(tl.max(qmax, 0).to(tl.int32, bitcast=True))\n    qdiv = tl.where(qmax > 0, qmax, 1.0)\n")
    t = _sub(t, "    return tiles, qdiv * q_big * (sm_scale * KEY_UNIT * 1.4426950408889634)",
             "    return tiles, qdiv * q_big * (sm_scale * KEY_UNIT * 1.4426950408889634), t_q, t_r")
    t = _sub(t, "    qs, rsc = _rotated_query(", "    qs, rsc, t_q, t_r = _rotated_query(")
    t = _sub(t, "    HALF: tl.constexpr,\n):", "    HALF: tl.constexpr, TS: tl.constexpr = 0,\n):")
    t = _sub(t, "    b = tl.program_id(2)\n", "    b = tl.program_id(2)\n    t_a = _now(b)\n")
    t = _sub(t, "    m_i = tl.full((NR,), -float(\"inf\"), tl.float32)\n",
             "    t_b = _now(tl.max(rsc, 0).to(tl.int32, bitcast=True))\n"
             "    m_i = tl.full((NR,), -float(\"inf\"), tl.float32)\n")
    loop = "    for t0 in range(start, body_end, BLOCK_N):\n"
    body = t[t.index(loop) + len(loop):t.index("    for t0 in range(body_end, end, BLOCK_N):")]
    t = _sub(t, loop + body, "    mid = start + (body_end - start) // BLOCK_N // 2 * BLOCK_N\n"
             "    for t0 in range(start, mid, BLOCK_N):\n" + body
             + "    t_m = _now(tl.max(l_i, 0).to(tl.int32, bitcast=True))\n"
             "    for t0 in range(mid, body_end, BLOCK_N):\n" + body)
    t = _sub(t, "    # this split's normalised partial", "    t_c = _now(tl.max(l_i, 0).to(tl.int32, bitcast=True))\n"
             "    # this split's normalised partial")
    t = t.rstrip("\n") + "\n"
    tail = "    tl.store(dst + (2 * uu + 1 + D // 2)[:, None], a3 * hi + bias_out, mask=om)\n"
    stamps = ["t_a", "t_q", "t_r", "t_b", "t_m", "t_c", "t_d", "_sreg(b, '%smid').to(tl.int64)",
              "_sreg(b, '%warpid').to(tl.int64)"]
    assert len(stamps) == NSTAMP
    t = _sub(t, tail, tail + "    t_d = _now(b)\n"
             f"    tsp = tl.full((), TS, tl.int64).to(tl.pointer_type(tl.int64)) + ((b * npairs + hp) * num_splits + split) * {NSTAMP}\n"
             + "".join(f"    tl.store(tsp + {i}, {x})\n" for i, x in enumerate(stamps)))
    return t


def timed_kernel():
    (KDIR / "_s18_timed.py").write_text(timed_source())
    return importlib.import_module("tq_hf.kernels._s18_timed")._warp_kernel


def main() -> None:
    out_dir = Path(os.environ.get("OUT", "/tmp/s18c2"))
    out_dir.mkdir(parents=True, exist_ok=True)
    kern = timed_kernel()
    flush = _flush_buffer()
    hq, hk, d = 32, 8, 128
    layout = BlockLayout(make_config("4bit"), hk, d)
    res = {}
    for b, s in ((16, 32768), (16, 1024), (8, 32768), (16, 131072)):
        q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.float16)
        pool, table = _fill_pool(layout, b, s)
        seq = torch.full((b,), s, device="cuda", dtype=torch.int32)
        out = torch.empty_like(q)

        def call():
            return unified_attention(q, pool, layout, table, seq, 1 / math.sqrt(d), max_seq_len=s, out=out)

        call()
        torch.cuda.synchronize()
        base = out.clone()
        ms = time_ms(call, 200, True, flush)
        plan = next(p for p in reversed(list(attention._PLANS.values())) if p.kernel is decode_warps._warp_kernel)
        nprog = plan.grid[0] * plan.grid[1] * plan.grid[2]
        ts = torch.zeros(nprog * NSTAMP, dtype=torch.int64, device="cuda")
        site0, consts0 = plan.attention, plan.constants
        plan.kernel, plan.attention, plan.constants = kern, None, dict(consts0, TS=ts.data_ptr())
        runs = []
        for i in range(5):
            flush.zero_()
            ts.zero_()
            call()
            torch.cuda.synchronize()
            if i:
                runs.append(ts.view(nprog, NSTAMP).cpu().tolist())
        diff = float((out.float() - base.float()).abs().max())
        ms_t = time_ms(call, 200, True, flush)
        plan.kernel, plan.attention, plan.constants = decode_warps._warp_kernel, site0, consts0
        res[f"{b}x{s}"] = dict(B=b, S=s, grid=plan.grid, ms=ms, ms_timed=ms_t, diff=diff, runs=runs)
        print(f"B={b} S={s} grid {plan.grid}: {ms:.4f} ms (timed kernel {ms_t:.4f}, max|diff| {diff:.1e})", flush=True)
        del pool, table
        torch.cuda.empty_cache()
    (out_dir / "s18call2.json").write_text(json.dumps(res))


if __name__ == "__main__":
    sys.exit(main())
