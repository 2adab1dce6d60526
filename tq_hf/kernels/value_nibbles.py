"""4-bit value codes to fp16 by integer masks in PTX: two tokens' 16-bit code words per register.

Why asm: the decode kernel loads value codes as 16-bit words (two code bytes of one token), so the
P.V MMA's operand register pairs two tokens; Triton's own 16-bit integer ops mask each half on
its own. These masks decode both halves at once: 8 codes in 5 integer instructions.

A nibble x masked in place is the fp16 subnormal x * 2**-24 (exponent bits zero), exact and with
no offset to subtract (the 0x6400 | x trick reads 1024 + x); the tensor cores keep fp16
subnormals, and the kernel scales the accumulators back once, in the epilogue. Per 16-bit half
(one token's bytes 2k, 2k + 1):
  $0: byte 2k low nibble x * 2**-24       $1: byte 2k high nibble x * 2**-20
  $2: byte 2k + 1 low nibble x * 2**-24   $3: byte 2k + 1 high nibble x * 2**-20
"""

from __future__ import annotations

ASM = """{
.reg .b32 s;
and.b32 $0, $4, 0x000F000F;
and.b32 $1, $4, 0x00F000F0;
shr.b32 s, $4, 8;
and.b32 $2, s, 0x000F000F;
and.b32 $3, s, 0x00F000F0;
}"""

CONSTRAINTS = "=r,=r,=r,=r,r"  # four fp16x2 outputs, one input register (two 16-bit code words)

# 3-bit value planes (layout.value_planes): per 16-bit half, one token's 2-bit-plane byte L in bits 0-7 and, in
# bits 8-15, the bit-plane bits of the same four coordinates at bits 8 + 2a (code_decoders.value_plane_words).
# Output $a holds code a = (L >> 2a & 3) | (bit 8 + 2a) << 2 as the fp16 subnormal code * 2**-24.
PLANES_ASM = (
    "{\n.reg .b32 s, t;\nshr.b32 t, $4, 6;\n"  # t: the bit-plane bits of code a at bit 2 + 2a
    "and.b32 $0, $4, 0x00030003;\nand.b32 s, t, 0x00040004;\nor.b32 $0, $0, s;\n"
    + "".join(f"shr.b32 s, $4, {2 * a};\nand.b32 ${a}, s, 0x00030003;\n"
              f"shr.b32 s, t, {2 * a};\nand.b32 s, s, 0x00040004;\nor.b32 ${a}, ${a}, s;\n" for a in (1, 2, 3))
    + "}")
