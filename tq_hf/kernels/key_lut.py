"""4-bit codebook keys to fp16 by byte permutes (PTX `prmt`): a lookup Triton treats as elementwise.

Why: `tl.gather` of the centroids is not elementwise for Triton, so the decode kernel unpacked
the key tile in a blocked layout (a warp shuffle per code) and staged it through shared memory
as fp16 before the MMA read it back (Nsight Compute: 255
registers, 102 KB of shared memory, 12.5% occupancy, issue-bound). Triton moves a *unary, pure*
inline asm past the layout conversion into the MMA's operand layout (as it does for the values'
nibble arithmetic), so with this lookup the codes are decoded where the MMA reads them and no
fp16 key tile touches shared memory (45 KB per program; H200 4bit decode 0.60 -> 0.46 ms at B=16, S=32k).

The Lloyd-Max codebook of the (symmetric) rotated-coordinate distribution is symmetric:
c[15 - n] == -c[n], also after rounding to fp16 (checked here, else `config_lut_words` returns
None and the kernel gathers). So 8 magnitudes M[i] = c[8 + i] suffice, and 4-bit keys are stored
sign-magnitude (reference.stored_codes): code r is +M[r], code 8 + r is -M[r]. The low and the high
bytes of the fp16 magnitudes make two 8-byte tables, which one `prmt` indexes with 4 codes at once
(its selector nibbles are the codes' ranks, code & 7).
The tables are immediates in the asm text (unary asm takes no table operands): one compiled
kernel variant per codebook, i.e. per head_dim.

The code-word asm (lut_words_asm, two 16-bit code words of a token per register) reads the magnitudes
as bytes: the 4-bit key codec puts its centroids on a grid of 1/255 of the largest magnitude
(reference.on_byte_grid), so a magnitude byte m is the fp16 subnormal m * 2**-24 and the code's sign
its high byte; one 8-byte table instead of two, and the kernel scales the scores by the grid step
* 2**24 once (lut_bytes). PRMT takes one table word as an immediate and the other from a register,
which ptxas copies from a uniform register before each use: halving the lookups halves those too.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..config import TurboQuantConfig


def _tables(words: dict[str, int], pinned: bool) -> str:
    """PTX setting the table registers: l0 / h0 (the words `prmt` reads from a register; l1 / h1 are its
    immediates). pinned: XORed with an opaque zero (lane id x 3 >> 32), so ptxas keeps each in a register of every
    thread for the whole walk; as constants it holds them in uniform registers and copies one into a vector
    register before every `prmt` that reads it (48-120 copies per tile, sm_90a; LaunchConfig.table_registers)."""
    lines = ["mov.u32 z, %laneid;", "mul.hi.u32 z, z, 3;"] if pinned else []
    for name, value in words.items():
        op = "xor.b32 {0}, z, {1};" if pinned and name in ("l0", "h0") else "mov.b32 {0}, {1};"
        lines.append(op.format(name, value))
    return "\n".join(lines)


# $2: 4 code bytes (low nibble: coordinate j of the head's first half, high nibble: j + D/2).
# $0, $1: fp16 centroids of bytes 0-1 and 2-3: of their low nibbles (sel 0x6240) or high (0x7351).
# The low- and the high-nibble calls share everything up to the last two permutes; ptxas merges
# that common part. Sign-magnitude codes spare the rank 7 - n that ascending levels' negative half took.
_HEAD = """{
.reg .b32 idx, idx2, la, ha, lb, hb, sh, sa, sb, l0, l1, h0, h1, z;
%(tables)s
and.b32 idx, $2, 0x77777777;
"""
_LOOKUP = """prmt.b32 la, l0, l1, idx;
prmt.b32 ha, h0, h1, idx;
shr.b32 idx2, idx, 16;
prmt.b32 lb, l0, l1, idx2;
prmt.b32 hb, h0, h1, idx2;
"""
_SIGN = """shl.b32 sh, $2, 4;
prmt.b32 sa, sh, $2, 0xD9C8;
prmt.b32 sb, sh, $2, 0xFBEA;
and.b32 sa, sa, 0x80808080;
or.b32 ha, ha, sa;
and.b32 sb, sb, 0x80808080;
or.b32 hb, hb, sb;
"""
_INTERLEAVE = """prmt.b32 $0, la, ha, %(sel)s;
prmt.b32 $1, lb, hb, %(sel)s;
}"""
_BODY = _HEAD + _LOOKUP + _SIGN + _INTERLEAVE
# how the steps work, per nibble n of the 4 code bytes (8 codes, sign-magnitude):
#   idx = n & 7 = magnitude rank
#   la/ha (lb/hb): low/high bytes of M[idx] for nibbles 0-3 (4-7), one byte per nibble
#   sa/sb: prmt's sign-replicate mode (selector bit 3) turns bit 3 of n (the sign, moved to a byte's
#          msb by the shift) into 0xFF/0x00 per byte; its bit 7 becomes the fp16 sign bit in the high byte
#   $0/$1: interleave (low byte, high byte) of the wanted nibbles into two fp16x2 words

CONSTRAINTS = "=r,=r,r"  # two 32-bit outputs (4 fp16 with pack=4), one 32-bit input (4 code bytes)

# 16-bit code words (bytes 2w, 2w + 1 of a token: coordinates 2w, 2w + 1 in the low nibbles, D/2 + 2w, D/2 + 2w + 1
# in the high ones), two words of one token per register ($4: bytes b0 b1 b2 b3 = words w, w + 1), so the key tile
# is the MMA's B operand with two K rows per register like the value words (kWidth 2: the query's A operand by
# ldmatrix). Outputs: $0 = (b0.lo, b2.lo), $1 = (b1.lo, b3.lo), $2 = (b0.hi, b2.hi), $3 = (b1.hi, b3.hi) as fp16x2:
# the bytes are first reordered (b0, b2, b1, b3) so the 4-bit lookup's interleave yields them.
# The magnitudes are bytes m (reference.on_byte_grid): each output half is the fp16 subnormal m * 2**-24 with the
# code's sign bit, so one table (8 bytes) serves all and a sign mask is the high byte; the kernel scales the scores by
# the grid step * 2**24 once (lut_bytes).
_WORDS_BODY = """{
.reg .b32 c, idx, idx2, la, lb, sl, sh, l0, l1, z;
%(tables)s
prmt.b32 c, $4, $4, 0x3120;
and.b32 idx, c, 0x77777777;
prmt.b32 la, l0, l1, idx;
shr.b32 idx2, idx, 16;
prmt.b32 lb, l0, l1, idx2;
shl.b32 sl, c, 4;
and.b32 sl, sl, 0x80808080;
and.b32 sh, c, 0x80808080;
prmt.b32 $0, la, sl, 0x5240;
prmt.b32 $1, lb, sl, 0x7260;
prmt.b32 $2, la, sh, 0x5341;
prmt.b32 $3, lb, sh, 0x7361;
}"""
# la (lb): magnitude bytes of nibbles 0-3 (4-7) of the reordered bytes c = (b0, b2, b1, b3): b0.lo, b0.hi, b2.lo,
# b2.hi (b1.lo, b1.hi, b3.lo, b3.hi); sl (sh): the low (high) nibbles' sign bits at bit 7 of each byte of c.
WORDS_CONSTRAINTS = "=r,=r,=r,=r,r"


@functools.lru_cache(maxsize=None)
def lut_words_asm(table: tuple[int, int], pinned: bool = False) -> str:
    """The asm decoding 2 code words of a token into 4 fp16x2 subnormals (WORDS_CONSTRAINTS); table: lut_bytes';
    pinned: _tables'."""
    l0, l1 = table
    return _WORDS_BODY % dict(tables=_tables(dict(l0=l0, l1=l1), pinned))


def lut_bytes(centroids: torch.Tensor) -> tuple[tuple[int, int], float] | None:
    """((M0, M1), unit): the 8 magnitudes of 16 ascending symmetric centroids as integer bytes m (4 per word) and
    unit = step * 2**24 with centroid = m * step, so a score over the subnormals m * 2**-24 times unit is the score
    over the centroids; None unless the magnitudes are whole multiples (1..255) of a step (reference.on_byte_grid)."""
    if centroids.numel() != 16:
        return None
    c = centroids.detach().to("cpu", torch.float32)
    mags = c[8:]
    if not (torch.equal(c[:8].flip(0), -mags) and bool((mags > 0).all())):
        return None
    step = mags.max() / 255
    m = torch.round(mags / step)
    if not (torch.equal(m * step, mags) and bool((m >= 1).all()) and bool((m <= 255).all())):
        return None
    b = [int(v) for v in m.tolist()]
    return (_word(b[:4]), _word(b[4:])), float(step) * 2.0**24


@functools.lru_cache(maxsize=None)
def config_lut_bytes(config: "TurboQuantConfig", head_dim: int) -> tuple[tuple[int, int], float] | None:
    """lut_bytes of this config's 4-bit codebook keys (computed on the CPU once per (config, head_dim))."""
    from ..reference import key_codec

    if not config.uses_codebook or config.key_bits != 4:
        return None
    return lut_bytes(key_codec(config, head_dim, "cpu").centroids)


@functools.lru_cache(maxsize=None)
def lut_asm(words: tuple[int, int, int, int], high: bool, pinned: bool = False) -> str:
    """The asm decoding the low (high=False) or the high nibbles of 4 code bytes with tables `words`
    (cached: the launcher asks for it on every decode step); pinned: _tables'."""
    return _BODY % dict(tables=_word_tables(words, pinned), sel="0x7351" if high else "0x6240")


def _word_tables(words: tuple[int, int, int, int], pinned: bool) -> str:
    l0, l1, h0, h1 = words
    return _tables(dict(l0=l0, l1=l1, h0=h0, h1=h1), pinned)


def _word(byte_values: list[int]) -> int:
    """4 bytes as a signed int32 (PTX takes it as a 32-bit immediate either way)."""
    w = sum(b << (8 * i) for i, b in enumerate(byte_values))
    return w - (1 << 32) if w >= 1 << 31 else w


def lut_words(centroids: torch.Tensor) -> tuple[int, int, int, int] | None:
    """(ML0, ML1, MH0, MH1): low/high bytes of the fp16 magnitudes c[8..15] in two 4-byte words
    each; None unless the 16 ascending centroids are symmetric and nonzero in fp16."""
    if centroids.numel() != 16:
        return None
    half = centroids.detach().to("cpu", torch.float16)
    mags = half[8:]
    if not (torch.equal(half[:8].flip(0), -mags) and bool((mags > 0).all())):
        return None
    return _byte_tables(mags)


def _byte_tables(entries: torch.Tensor) -> tuple[int, int, int, int]:
    """8 fp16 table entries as (L0, L1, H0, H1): their low and their high bytes, 4 per word."""
    bits = [int(v) & 0xFFFF for v in entries.view(torch.int16).tolist()]
    low, high = [b & 0xFF for b in bits], [b >> 8 for b in bits]
    return _word(low[:4]), _word(low[4:]), _word(high[:4]), _word(high[4:])


@functools.lru_cache(maxsize=None)
def config_lut_words(config: "TurboQuantConfig", head_dim: int) -> tuple[int, int, int, int] | None:
    """The tables for this config's 4-bit codebook keys, computed on the CPU once per (config,
    head_dim) (no device sync in a decode step); None when the lookup does not apply."""
    from ..reference import key_codec

    if not config.uses_codebook or config.key_bits != 4:
        return None
    return lut_words(key_codec(config, head_dim, "cpu").centroids)


# ---- 3-bit codebook keys ------------------------------------------------------------------------
# The key codes sit in three byte planes (layout.py): bits 0-2 and 4-6 of each byte are two codes;
# the kernel gathers codes 6 and 7 from the planes' spare bits 3 and 7 into one more such byte (SPARE_ASM,
# code_decoders.spare_codes). Any 8 centroids fit the two 8-byte tables: the code itself is the selector
# nibble, no sign step. $2: 4 code bytes; $0, $1: fp16 centroids of their low (sel 0x6240) or high
# (0x7351) nibbles.
_BODY3 = _HEAD + _LOOKUP + _INTERLEAVE  # the 4-bit lookup without its sign step

# $1, $2, $3: 4 bytes of planes 0, 1, 2 (pack=4); $0: their 4 spare-code bytes, code 6 from bits 3 (plane 0 -> bit 0,
# plane 1 -> bit 1, plane 2 -> bit 2), code 7 from bits 7 (-> bits 4, 5, 6). Triton keeps this three-input asm in the
# MMA operand layout the loads land in (no extra shared-memory traffic in the sm_90a SASS, Triton 3.6-3.9).
SPARE_ASM = """{
.reg .b32 a, b, c;
shr.b32 a, $1, 3;
shr.b32 b, $2, 2;
shr.b32 c, $3, 1;
and.b32 a, a, 0x11111111;
and.b32 b, b, 0x22222222;
and.b32 c, c, 0x44444444;
or.b32 a, a, b;
or.b32 $0, a, c;
}"""
SPARE_CONSTRAINTS = "=r,r,r,r"


@functools.lru_cache(maxsize=None)
def lut3_asm(words: tuple[int, int, int, int], high: bool, pinned: bool = False) -> str:
    """The asm decoding the low (high=False) or the high 3-bit codes of 4 code bytes (CONSTRAINTS); pinned: _tables'."""
    return _BODY3 % dict(tables=_word_tables(words, pinned), sel="0x7351" if high else "0x6240")


def lut3_words(centroids: torch.Tensor) -> tuple[int, int, int, int] | None:
    """(L0, L1, H0, H1): low/high bytes of the 8 fp16 centroids by stored code; None unless 8 finite ones."""
    if centroids.numel() != 8:
        return None
    half = centroids.detach().to("cpu", torch.float16)
    if not bool(torch.isfinite(half).all()):
        return None
    return _byte_tables(half)


@functools.lru_cache(maxsize=None)
def config_lut3_words(config: "TurboQuantConfig", head_dim: int) -> tuple[int, int, int, int] | None:
    """The tables for this config's 3-bit codebook keys (computed once per (config, head_dim)); None
    when the keys are not 3-bit codebook keys."""
    from ..reference import key_codec

    if not config.uses_codebook or config.key_bits != 3:
        return None
    return lut3_words(key_codec(config, head_dim, "cpu").code_centroids)


# ---- 3-bit codebook keys as a bit stream (head_dims whose planes do not fill an MMA's K) ----------
# The bit stream unpacks to one int32 code per coordinate (code_decoders.unpack3); 4 of them (0..7 each) become
# the selector nibbles of one prmt per table byte, as the plane lookup's code bytes do, and two interleaves give
# their fp16 centroids: ~4 instructions per code with the unpacking, where a gather over the 8-entry table lowered
# to ~16 compare-and-selects per code (Triton 3.9; Triton 3.6-3.8 staged it through shared memory), sm_90a SASS.
# $2..$5: 4 codes; $0: fp16x2 centroids of codes $2, $3; $1: of $4, $5.
_CODES_BODY = """{
.reg .b32 sel, t, lo, hi, l0, l1, h0, h1, z;
%(tables)s
shl.b32 t, $3, 4;
or.b32 sel, $2, t;
shl.b32 t, $4, 8;
or.b32 sel, sel, t;
shl.b32 t, $5, 12;
or.b32 sel, sel, t;
prmt.b32 lo, l0, l1, sel;
prmt.b32 hi, h0, h1, sel;
prmt.b32 $0, lo, hi, 0x5140;
prmt.b32 $1, lo, hi, 0x7362;
}"""
CODES_CONSTRAINTS = "=r,=r,r,r,r,r"  # two fp16x2 outputs (4 fp16 with pack=4), four 32-bit codes


@functools.lru_cache(maxsize=None)
def lut3_codes_asm(words: tuple[int, int, int, int], pinned: bool = False) -> str:
    """The asm decoding 4 int32 3-bit codes into their fp16 centroids (CODES_CONSTRAINTS); words: lut3_words';
    pinned: _tables'."""
    return _CODES_BODY % dict(tables=_word_tables(words, pinned))
