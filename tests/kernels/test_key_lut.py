"""The prmt lookup of 4-bit codebook keys (tq_hf.kernels.key_lut), run through a PTX emulator:
the CPU interpreter runs no PTX, so these tests check the very asm text the GPU compiles."""

from __future__ import annotations

import pytest
import torch

from tq_hf.config import TurboQuantConfig
from tq_hf.kernels.key_lut import CONSTRAINTS, config_lut_words, lut_asm, lut_words
from tq_hf.reference import key_codec

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
