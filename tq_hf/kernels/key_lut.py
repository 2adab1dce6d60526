"""4-bit codebook keys to fp16 with byte permutes (PTX `prmt`) instead of a gathered table.

The decode kernel's profile (eval/results/gpu_checks/session3/) showed the `tl.gather` of the 16
centroids costing a warp shuffle, a select and several integer ops per key coordinate, with a
broadcast copy of the table in registers (255 registers, 12.5% occupancy). A symmetric Lloyd-Max
codebook (c[15 - j] == -c[j]) needs only its 8 positive levels: the low and the high bytes of
their fp16 values fit in two 8-byte tables, which `prmt` indexes four bytes at a time; the sign
comes from bit 3 of the code. One inline-asm call turns 4 code bytes (8 codes) into 8 fp16
centroids with ~30 integer instructions and no shuffles or shared memory.

The mapping is elementwise (byte -> its two centroids), so it does not matter which elements
Triton packs into one call. `key_lut_words` returns None for a codebook that is not symmetric (the
kernel then keeps the gather); the CPU tests run the asm text through a PTX emulator.
"""

from __future__ import annotations

import functools

import torch

from ..config import TurboQuantConfig
from ..codebook import lloyd_max

# Inputs: $4 = 4 code bytes (low nibble: coordinate of the first half of the head, high nibble:
# the second half); the tables L0, L1, H0, H1 (low and high bytes of the fp16 levels m[0..7]) as
# $5, $9, $13, $17 (scalars: with pack=4 each 32-bit input takes 4 operands, one per element).
# Outputs: $0, $1 = fp16 centroids of the low nibbles of bytes 0-1 and 2-3; $2, $3 = the high nibbles.
ASM = """{
.reg .b32 rneg, ridx, rt, rsl, rsh, rlo, rhi, rsg, rzero;
mov.b32 rzero, 0;
shr.b32 rt, $4, 3;
and.b32 rt, rt, 0x11111111;
xor.b32 rneg, rt, 0x11111111;
mul.lo.u32 rt, rneg, 7;
xor.b32 ridx, $4, rt;
and.b32 ridx, ridx, 0x77777777;
shl.b32 rsl, rneg, 7;
shl.b32 rsh, rneg, 3;
prmt.b32 rlo, $5, $9, ridx;
shl.b32 rt, ridx, 4;
prmt.b32 rhi, $13, $17, rt;
prmt.b32 rsg, rsl, rzero, 0x1000;
and.b32 rlo, rlo, 0x00ff00ff;
and.b32 rhi, rhi, 0x7f007f00;
and.b32 rsg, rsg, 0x80008000;
or.b32 rlo, rlo, rhi;
or.b32 $0, rlo, rsg;
shr.b32 rt, ridx, 16;
prmt.b32 rlo, $5, $9, rt;
shr.b32 rt, ridx, 12;
prmt.b32 rhi, $13, $17, rt;
prmt.b32 rsg, rsl, rzero, 0x3020;
and.b32 rlo, rlo, 0x00ff00ff;
and.b32 rhi, rhi, 0x7f007f00;
and.b32 rsg, rsg, 0x80008000;
or.b32 rlo, rlo, rhi;
or.b32 $1, rlo, rsg;
shr.b32 rt, ridx, 4;
prmt.b32 rlo, $5, $9, rt;
prmt.b32 rhi, $13, $17, ridx;
prmt.b32 rsg, rsh, rzero, 0x1000;
and.b32 rlo, rlo, 0x00ff00ff;
and.b32 rhi, rhi, 0x7f007f00;
and.b32 rsg, rsg, 0x80008000;
or.b32 rlo, rlo, rhi;
or.b32 $2, rlo, rsg;
shr.b32 rt, ridx, 20;
prmt.b32 rlo, $5, $9, rt;
shr.b32 rt, ridx, 16;
prmt.b32 rhi, $13, $17, rt;
prmt.b32 rsg, rsh, rzero, 0x3020;
and.b32 rlo, rlo, 0x00ff00ff;
and.b32 rhi, rhi, 0x7f007f00;
and.b32 rsg, rsg, 0x80008000;
or.b32 rlo, rlo, rhi;
or.b32 $3, rlo, rsg;
}"""

CONSTRAINTS = "=r,=r,=r,=r,r" + ",r" * 16


def _word(byte_values: list[int]) -> int:
    """4 bytes as a signed int32 (so Triton passes it as an i32 kernel argument)."""
    w = sum(b << (8 * i) for i, b in enumerate(byte_values))
    return w - (1 << 32) if w >= 1 << 31 else w


def lut_words_for(centroids: torch.Tensor) -> tuple[int, int, int, int] | None:
    """(L0, L1, H0, H1) for 16 ascending centroids, or None unless their fp16 values are symmetric."""
    if centroids.numel() != 16:
        return None
    half = centroids.detach().to("cpu", torch.float16)
    mags = half[8:]
    if not (torch.equal(half[:8].flip(0), -mags) and bool((mags > 0).all())):
        return None
    bits = [int(v) & 0xFFFF for v in mags.view(torch.int16).tolist()]
    low, high = [b & 0xFF for b in bits], [b >> 8 for b in bits]
    return _word(low[:4]), _word(low[4:]), _word(high[:4]), _word(high[4:])


@functools.lru_cache(maxsize=None)
def key_lut_words(config: TurboQuantConfig, head_dim: int) -> tuple[int, int, int, int] | None:
    """The prmt tables for this config's 4-bit codebook keys; None when the lookup does not apply."""
    if not config.uses_codebook or config.key_bits != 4:
        return None
    return lut_words_for(lloyd_max(head_dim, config.key_bits).centroids)
