"""Code decoders of the unified kernel's tiles: packed key and value codes to fp16 MMA operands.

4-bit values as bytes (the 0x6400 trick) or 16-bit words (fp16 subnormals, value_nibbles.py's asm), 3-bit
value planes, the 3-bit bit stream, and 3-bit keys (planes or bit stream) looked up by key_lut.py's byte permutes
or gathered from the centroid table.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .key_lut import CODES_CONSTRAINTS as _LUT_CODES_CONSTRAINTS, CONSTRAINTS as _LUT_CONSTRAINTS
from .key_lut import SPARE_ASM as _SPARE_ASM, SPARE_CONSTRAINTS as _SPARE_CONSTRAINTS
from .key_lut import WORDS_CONSTRAINTS as _LUT_WORDS_CONSTRAINTS
from .value_nibbles import ASM as _VALUE_NIBBLES_ASM, CONSTRAINTS as _VALUE_NIBBLES_CONSTRAINTS, PLANES_ASM as _PLANES_ASM
from .value_nibbles import PLANE_BYTES_ASM as _PLANE_BYTES_ASM, PLANE_BYTES_CONSTRAINTS as _PLANE_BYTES_CONSTRAINTS
from .value_nibbles import PLANE_SCALED_ASM as _PLANE_SCALED_ASM

LUT_CONSTRAINTS = tl.constexpr(_LUT_CONSTRAINTS)
LUT_WORDS_CONSTRAINTS = tl.constexpr(_LUT_WORDS_CONSTRAINTS)
LUT_CODES_CONSTRAINTS = tl.constexpr(_LUT_CODES_CONSTRAINTS)
SPARE_ASM = tl.constexpr(_SPARE_ASM)
SPARE_CONSTRAINTS = tl.constexpr(_SPARE_CONSTRAINTS)
VALUE_NIBBLES_ASM = tl.constexpr(_VALUE_NIBBLES_ASM)
VALUE_NIBBLES_CONSTRAINTS = tl.constexpr(_VALUE_NIBBLES_CONSTRAINTS)
VALUE_PLANES_ASM = tl.constexpr(_PLANES_ASM)
PLANE_BYTES_ASM = tl.constexpr(_PLANE_BYTES_ASM)
PLANE_BYTES_CONSTRAINTS = tl.constexpr(_PLANE_BYTES_CONSTRAINTS)
PLANE_SCALED_ASM = tl.constexpr(_PLANE_SCALED_ASM)


@triton.jit
def nibbles_to_f16(b, HIGH: tl.constexpr):
    """uint8 codes -> fp16 (low nibble) or fp16 16 x (high nibble), exact, by the 0x6400 trick:
    (0x6400 | n) read as fp16 is 1024 + n."""
    return codes_to_f16(b.to(tl.uint16) & (0xF0 if HIGH else 0x0F))


@triton.jit
def codes_to_f16(codes):
    """Small non-negative int codes (< 1024) -> fp16, exact, by the 0x6400 trick: two full-rate ops where an
    int-to-float conversion runs at a quarter of the ALU rate."""
    return (codes | 0x6400).to(tl.uint16).to(tl.float16, bitcast=True) - 1024.0


@triton.jit
def value_word_nibbles(w, PTX: tl.constexpr):
    """16-bit words of 4-bit value codes (bytes 2k, 2k + 1 of a token) -> their 4 nibbles x as fp16
    subnormals x * 2**-24, exact: (byte 2k low, 16 x byte 2k high, byte 2k + 1 low, 16 x byte
    2k + 1 high); the epilogue scales by 2**24 (2**20) once. One mask per 2 codes, no offset to
    subtract. Loading words, not bytes, lets the MMA operand take 2 tokens per 32-bit register
    (bytes: a shared-memory load per code byte, H200 SASS)."""
    if PTX:
        n0, n1, n2, n3 = tl.inline_asm_elementwise(VALUE_NIBBLES_ASM, VALUE_NIBBLES_CONSTRAINTS, [w],
                                                   dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
                                                   is_pure=True, pack=2)
    else:
        n0 = (w & 0x000F).to(tl.float16, bitcast=True)
        n1 = (w & 0x00F0).to(tl.float16, bitcast=True)
        n2 = ((w >> 8) & 0x000F).to(tl.float16, bitcast=True)
        n3 = ((w >> 8) & 0x00F0).to(tl.float16, bitcast=True)
    return n0, n1, n2, n3


@triton.jit
def value_col(c, J: tl.constexpr, D: tl.constexpr, WORDS: tl.constexpr, PLANES: tl.constexpr):
    """The coordinate behind column c of value accumulator J. 4-bit: code i sits in byte i (low
    nibble) for i < D/2, else in byte i - D/2 (high nibble). WORDS: accumulator J holds nibble J
    of 16-bit word c (value_word_nibbles' order); bytes: accumulator 0 the low nibbles, 1 the high.
    PLANES (3-bit values, layout.value_planes): accumulator J holds coordinates J * D/4 + c."""
    if PLANES:
        return J * (D // 4) + c
    elif WORDS:
        return 2 * c + J // 2 + (J % 2) * (D // 2)
    else:
        return c + J * (D // 2)


@triton.jit
def code_unit(J: tl.constexpr, VALUE_WORDS: tl.constexpr, PLANE_WORDS: tl.constexpr, VALUE_PLANES: tl.constexpr):
    """What one unit of value accumulator J's fp16 codes stands for: the MMAs sum codes as the decoders leave them
    (subnormals, 1024-offset bytes, codes shifted or not), and exact values join (and the epilogue leaves) each
    accumulator in its unit. PLANE_WORDS 2: plane codes decoded in place, code J at 4**J (PLANE_SCALED_ASM)."""
    if VALUE_WORDS:  # nibble words: odd accumulators the high nibbles, 16 x
        unit: tl.constexpr = 5.960464477539063e-08 * (16 if J % 2 else 1)
    elif PLANE_WORDS:
        unit: tl.constexpr = 5.960464477539063e-08 * ((1 << (2 * J)) if PLANE_WORDS == 2 else 1)
    elif VALUE_PLANES:  # 64-row tiles: the codes themselves
        unit: tl.constexpr = 1.0
    else:  # 4-bit bytes: acc1 the high nibbles, 16 x
        unit: tl.constexpr = 16.0 if J == 1 else 1.0
    return unit


@triton.jit
def value_plane_words(low, high, half, PTX: tl.constexpr, IN_PLACE: tl.constexpr):
    """3-bit value codes (layout.value_planes) of coordinates a * D/4 + j, a = 0..3, from the 2-bit plane's
    bytes `low` and the bit plane's bytes `high` (byte j % (D/8); half = j // (D/8)), as fp16 subnormals
    code * 2**-24. One 16-bit word per token and column (low | the column's bit-plane bits << 8) feeds a
    mask-only decode of two tokens per register (value_nibbles.PLANES_ASM), as the 4-bit value words do. PTX 2: the
    words are paired in registers by value_nibbles.PLANE_BYTES_ASM instead, 4 elements per asm; 0: integer ops.
    IN_PLACE: code a left at bits 2a to 2a + 2, code * 4**a * 2**-24 (code_unit; PLANE_SCALED_ASM with PTX 2)."""
    if PTX == 2:  # the words never built: 4 elements per asm, from the bytes
        return tl.inline_asm_elementwise(PLANE_SCALED_ASM if IN_PLACE else PLANE_BYTES_ASM, PLANE_BYTES_CONSTRAINTS,
                                         [low, high, (half * 255).to(tl.uint8)],
                                         dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=4)
    w = low.to(tl.uint16) | (((high >> half) & 0x55).to(tl.uint16) << 8)
    if IN_PLACE:  # (the interpreter's path to the same codes): s puts each code's bit-plane bit at bit 2a + 2
        s = w >> 6
        n0 = ((w & 0x0003) | (s & 0x0004)).to(tl.float16, bitcast=True)
        n1 = ((w & 0x000C) | (s & 0x0010)).to(tl.float16, bitcast=True)
        n2 = ((w & 0x0030) | (s & 0x0040)).to(tl.float16, bitcast=True)
        n3 = ((w & 0x00C0) | (s & 0x0100)).to(tl.float16, bitcast=True)
    elif PTX:
        n0, n1, n2, n3 = tl.inline_asm_elementwise(VALUE_PLANES_ASM, VALUE_NIBBLES_CONSTRAINTS, [w],
                                                   dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
                                                   is_pure=True, pack=2)
    else:
        n0 = ((w & 0x0003) | ((w >> 6) & 0x0004)).to(tl.float16, bitcast=True)
        n1 = (((w >> 2) & 0x0003) | ((w >> 8) & 0x0004)).to(tl.float16, bitcast=True)
        n2 = (((w >> 4) & 0x0003) | ((w >> 10) & 0x0004)).to(tl.float16, bitcast=True)
        n3 = (((w >> 6) & 0x0003) | ((w >> 12) & 0x0004)).to(tl.float16, bitcast=True)
    return n0, n1, n2, n3


@triton.jit
def value_plane_bytes(low, high, c, J: tl.constexpr, D: tl.constexpr):
    """3-bit value codes (layout.value_planes) of coordinates J * D/2 + c as fp16 codes (the 0x6400 trick),
    for 64-row (wgmma) tiles, where the plane words' 4 accumulators of D/4 columns faulted (H200): column c
    is code a = 2J + c // (D/4) of byte j = c % (D/4) (low: 2-bit plane byte j, high: bit-plane byte j % (D/8))."""
    a = (2 * J + c // (D // 4))[None, :]
    half = ((c % (D // 4)) // (D // 8))[None, :]
    code = ((low >> (2 * a)) & 3) | (((high >> (2 * a + half)) & 1) << 2)
    return codes_to_f16(code)


@triton.jit
def unpack3(pool_ptr, plane, row_off, tok_ok, BLOCK_N: tl.constexpr, CODE_GROUPS: tl.constexpr,
            REAL_GROUPS: tl.constexpr):
    """3-bit little-endian bit stream -> int32 codes [BLOCK_N, 8 * CODE_GROUPS] of the rows at byte offsets row_off:
    each 3-byte group is loaded once (three strided byte loads), joined into a 24-bit word and split into its 8
    codes (code 8g + p at bits 3p of group g), put together by joins in the registers of the thread that loaded the
    group (a broadcast over a third axis moved the loaded bytes into another layout through shared memory first)."""
    g = tl.arange(0, CODE_GROUPS)
    ptr = pool_ptr + (plane[:, None] + row_off[:, None] + 3 * g[None, :])
    m = tok_ok[:, None] & (g[None, :] < REAL_GROUPS)
    b0 = tl.load(ptr, mask=m, other=0).to(tl.int32)
    b1 = tl.load(ptr + 1, mask=m, other=0).to(tl.int32)
    b2 = tl.load(ptr + 2, mask=m, other=0).to(tl.int32)
    w = b0 | (b1 << 8) | (b2 << 16)
    # [N, G, 2, 2, 2] with element (i, j, k) = code 4i + 2j + k of the group: row-major flattening keeps code order
    even = tl.join(tl.join(w & 7, (w >> 12) & 7), tl.join((w >> 6) & 7, (w >> 18) & 7))
    odd = tl.join(tl.join((w >> 3) & 7, (w >> 15) & 7), tl.join((w >> 9) & 7, (w >> 21) & 7))
    return tl.reshape(tl.join(even, odd), (BLOCK_N, CODE_GROUPS * 8))


@triton.jit
def spare_codes(p0, p1, p2, PTX: tl.constexpr):
    """Bytes j of the three 3-bit key planes (layout.py) -> one byte of codes 6 (bits 0-2) and 7 (bits
    4-6) of coordinates 6J + j and 7J + j, gathered from the planes' spare bits 3 and 7. PTX: by key_lut.SPARE_ASM,
    4 bytes of each plane per instruction, in the MMA operand layout the loads land in (Triton's integer ops on
    uint8 tensors ran per byte, unpacking and repacking them: 1,549 -> 1,208 instructions per k3v4 decode tile at
    32/8/128, sm_90a SASS, Triton 3.6)."""
    if PTX:
        return tl.inline_asm_elementwise(SPARE_ASM, SPARE_CONSTRAINTS, [p0, p1, p2], dtype=tl.uint8, is_pure=True,
                                         pack=4)
    return ((p0 >> 3) & 0x11) | ((p1 >> 2) & 0x22) | ((p2 >> 1) & 0x44)


@triton.jit
def lookup_dots(s, q_lo, q_hi, codes, LUT_LO: tl.constexpr, LUT_HI: tl.constexpr):
    """s (None: none yet) plus the scores of a 3-bit code byte tile [rows, N] (two codes per byte, bits 0-2 and 4-6) by
    key_lut.py's byte-permute lookup, decoded in the MMA's B-operand layout; q_lo, q_hi: the query's
    coordinates of each row's low and high code."""
    s = tl.dot(q_lo, tl.inline_asm_elementwise(LUT_LO, LUT_CONSTRAINTS, [codes], dtype=tl.float16, is_pure=True, pack=4), s)
    return tl.dot(q_hi, tl.inline_asm_elementwise(LUT_HI, LUT_CONSTRAINTS, [codes], dtype=tl.float16, is_pure=True, pack=4), s)


@triton.jit
def gather_dots(s, q_lo, q_hi, codes, table):
    """lookup_dots by gathers from the centroid table [N, 8]; codes [N, rows]."""
    s = tl.dot(q_lo, tl.trans(tl.gather(table, (codes & 7).to(tl.int32), 1)), s)
    return tl.dot(q_hi, tl.trans(tl.gather(table, (codes >> 4).to(tl.int32) & 7, 1)), s)


@triton.jit
def gather_cols(table, codes):
    """Centroids of a code tile [K, N] (table: [N, NC] fp16, by stored code) as [K, N] fp16."""
    return tl.trans(tl.gather(table, tl.trans(codes.to(tl.int32)), 1))


@triton.jit
def operand_boundary(x):
    """fp16 x unchanged, behind an asm with side effects (a plain move, which ptxas drops). Triton sizes a dot's
    operand layout by the narrowest load its pure elementwise chain reaches (AccelerateMatmul's origBitWidth): codes
    decoded from bytes give fp16 operands 8-bit layouts (kWidth 4), whose registers ptxas regroups by 4 moves before
    each MMA; past this boundary the dot takes 16-bit layouts, read by ldmatrix."""
    return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.float16, is_pure=False, pack=2)


@triton.jit
def operand_boundaries(a, b, c, d):
    """operand_boundary of each of four code tiles (the value words' accumulators)."""
    return operand_boundary(a), operand_boundary(b), operand_boundary(c), operand_boundary(d)
