"""Segment reduction for split-KV decode: merge per-split partial outputs by their log-sum-exp.

Under value rotation the partials may stay in the rotated value space (the attention kernel's ROT_IN_REDUCE) and the
merged row is rotated back here, once per row instead of once per split program; exact values accumulated in the
original space then sit in a second half of each partial row (EXACT_PART)."""

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
    vrot_ptr,  # [D, D] fp32 value rotation Rv, if VALUE_ROT
    D: tl.constexpr, DP: tl.constexpr, G: tl.constexpr, BLOCK_M: tl.constexpr, NSP: tl.constexpr,
    M_TILES: tl.constexpr,  # row tiles per KV head (row r in tile r // BLOCK_M)
    PARTIAL_W: tl.constexpr,  # fp32 values per partial row: DP, or 2 x DP with EXACT_PART
    VALUE_ROT: tl.constexpr,  # the partials are in the rotated value space: the merged row is multiplied by Rv
    EXACT_PART: tl.constexpr,  # (VALUE_ROT) each partial row's second DP values: exact values, original space
    ROT_STEP: tl.constexpr,  # rotated coordinates per step of the product with Rv
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
    row0 = pout_ptr + base.to(tl.int64)[:, None] * PARTIAL_W
    live = sp[:, None] < num_splits
    if VALUE_ROT:  # (sum_s w_s y_s) @ Rv, ROT_STEP rotated coordinates at a time
        acc = tl.zeros((DP,), tl.float32)
        for c0 in tl.static_range(0, DP, ROT_STEP):
            kc = c0 + tl.arange(0, ROT_STEP)
            y = tl.sum(tl.load(row0 + kc[None, :], mask=live & (kc[None, :] < D), other=0.0) * w[:, None], axis=0)
            rv = tl.load(vrot_ptr + kc[:, None] * D + dc[None, :], mask=(kc[:, None] < D) & (dc[None, :] < D), other=0.0)
            acc += tl.sum(y[:, None] * rv, axis=0)
        if EXACT_PART:
            acc += tl.sum(tl.load(row0 + DP + dc[None, :], mask=live & (dc[None, :] < D), other=0.0) * w[:, None], axis=0)
    else:
        acc = tl.sum(tl.load(row0 + dc[None, :], mask=live & (dc[None, :] < D), other=0.0) * w[:, None], axis=0)
    res = tl.where(total > 0, acc / tl.where(total > 0, total, 1.0), 0.0)
    qi = r // G
    qg = r % G
    dst = o_ptr + b.to(tl.int64) * s_ob + (h * G + qg).to(tl.int64) * s_oh + qi.to(tl.int64) * s_ol
    store_rounded(dst + dc, res, dc < D)


def reduce_site(b: int, hk: int, g: int, lq: int, num_splits: int, block_m: int, d: int, dp: int,
                m_tiles: int = 1, value_rotation: bool = False, exact_part: bool = False) -> LaunchSite:
    """The launch combining num_splits partials per (row, KV head, sequence) into out [B, Hq, Lq, D]; call it
    with (pout, plse, out, out.stride(0), out.stride(1), out.stride(2), num_splits, vrot). value_rotation: the
    partials are in the rotated value space (and exact_part: each row's exact values follow, original space)."""
    return LaunchSite(_reduce_kernel, (g * lq, hk, b), dict(
        D=d, DP=dp, G=g, BLOCK_M=block_m, NSP=next_pow2(num_splits), M_TILES=m_tiles,
        PARTIAL_W=partial_width(dp, value_rotation and exact_part), VALUE_ROT=value_rotation,
        EXACT_PART=value_rotation and exact_part, ROT_STEP=min(16, dp), num_warps=4 if dp >= 128 else 2))


def partial_width(dp: int, exact_part: bool) -> int:
    """fp32 values per split partial row: the output's DP, twice that when exact values are kept apart."""
    return 2 * dp if exact_part else dp
