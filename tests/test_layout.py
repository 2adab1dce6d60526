"""BlockLayout: the byte diagram of its docstring, checked byte by byte through the views."""

from __future__ import annotations

import pytest
import torch

from tq_hf.config import BLOCK_SIZES, PRESETS, TurboQuantConfig
from tq_hf.layout import KEY_SCALE, METADATA_DTYPE, VALUE_MID, VALUE_SCALE, BlockLayout

ALL_HEAD_DIMS = tuple(range(32, 257, 16))


def make_layout(preset: str, head_dim: int, block_size: int | None = 16, heads: int = 3) -> BlockLayout:
    rotation = "hadamard" if head_dim & (head_dim - 1) == 0 else "random"
    cfg = TurboQuantConfig.from_preset(preset, rotation=rotation, block_size=block_size)
    return BlockLayout(cfg, heads, head_dim)


# ---- geometry -----------------------------------------------------------------------------------
def test_block_size_default_per_head_dim():
    """block_size=None (the default) takes default_block_size's choice: 64 at head_dim 128, 16 elsewhere; an
    explicit size always wins."""
    for head_dim in ALL_HEAD_DIMS:
        lay = make_layout("4bit", head_dim, None)
        assert lay.config.block_size is None
        assert lay.block_size == (64 if head_dim == 128 else 16), head_dim
        assert lay.plane_bytes == lay.block_size * lay.config.token_head_bytes(head_dim)
        for t in BLOCK_SIZES:
            assert make_layout("4bit", head_dim, t).block_size == t


@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_sizes_match_config_and_regions_are_32_byte_aligned(preset, block_size):
    for head_dim in ALL_HEAD_DIMS:
        lay = make_layout(preset, head_dim, block_size, heads=5)
        cfg, t = lay.config, block_size
        kb, vb = cfg.key_code_bytes(head_dim), cfg.value_code_bytes(head_dim)
        assert (lay.key_bytes, lay.value_bytes) == (kb, vb)
        # offsets from the docstring's diagram
        assert lay.key_offset == 0
        assert lay.value_offset == t * kb
        assert lay.metadata_offset == t * (kb + vb)
        assert lay.plane_bytes == t * (kb + vb + 6) == t * cfg.token_head_bytes(head_dim)
        assert lay.block_bytes == 5 * lay.plane_bytes
        field_starts = [lay.metadata_offset + f * 2 * t for f in range(3)]
        for off in (lay.key_offset, lay.value_offset, lay.metadata_offset, lay.plane_bytes, *field_starts):
            assert off % 32 == 0, f"{preset} D={head_dim} T={block_size}: offset {off} not 32-byte aligned"


@pytest.mark.parametrize("preset", list(PRESETS))
def test_allocate(preset):
    lay = make_layout(preset, 128, 32, heads=2)
    pool = lay.allocate(7, "cpu")
    assert pool.shape == (7, 2, lay.plane_bytes) and pool.dtype == torch.uint8
    assert pool.numel() == 7 * lay.block_bytes
    assert pool.is_contiguous() and not pool.any()
    lay.check_pool(pool)


# ---- views alias the pool at the documented byte offsets ----------------------------------------
@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("head_dim, block_size", [(64, 16), (96, 32), (128, 64), (256, 16)])
def test_views_alias_pool_at_documented_offsets(preset, head_dim, block_size):
    heads, blocks = 3, 4
    lay = make_layout(preset, head_dim, block_size, heads)
    cfg, t = lay.config, block_size
    kb, vb = cfg.key_code_bytes(head_dim), cfg.value_code_bytes(head_dim)
    pool = lay.allocate(blocks, "cpu")
    flat = pool.view(-1)

    kc, vc, meta = lay.key_codes(pool), lay.value_codes(pool), lay.metadata(pool)
    assert kc.shape == (blocks, heads, t, kb) and kc.dtype == torch.uint8
    assert vc.shape == (blocks, heads, t, vb) and vc.dtype == torch.uint8
    assert meta.shape == (blocks, heads, 3, t) and meta.dtype == METADATA_DTYPE == torch.bfloat16
    for view in (kc, vc, meta):
        assert view.untyped_storage().data_ptr() == pool.untyped_storage().data_ptr()

    def plane_start(b: int, h: int) -> int:
        return (b * heads + h) * t * (kb + vb + 6)

    b, h, tok = 2, 1, t - 3
    expected = torch.zeros_like(flat)
    # key codes: token tok at tok * KB
    key_row = (torch.arange(kb) % 251 + 1).to(torch.uint8)
    kc[b, h, tok] = key_row
    start = plane_start(b, h) + tok * kb
    expected[start : start + kb] = key_row
    # value codes: token tok at T * KB + tok * VB
    vc[b, h, tok] = 200
    start = plane_start(b, h) + t * kb + tok * vb
    expected[start : start + vb] = 200
    # metadata: field f, token tok at T * (KB + VB) + (f * T + tok) * 2, little-endian bfloat16
    assert (KEY_SCALE, VALUE_SCALE, VALUE_MID) == (0, 1, 2)
    fields = {KEY_SCALE: (1.5, 0x3FC0), VALUE_SCALE: (-2.0, 0xC000), VALUE_MID: (-0.0078125, 0xBC00)}
    for f, (x, raw) in fields.items():
        meta[b, h, f, tok] = x
        start = plane_start(b, h) + t * (kb + vb) + (f * t + tok) * 2
        expected[start], expected[start + 1] = raw & 0xFF, raw >> 8
    mismatch = (flat != expected).nonzero().flatten().tolist()
    assert not mismatch, f"bytes differ from the diagram at flat offsets {mismatch[:10]}"

    # writes into the pool show through the views (the other direction)
    pool.zero_()
    start = plane_start(3, 2) + t * kb + 0 * vb + (vb - 1)
    flat[start] = 77
    assert vc[3, 2, 0, vb - 1].item() == 77 and int((vc != 0).sum()) == 1
    assert not kc.any() and not meta.view(torch.int16).any()


def test_metadata_view_of_whole_plane_fields():
    """One head's field is T contiguous bf16 values (structure of arrays)."""
    lay = make_layout("4bit", 64, 16, heads=2)
    pool = lay.allocate(2, "cpu")
    meta = lay.metadata(pool)
    meta[1, 0, VALUE_SCALE] = torch.arange(16, dtype=torch.bfloat16)
    start = (1 * 2 + 0) * lay.plane_bytes + lay.metadata_offset + 2 * 16
    got = pool.view(-1)[start : start + 32].view(torch.bfloat16)
    assert torch.equal(got, torch.arange(16, dtype=torch.bfloat16))


# ---- errors -------------------------------------------------------------------------------------
def test_check_pool_errors():
    lay = make_layout("k3v4", 64, 16, heads=2)
    good = lay.allocate(3, "cpu")
    bad_pools = {
        "dtype": good.view(torch.int8),
        "dims": good.flatten(1),
        "heads": torch.zeros(3, 3, lay.plane_bytes, dtype=torch.uint8),
        "plane": torch.zeros(3, 2, lay.plane_bytes + 32, dtype=torch.uint8),
    }
    for what, pool in bad_pools.items():
        with pytest.raises(ValueError) as err:
            lay.check_pool(pool)
        assert f"[num_blocks, 2, {lay.plane_bytes}]" in str(err.value), what
    strided = torch.zeros(2, 3, 2, lay.plane_bytes, dtype=torch.uint8)[:, :, 0].transpose(0, 1)
    assert strided.shape == (3, 2, lay.plane_bytes)
    with pytest.raises(ValueError, match="contiguous"):
        lay.check_pool(strided)


@pytest.mark.parametrize("head_dim", [24, 100, 272])
def test_layout_rejects_unsupported_head_dim(head_dim):
    with pytest.raises(ValueError, match="multiples of 16 from 32 to 256"):
        BlockLayout(TurboQuantConfig(rotation="random"), 2, head_dim)


def test_layout_rejects_hadamard_non_power_of_two():
    with pytest.raises(ValueError, match="random"):
        BlockLayout(TurboQuantConfig(rotation="hadamard"), 2, 96)


@pytest.mark.parametrize("heads", [0, -1])
def test_layout_rejects_bad_head_count(heads):
    with pytest.raises(ValueError, match="num_kv_heads"):
        BlockLayout(TurboQuantConfig(), heads, 64)
