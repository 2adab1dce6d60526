"""Fused store: quantize new keys/values and write them into their cache slots, one launch.

Each program takes BLOCK_T tokens of one KV head, their keys or their values: keys (minus the
key_centering mean, if any) are rotated by one tensor-core matmul (3xTF32, so codes match
reference.py's fp32 rotation), bucketed against the codebook boundaries, norm corrected and
packed; values (rotated the same way under value_rotation) get their midpoint/scale and packed
codes; the three bfloat16 metadata fields are rounded with reference.py's exact rules using
integer bit operations.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from ..codebook import is_symmetric
from ..layout import KEY_SCALE, VALUE_MID, VALUE_SCALE, BlockLayout, key_planes, ring_tail_bytes, value_planes
from ..reference import token_rows
from .checks import ACTIVATION_DTYPES, check_key_offset, check_layout_pool, check_ring_alignment, check_tensor
from .codec_tensors import codec_tensors, key_rotation_units, next_pow2, value_rotation_tensor, value_rotation_units
from .device import DeviceTraits, device_traits as _traits_of
from .fast_launch import LaunchSite, PlanCache, addresses, argument_key, device_of, holdable_offset
from .launch_config import StoreLaunchConfig
from .rotation import hadamard_dot, hadamard_input, matmul_square, row_norm, split_dot
from .rounding import bf16_bits_to_f32, bf16_rne_bits, bf16_up_bits, fp8e4m3_bits


@triton.jit
def _store_meta(plane, field: tl.constexpr, off, T: tl.constexpr, META: tl.constexpr, bits, mask):
    """Write bfloat16 bit patterns `bits` into metadata field `field` of tokens `off`."""
    ptr = (plane + META + (field * T + off) * 2).to(tl.pointer_type(tl.int16))
    tl.store(ptr, bits.to(tl.int16), mask=mask)


@triton.jit
def _unit_input(x, D: tl.constexpr):
    """x with rows scaled to |.| <= 1 for _unit_dot, and the factor that takes its products back to x @ R^T (the
    rows' scale / sqrt(D)); hadamard_input without the signs, which ride in the units."""
    n = row_norm(x)[:, None]
    return x / n, n * (1.0 / tl.sqrt(D * 1.0))


@triton.jit
def _unit_dot(xu, units_ptr, rows, out, out_ok, D: tl.constexpr):
    """xu @ U^T[rows, out] for the fp16 units U (+-1, codec_tensors' *_rotation_units) of R = U / sqrt(D), xu from
    _unit_input through 3 fp16 parts: hadamard_dot with the entries read instead of built (the same products)."""
    u = tl.load(units_ptr + out[None, :] * D + rows[:, None], mask=(rows[:, None] < D) & out_ok[None, :], other=0.0)
    return split_dot(xu, u, tl.zeros((xu.shape[0], out.shape[0]), tl.float32), 3)


@triton.jit
def _rotate_halves(x, rot_ptr, D: tl.constexpr, DP: tl.constexpr, DHP: tl.constexpr, HADAMARD: tl.constexpr,
                   UNITS: tl.constexpr):
    """(x @ R^T)[:, :D/2] and [:, D/2:] (fp32, 3xTF32; under rotation="hadamard" R is not read but its fp16 units,
    UNITS, or its entries built in registers, rotation.hadamard_dot): the split-half nibble pairs (j, j + D/2)."""
    cols = tl.arange(0, DP)
    hc = tl.arange(0, DHP)
    # (one branch per case, no early return: Triton type-checks the code after a constexpr branch's return, and
    # with the fp16 units the fp32 branch's dots would not compile)
    if HADAMARD and UNITS:
        xu, scale = _unit_input(x, D)
        y_lo = _unit_dot(xu, rot_ptr, cols, hc, hc < D // 2, D) * scale
        y_hi = _unit_dot(xu, rot_ptr, cols, hc + D // 2, hc < D // 2, D) * scale
    elif HADAMARD:
        xu, scale = hadamard_input(x, rot_ptr, cols, D)
        zero = tl.zeros((x.shape[0], DHP), tl.float32)
        y_lo = hadamard_dot(xu, cols, hc, hc < D // 2, zero, 3) * scale
        y_hi = hadamard_dot(xu, cols, hc + D // 2, hc < D // 2, zero, 3) * scale
    else:
        rmask = (cols[:, None] < D) & (hc[None, :] < D // 2)
        r_lo = tl.load(rot_ptr + hc[None, :] * D + cols[:, None], mask=rmask, other=0.0)  # R^T[:, :D/2]
        r_hi = tl.load(rot_ptr + (hc[None, :] + D // 2) * D + cols[:, None], mask=rmask, other=0.0)
        y_lo = tl.dot(x, r_lo, input_precision="tf32x3")
        y_hi = tl.dot(x, r_hi, input_precision="tf32x3")
    return y_lo, y_hi


@triton.jit
def _rotate(x, rot_ptr, D: tl.constexpr, DP: tl.constexpr, HADAMARD: tl.constexpr, UNITS: tl.constexpr):
    """x @ R^T (fp32, 3xTF32; under rotation="hadamard" from R's fp16 units, UNITS, or built in registers)."""
    cols = tl.arange(0, DP)
    if HADAMARD and UNITS:
        xu, scale = _unit_input(x, D)
        y = _unit_dot(xu, rot_ptr, cols, cols, cols < D, D) * scale
    elif HADAMARD:
        xu, scale = hadamard_input(x, rot_ptr, cols, D)
        y = hadamard_dot(xu, cols, cols, cols < D, tl.zeros((x.shape[0], DP), tl.float32), 3) * scale
    else:
        y = matmul_square(x, rot_ptr, D, DP, True)
    return y


@triton.jit
def _bucket(y, bnd_ptr, cent_ptr, NB: tl.constexpr):
    """(codebook index, centroid) of y: the index is the number of the NB ascending boundaries
    strictly below y (torch.bucketize). A compare/select chain, not tl.gather: Triton 3.6 fails to
    compile gathers whose axis is not warp-local (e.g. 16 rows over 8 warps)."""
    above = y > tl.load(bnd_ptr)
    code = above.to(tl.int32)
    val = tl.where(above, tl.load(cent_ptr + 1), tl.load(cent_ptr))
    for i in tl.static_range(1, NB):
        above = y > tl.load(bnd_ptr + i)
        code += above.to(tl.int32)
        val = tl.where(above, tl.load(cent_ptr + i + 1), val)
    return code, val


@triton.jit
def _bucket_sign_magnitude(y, bnd_ptr, cent_ptr, NC: tl.constexpr):
    """(stored code, centroid) of y for a symmetric codebook (boundary NC/2 - 1 is 0, c[NC-1-n] == -c[n]
    exactly): the same as _bucket followed by reference.stored_codes (sign-magnitude), from the
    magnitude's rank over the NC/2 - 1 positive boundaries: half the compares and no remap (H200, the
    remap after _bucket cost 20% of a 16k-token 4-bit store)."""
    H: tl.constexpr = NC // 2
    neg = y <= 0.0  # levels 0 .. H-1 (boundary H-1 is 0, and a level counts boundaries strictly below y)
    a = tl.abs(y)
    # for y <= 0 the rank counts boundaries <= |y|: one ulp up turns that into the strict compare below
    a = tl.where(neg, (a.to(tl.int32, bitcast=True) + 1).to(tl.float32, bitcast=True), a)
    rank = tl.zeros(y.shape, tl.int32)
    mag = tl.zeros(y.shape, tl.float32) + tl.load(cent_ptr + H)
    for i in tl.static_range(0, H - 1):
        above = a > tl.load(bnd_ptr + H + i)
        rank += above.to(tl.int32)
        mag = tl.where(above, tl.load(cent_ptr + H + 1 + i), mag)
    return rank + neg.to(tl.int32) * H, tl.where(neg, -mag, mag)


@triton.jit
def _store3(ptr, codes, mask, BLOCK_T: tl.constexpr, GP: tl.constexpr):
    """Pack int32 codes [BLOCK_T, 8 * GP] as the 3-bit little-endian stream: 8 codes -> 3 bytes
    at ptr [BLOCK_T, GP] (byte pointers of each group's first byte)."""
    phase = tl.arange(0, 8)
    word = tl.sum(tl.reshape(codes, (BLOCK_T, GP, 8)) << (3 * phase)[None, None, :], axis=2)
    tl.store(ptr, (word & 255).to(tl.uint8), mask=mask)
    tl.store(ptr + 1, ((word >> 8) & 255).to(tl.uint8), mask=mask)
    tl.store(ptr + 2, ((word >> 16) & 255).to(tl.uint8), mask=mask)


@triton.jit
def _store_key_planes(row, code, ok, BLOCK_T: tl.constexpr, D: tl.constexpr):
    """Write codes [BLOCK_T, D] (coordinate c * J + j, J = D/8) as the three byte planes of layout.py at
    the key rows `row` [BLOCK_T, 1]: byte j of plane k = p_2k | p_2k+1 << 4 | bit k of p_6 << 3 | of p_7 << 7."""
    J: tl.constexpr = D // 8
    x = tl.permute(tl.reshape(code, (BLOCK_T, 2, 2, 2, J)), (0, 4, 1, 2, 3))  # [T, j, a, b, e]: c = 4a + 2b + e
    even, odd = tl.split(x)
    nib = even | (odd << 4)  # [T, j, a, b]: pair k = 2a + b holds p_2k | p_2k+1 << 4 (k = 3: p_6 | p_7 << 4)
    b0, b1 = tl.split(nib)
    k0, k2 = tl.split(b0)
    k1, k3 = tl.split(b1)
    jj = tl.arange(0, J)
    m = ok[:, None]
    tl.store(row + jj[None, :], (k0 | ((k3 & 0x11) << 3)).to(tl.uint8), mask=m)
    tl.store(row + J + jj[None, :], (k1 | (((k3 >> 1) & 0x11) << 3)).to(tl.uint8), mask=m)
    tl.store(row + 2 * J + jj[None, :], (k2 | (((k3 >> 2) & 0x11) << 3)).to(tl.uint8), mask=m)


@triton.jit
def _store_value_planes(row, code, ok, BLOCK_T: tl.constexpr, D: tl.constexpr):
    """Write codes [BLOCK_T, D] as the 2-bit plane and the bit plane of layout.py at the value rows `row`
    [BLOCK_T, 1]: byte j of the first = the low bits of coordinates a * D/4 + j at bits 2a; byte i of the
    second = bit 2 of coordinates t * D/8 + i at bit t. Disjoint bits, so sums are ors."""
    Q: tl.constexpr = D // 4
    E: tl.constexpr = D // 8
    low = tl.sum(tl.reshape(code & 3, (BLOCK_T, 4, Q)) << (2 * tl.arange(0, 4))[None, :, None], axis=1)
    high = tl.sum(tl.reshape((code >> 2) & 1, (BLOCK_T, 8, E)) << tl.arange(0, 8)[None, :, None], axis=1)
    m = ok[:, None]
    tl.store(row + tl.arange(0, Q)[None, :], low.to(tl.uint8), mask=m)
    tl.store(row + Q + tl.arange(0, E)[None, :], high.to(tl.uint8), mask=m)


@triton.jit
def _value_codes(x, mid, div, HALF: tl.constexpr, LEVELS: tl.constexpr):
    q = tl.floor(tl.math.div_rn(x - mid[:, None], div[:, None]) + (HALF + 0.5))
    return tl.minimum(tl.maximum(q, 0.0), LEVELS).to(tl.int32)


@triton.jit
def _token_planes(slot, ok, pool_ptr, block_bytes, head_bytes, T: tl.constexpr):
    """Each token's plane of its head ([BLOCK_T] uint8 pointers) and its offset in the block (0 where not ok)."""
    blk = tl.where(ok, slot // T, 0)
    off = tl.where(ok, slot % T, 0)
    return pool_ptr + blk * block_bytes + head_bytes, off


@triton.jit
def _write_ring(ring_ptr, ring_row, cols, raw, rmask, in_ring, D: tl.constexpr, DP: tl.constexpr,
                BLOCK_T: tl.constexpr, RING_Q8: tl.constexpr, TAIL_HALVES: tl.constexpr):
    """Tokens into their ring slots (row offsets ring_row): as they are, in the ring's dtype, or as int8 records
    (reference.encode_ring, bit for bit: per 16 elements s = the smallest bfloat16 >= absmax / 127 and codes
    floor(x / s + 1/2), then the scales' bfloat16 bits and zeros to TAIL_HALVES 16-bit words)."""
    if RING_Q8:
        GROUPS: tl.constexpr = DP // 16
        x = tl.reshape(tl.where(rmask, raw.to(tl.float32), 0.0), (BLOCK_T, GROUPS, 16))
        s_bits = bf16_up_bits(tl.math.div_rn(tl.max(tl.abs(x), axis=2), 127.0))  # [BLOCK_T, GROUPS]
        s = bf16_bits_to_f32(s_bits)
        c = tl.floor(tl.math.div_rn(x, tl.where(s > 0, s, 1.0)[:, :, None]) + 0.5)
        c = tl.reshape(tl.minimum(tl.maximum(c, -127.0), 127.0), (BLOCK_T, DP))
        tl.store(ring_ptr + ring_row[:, None] + cols[None, :], c.to(tl.int8), mask=rmask)
        tail = (ring_ptr + ring_row + D).to(tl.pointer_type(tl.int16))
        g = tl.arange(0, GROUPS)
        tl.store(tail[:, None] + g[None, :], s_bits.to(tl.uint16).to(tl.int16, bitcast=True),
                 mask=in_ring[:, None] & (g[None, :] < D // 16))
        w = tl.arange(0, TAIL_HALVES)
        tl.store(tail[:, None] + w[None, :], tl.zeros((BLOCK_T, TAIL_HALVES), tl.int16),
                 mask=in_ring[:, None] & (w[None, :] >= D // 16))
    else:
        tl.store(ring_ptr + ring_row[:, None] + cols[None, :], raw.to(ring_ptr.dtype.element_ty), mask=rmask)


@triton.jit
def _ring_keys(kbase, koff_ptr, s_koff, tokens_per_row, rk_ptr, ring_row, cols, n, h, rmask, in_ring, D: tl.constexpr,
               DP: tl.constexpr, BLOCK_T: tl.constexpr, RING_Q8: tl.constexpr, HAS_KEY_OFFSET: tl.constexpr,
               TAIL_HALVES: tl.constexpr):
    """The tokens' keys into their ring slots (_write_ring); int8 key records hold k - mu (layout: the ring)."""
    kr = tl.load(kbase[:, None] + cols[None, :], mask=rmask)
    if RING_Q8 and HAS_KEY_OFFSET:
        rrow = (n // tokens_per_row).to(tl.int64) * s_koff + h * D
        kr = kr.to(tl.float32) - tl.load(koff_ptr + rrow[:, None] + cols[None, :], mask=rmask, other=0.0)
    _write_ring(rk_ptr, ring_row, cols, kr, rmask, in_ring, D, DP, BLOCK_T, RING_Q8, TAIL_HALVES)


@triton.jit
def _ring_values(vbase, rv_ptr, ring_row, cols, rmask, in_ring, D: tl.constexpr, DP: tl.constexpr,
                 BLOCK_T: tl.constexpr, RING_Q8: tl.constexpr, TAIL_HALVES: tl.constexpr):
    """The tokens' values into their ring slots (_write_ring)."""
    _write_ring(rv_ptr, ring_row, cols, tl.load(vbase[:, None] + cols[None, :], mask=rmask), rmask, in_ring, D, DP,
                BLOCK_T, RING_Q8, TAIL_HALVES)


# slot_shift, ring_start and new_len change every decode step: not specialized (one compiled variant serves them all)
@triton.jit(do_not_specialize=["slot_shift", "ring_start", "new_len"])
def _store_kernel(
    key_ptr, stride_kn, stride_kh,  # [N, H, D] fp16/bf16/fp32, last dim contiguous
    val_ptr, stride_vn, stride_vh,  # [N, H, D]
    slots_ptr,  # [N] int64, negative = skip
    slot_shift,  # added to every slot that is not skipped (a decode step: the rows' first slots + its position's)
    pool_ptr,  # [num_blocks, H, plane_bytes] uint8
    rot_ptr,  # [D, D] fp32 key rotation R (rotated = x @ R^T)
    cent_ptr,  # [2**KEY_BITS] fp32 centroids (ascending)
    bnd_ptr,  # [2**KEY_BITS - 1] fp32 decision boundaries
    koff_ptr, s_koff, tokens_per_row,  # fp32 key_centering mean [H, D] (s_koff 0) or [R, H, D] per row, if HAS_KEY_OFFSET
    vrot_ptr,  # [D, D] fp32 value rotation Rv (stored = v @ Rv^T), if VALUE_ROT
    N, block_bytes, plane_bytes,
    rk_ptr, rv_ptr, s_rb, s_rh, s_rw, ring_w,  # [R, H, W, D] recent ring (keys, values) or int8 records, if HAS_RING
    ring_start,  # the position of each row's first new token (token n: row n // tokens_per_row)
    seq_ptr, new_len,  # [R] int32 row lengths, set to new_len, if HAS_SEQ
    pos_ptr,  # int32/int64 device positions: [0] is each row's first new position (instead of ring_start), if POS_ON_DEVICE
    D: tl.constexpr, DP: tl.constexpr, DHP: tl.constexpr, GP: tl.constexpr,
    KEY_PLANES: tl.constexpr,  # 3-bit keys as code planes (layout.key_planes)
    VALUE_PLANES: tl.constexpr,  # 3-bit values as a 2-bit plane and a bit plane (layout.value_planes)
    T: tl.constexpr, KB: tl.constexpr, VB: tl.constexpr, META: tl.constexpr,
    KEY_BITS: tl.constexpr, VALUE_BITS: tl.constexpr, NORM_CORRECTION: tl.constexpr,
    HAS_KEY_OFFSET: tl.constexpr, VALUE_ROT: tl.constexpr, BLOCK_T: tl.constexpr,
    SYMMETRIC: tl.constexpr,  # 4-bit codebook exactly symmetric in fp32: _bucket_sign_magnitude
    HADAMARD: tl.constexpr,  # rotation="hadamard": R / Rv not read as fp32 (their fp16 units, or built in registers)
    UNITS: tl.constexpr,  # (HADAMARD) rot_ptr / vrot_ptr hold R / Rv x sqrt(D) in fp16 (+-1), read as MMA operands
    HAS_RING: tl.constexpr, HAS_SEQ: tl.constexpr,
    RING_Q8: tl.constexpr,  # the ring holds int8 records (layout.ring_spec)
    RING_TAIL_HALVES: tl.constexpr,  # 16-bit words after an int8 record's codes (layout.ring_tail_bytes / 2)
    POS_ON_DEVICE: tl.constexpr,  # the ring's positions from pos_ptr; skipped tokens (slot < 0) stay out of the ring
    RING_PART: tl.constexpr,  # programs of a third part write the ring (keys and values), beside the quantization
):
    pid_n = tl.program_id(0)
    h = tl.program_id(1)
    part = tl.program_id(2)  # 0: the keys, 1: the values (independent: a decode step's few tokens
    # then run on twice the programs, each half the serial work), 2: the ring under RING_PART
    n = pid_n * BLOCK_T + tl.arange(0, BLOCK_T)
    slot = tl.load(slots_ptr + n, mask=n < N, other=-1)
    ok = slot >= 0
    n64 = n.to(tl.int64)
    kbase = key_ptr + n64 * stride_kn + h * stride_kh
    vbase = val_ptr + n64 * stride_vn + h * stride_vh
    cols = tl.arange(0, DP)
    hc = tl.arange(0, DHP)
    g = tl.arange(0, GP)
    cmask = ok[:, None] & (cols[None, :] < D)
    hmask = ok[:, None] & (hc[None, :] < D // 2)
    gmask = ok[:, None] & (g[None, :] < D // 8)
    # the exact ring (recent_window): each row's last min(L, W) new tokens as they are, position p at slot p % W
    t_row = n % tokens_per_row
    in_ring = (n < N) & (t_row >= tokens_per_row - ring_w)
    if POS_ON_DEVICE:  # a compiled step's positions (its slots past a fixed capacity are skipped, and so is the ring)
        first = tl.load(pos_ptr).to(tl.int32)
        in_ring = in_ring & ok
    else:
        first = ring_start
    rmask = in_ring[:, None] & (cols[None, :] < D)
    ring_row = ((n // tokens_per_row).to(tl.int64) * s_rb + h * s_rh
                + ((first + t_row) % tl.maximum(ring_w, 1)).to(tl.int64) * s_rw)

    if part == 2:
        # ---------------- the ring (RING_PART) ----------------
        _ring_keys(kbase, koff_ptr, s_koff, tokens_per_row, rk_ptr, ring_row, cols, n, h, rmask, in_ring, D, DP,
                   BLOCK_T, RING_Q8, HAS_KEY_OFFSET, RING_TAIL_HALVES)
        _ring_values(vbase, rv_ptr, ring_row, cols, rmask, in_ring, D, DP, BLOCK_T, RING_Q8, RING_TAIL_HALVES)
    elif part == 0:
        # ---------------- keys ----------------
        plane, off = _token_planes(slot + slot_shift, ok, pool_ptr, block_bytes, h * plane_bytes, T)
        if HAS_RING and not RING_PART:
            _ring_keys(kbase, koff_ptr, s_koff, tokens_per_row, rk_ptr, ring_row, cols, n, h, rmask, in_ring, D, DP,
                       BLOCK_T, RING_Q8, HAS_KEY_OFFSET, RING_TAIL_HALVES)
        if HAS_SEQ:  # the rows' new lengths, by each row's last token (the keys' programs of head 0)
            if h == 0:
                last = (n < N) & (t_row == tokens_per_row - 1)
                tl.store(seq_ptr + n // tokens_per_row, tl.zeros_like(n) + new_len, mask=last)
        x = tl.load(kbase[:, None] + cols[None, :], mask=cmask, other=0.0).to(tl.float32)
        if HAS_KEY_OFFSET:
            krow = (n // tokens_per_row).to(tl.int64) * s_koff + h * D  # token n of row n // tokens_per_row
            x = x - tl.load(koff_ptr + krow[:, None] + cols[None, :], mask=cmask, other=0.0)
            x = tl.where(cmask, x, 0.0)
        amax = tl.max(tl.abs(x), axis=1)
        nonzero = amax > 0
        if KEY_BITS == 8:
            scale = tl.where(nonzero, bf16_bits_to_f32(bf16_up_bits(tl.math.div_rn(amax, 448.0))), 0.0)
            scaled = tl.math.div_rn(x, tl.where(scale > 0, scale, 1.0)[:, None])
            codes = fp8e4m3_bits(scaled)
            tl.store(plane[:, None] + off[:, None] * KB + cols[None, :], codes.to(tl.uint8), mask=cmask)
            kscale_bits = bf16_rne_bits(scale)
        else:
            NC: tl.constexpr = 1 << KEY_BITS
            u = tl.math.div_rn(x, tl.where(nonzero, amax, 1.0)[:, None])
            rms_u = tl.sqrt_rn(tl.math.div_rn(tl.sum(u * u, axis=1), D * 1.0))
            inv = tl.where(nonzero, rms_u, 1.0)[:, None]
            if KEY_BITS == 4:
                y_lo, y_hi = _rotate_halves(u, rot_ptr, D, DP, DHP, HADAMARD, UNITS)
                # stored sign-magnitude (reference.stored_codes): level n >= 8 -> n - 8, n < 8 -> 15 - n
                if SYMMETRIC:
                    c_lo, v_lo = _bucket_sign_magnitude(tl.math.div_rn(y_lo, inv), bnd_ptr, cent_ptr, NC)
                    c_hi, v_hi = _bucket_sign_magnitude(tl.math.div_rn(y_hi, inv), bnd_ptr, cent_ptr, NC)
                else:
                    c_lo, v_lo = _bucket(tl.math.div_rn(y_lo, inv), bnd_ptr, cent_ptr, NC - 1)
                    c_hi, v_hi = _bucket(tl.math.div_rn(y_hi, inv), bnd_ptr, cent_ptr, NC - 1)
                    c_lo = tl.where(c_lo >= 8, c_lo - 8, 15 - c_lo)
                    c_hi = tl.where(c_hi >= 8, c_hi - 8, 15 - c_hi)
                csum = tl.sum(tl.where(hc[None, :] < D // 2, v_lo * v_lo + v_hi * v_hi, 0.0), axis=1)
                tl.store(plane[:, None] + off[:, None] * KB + hc[None, :], (c_lo | (c_hi << 4)).to(tl.uint8), mask=hmask)
            elif KEY_PLANES:  # 3-bit code planes (layout.key_planes): bucketed in coordinate order, then shuffled
                code, val = _bucket(tl.math.div_rn(_rotate(u, rot_ptr, D, DP, HADAMARD, UNITS), inv), bnd_ptr, cent_ptr, NC - 1)
                csum = tl.sum(tl.where(cols[None, :] < D, val * val, 0.0), axis=1)
                _store_key_planes(plane[:, None] + off[:, None] * KB, code, ok, BLOCK_T, D)
            else:  # other 3-bit keys: a little-endian bit stream, 8 codes -> 3 bytes
                code, val = _bucket(tl.math.div_rn(_rotate(u, rot_ptr, D, DP, HADAMARD, UNITS), inv), bnd_ptr, cent_ptr, NC - 1)
                csum = tl.sum(tl.where(cols[None, :] < D, val * val, 0.0), axis=1)
                _store3(plane[:, None] + off[:, None] * KB + 3 * g[None, :], code, gmask, BLOCK_T, GP)
            scale = amax * rms_u
            if NORM_CORRECTION:
                scale = tl.math.div_rn(scale, tl.sqrt_rn(tl.math.div_rn(csum, D * 1.0)))
            kscale_bits = bf16_rne_bits(scale)
        _store_meta(plane, 0, off, T, META, kscale_bits, ok)
    else:
        # ---------------- values ----------------
        plane, off = _token_planes(slot + slot_shift, ok, pool_ptr, block_bytes, h * plane_bytes, T)
        if HAS_RING and not RING_PART:
            _ring_values(vbase, rv_ptr, ring_row, cols, rmask, in_ring, D, DP, BLOCK_T, RING_Q8, RING_TAIL_HALVES)
        LEVELS: tl.constexpr = (1 << VALUE_BITS) - 1
        HALF: tl.constexpr = LEVELS / 2
        if VALUE_BITS == 4:
            if VALUE_ROT:
                xv = tl.load(vbase[:, None] + cols[None, :], mask=cmask, other=0.0).to(tl.float32)
                x_lo, x_hi = _rotate_halves(xv, vrot_ptr, D, DP, DHP, HADAMARD, UNITS)
            else:
                x_lo = tl.load(vbase[:, None] + hc[None, :], mask=hmask, other=0.0).to(tl.float32)
                x_hi = tl.load(vbase[:, None] + hc[None, :] + D // 2, mask=hmask, other=0.0).to(tl.float32)
            vmax = tl.maximum(tl.max(tl.where(hmask, x_lo, -float("inf")), axis=1), tl.max(tl.where(hmask, x_hi, -float("inf")), axis=1))
            vmin = tl.minimum(tl.min(tl.where(hmask, x_lo, float("inf")), axis=1), tl.min(tl.where(hmask, x_hi, float("inf")), axis=1))
        else:
            xv = tl.load(vbase[:, None] + cols[None, :], mask=cmask, other=0.0).to(tl.float32)
            if VALUE_ROT:
                xv = _rotate(xv, vrot_ptr, D, DP, HADAMARD, UNITS)
            vmax = tl.max(tl.where(cmask, xv, -float("inf")), axis=1)
            vmin = tl.min(tl.where(cmask, xv, float("inf")), axis=1)
        vmax = tl.where(ok, vmax, 0.0)
        vmin = tl.where(ok, vmin, 0.0)
        mid_bits = bf16_rne_bits(vmax * 0.5 + vmin * 0.5)
        mid = bf16_bits_to_f32(mid_bits)
        half_range = tl.maximum(vmax - mid, mid - vmin)
        vscale_bits = bf16_up_bits(tl.math.div_rn(half_range, HALF))
        vscale = bf16_bits_to_f32(vscale_bits)
        div = tl.where(vscale > 0, vscale, 1.0)
        if VALUE_BITS == 4:
            q_lo = _value_codes(x_lo, mid, div, HALF, LEVELS)
            q_hi = _value_codes(x_hi, mid, div, HALF, LEVELS)
            tl.store(plane[:, None] + T * KB + off[:, None] * VB + hc[None, :], (q_lo | (q_hi << 4)).to(tl.uint8), mask=hmask)
        else:
            q = _value_codes(xv, mid, div, HALF, LEVELS)
            if VALUE_PLANES:
                _store_value_planes(plane[:, None] + T * KB + off[:, None] * VB, q, ok, BLOCK_T, D)
            else:
                _store3(plane[:, None] + T * KB + off[:, None] * VB + 3 * g[None, :], q, gmask, BLOCK_T, GP)
        _store_meta(plane, 1, off, T, META, vscale_bits, ok)
        _store_meta(plane, 2, off, T, META, mid_bits, ok)


def store_kv(pool: torch.Tensor, layout: BlockLayout, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor,
             key_offset: torch.Tensor | None = None, launch: StoreLaunchConfig | None = None,
             recent: tuple[torch.Tensor, torch.Tensor] | None = None, start: int = 0,
             seq_lens: torch.Tensor | None = None, device_traits: DeviceTraits | None = None,
             held: "HeldStore | None" = None, slot_shift: int = 0, positions: torch.Tensor | None = None) -> None:
    """Quantize key/value [N, H, D] and write token n into slot slots[n] (negative = skip). A decode step's
    [R, H, 1, D] (one token per row) is read as [R, H, D], without a view per call once held.

    Same contract and bytes as reference.store (slot_shift: a host int added to every slot that is not
    skipped; key_offset: the key_centering mean, [H, D] or per
    row [R, H, D] for R rows of N / R tokens each; value_rotation comes from the layout's config;
    recent: the exact ring [R, H, W, D] that gets each row's last new tokens, their positions counted from
    `start`; seq_lens [R] int32: set to start + N / R); one kernel launch, no host synchronisation.
    positions: a device tensor whose first element is the rows' first new position, instead of `start` (a compiled
    step's, which must not read it on the host); skipped tokens then stay out of the ring too. Not with seq_lens.
    launch: overrides of the launch heuristics, for benchmarks (launch_config.StoreLaunchConfig).
    device_traits: the device as the launch heuristics see it (default: the pool's device, device.device_traits).
    held: the caller's HeldStore: reused when this call matches the one it holds, else refilled with this call.
    """
    ring_k, ring_v = recent if recent is not None else (None, None)
    signature = None
    if held is not None:
        signature = store_signature(pool, layout, slots, key_offset, ring_k, ring_v, seq_lens, positions, launch,
                                    device_traits)
        if held.serves(signature, key, value):
            held.launch(key, value, start, slot_shift)
            return
    given = key, value  # (the kinds a held call compares)
    key, value = token_rows(key), token_rows(value)
    if launch is not None and type(launch) is not StoreLaunchConfig:
        raise TypeError(f"launch must be a tq_hf.kernels.launch_config.StoreLaunchConfig or None, got "
                        f"{type(launch).__name__}")
    traits = device_traits if device_traits is not None else _traits_of(pool.device)
    plan_key = (id(layout), *map(argument_key, (pool, key, value, slots, key_offset, ring_k, ring_v, seq_lens,
                                                 positions)), launch, traits, _store_kernel)
    plan = _PLANS.get(plan_key)
    if plan is None or plan.layout is not layout:
        plan = _PLANS.put(plan_key, _make_plan(pool, layout, key, value, slots, key_offset, launch, ring_k, ring_v,
                                               seq_lens, traits, positions))
    _check_positions(start, slot_shift)
    if plan.site is None:  # no tokens
        return
    koff = key_offset.float().contiguous() if key_offset is not None else plan.cent
    lasting = (pool, plan.rot, plan.cent, plan.bnd, koff, *plan.scalars)
    with device_of(pool):
        plan.site(*_store_arguments(key, value, slots, slot_shift, lasting, ring_k, ring_v, plan.ring_scalars, start,
                                    seq_lens if seq_lens is not None else slots, plan.tokens_per_row, positions))
    if signature is not None and holdable_offset(key_offset):
        held.hold(signature, plan, *given, lasting, (pool, layout, slots, key_offset, ring_k, ring_v, seq_lens,
                                                     positions))


def store_signature(pool, layout, slots, key_offset, ring_k, ring_v, seq_lens, positions=None, launch=None,
                    device_traits=None) -> tuple:
    """What a held store must match besides its key and value (store_kv's arguments but those, start and
    slot_shift): the tensors by identity and the settings."""
    traits = device_traits if device_traits is not None else _traits_of(pool.device)
    return (id(pool), id(layout), id(slots), id(key_offset), id(ring_k), id(ring_v), id(seq_lens), id(positions),
            launch, traits)


def _check_positions(start, slot_shift) -> None:
    if type(start) is not int or start < 0:
        raise ValueError(f"start must be an int >= 0 (the position of each row's first new token), got {start!r}")
    if type(slot_shift) is not int or slot_shift < 0:
        raise ValueError(f"slot_shift must be an int >= 0 (added to every stored slot), got {slot_shift!r}")


def _store_arguments(key, value, slots, slot_shift: int, lasting: tuple, ring_k, ring_v, ring_scalars: tuple,
                     start: int, seq_lens, tokens_per_row: int, positions=None, key_at=None, value_at=None) -> tuple:
    """The store kernel's runtime arguments: the tokens (absent ring buffers: the tokens as placeholders), the
    slots, the arguments that last across calls, the positions. key_at, value_at: the tokens' addresses, passed in
    their place (a direct launch whose other tensors are addresses too)."""
    k = key if key_at is None else key_at
    v = value if value_at is None else value_at
    return (k, key.stride(0), key.stride(1), v, value.stride(0), value.stride(1), slots, slot_shift, *lasting,
            ring_k if ring_k is not None else k, ring_v if ring_v is not None else v, *ring_scalars,
            start, seq_lens, start + tokens_per_row, positions if positions is not None else slots)


class HeldStore:
    """One caller's repeated store_kv call (a cache layer's decode steps): its plan and the arguments that stay, kept
    while each call names the same tensors (by identity; held here, so no other tensor takes their ids) and settings,
    with key and value of the kinds the plan was made for. As attention.HeldAttention: the tensors keep their shapes,
    strides and storage; a call with anything else plans (and validates) anew and is held instead."""

    __slots__ = ("_signature", "_key_kind", "_value_kind", "_plan", "_lasting", "_tensors", "_at")

    def __init__(self):
        self._signature = None

    def serves(self, signature: tuple, key: torch.Tensor, value: torch.Tensor) -> bool:
        """Whether a call with this signature, key and value can reuse what is held."""
        return (signature == self._signature and argument_key(key) == self._key_kind
                and argument_key(value) == self._value_kind)

    def hold(self, signature: tuple, plan: "_StorePlan", key: torch.Tensor, value: torch.Tensor, lasting: tuple,
             tensors: tuple) -> None:
        """Keep a launched call (a plan with tokens to store): what its next call reuses."""
        self._signature, self._plan, self._lasting, self._tensors = signature, plan, lasting, tensors
        self._key_kind, self._value_kind = argument_key(key), argument_key(value)
        _, _, slots, _, ring_k, ring_v, seq_lens, positions = tensors
        # the lasting tensors' addresses for direct launches (absent rings: the tokens' own, per call)
        seq_or_slots = seq_lens if seq_lens is not None else slots
        slots_at, ring_k_at, ring_v_at, seq_at, pos_at = addresses(
            (slots, ring_k, ring_v, seq_or_slots, positions if positions is not None else slots))
        self._at = (slots_at, addresses(lasting), ring_k_at, ring_v_at, seq_at, pos_at)

    def launch(self, key: torch.Tensor, value: torch.Tensor, start: int, slot_shift: int = 0) -> None:
        """The held call with new tokens at `start`, their slots shifted by `slot_shift`."""
        _check_positions(start, slot_shift)
        plan = self._plan
        pool, _, _, _, ring_k, ring_v, _, _ = self._tensors
        with device_of(pool):
            site = plan.site
            if site.direct():  # addresses: no driver lookup per tensor
                slots_at, lasting_at, ring_k_at, ring_v_at, seq_at, pos_at = self._at
                site.run_direct(*_store_arguments(key, value, slots_at, slot_shift, lasting_at, ring_k_at, ring_v_at,
                                                  plan.ring_scalars, start, seq_at, plan.tokens_per_row, pos_at,
                                                  key.data_ptr(), value.data_ptr()))
                return
            self.launch_tensors(key, value, start, slot_shift)

    def launch_tensors(self, key: torch.Tensor, value: torch.Tensor, start: int, slot_shift: int = 0) -> None:
        """The held call with every tensor passed as a tensor (Triton's own path, or the direct one converting each;
        eval.launch_overhead times it against launch's addresses)."""
        plan = self._plan
        _, _, slots, _, ring_k, ring_v, seq_lens, positions = self._tensors
        plan.site(*_store_arguments(key, value, slots, slot_shift, self._lasting, ring_k, ring_v, plan.ring_scalars,
                                    start, seq_lens if seq_lens is not None else slots, plan.tokens_per_row, positions))


@dataclasses.dataclass(slots=True)
class _StorePlan:
    """What a store's argument kinds decide (validated once): the launch and its scalar arguments."""

    layout: BlockLayout  # held, so the id keying this plan stays this layout's
    rot: torch.Tensor
    cent: torch.Tensor
    bnd: torch.Tensor
    scalars: tuple  # (s_koff, tokens_per_row, vrot, n, block_bytes, plane_bytes)
    ring_scalars: tuple  # the ring's (batch, head, slot) strides and W (zeros without a ring)
    tokens_per_row: int  # L: the new tokens of each row (N / R; N without rows); their new length is start + L
    site: LaunchSite | None  # None: no tokens to store


_PLANS = PlanCache()


def _check_ring(ring_k, ring_v, seq_lens, layout, key, device) -> int | None:
    """The row count the ring and seq_lens imply (None: neither given), after checking them."""
    rows = None
    if ring_k is not None:
        records = ring_k.dtype == torch.int8  # int8 ring records (layout.ring_spec)
        width = layout.ring_width(ring_k.dtype)
        for name, t in (("recent keys", ring_k), ("recent values", ring_v)):
            check_tensor(name, t, dim=4, dtypes=(torch.int8,) if records else ACTIVATION_DTYPES, device=device)
            if t.shape[1] != layout.num_kv_heads or t.shape[3] != width or t.shape[2] < 1:
                raise ValueError(f"{name} must be [rows, {layout.num_kv_heads}, W >= 1, {width}] for this layout"
                                 f"{' (int8 ring records)' if records else ''}, got {list(t.shape)}")
            if records:
                check_ring_alignment(name, t)
        if ring_v.shape != ring_k.shape or ring_v.stride() != ring_k.stride() or ring_k.stride(-1) != 1:
            raise ValueError(f"recent keys and values must have one shape and the same strides, contiguous in "
                             f"head_dim, got {list(ring_k.shape)} {ring_k.stride()} and {list(ring_v.shape)} "
                             f"{ring_v.stride()}")
        rows = ring_k.shape[0]
    if seq_lens is not None:
        check_tensor("seq_lens", seq_lens, dim=1, dtypes=(torch.int32,), device=device)
        if rows is not None and seq_lens.shape[0] != rows:
            raise ValueError(f"seq_lens has {seq_lens.shape[0]} rows but the recent ring {rows}")
        rows = seq_lens.shape[0]
    if rows is not None and (rows == 0 or key.shape[0] % rows):
        raise ValueError(f"a ring or seq_lens of {rows} rows needs a token count divisible by it, got {key.shape[0]}")
    return rows


def _make_plan(pool, layout, key, value, slots, key_offset, launch: StoreLaunchConfig | None = None, ring_k=None,
               ring_v=None, seq_lens=None, traits: DeviceTraits | None = None, positions=None) -> _StorePlan:
    check_layout_pool(pool, layout)
    traits = traits if traits is not None else _traits_of(pool.device)
    for name, t in (("key", key), ("value", value)):
        check_tensor(name, t, dim=3, dtypes=ACTIVATION_DTYPES, device=pool.device)
        if tuple(t.shape[1:]) != (layout.num_kv_heads, layout.head_dim):
            raise ValueError(
                f"{name} must be [N, {layout.num_kv_heads}, {layout.head_dim}] for this layout, got {list(t.shape)}"
            )
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last (head_dim) dimension")
    check_tensor("slots", slots, dim=1, dtypes=(torch.int64, torch.int32), device=pool.device)
    if key.shape[0] != value.shape[0] or slots.shape[0] != key.shape[0]:
        raise ValueError(
            f"key, value and slots must agree on N, got {key.shape[0]}, {value.shape[0]}, {slots.shape[0]}"
        )
    key_offset, s_koff = check_key_offset(key_offset, layout, pool.device)
    rows = _check_ring(ring_k, ring_v, seq_lens, layout, key, pool.device)
    if positions is not None:
        check_tensor("positions", positions, dtypes=(torch.int64, torch.int32), device=pool.device)
        if positions.numel() < 1 or seq_lens is not None:
            raise ValueError(f"positions must hold the first new position (got {positions.numel()} elements) and "
                             "comes without seq_lens (a compiled step sets the lengths itself)")
    n = key.shape[0]
    tokens_per_row = max(n, 1)
    if s_koff:
        if n % key_offset.shape[0]:
            raise ValueError(f"a per-row key_offset of {key_offset.shape[0]} rows needs N divisible by it, got N={n}")
        if rows is not None and key_offset.shape[0] != rows:
            raise ValueError(f"key_offset has {key_offset.shape[0]} rows but the ring / seq_lens {rows}")
        tokens_per_row = max(n // key_offset.shape[0], 1)
    if rows is not None:
        tokens_per_row = max(n // rows, 1)
    assert (KEY_SCALE, VALUE_SCALE, VALUE_MID) == (0, 1, 2)  # field order used by _store_meta
    cfg, d = layout.config, layout.head_dim
    rot, cent, bnd, _ = codec_tensors(layout, str(pool.device))
    vrot = value_rotation_tensor(layout, str(pool.device))
    # Long prefills: 64-token tiles amortise the rotation matrices each program loads (64 KB at
    # D=128); decode steps (a few tokens) take the smallest tile that holds them.
    block_t = min(64 if d <= 128 else 32, max(16, next_pow2(n)))
    # 8 warps for every tile: each warp's share of the serial work halves (faster at every batch, levers too)
    num_warps = 8
    if not traits.tuned_for_gpu:
        block_t, num_warps = 16, 4
    if launch is not None:
        block_t = block_t if launch.block_t is None else launch.block_t
        num_warps = num_warps if launch.num_warps is None else launch.num_warps
    # the ring in programs of its own (StoreLaunchConfig.ring_part): its encoding then runs beside the quantization
    # instead of before it in the key and value programs; on for a store of one tile (decode steps), the case timed
    ring_default = triton.cdiv(n, block_t) == 1
    # under rotation="hadamard" the rotations' fp16 units read as MMA operands instead of the entries built in
    # registers: far fewer instructions in the store's chain for a 32 KB load per program, faster at every length timed
    hadamard = cfg.rotation == "hadamard"
    units = hadamard and (launch is None or launch.rotation_units is not False)
    if units:
        rot = key_rotation_units(layout, str(pool.device)) if cfg.uses_codebook else rot
        vrot = value_rotation_units(layout, str(pool.device)) if cfg.value_rotation else vrot
    ring_part = ring_k is not None and bool(ring_default if launch is None or launch.ring_part is None
                                            else launch.ring_part)
    site = None
    if n:
        site = LaunchSite(_store_kernel, (triton.cdiv(n, block_t), layout.num_kv_heads, 3 if ring_part else 2), dict(
            D=d, DP=next_pow2(d), DHP=next_pow2(d // 2), GP=next_pow2(d // 8), KEY_PLANES=key_planes(cfg, d),
            VALUE_PLANES=value_planes(cfg, d),
            T=layout.block_size, KB=layout.key_bytes, VB=layout.value_bytes, META=layout.metadata_offset,
            KEY_BITS=cfg.key_bits, VALUE_BITS=cfg.value_bits, NORM_CORRECTION=cfg.norm_correction,
            HAS_KEY_OFFSET=key_offset is not None, VALUE_ROT=cfg.value_rotation, BLOCK_T=block_t, HADAMARD=hadamard, UNITS=units,
            SYMMETRIC=cfg.uses_codebook and cfg.key_bits == 4 and is_symmetric(d, cfg.key_bits),
            HAS_RING=ring_k is not None, HAS_SEQ=seq_lens is not None,
            RING_Q8=ring_k is not None and ring_k.dtype == torch.int8,
            RING_TAIL_HALVES=ring_tail_bytes(layout.head_dim) // 2, POS_ON_DEVICE=positions is not None,
            RING_PART=ring_part,
            num_warps=num_warps,
        ))
    ring_scalars = (*ring_k.stride()[:3], ring_k.shape[2]) if ring_k is not None else (0, 0, 0, 0)
    return _StorePlan(layout=layout, rot=rot, cent=cent, bnd=bnd, site=site, ring_scalars=ring_scalars,
                      tokens_per_row=tokens_per_row,
                      scalars=(s_koff, tokens_per_row, vrot, n, layout.block_bytes, layout.plane_bytes))
