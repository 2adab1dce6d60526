"""The prmt lookup of 4-bit codebook keys (tq_hf.kernels.key_lut), run through a PTX emulator."""

from __future__ import annotations

import pytest
import torch

from tq_hf.config import TurboQuantConfig
from tq_hf.kernels.key_lut import ASM, CONSTRAINTS, key_lut_words, lut_words_for
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
    """All 256 byte values, in every position of the 4-byte word, bit-exact fp16 centroids."""
    cfg = TurboQuantConfig.from_preset("4bit", rotation="random")
    words = key_lut_words(cfg, head_dim)
    assert words is not None and CONSTRAINTS.count("=r") == 4 and CONSTRAINTS.count(",r") == 17
    tables = dict(zip((5, 9, 13, 17), words))
    want = _fp16_bits(key_codec(cfg, head_dim, "cpu").centroids)
    gen = torch.Generator().manual_seed(head_dim)
    words = [[v, (v * 7 + 3) % 256, (v * 13 + 5) % 256, (v * 29 + 11) % 256] for v in range(256)]
    words += torch.randint(0, 256, (64, 4), generator=gen).tolist()
    for bytes4 in words:
        word = sum(b << (8 * i) for i, b in enumerate(bytes4))
        out = run(ASM, {4: word, **tables})
        lo = _halves(out[0]) + _halves(out[1])
        hi = _halves(out[2]) + _halves(out[3])
        assert lo == [want[b & 15] for b in bytes4], f"low nibbles of {bytes4}: got {lo}"
        assert hi == [want[b >> 4] for b in bytes4], f"high nibbles of {bytes4}: got {hi}"


def test_only_symmetric_positive_codebooks_get_the_lookup():
    c = torch.linspace(-1.5, 1.5, 16)
    assert lut_words_for(c) is not None
    skewed = c.clone()
    skewed[0] = -1.6
    assert lut_words_for(skewed) is None
    assert lut_words_for(torch.linspace(-1, 1, 8)) is None  # 3-bit keys keep the gather
    assert key_lut_words(TurboQuantConfig.from_preset("k3v4"), 128) is None
    assert key_lut_words(TurboQuantConfig.from_preset("k8v4"), 128) is None
