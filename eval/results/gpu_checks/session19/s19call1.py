"""Session 19 call 1: is the one-warp decode's walk bound by the pool's access pattern? (32/8/128 4bit plain)

For B=16 S=32k (and B=1 S=32k) over pools of 16- and 64-token blocks whose block tables are
  randperm     the benchmark's (eval.bench_kernels._fill_pool: blocks in random order)
  interleaved  TurboQuantCache's (block j of row r at j * B + r)
  contiguous   each row's blocks in order, rows one after another
(the same tokens in every pool: the blocks copied to the table's places; outputs compared), times:
  decode       the launcher's default decode (unified_attention)
  probe N/W    a load-only kernel: the same grid of one-warp programs, the same split walk, the same bytes per
               tile (key words, value words, the 3 metadata fields of both heads), XOR-folded; N-token tiles with
               the next tile's loads issued before the current one is folded (W warps, W x N tokens per step)
and, as the contiguous ceiling, torch's int64 sum of the whole pool; fp16 SDPA on the same shapes. Each with the
L2 flushed by zeroing 256 MB (the benchmark's way: leaves ~50 MB of dirty lines in L2), by reading 256 MB
(clean lines), or not at all.

    PYTHONPATH=. python eval/results/gpu_checks/session19/s19call1.py
"""

from __future__ import annotations

import json
import math
import os
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from eval.bench_kernels import _fill_pool, make_config
from tq_hf.kernels import unified_attention
from tq_hf.layout import BlockLayout


@triton.jit
def _probe_tile(pool_ptr, bt_row, t0, end, head_off, block_bytes, plane_bytes, ii, ww, T: tl.constexpr,
                KB: tl.constexpr, VB: tl.constexpr, META: tl.constexpr):
    tok = t0 + ii
    ok = tok < end
    blk = tl.load(bt_row + tok // T, mask=ok, other=0)
    off = tok % T
    base = blk * block_bytes + head_off
    p0 = base
    p1 = base + plane_bytes
    k0 = tl.load((pool_ptr + (p0 + off * KB)[:, None]).to(tl.pointer_type(tl.int32)) + ww[None, :], mask=ok[:, None])
    v0 = tl.load((pool_ptr + (p0 + T * KB + off * VB)[:, None]).to(tl.pointer_type(tl.int32)) + ww[None, :],
                 mask=ok[:, None])
    k1 = tl.load((pool_ptr + (p1 + off * KB)[:, None]).to(tl.pointer_type(tl.int32)) + ww[None, :], mask=ok[:, None])
    v1 = tl.load((pool_ptr + (p1 + T * KB + off * VB)[:, None]).to(tl.pointer_type(tl.int32)) + ww[None, :],
                 mask=ok[:, None])
    m = tl.zeros(ii.shape, tl.int32)
    for f in tl.static_range(3):
        m ^= tl.load((pool_ptr + p0 + META + f * T * 2 + off * 2).to(tl.pointer_type(tl.uint16)), mask=ok).to(tl.int32)
        m ^= tl.load((pool_ptr + p1 + META + f * T * 2 + off * 2).to(tl.pointer_type(tl.uint16)), mask=ok).to(tl.int32)
    return k0 ^ v0 ^ k1 ^ v1, m


@triton.jit
def _probe_kernel(pool_ptr, bt_ptr, s_bt, seq_ptr, out_ptr, num_splits, block_bytes, plane_bytes, T: tl.constexpr,
                  KB: tl.constexpr, VB: tl.constexpr, META: tl.constexpr, BLOCK_N: tl.constexpr):
    split = tl.program_id(0)
    hp = tl.program_id(1)
    b = tl.program_id(2)
    seq_len = tl.load(seq_ptr + b)
    n_tiles = tl.cdiv(seq_len, BLOCK_N)
    per_split = tl.cdiv(n_tiles, num_splits)
    start = split * per_split * BLOCK_N
    end = tl.minimum(start + per_split * BLOCK_N, seq_len)
    ii = tl.arange(0, BLOCK_N)
    ww = tl.arange(0, KB // 4)
    head_off = hp * 2 * plane_bytes
    bt_row = bt_ptr + b * s_bt
    acc = tl.zeros((BLOCK_N, KB // 4), tl.int32)
    macc = tl.zeros((BLOCK_N,), tl.int32)
    nxt, nm = _probe_tile(pool_ptr, bt_row, start, end, head_off, block_bytes, plane_bytes, ii, ww, T, KB, VB, META)
    for t0 in range(start, end, BLOCK_N):
        cur, cm = nxt, nm
        nxt, nm = _probe_tile(pool_ptr, bt_row, t0 + BLOCK_N, end, head_off, block_bytes, plane_bytes, ii, ww, T, KB,
                              VB, META)
        acc ^= cur
        macc ^= cm
    pid = (b * tl.num_programs(1) + hp) * tl.num_programs(0) + split
    tl.store(out_ptr + pid, tl.sum(acc, axis=1).to(tl.int32).sum() + tl.sum(macc))


def probe(pool, layout, table, seq, out, block_n: int, warps: int, splits: int):
    grid = (splits, layout.num_kv_heads // 2, table.shape[0])
    _probe_kernel[grid](pool, table, table.stride(0), seq, out, splits, layout.block_bytes, layout.plane_bytes,
                        T=layout.block_size, KB=layout.key_bytes, VB=layout.value_bytes, META=layout.metadata_offset,
                        BLOCK_N=block_n, num_warps=warps, num_stages=1)


FLUSH = 256 * 2**20


def timed(fn, flush_mode: str, buf: torch.Tensor, reps: int = 200) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        with torch.cuda.graph(g, stream=stream):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    sink = torch.empty((), dtype=torch.int64, device="cuda")
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        if flush_mode == "zero":
            buf.zero_()
        elif flush_mode == "read":
            torch.sum(buf.view(torch.int64), 0, out=sink)
        starts[i].record()
        g.replay()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def relaid(pool, table_from, table_to):
    """A pool holding pool's blocks at table_to's places (the same tokens per row)."""
    new = torch.empty_like(pool)
    new[table_to.flatten().long()] = pool[table_from.flatten().long()]
    return new


def tables(b: int, nb: int) -> dict[str, torch.Tensor]:
    j = torch.arange(nb, device="cuda", dtype=torch.int32)
    r = torch.arange(b, device="cuda", dtype=torch.int32)
    return {"interleaved": (j[None, :] * b + r[:, None]).contiguous(), "contiguous": (r[:, None] * nb + j[None, :])}


def main() -> None:
    out_dir = Path(os.environ.get("OUT", "/tmp/s19c1"))
    out_dir.mkdir(parents=True, exist_ok=True)
    buf = torch.empty(FLUSH, dtype=torch.uint8, device="cuda")
    hq, hk, d = 32, 8, 128
    rows = []

    def row(gb: float, **kw):
        kw["gbs"] = gb / kw["ms"] * 1e3
        rows.append(kw)
        print(" ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in kw.items()), flush=True)

    for b, s in ((16, 32768), (1, 32768)):
        q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.float16)
        k = torch.randn(b, hk, s, d, device="cuda", dtype=torch.float16)
        v = torch.randn_like(k)
        for fm in ("zero", "read", "none"):
            row(B=b, S=s, T=0, table="-", what="fp16 SDPA", flush=fm,
                ms=timed(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), fm, buf),
                gb=2 * k.numel() * 2 / 1e9)
        del k, v
        ref_out = None
        for t in (16, 64):
            layout = BlockLayout(make_config("4bit", t), hk, d)
            pool0, rand = _fill_pool(layout, b, s)
            seq = torch.full((b,), s, device="cuda", dtype=torch.int32)
            nb = rand.shape[1]
            gbytes = b * hk * s * (layout.key_bytes + layout.value_bytes + 6) / 1e9
            kinds = {"randperm": (pool0, rand)}
            for name, tab in tables(b, nb).items():
                kinds[name] = (relaid(pool0, rand, tab), tab)
            for name, (pool, tab) in kinds.items():
                out = torch.full_like(q, float("nan"))

                def dec():
                    return unified_attention(q, pool, layout, tab, seq, 1 / math.sqrt(d), max_seq_len=s, out=out)

                for fm in (("zero", "read", "none") if name == "randperm" else ("zero",)):
                    ms = timed(dec, fm, buf)
                    row(B=b, S=s, T=t, table=name, what="decode", flush=fm, ms=ms, gb=gbytes)
                dec()
                torch.cuda.synchronize()
                if ref_out is None:
                    ref_out = out.clone()
                diff = (out.float() - ref_out.float()).abs().max().item()
                print(f"  output max |diff| vs the first pool's: {diff:.3e}", flush=True)
                if b == 16:
                    pout = torch.zeros(16 * 4 * 16 * 8, dtype=torch.int32, device="cuda")
                    for bn, w in ((32, 1), (64, 1), (32, 4)):
                        ms = timed(lambda: probe(pool, layout, tab, seq, pout, bn, w, 16), "zero", buf)
                        row(B=b, S=s, T=t, table=name, what=f"probe {bn}/{w}w", flush="zero", ms=ms,
                            gb=gbytes)
            if b == 16 and t == 16:
                sink = torch.empty((), dtype=torch.int64, device="cuda")
                ms = timed(lambda: torch.sum(pool0.view(torch.int64).view(-1), 0, out=sink), "zero", buf)
                row(B=b, S=s, T=t, table="-", what="torch int64 sum of the pool", flush="zero", ms=ms,
                    gb=pool0.numel() / 1e9)
                ms = timed(lambda: torch.sum(buf.view(torch.int64), 0, out=sink), "none", buf)
                row(B=b, S=s, T=t, table="-", what="torch int64 sum of 256 MB", flush="none", ms=ms,
                    gb=buf.numel() / 1e9)
            del kinds, pool0
            torch.cuda.empty_cache()
    (out_dir / "s19call1.json").write_text(json.dumps(rows, indent=1))
    print("\n| B | T | table | what | flush | ms | GB/s |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['B']} | {r['T']} | {r['table']} | {r['what']} | {r['flush']} | {r['ms']:.4f} | {r['gbs']:.0f} |")


if __name__ == "__main__":
    main()
