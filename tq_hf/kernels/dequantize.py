"""Dequantize a compressed history into dense K/V in the rotated spaces, one launch.

A forward of many queries (a chat's next turn, a prefill chunk) reads the history best as dense K/V through
flash attention (history.py): every query tile then shares one read of dense tiles, where the unified kernel
decodes the codes again for each tile of queries. The keys come out as scale * c[code] + mu R^T (the key
rotation's space: q . k = (q R^T) . (k R^T)) and the values as mid + scale * (code - L/2) (the value rotation's
space), so the launch is elementwise: no matmul, and the caller rotates the few queries and outputs instead. The
exact tokens written over their positions afterwards (ExactTokens: the ring's and the prefix's, a few dozen per row)
are rotated in a launch of their own, by a small product per 16 positions (rotation.dot_square).

The code unpacking comes from reference.py's own packers (code_pieces): each coordinate's code is at most three
runs of bits in its token's row, found by packing one-bit codes, so this kernel holds no format of its own.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .. import reference
from ..layout import BlockLayout, key_planes, value_planes
from .checks import check_key_offset, check_layout_pool, check_tensor
from .codec_tensors import codec_tensors, next_pow2, value_rotation_tensor
from .fast_launch import LaunchSite, PlanCache, device_of, variant_key
from .rotation import dot_square, dot_in_f32
from .rounding import store_rounded

DEQUANT_WARPS = 4  # per program of one block and head (docs/performance.md)
CENTROID_LOADS = False  # key centroids gathered in registers (else a load per code; docs/performance.md)
MAX_PIECES = 3  # bit runs per code: 3-bit key planes keep the last two codes' bits in three bytes
FP16_MAX = tl.constexpr(65504.0)  # a constexpr: the kernel reads it


@functools.lru_cache(maxsize=None)
def code_pieces(layout: BlockLayout, values: bool, device: str) -> torch.Tensor:
    """[MAX_PIECES, 4, D] int32 (byte, shift, mask, place) per coordinate: its code is the sum over pieces of
    ((row[byte] >> shift) & mask) << place, `row` the token's packed key (or value) bytes; a piece of mask 0 is
    unused. Derived by packing one-bit codes with reference.pack_key_codes / pack_value_codes."""
    cfg, d = layout.config, layout.head_dim
    bits = cfg.value_bits if values else cfg.key_bits
    one_bits = torch.zeros(d, bits, d, dtype=torch.int64)  # [coordinate, bit, codes]: one set bit each
    for i in range(bits):
        one_bits[torch.arange(d), i, torch.arange(d)] = 1 << i
    flat = one_bits.flatten(0, 1)
    if values:
        packed = reference.pack_value_codes(flat, bits, value_planes(cfg, d))
    else:
        packed = reference.pack_key_codes(flat, bits, key_planes(cfg, d))
    packed = packed.to(torch.int64).unflatten(0, (d, bits))  # [coordinate, bit, bytes]
    pieces = torch.zeros(MAX_PIECES, 4, d, dtype=torch.int32)
    for c in range(d):
        runs: list[list[int]] = []  # [byte, shift, length, place]
        for i in range(bits):
            byte = int(packed[c, i].nonzero()[0, 0])
            shift = int(packed[c, i, byte]).bit_length() - 1
            last = runs[-1] if runs else None
            if last and last[0] == byte and last[1] + last[2] == shift and last[3] + last[2] == i:
                last[2] += 1
            else:
                runs.append([byte, shift, 1, i])
        if len(runs) > MAX_PIECES:
            raise ValueError(f"a code of coordinate {c} spans {len(runs)} bit runs; the dequantizer reads {MAX_PIECES}")
        for p, (byte, shift, length, place) in enumerate(runs):
            pieces[p, :, c] = torch.tensor([byte, shift, (1 << length) - 1, place], dtype=torch.int32)
    return pieces.to(device)


def piece_count(pieces: torch.Tensor) -> int:
    """Pieces in use (a constexpr: the kernel's loop over them unrolls)."""
    return int((pieces[:, 2] != 0).any(-1).sum())


@functools.lru_cache(maxsize=None)
def code_groups(layout: BlockLayout, values: bool, device: str) -> torch.Tensor | None:
    """code_pieces as G column groups [G, MAX_PIECES, 4] (start byte, shift, mask, place), when each group of D/G
    coordinates reads its pieces from consecutive bytes with one shift, mask and place (4-bit codes, FP8 keys, 3-bit
    planes): the kernel then loads each group's bytes as wide rows instead of gathering a byte per coordinate.
    None for formats that straddle bytes (3-bit bit streams) or groups of a width that is not a power of two."""
    pieces = code_pieces(layout, values, "cpu")
    d = layout.head_dim
    for g in (1, 2, 4, 8):
        width = d // g
        if d % g or width & (width - 1):
            continue
        grouped = pieces.unflatten(-1, (g, width))  # [P, 4, G, W]
        byte, rest = grouped[:, 0], grouped[:, 1:]
        step = torch.arange(width, dtype=torch.int32)
        used = grouped[:, 2] != 0
        starts = byte[..., :1]
        if ((byte == starts + step) | ~used).all() and (rest == rest[..., :1]).all() and (starts % 16 == 0).all():
            return grouped[..., 0].permute(2, 0, 1).contiguous().to(device)  # [G, P, 4]
    return None


@triton.jit
def _codes(row_ptr, pieces_ptr, rows, cols, ok, D: tl.constexpr, ROW_BYTES: tl.constexpr, ROW_P: tl.constexpr,
           PIECES: tl.constexpr):
    """[T, DP] int32 codes of the rows at row_ptr + rows * ROW_BYTES (code_pieces' recipe); 0 past D. The rows
    are loaded whole (wide, coalesced loads) and each coordinate's bytes gathered from them in registers."""
    col_ok = cols < D
    rb = tl.arange(0, ROW_P)
    row = tl.load(row_ptr + rows[:, None] * ROW_BYTES + rb[None, :], mask=ok[:, None] & (rb[None, :] < ROW_BYTES),
                  other=0).to(tl.int32)
    code = tl.zeros((rows.shape[0], cols.shape[0]), tl.int32)
    for p in tl.static_range(PIECES):
        byte = tl.load(pieces_ptr + (p * 4) * D + cols, mask=col_ok, other=0)
        shift = tl.load(pieces_ptr + (p * 4 + 1) * D + cols, mask=col_ok, other=0)
        mask = tl.load(pieces_ptr + (p * 4 + 2) * D + cols, mask=col_ok, other=0)
        place = tl.load(pieces_ptr + (p * 4 + 3) * D + cols, mask=col_ok, other=0)
        b = tl.gather(row, tl.broadcast_to(byte[None, :], (rows.shape[0], cols.shape[0])), 1)
        code = code | (((b >> shift[None, :]) & mask[None, :]) << place[None, :])
    return code


@triton.jit
def _group_codes(row_ptr, groups_ptr, g: tl.constexpr, rows, ok, W: tl.constexpr, ROW_BYTES: tl.constexpr,
                 PIECES: tl.constexpr, MAXP: tl.constexpr):
    """[T, W] int32 codes of column group g (code_groups' recipe): each piece a run of W consecutive bytes."""
    cw = tl.arange(0, W)
    code = tl.zeros((rows.shape[0], W), tl.int32)
    for p in tl.static_range(PIECES):
        entry = groups_ptr + (g * MAXP + p) * 4
        start = tl.multiple_of(tl.load(entry), 16)
        shift = tl.load(entry + 1)
        mask = tl.load(entry + 2)
        place = tl.load(entry + 3)
        b = tl.load(row_ptr + rows[:, None] * ROW_BYTES + start + cw[None, :], mask=ok[:, None], other=0).to(tl.int32)
        code = code | (((b >> shift) & mask) << place)
    return code


@triton.jit
def _meta(plane_ptr, field: tl.constexpr, rows, ok, T: tl.constexpr, META: tl.constexpr):
    ptr = (plane_ptr + (META + (field * T) * 2)).to(tl.pointer_type(tl.bfloat16))
    return tl.load(ptr + rows, mask=ok, other=0.0).to(tl.float32)


@triton.jit
def _exact_tokens(ring_ptr, s_rs, n, lo, pre_ptr, s_ps, p_len, rot_ptr, pos, ok, cols, D: tl.constexpr,
                  DP: tl.constexpr, ROT: tl.constexpr, DOT_F32: tl.constexpr):
    """([T, DP] fp32 exact tokens at positions pos, times rot (R^T [D, D]) where ROT; which rows hold one): the
    ring's slot pos % n for pos >= lo, the prefix's row pos for pos < p_len (p_len <= lo: disjoint)."""
    col_ok = cols < D
    in_ring = ok & (pos >= lo)
    in_prefix = ok & (pos < p_len)
    x = tl.load(ring_ptr + ((pos % n) * s_rs)[:, None] + cols[None, :], mask=in_ring[:, None] & col_ok[None, :],
                other=0.0).to(tl.float32)
    x += tl.load(pre_ptr + (pos * s_ps)[:, None] + cols[None, :], mask=in_prefix[:, None] & col_ok[None, :],
                 other=0.0).to(tl.float32)
    if ROT:
        x = dot_square(x, rot_ptr, D, DP, DOT_F32)
    return x, in_ring | in_prefix


@triton.jit
def _dequantize_kernel(pool_ptr, bt_ptr, s_bt, k_ptr, v_ptr, s_ob, s_oh, s_os, koff_ptr, s_koff, cent_ptr,
                       kpieces_ptr, vpieces_ptr, length,
                       H: tl.constexpr, T: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, KB: tl.constexpr,
                       VB: tl.constexpr, KBP: tl.constexpr, VBP: tl.constexpr, META: tl.constexpr,
                       PLANE: tl.constexpr, KEY_FP8: tl.constexpr, KEY_PIECES: tl.constexpr,
                       VALUE_PIECES: tl.constexpr, KEY_GROUPS: tl.constexpr, VALUE_GROUPS: tl.constexpr,
                       MAXP: tl.constexpr, VALUE_HALF: tl.constexpr, CODES: tl.constexpr, CENT_LOAD: tl.constexpr,
                       HAS_KOFF: tl.constexpr, SATURATE: tl.constexpr):
    """Program (j, h, b): block j of row b, KV head h -> its T positions of k/v [B, H, S, D] (strides s_ob, s_oh,
    s_os; D contiguous). KEY_GROUPS / VALUE_GROUPS > 0: the codes by code_groups' column groups (the pieces
    pointers hold those), 0: by code_pieces' per-coordinate gathers over the padded row."""
    j = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    blk = tl.load(bt_ptr + b * s_bt + j).to(tl.int64)
    plane_ptr = pool_ptr + blk * (H * PLANE) + h * PLANE
    rows = tl.arange(0, T)
    pos = j * T + rows
    ok = pos < length
    base = b.to(tl.int64) * s_ob + h.to(tl.int64) * s_oh
    kscale = _meta(plane_ptr, 0, rows, ok, T, META)
    vscale = _meta(plane_ptr, 1, rows, ok, T, META)
    vmid = _meta(plane_ptr, 2, rows, ok, T, META)
    KG: tl.constexpr = KEY_GROUPS if KEY_GROUPS > 0 else 1
    for g in tl.static_range(KG):
        if KEY_GROUPS > 0:
            cols = g * (D // KG) + tl.arange(0, D // KG)
            kcode = _group_codes(plane_ptr, kpieces_ptr, g, rows, ok, D // KG, KB, KEY_PIECES, MAXP)
        else:
            cols = tl.arange(0, DP)
            kcode = _codes(plane_ptr, kpieces_ptr, rows, cols, ok, D, KB, KBP, KEY_PIECES)
        if KEY_FP8:
            k = kcode.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        elif CENT_LOAD:
            k = tl.load(cent_ptr + kcode)
        else:
            k = tl.gather(tl.broadcast_to(tl.load(cent_ptr + tl.arange(0, CODES))[None, :], (T, CODES)), kcode, 1)
        k = k * kscale[:, None]
        if HAS_KOFF:
            k = k + tl.load(koff_ptr + b * s_koff + h * D + cols, mask=cols < D, other=0.0)[None, :]
        if SATURATE:  # fp16 out: a rotated coordinate may exceed fp16's range where the original ones did not
            k = tl.minimum(tl.maximum(k, -FP16_MAX), FP16_MAX)
        tl.store(k_ptr + base + (pos[:, None] * s_os + cols[None, :]), k.to(k_ptr.dtype.element_ty),
                 mask=ok[:, None] & (cols[None, :] < D))  # (int32 offsets: a row's positions x D < 2**31)
    VG: tl.constexpr = VALUE_GROUPS if VALUE_GROUPS > 0 else 1
    for g in tl.static_range(VG):
        if VALUE_GROUPS > 0:
            cols = g * (D // VG) + tl.arange(0, D // VG)
            vcode = _group_codes(plane_ptr + T * KB, vpieces_ptr, g, rows, ok, D // VG, VB, VALUE_PIECES, MAXP)
        else:
            cols = tl.arange(0, DP)
            vcode = _codes(plane_ptr + T * KB, vpieces_ptr, rows, cols, ok, D, VB, VBP, VALUE_PIECES)
        v = vmid[:, None] + vscale[:, None] * (vcode.to(tl.float32) - VALUE_HALF)
        if SATURATE:
            v = tl.minimum(tl.maximum(v, -FP16_MAX), FP16_MAX)
        tl.store(v_ptr + base + (pos[:, None] * s_os + cols[None, :]), v.to(v_ptr.dtype.element_ty),
                 mask=ok[:, None] & (cols[None, :] < D))


@triton.jit(do_not_specialize=["lo", "p_len", "pre_tiles", "ring_tile0"])
def _overlay_kernel(k_ptr, v_ptr, s_ob, s_oh, s_os, ek_ptr, ev_ptr, s_eb, s_eh, s_es, n, lo, pk_ptr, pv_ptr, s_pb,
                    s_ph, s_ps, p_len, rk_ptr, rv_ptr, length, pre_tiles, ring_tile0,
                    OT: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, ROT_K: tl.constexpr, ROT_V: tl.constexpr,
                    DOT_F32: tl.constexpr, SATURATE: tl.constexpr):
    """Program (i, h, b): tile i of the exact positions of row b, KV head h (the prefix's pre_tiles tiles of OT
    positions from 0, then the ring's from tile ring_tile0) -> those positions of k/v [B, H, S, D], the exact tokens
    rotated by rk / rv where ROT_K / ROT_V (ExactTokens); the other positions of the tile are left as they are."""
    i = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    tile = tl.where(i < pre_tiles, i, ring_tile0 + i - pre_tiles)
    pos = tile * OT + tl.arange(0, OT)
    ok = pos < length
    cols = tl.arange(0, DP)
    out = b * s_ob + h * s_oh + pos[:, None] * s_os + cols[None, :]
    y, exact = _exact_tokens(ek_ptr + b * s_eb + h * s_eh, s_es, n, lo, pk_ptr + b * s_pb + h * s_ph, s_ps, p_len,
                             rk_ptr, pos, ok, cols, D, DP, ROT_K, DOT_F32)
    if SATURATE:  # fp16 out: as the dequantization, a rotated coordinate saturates
        y = tl.minimum(tl.maximum(y, -FP16_MAX), FP16_MAX)
    store_rounded(k_ptr + out, y, exact[:, None] & (cols[None, :] < D))
    y, exact = _exact_tokens(ev_ptr + b * s_eb + h * s_eh, s_es, n, lo, pv_ptr + b * s_pb + h * s_ph, s_ps, p_len,
                             rv_ptr, pos, ok, cols, D, DP, ROT_V, DOT_F32)
    if SATURATE:
        y = tl.minimum(tl.maximum(y, -FP16_MAX), FP16_MAX)
    store_rounded(v_ptr + out, y, exact[:, None] & (cols[None, :] < D))


class ExactTokens(NamedTuple):
    """Exact tokens dequantize_rotated writes over their positions, rotated into the dense copy's spaces on the device
    (where torch took per tensor two matmuls and up to three copies): the ring [rows, H, n, D] serves positions
    [lo, length) (position p at slot p % n), the prefix [rows, H, P, D] positions [0, prefix_len) (prefix_len <= lo);
    both in the output dtype, D contiguous, keys and values of the same strides, or None. key_rotation /
    value_rotation: R^T / Rv^T [D, D] in that dtype, contiguous, or None (that space is the model's)."""

    ring_keys: torch.Tensor | None
    ring_values: torch.Tensor | None
    lo: int
    prefix_keys: torch.Tensor | None
    prefix_values: torch.Tensor | None
    prefix_len: int
    key_rotation: torch.Tensor | None
    value_rotation: torch.Tensor | None


OVERLAY_TILE = 16  # positions per program of the exact tokens' launch (a tensor-core product's narrowest M)


def dequantize_rotated(pool: torch.Tensor, layout: BlockLayout, block_table: torch.Tensor, length: int,
                       dtype: torch.dtype, key_offset: torch.Tensor | None = None,
                       out: tuple[torch.Tensor, torch.Tensor] | None = None,
                       exact: ExactTokens | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions [0, length) of every row as dense (K R^T, V Rv^T), each [rows, H, length, D] in `dtype`: the keys
    in the key rotation's space (as they are for FP8 keys), the values in the value rotation's (as they are
    without value_rotation). key_offset: the key_centering mean already in that space, [H, D] or [rows, H, D]
    (fp32). out: the two buffers to write (that shape and dtype, D contiguous; default: new ones). exact: tokens
    written over the pool's at their positions by a second launch (ExactTokens). The caller checks the arguments
    (history.py); the pool's bytes are read as they are."""
    rows, h, d, t = block_table.shape[0], layout.num_kv_heads, layout.head_dim, layout.block_size
    if out is None:
        k = torch.empty(rows, h, length, d, dtype=dtype, device=pool.device)
        v = torch.empty_like(k)
    else:
        k, v = out
        if k.shape != (rows, h, length, d) or v.shape != k.shape or k.dtype != dtype or v.dtype != dtype or (
                k.stride(-1) != 1 or v.stride() != k.stride()):
            raise ValueError(f"out must be two {dtype} buffers [{rows}, {h}, {length}, {d}] of the same strides, "
                             f"D contiguous; got {list(k.shape)} {k.dtype} and {list(v.shape)} {v.dtype}")
    if rows == 0 or length == 0:
        return k, v
    koff = key_offset.float().contiguous() if key_offset is not None else None
    s_koff = h * d if koff is not None and koff.dim() == 3 else 0
    # the grid follows the length; the compiled variant follows only what int_key / pointer_key tell of each
    # argument, so one plan serves every length of a kind (chunked prefill, a chat's turns) without Triton's binder
    ints = (block_table.stride(0), k.stride(0), k.stride(1), k.stride(2), s_koff, length)
    cent, kp, vp = _codec(layout, str(pool.device))
    koff = koff if koff is not None else cent  # (not read without an offset)
    key = (layout, dtype, key_offset is not None, *variant_key((pool, block_table, k, v, koff) + ints))
    site = _PLANS.get(key)
    if site is None:
        site = _PLANS.put(key, _dequantize_site(layout, str(pool.device), dtype, key_offset is not None))
    with device_of(pool):
        site.regrid((-(-length // t), h, rows))(pool, block_table, ints[0], k, v, *ints[1:4], koff, s_koff, cent, kp,
                                                 vp, length)
        if exact is not None:
            _overlay(exact, k, v, length)
    return k, v


def _overlay(exact: ExactTokens, k: torch.Tensor, v: torch.Tensor, length: int) -> None:
    """One launch writing `exact`'s tokens over their positions of k and v (after the dequantization's, on its stream):
    a program per OVERLAY_TILE positions of the prefix's and the ring's ranges, per row and KV head."""
    rows, h, _, d = k.shape
    ring, prefix = exact.ring_keys, exact.prefix_keys
    ring_args = (ring, exact.ring_values, *ring.stride()[:3], ring.shape[2], exact.lo) if ring is not None else (
        k, v, 0, 0, 0, 1, length)
    prefix_args = (prefix, exact.prefix_values, *prefix.stride()[:3], exact.prefix_len) if prefix is not None else (
        k, v, 0, 0, 0, 0)
    lo, p_len = ring_args[-1], prefix_args[-1]
    pre_tiles = -(-p_len // OVERLAY_TILE)
    ring_tile0 = lo // OVERLAY_TILE
    tiles = pre_tiles + (max(0, -(-length // OVERLAY_TILE) - ring_tile0) if ring is not None else 0)
    if tiles == 0:
        return
    rk = exact.key_rotation if exact.key_rotation is not None else k  # (not read without a rotation)
    rv = exact.value_rotation if exact.value_rotation is not None else k
    args = (k, v, *k.stride()[:3], *ring_args, *prefix_args, rk, rv, length, pre_tiles, ring_tile0)
    # lo, p_len and the tile counts are not specialized (args 11, 17, 21, 22)
    key = (d, exact.key_rotation is not None, exact.value_rotation is not None,
           *variant_key(args[:11] + args[12:17] + args[18:21]))
    site = _OVERLAYS.get(key)
    if site is None:
        site = _OVERLAYS.put(key, LaunchSite(_overlay_kernel, (1, 1, 1), dict(
            OT=OVERLAY_TILE, D=d, DP=next_pow2(d), ROT_K=exact.key_rotation is not None,
            ROT_V=exact.value_rotation is not None, SATURATE=k.dtype == torch.float16,
            DOT_F32=dot_in_f32(k.dtype, k.device), num_warps=4)))
    site.regrid((tiles, h, rows))(*args)


_OVERLAYS = PlanCache()
_PLANS = PlanCache()


@functools.lru_cache(maxsize=None)
def _codec(layout: BlockLayout, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(centroids, key pieces, value pieces) as the kernel reads them: code_groups where they apply, else
    code_pieces."""
    kg, vg = code_groups(layout, False, device), code_groups(layout, True, device)
    return (codec_tensors(layout, device)[3], kg if kg is not None else code_pieces(layout, False, device),
            vg if vg is not None else code_pieces(layout, True, device))


def _dequantize_site(layout: BlockLayout, device: str, dtype: torch.dtype, has_offset: bool) -> LaunchSite:
    """The launch of _dequantize_kernel for this format and output dtype (its grid set per call)."""
    cfg, d = layout.config, layout.head_dim
    kg, vg = code_groups(layout, False, device), code_groups(layout, True, device)
    return LaunchSite(_dequantize_kernel, (1, 1, 1), dict(
        H=layout.num_kv_heads, T=layout.block_size, D=d, DP=next_pow2(d), KB=layout.key_bytes, VB=layout.value_bytes,
        KBP=next_pow2(layout.key_bytes), VBP=next_pow2(layout.value_bytes), META=layout.metadata_offset,
        PLANE=layout.plane_bytes, KEY_FP8=not cfg.uses_codebook, KEY_PIECES=_pieces_in_use(layout, False),
        VALUE_PIECES=_pieces_in_use(layout, True), KEY_GROUPS=0 if kg is None else kg.shape[0],
        VALUE_GROUPS=0 if vg is None else vg.shape[0], MAXP=MAX_PIECES, VALUE_HALF=((1 << cfg.value_bits) - 1) / 2,
        CODES=_codec(layout, device)[0].numel(), CENT_LOAD=CENTROID_LOADS, HAS_KOFF=has_offset,
        SATURATE=dtype == torch.float16, num_warps=DEQUANT_WARPS))


def rotated_mean(layout: BlockLayout, key_offset: torch.Tensor | None) -> torch.Tensor | None:
    """The key_centering mean in the key rotation's space, as dequantize_rotated takes it (FP8 keys: as it is)."""
    if key_offset is None or not layout.config.uses_codebook:
        return key_offset
    rotation_t = codec_tensors(layout, str(key_offset.device))[0].T
    # a broadcast product summed (two short launches), not a matmul: cuBLAS ran the 8 x 128 by 128 x 128 fp32
    # product as one tile, a large share of a many-query forward's device time (docs/performance.md)
    return (key_offset.unsqueeze(-1) * rotation_t).sum(-2)


def dequantize(pool: torch.Tensor, layout: BlockLayout, block_table: torch.Tensor,
               key_offset: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.gather by the kernel: every slot of every row's blocks as (K, V), each [B, H, NB * T, D] float32 in
    the model's space (the rotations undone by one matmul each), for attention implementations that read the
    history dense. key_offset: the key_centering mean, [H, D] or [B, H, D]."""
    check_layout_pool(pool, layout)
    check_tensor("block_table", block_table, dim=2, dtypes=(torch.int32, torch.int64), device=pool.device)
    key_offset, _ = check_key_offset(key_offset, layout, pool.device, rows=block_table.shape[0])
    cfg, device = layout.config, str(pool.device)
    rot = codec_tensors(layout, device)[0] if cfg.uses_codebook else None  # R: rotated = x @ R^T
    k, v = dequantize_rotated(pool, layout, block_table, block_table.shape[1] * layout.block_size, torch.float32,
                              rotated_mean(layout, key_offset))
    vrot = value_rotation_tensor(layout, device) if cfg.value_rotation else None
    return k if rot is None else k @ rot, v if vrot is None else v @ vrot


@functools.lru_cache(maxsize=None)
def _pieces_in_use(layout: BlockLayout, values: bool) -> int:
    return piece_count(code_pieces(layout, values, "cpu"))
