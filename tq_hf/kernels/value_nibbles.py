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

def _plane_codes(word: str, outs: tuple[str, ...]) -> str:
    """3-bit codes from `word`, two tokens' 16-bit plane words (below), code a into register outs[a]."""
    body = (f"shr.b32 t, {word}, 6;\n"  # t: the bit-plane bits of code a at bit 2 + 2a
            f"and.b32 {outs[0]}, {word}, 0x00030003;\nand.b32 s, t, 0x00040004;\nor.b32 {outs[0]}, {outs[0]}, s;\n")
    for a in (1, 2, 3):
        body += (f"shr.b32 s, {word}, {2 * a};\nand.b32 {outs[a]}, s, 0x00030003;\n"
                 f"shr.b32 s, t, {2 * a};\nand.b32 s, s, 0x00040004;\nor.b32 {outs[a]}, {outs[a]}, s;\n")
    return body


# 3-bit value planes (layout.value_planes): per 16-bit half, one token's 2-bit-plane byte L in bits 0-7 and, in
# bits 8-15, the bit-plane bits of the same four coordinates at bits 8 + 2a (code_decoders.value_plane_words).
# Output $a holds code a = (L >> 2a & 3) | (bit 8 + 2a) << 2 as the fp16 subnormal code * 2**-24.
PLANES_ASM = "{\n.reg .b32 s, t;\n" + _plane_codes("$4", ("$0", "$1", "$2", "$3")) + "}"

# The same codes straight from the loaded bytes, 4 elements per instance (pack=4): $8 their 2-bit-plane bytes, $9
# their bit-plane bytes, $10 a byte mask each (0x00: the element's column takes its bit-plane byte's even bits,
# 0xFF: the odd ones). The bits are selected and paired with the plane bytes by two byte permutes into the words
# above, where Triton's 16-bit integer ops built each word on its own; output $2a holds code a of elements 0 and 1,
# $2a + 1 of elements 2 and 3.
PLANE_BYTES_ASM = (
    "{\n.reg .b32 s, t, w, lo, hi, m;\n"
    "and.b32 lo, $9, 0x55555555;\nshr.b32 hi, $9, 1;\nand.b32 hi, hi, 0x55555555;\n"
    "and.b32 hi, hi, $10;\nnot.b32 m, $10;\nand.b32 lo, lo, m;\nor.b32 lo, lo, hi;\n"
    "prmt.b32 w, $8, lo, 0x5140;\n" + _plane_codes("w", ("$0", "$2", "$4", "$6"))
    + "prmt.b32 w, $8, lo, 0x7362;\n" + _plane_codes("w", ("$1", "$3", "$5", "$7")) + "}")

PLANE_BYTES_CONSTRAINTS = "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r"  # 4 fp16 outputs x 4 elements; 3 inputs of 4 bytes

# The same codes decoded in place, each at its own scale (code a as code * 4**a * 2**-24; the accumulators are
# scaled back once, as the high nibbles' are): with the bit-plane bits moved next to their codes (s = w >> 6 puts
# code a's at bit 2a + 2), one bit select joins codes 0 and 2 with theirs, another codes 1 and 3, and one mask
# each cuts a code out, where _plane_codes shifted each down (29 against 47 PTX instructions per 16 codes). Bits
# between the selected ones may hold anything (the odd bits of the bit-plane bytes, the next lane's): no mask
# keeps them. Output $2a holds code a of elements 0 and 1 at bits 2a to 2a + 2, $2a + 1 of elements 2 and 3.
def _scaled_codes(word: str, outs: tuple[str, ...]) -> str:
    return (f"shr.b32 s, {word}, 6;\n"
            f"and.b32 t, {word}, 0x00330033;\nand.b32 u, s, 0xFFCCFFCC;\nor.b32 t, t, u;\n"  # codes 0 and 2
            f"and.b32 {outs[0]}, t, 0x00070007;\nand.b32 {outs[2]}, t, 0x00700070;\n"
            f"and.b32 t, {word}, 0x00CC00CC;\nand.b32 u, s, 0xFF33FF33;\nor.b32 t, t, u;\n"  # codes 1 and 3
            f"and.b32 {outs[1]}, t, 0x001C001C;\nand.b32 {outs[3]}, t, 0x01C001C0;\n")


PLANE_SCALED_ASM = (
    "{\n.reg .b32 s, t, u, w, hb;\n"
    "shr.b32 s, $9, 1;\nand.b32 s, s, $10;\nnot.b32 t, $10;\nand.b32 hb, $9, t;\nor.b32 hb, hb, s;\n"
    "prmt.b32 w, $8, hb, 0x5140;\n" + _scaled_codes("w", ("$0", "$2", "$4", "$6"))
    + "prmt.b32 w, $8, hb, 0x7362;\n" + _scaled_codes("w", ("$1", "$3", "$5", "$7")) + "}")

