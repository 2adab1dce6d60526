"""Segment reduction for split-KV decode: merge per-split partial outputs by their log-sum-exp.

Under value rotation the partials may stay in the rotated value space (the attention kernel's ROT_IN_REDUCE) and the
merged row is rotated back here, once per row instead of once per split program; exact values accumulated in the
original space then sit in a second half of each partial row (EXACT_PART)."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

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
    SPLIT_STEP: tl.constexpr,  # (VALUE_ROT) partials merged per step
    COL_STEP: tl.constexpr,  # (VALUE_ROT) output coordinates per product with Rv's columns
    ROT_STEP: tl.constexpr,  # (VALUE_ROT, COL_TILES 0) rotated coordinates per step of the product with Rv
    COL_TILES: tl.constexpr,  # (VALUE_ROT) programs per row, each rotating DP / COL_TILES output coordinates; 0: one
    # program per row stepping over the rotated coordinates (every split's slice of the partials each step)
    PDL: tl.constexpr,  # launched as a programmatic dependent: wait for the attention's partials first
):
    if PDL:
        gdc_wait()
    r = tl.program_id(0)  # row = (query i, group member g)
    h = tl.program_id(1)
    if COL_TILES > 1:
        b = tl.program_id(2) // COL_TILES
    else:
        b = tl.program_id(2)
    sp = tl.arange(0, NSP)
    dc = tl.arange(0, DP)
    tile = ((b * tl.num_programs(1) + h) * M_TILES + r // BLOCK_M).to(tl.int64)
    base = (tile * num_splits + sp) * BLOCK_M + r % BLOCK_M  # [NSP]
    lse = tl.load(plse_ptr + base, mask=sp < num_splits, other=-float("inf"))
    mx = tl.max(lse, axis=0)
    mx = tl.where(mx == -float("inf"), 0.0, mx)
    w = tl.exp2(lse - mx)
    total = tl.sum(w, axis=0)
    nonzero = tl.where(total > 0, total, 1.0)
    row0 = pout_ptr + base.to(tl.int64)[:, None] * PARTIAL_W
    live = sp[:, None] < num_splits
    qi = r // G
    qg = r % G
    dst = o_ptr + b.to(tl.int64) * s_ob + (h * G + qg).to(tl.int64) * s_oh + qi.to(tl.int64) * s_ol
    if VALUE_ROT and COL_TILES == 0:  # (sum_s w_s y_s) @ Rv, ROT_STEP rotated coordinates at a time
        acc = tl.zeros((DP,), tl.float32)
        for c0 in tl.static_range(0, DP, ROT_STEP):
            kc = c0 + tl.arange(0, ROT_STEP)
            y = tl.sum(tl.load(row0 + kc[None, :], mask=live & (kc[None, :] < D), other=0.0) * w[:, None], axis=0)
            rv = tl.load(vrot_ptr + kc[:, None] * D + dc[None, :], mask=(kc[:, None] < D) & (dc[None, :] < D), other=0.0)
            acc += tl.sum(y[:, None] * rv, axis=0)
        if EXACT_PART:
            acc += tl.sum(tl.load(row0 + DP + dc[None, :], mask=live & (dc[None, :] < D), other=0.0) * w[:, None], axis=0)
        store_rounded(dst + dc, tl.where(total > 0, acc / nonzero, 0.0), dc < D)
    elif VALUE_ROT:
        # the merged row y = sum_s w_s y_s (whole rows of partials per step, one cross-thread sum), then y @ Rv a few
        # of Rv's columns at a time; each of COL_TILES programs takes its share of the columns (few rows: more
        # programs than one per row)
        ss = tl.arange(0, SPLIT_STEP)
        part = tl.zeros((SPLIT_STEP, DP), tl.float32)
        for s0 in range(0, num_splits, SPLIT_STEP):
            sc = s0 + ss
            ok = sc < num_splits
            base_c = (tile * num_splits + sc) * BLOCK_M + r % BLOCK_M
            w_c = tl.exp2(tl.load(plse_ptr + base_c, mask=ok, other=-float("inf")) - mx)
            vals = tl.load(pout_ptr + base_c.to(tl.int64)[:, None] * PARTIAL_W + dc[None, :],
                           mask=ok[:, None] & (dc[None, :] < D), other=0.0)
            part += vals * w_c[:, None]
        y = tl.sum(part, axis=0)
        first = (tl.program_id(2) % COL_TILES) * (DP // COL_TILES) if COL_TILES > 1 else 0
        for c0 in tl.static_range(0, DP // COL_TILES, COL_STEP):
            cols = first + c0 + tl.arange(0, COL_STEP)
            col_ok = cols < D
            rv = tl.load(vrot_ptr + dc[:, None] * D + cols[None, :], mask=(dc[:, None] < D) & col_ok[None, :], other=0.0)
            res = tl.sum(y[:, None] * rv, axis=0)
            if EXACT_PART:
                res += tl.sum(tl.load(row0 + DP + cols[None, :], mask=live & col_ok[None, :], other=0.0) * w[:, None],
                              axis=0)
            store_rounded(dst + cols, tl.where(total > 0, res / nonzero, 0.0), col_ok)
    else:
        acc = tl.sum(tl.load(row0 + dc[None, :], mask=live & (dc[None, :] < D), other=0.0) * w[:, None], axis=0)
        store_rounded(dst + dc, tl.where(total > 0, acc / nonzero, 0.0), dc < D)


def reduce_site(b: int, hk: int, g: int, lq: int, num_splits: int, block_m: int, d: int, dp: int,
                m_tiles: int = 1, value_rotation: bool = False, exact_part: bool = False,
                column_sms: int | None = None, pdl: bool = False) -> LaunchSite:
    """The launch combining num_splits partials per (row, KV head, sequence) into out [B, Hq, Lq, D]; call it
    with (pout, plse, out, out.stride(0), out.stride(1), out.stride(2), num_splits, vrot). value_rotation: the
    partials are in the rotated value space (and exact_part: each row's exact values follow, original space);
    column_sms: the rotation by Rv's columns, their programs sharing them out to fill this many SMs (one program per
    row at least); None: one program per row stepping over the rotated coordinates. pdl: launched as a programmatic
    dependent of the attention (sm_90+), waiting for its partials in the kernel."""
    col_step = min(32, dp)
    col_tiles = 0 if column_sms is None else 1
    rows = b * hk * g * lq
    while value_rotation and col_tiles and 2 * col_tiles * rows <= column_sms and dp // (2 * col_tiles) >= col_step:
        col_tiles *= 2
    return LaunchSite(_reduce_kernel, (g * lq, hk, b * max(1, col_tiles)), dict(
        D=d, DP=dp, G=g, BLOCK_M=block_m, NSP=next_pow2(num_splits), M_TILES=m_tiles,
        PARTIAL_W=partial_width(dp, value_rotation and exact_part), VALUE_ROT=value_rotation,
        EXACT_PART=value_rotation and exact_part, SPLIT_STEP=min(16, next_pow2(num_splits)), COL_STEP=col_step,
        ROT_STEP=min(16, dp), COL_TILES=col_tiles, num_warps=4 if dp >= 128 else 2, **pdl_options(pdl)))


def pdl_options(pdl: bool) -> dict:
    """A launch's PDL constexpr and, when on, Triton's launch_pdl option (the launch attribute)."""
    return {"PDL": pdl, "launch_pdl": True} if pdl else {"PDL": False}


def partial_width(dp: int, exact_part: bool) -> int:
    """fp32 values per split partial row: the output's DP, twice that when exact values are kept apart."""
    return 2 * dp if exact_part else dp
