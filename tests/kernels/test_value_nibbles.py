"""The PTX that decodes 4-bit value codes from 16-bit words (tq_hf.kernels.value_nibbles), run
through the PTX emulator on every 16-bit word: the CPU interpreter runs no PTX."""

from __future__ import annotations

import numpy as np
import pytest

from tq_hf.kernels.value_nibbles import (ASM, CONSTRAINTS, PLANE_BYTES_ASM, PLANE_BYTES_CONSTRAINTS, PLANE_SCALED_ASM,
                                         PLANES_ASM)

from ptx_emulator import run


def test_every_word_becomes_its_four_nibbles_as_fp16_subnormals():
    """Each 16-bit half of the input register (one token's code bytes 2k, 2k + 1) gives, in the same
    half of outputs $0..$3, the fp16 value x * 2**-24 of: byte 2k's low nibble, 16 x its high
    nibble, byte 2k + 1's low nibble, 16 x its high nibble (exact, as numpy reads the fp16 bits)."""
    assert CONSTRAINTS == "=r,=r,=r,=r,r"
    words = np.arange(1 << 16, dtype=np.uint32)
    other = (words * 40503 + 12345) & 0xFFFF  # the register's other half: a different word each time
    for low_half in (True, False):
        regs = (words | (other << 16)) if low_half else (other | (words << 16))
        outs = {j: np.empty(len(words), np.uint32) for j in range(4)}
        for i, r in enumerate(regs.tolist()):
            got = run(ASM, {4: r})
            for j in range(4):
                outs[j][i] = got[j]
        b0, b1 = words & 0xFF, words >> 8
        want = [b0 & 15, (b0 >> 4) * 16, b1 & 15, (b1 >> 4) * 16]
        for j in range(4):
            half = (outs[j] & 0xFFFF) if low_half else (outs[j] >> 16)
            values = half.astype(np.uint16).view(np.float16).astype(np.float64)
            bad = np.nonzero(values != want[j] * 2.0 ** -24)[0]
            assert bad.size == 0, (f"output ${j}, {'low' if low_half else 'high'} half: word {int(words[bad[0]]):#06x} "
                                   f"-> {values[bad[0]]!r}, want {want[j][bad[0]] * 2.0 ** -24!r} ({bad.size} wrong)")


@pytest.mark.slow
def test_every_plane_word_becomes_its_four_3bit_codes_as_fp16_subnormals():
    """3-bit value planes: each 16-bit half (a token's 2-bit-plane byte L, its column's bit-plane bits at
    bits 8 + 2a) gives, in the same half of output $a, the fp16 value code * 2**-24 of
    code = (L >> 2a & 3) | (bit 8 + 2a) << 2, whatever the other half holds."""
    words = np.arange(1 << 16, dtype=np.uint32)
    other = (words * 40503 + 12345) & 0xFFFF
    for low_half in (True, False):
        regs = (words | (other << 16)) if low_half else (other | (words << 16))
        outs = {a: np.empty(len(words), np.uint32) for a in range(4)}
        for i, r in enumerate(regs.tolist()):
            got = run(PLANES_ASM, {4: r})
            for a in range(4):
                outs[a][i] = got[a]
        for a in range(4):
            want = ((words >> (2 * a)) & 3) | (((words >> (8 + 2 * a)) & 1) << 2)
            half = (outs[a] & 0xFFFF) if low_half else (outs[a] >> 16)
            values = half.astype(np.uint16).view(np.float16).astype(np.float64)
            bad = np.nonzero(values != want * 2.0 ** -24)[0]
            assert bad.size == 0, (f"output ${a}, {'low' if low_half else 'high'} half: word {int(words[bad[0]]):#06x} "
                                   f"-> {values[bad[0]]!r}, want {int(want[bad[0]])} * 2**-24 ({bad.size} wrong)")


@pytest.mark.slow
@pytest.mark.parametrize("asm,in_place", [(PLANE_BYTES_ASM, False), (PLANE_SCALED_ASM, True)])
def test_plane_bytes_become_their_four_3bit_codes_as_fp16_subnormals(asm, in_place):
    """3-bit value planes from the loaded bytes, 4 elements per instance: element k's 2-bit-plane byte L (byte k of
    $8), bit-plane byte H (of $9) and mask (of $10: 0x00 its column's even bits, 0xFF the odd ones) give, in half
    k % 2 of output $2a + k // 2, code (L >> 2a & 3) | (H >> (2a + odd) & 1) << 2 as the fp16 value code * 2**-24
    (its bits are the code); decoded in place (PLANE_SCALED_ASM), code * 4**a * 2**-24 (the code at bits 2a to
    2a + 2, every other bit clear). Every (L, H) pair sits in one element, its neighbours and every mask random."""
    assert PLANE_BYTES_CONSTRAINTS.count("=r") == 8 and PLANE_BYTES_CONSTRAINTS.count(",r") == 3
    rng = np.random.default_rng()
    n = 1 << 16
    odd = rng.integers(0, 2, size=(n, 4), dtype=np.uint32)
    low = rng.integers(0, 256, size=(n, 4), dtype=np.uint32)
    high = rng.integers(0, 256, size=(n, 4), dtype=np.uint32)
    pairs, at = np.arange(n, dtype=np.uint32), np.arange(n) % 4
    low[np.arange(n), at], high[np.arange(n), at] = pairs & 0xFF, pairs >> 8
    shift = 8 * np.arange(4, dtype=np.uint32)
    regs = [(x << shift).sum(axis=1).tolist() for x in (low, high, odd * 0xFF)]
    outs = np.array([[got[j] for j in range(8)] for got in (run(asm, {8: a, 9: b, 10: c})
                                                            for a, b, c in zip(*regs))], dtype=np.uint32)
    for k in range(4):
        for a in range(4):
            half = (outs[:, 2 * a + k // 2] >> (16 * (k % 2))) & 0xFFFF
            code = ((low[:, k] >> (2 * a)) & 3) | (((high[:, k] >> (2 * a + odd[:, k])) & 1) << 2)
            code = code << (2 * a) if in_place else code
            bad = np.nonzero(half != code)[0]
            assert bad.size == 0, (f"element {k}, code {a}: L {int(low[bad[0], k]):#04x} H {int(high[bad[0], k]):#04x} "
                                   f"odd {int(odd[bad[0], k])} -> {int(half[bad[0]]):#06x}, want {int(code[bad[0]])} "
                                   f"({bad.size} wrong)")
