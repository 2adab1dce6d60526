"""Segment reduction for split-KV decode: merge per-split partial outputs by their log-sum-exp."""

from __future__ import annotations

import triton
import triton.language as tl

from .codec_tensors import next_pow2
from .fast_launch import LaunchSite
from .rounding import store_rounded


@triton.jit
def _reduce_kernel(
    pout_ptr,  # [B, Hk, M_TILES, NS, BLOCK_M, DP] fp32 normalised partial outputs
    plse_ptr,  # [B, Hk, M_TILES, NS, BLOCK_M] fp32 log2-sum-exp of each partial (-inf: empty)
    o_ptr, s_ob, s_oh, s_ol,  # [B, Hq, Lq, D] output
    num_splits,
    D: tl.constexpr, DP: tl.constexpr, G: tl.constexpr, BLOCK_M: tl.constexpr, NSP: tl.constexpr,
    M_TILES: tl.constexpr,  # row tiles per KV head (row r in tile r // BLOCK_M)
):
    r = tl.program_id(0)  # row = (query i, group member g)
    h = tl.program_id(1)
    b = tl.program_id(2)
    sp = tl.arange(0, NSP)
    dc = tl.arange(0, DP)
    tile = ((b * tl.num_programs(1) + h) * M_TILES + r // BLOCK_M).to(tl.int64)
    base = (tile * num_splits + sp) * BLOCK_M + r % BLOCK_M  # [NSP]
    lse = tl.load(plse_ptr + base, mask=sp < num_splits, other=-float("inf"))
    mx = tl.max(lse, axis=0)
    w = tl.exp2(lse - tl.where(mx == -float("inf"), 0.0, mx))
    total = tl.sum(w, axis=0)
    part = tl.load(pout_ptr + base.to(tl.int64)[:, None] * DP + dc[None, :], mask=(sp[:, None] < num_splits) & (dc[None, :] < D), other=0.0)
    acc = tl.sum(part * w[:, None], axis=0)
    res = tl.where(total > 0, acc / tl.where(total > 0, total, 1.0), 0.0)
    qi = r // G
    qg = r % G
    dst = o_ptr + b.to(tl.int64) * s_ob + (h * G + qg).to(tl.int64) * s_oh + qi.to(tl.int64) * s_ol
    store_rounded(dst + dc, res, dc < D)


def reduce_site(b: int, hk: int, g: int, lq: int, num_splits: int, block_m: int, d: int, dp: int,
                m_tiles: int = 1) -> LaunchSite:
    """The launch combining num_splits partials per (row, KV head, sequence) into out [B, Hq, Lq, D];
    call it with (pout, plse, out, out.stride(0), out.stride(1), out.stride(2), num_splits)."""
    return LaunchSite(_reduce_kernel, (g * lq, hk, b), dict(
        D=d, DP=dp, G=g, BLOCK_M=block_m, NSP=next_pow2(num_splits), M_TILES=m_tiles,
        num_warps=4 if dp >= 128 else 2))
