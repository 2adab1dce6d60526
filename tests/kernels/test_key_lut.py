"""The prmt lookup of 4-bit codebook keys (tq_hf.kernels.key_lut), run through a PTX emulator:
the CPU interpreter runs no PTX, so these tests check the very asm text the GPU compiles."""

from __future__ import annotations

import pytest
import torch

from tq_hf.config import TurboQuantConfig
from tq_hf.kernels.key_lut import (CONSTRAINTS, SPARE_ASM, WORDS_CONSTRAINTS, config_lut3_words, config_lut_bytes, config_lut_words,
                                   lut3_asm, lut3_codes_asm, lut3_words, lut_asm, lut_bytes, lut_words, lut_words_asm)
from tq_hf.reference import key_codec, pack_key_codes, unpack_key_codes

from ptx_emulator import prmt, run


def _halves(word: int) -> list[int]:
    return [word & 0xFFFF, word >> 16]


def _fp16_bits(values: torch.Tensor) -> list[int]:
    return [int(v) & 0xFFFF for v in values.to(torch.float16).view(torch.int16).tolist()]


def test_emulated_prmt_follows_the_ptx_definition():
    a, b = 0x33221100, 0x77665544
    assert prmt(a, b, 0x3210) == a and prmt(a, b, 0x7654) == b
    assert prmt(a, b, 0x0415) == 0x00441155
    assert prmt(0x0000807F, 0, 0x0089) == 0x7F7F00FF  # bit 3: the selected byte's sign, replicated


@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
def test_every_code_byte_becomes_its_two_centroids(head_dim):
    """All 256 byte values in every position of the 4-byte word (and random words): bit-exact fp16
    centroids of the low nibbles from one asm, of the high nibbles from the other; a unary asm (one
    input, two 32-bit outputs) is what Triton moves into the MMA's operand layout."""
    cfg = TurboQuantConfig.from_preset("4bit", rotation="random")
    words = config_lut_words(cfg, head_dim)
    assert words is not None and CONSTRAINTS == "=r,=r,r"
    want = _fp16_bits(key_codec(cfg, head_dim, "cpu").code_centroids)  # by stored (sign-magnitude) code
    gen = torch.Generator().manual_seed(head_dim)
    cases = [[v, (v * 7 + 3) % 256, (v * 13 + 5) % 256, (v * 29 + 11) % 256] for v in range(256)]
    cases += torch.randint(0, 256, (64, 4), generator=gen).tolist()
    low, high = lut_asm(words, high=False), lut_asm(words, high=True)
    for bytes4 in cases:
        word = sum(b << (8 * i) for i, b in enumerate(bytes4))
        lo_out, hi_out = run(low, {2: word}), run(high, {2: word})
        lo = _halves(lo_out[0]) + _halves(lo_out[1])
        hi = _halves(hi_out[0]) + _halves(hi_out[1])
        assert lo == [want[b & 15] for b in bytes4], f"head_dim {head_dim}, low nibbles of {bytes4}: got {lo}, want " \
                                                     f"{[want[b & 15] for b in bytes4]}"
        assert hi == [want[b >> 4] for b in bytes4], f"head_dim {head_dim}, high nibbles of {bytes4}: got {hi}"


def test_only_symmetric_nonzero_codebooks_get_the_lookup():
    c = torch.linspace(-1.5, 1.5, 16)
    assert lut_words(c) is not None
    skewed = c.clone()
    skewed[0] = -1.6
    assert lut_words(skewed) is None
    with_zero = c.clone()
    with_zero[7:9] = 0.0
    assert lut_words(with_zero) is None
    assert lut_words(torch.linspace(-1, 1, 8)) is None  # 3-bit keys keep the gather
    assert config_lut_words(TurboQuantConfig.from_preset("k3v4"), 128) is None
    assert config_lut_words(TurboQuantConfig.from_preset("k8v4"), 128) is None


def _spare_codes(p0: int, p1: int, p2: int) -> int:
    """code_decoders.spare_codes on 4-byte words (its integer ops act bytewise, as here)."""
    return ((p0 >> 3) & 0x11111111) | ((p1 >> 2) & 0x22222222) | ((p2 >> 1) & 0x44444444)


@pytest.mark.parametrize("head_dim", [128, 256])
def test_every_3bit_key_plane_byte_becomes_its_centroids(head_dim):
    """3-bit keys (layout.py's planes), through the emulated asm: each plane's low/high codes, and
    codes 6/7 gathered from the spare bits as the kernel does, come out as the bit-exact fp16
    centroids of the codes reference.unpack_key_codes reads, for every code in every position."""
    cfg = TurboQuantConfig.from_preset("k3v4", rotation="random")
    words = config_lut3_words(cfg, head_dim)
    assert words is not None and CONSTRAINTS == "=r,=r,r"
    cent = _fp16_bits(key_codec(cfg, head_dim, "cpu").code_centroids)
    gen = torch.Generator().manual_seed(head_dim)
    j_count = head_dim // 8
    codes = torch.randint(0, 8, (40, head_dim), generator=gen)
    codes[:8] = torch.arange(8)[:, None].expand(8, head_dim)  # every code in every coordinate
    codes[8:16] = (torch.arange(head_dim)[None, :] + torch.arange(8)[:, None]) % 8
    planes = pack_key_codes(codes, 3, True).unflatten(-1, (3, j_count))  # [rows, plane, j]
    want = unpack_key_codes(pack_key_codes(codes, 3, True), 3, head_dim, True).unflatten(-1, (8, j_count))  # [rows, c, j]
    assert torch.equal(want.flatten(-2), codes)
    low, high = lut3_asm(words, high=False), lut3_asm(words, high=True)
    for row in range(codes.shape[0]):
        for j0 in range(0, j_count - 3, 4):
            word = [sum(int(planes[row, k, j0 + i]) << (8 * i) for i in range(4)) for k in range(3)]
            word.append(_spare_codes(*word))  # codes 6 (low nibbles) and 7 (high)
            for c in range(8):
                out = run(high if c % 2 else low, {2: word[c // 2]})
                got = _halves(out[0]) + _halves(out[1])
                exp = [cent[int(want[row, c, j0 + i])] for i in range(4)]
                assert got == exp, f"head_dim {head_dim}, row {row}, code {c}, rows {j0}..{j0 + 3}: got {got}, want {exp}"


def test_3bit_tables_take_any_8_finite_centroids():
    skewed = torch.tensor([-2.0, -1.1, -0.5, -0.1, 0.0, 0.4, 1.0, 2.5])  # no symmetry, a zero: fine
    words = lut3_words(skewed)
    assert words is not None
    bits = _fp16_bits(skewed)
    for code in range(8):  # one byte of plane 0 whose low nibble is `code`
        out = run(lut3_asm(words, high=False), {2: code})
        assert _halves(out[0])[0] == bits[code]
    assert lut3_words(torch.linspace(-1, 1, 16)) is None
    assert lut3_words(torch.tensor([float("inf")] + [0.0] * 7)) is None
    assert config_lut3_words(TurboQuantConfig.from_preset("4bit"), 128) is None
    assert config_lut3_words(TurboQuantConfig.from_preset("k8v4"), 128) is None


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_every_code_word_pair_becomes_its_four_centroid_pairs(head_dim):
    """The word asm (two 16-bit code words of a token per register): every byte value in every position (and
    random words) -> fp16 subnormal pairs (b0.lo, b2.lo), (b1.lo, b3.lo), (b0.hi, b2.hi), (b1.hi, b3.hi) which,
    times lut_bytes' unit, are the stored codes' centroids exactly (fp32)."""
    cfg = TurboQuantConfig.from_preset("4bit", rotation="random")
    table, unit = config_lut_bytes(cfg, head_dim)
    assert WORDS_CONSTRAINTS == "=r,=r,=r,=r,r"
    want = key_codec(cfg, head_dim, "cpu").code_centroids  # by stored (sign-magnitude) code
    gen = torch.Generator().manual_seed(head_dim + 1)
    cases = [[v, (v * 7 + 3) % 256, (v * 13 + 5) % 256, (v * 29 + 11) % 256] for v in range(256)]
    cases += [c[1:] + c[:1] for c in cases] + torch.randint(0, 256, (64, 4), generator=gen).tolist()
    asm = lut_words_asm(table)
    for b in cases:
        out = run(asm, {4: sum(v << (8 * i) for i, v in enumerate(b))})
        halves = torch.tensor([h for n in range(4) for h in _halves(out[n])], dtype=torch.int32).to(torch.int16)
        got = halves.view(torch.float16).float() * unit  # subnormal m * 2**-24, exact in fp32
        codes = [b[0] & 15, b[2] & 15, b[1] & 15, b[3] & 15, b[0] >> 4, b[2] >> 4, b[1] >> 4, b[3] >> 4]
        assert torch.equal(got, want[codes]), f"head_dim {head_dim}, code bytes {b}: got {got.tolist()}, want " \
                                              f"{want[codes].tolist()}"


def test_byte_magnitudes_need_the_grid():
    """lut_bytes takes symmetric centroids whose magnitudes are whole multiples (1..255) of one step, else None."""
    c = torch.linspace(-1.5, 1.5, 16)
    assert lut_bytes(c) is None  # off the grid
    step = c.abs().max() / 255
    on = torch.round(c / step) * step
    (m0, m1), unit = lut_bytes(on)
    assert unit == float(step) * 2.0**24 and (m1 >> 24) & 0xFF == 255
    skewed = on.clone()
    skewed[0] = -on[0] + step
    assert lut_bytes(skewed) is None



def test_every_3bit_code_quad_becomes_its_centroids():
    """lut3_codes_asm on 4 int32 codes (the unpacked bit stream) gives their fp16 centroids, lowest code in the low
    half of the first output, for random quads covering every code at every position."""
    centroids = key_codec(TurboQuantConfig.from_preset("k3v4"), 64).code_centroids
    asm = lut3_codes_asm(config_lut3_words(TurboQuantConfig.from_preset("k3v4"), 64))
    bits = _fp16_bits(centroids)
    gen = torch.Generator().manual_seed(0)
    quads = torch.cat([torch.arange(8)[:, None].expand(8, 4), torch.randint(0, 8, (64, 4), generator=gen)])
    for quad in quads.tolist():
        out = run(asm, {2 + i: code for i, code in enumerate(quad)})
        got = _halves(out[0]) + _halves(out[1])
        assert got == [bits[c] for c in quad], f"codes {quad}: got {got}"


def test_spare_code_bytes_gather_codes_6_and_7_from_the_planes():
    """SPARE_ASM on 4 bytes of each of the three key planes gives, byte by byte, the integer formula the CPU path
    uses and the layout's packing implies: code 6 from the planes' bits 3, code 7 from their bits 7."""
    gen = torch.Generator().manual_seed(1)
    for _ in range(200):
        planes = torch.randint(0, 256, (3, 4), generator=gen).tolist()
        words = [sum(b << (8 * i) for i, b in enumerate(p)) for p in planes]
        got = run(SPARE_ASM, {1: words[0], 2: words[1], 3: words[2]})[0]
        for i in range(4):
            p0, p1, p2 = (p[i] for p in planes)
            code6 = ((p0 >> 3) & 1) | (((p1 >> 3) & 1) << 1) | (((p2 >> 3) & 1) << 2)
            code7 = ((p0 >> 7) & 1) | (((p1 >> 7) & 1) << 1) | (((p2 >> 7) & 1) << 2)
            assert (got >> (8 * i)) & 0xFF == code6 | (code7 << 4), (planes, i)


def test_tables_pinned_in_registers_decode_the_same():
    """pinned=True (the table words XORed with an opaque zero, lane id x 3 >> 32, LaunchConfig.table_registers):
    every lookup asm gives, in every lane, exactly the outputs of its constant-table version, which the tests above
    check against the centroids; the words really are set through the lane id (a version that reads no lane id, or
    whose zero is not zero in some lane, fails)."""
    k4, k3 = TurboQuantConfig.from_preset("4bit", rotation="random"), TurboQuantConfig.from_preset("k3v4")
    words4, (bytes4, _), words3 = config_lut_words(k4, 128), config_lut_bytes(k4, 128), config_lut3_words(k3, 128)
    builders = [(lut_asm, words4, (False,)), (lut_asm, words4, (True,)), (lut_words_asm, bytes4, ()),
                (lut3_asm, words3, (False,)), (lut3_asm, words3, (True,)), (lut3_codes_asm, words3, ())]
    gen = torch.Generator().manual_seed(3)
    regs = torch.randint(0, 1 << 31, (48, 4), generator=gen).tolist()
    for build, table, args in builders:
        plain, pinned = build(table, *args), build(table, *args, pinned=True)
        assert "%laneid" in pinned and "%laneid" not in plain
        for lane in range(32):
            for r in regs:
                inputs = {2: r[0], 3: r[1] & 7, 4: r[2], 5: r[3] & 7}  # the 4 codes of lut3_codes_asm are 0..7
                assert run(pinned, inputs, lane) == run(plain, inputs, lane), (build.__name__, args, lane, r)
