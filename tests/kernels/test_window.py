"""kernels.ring_window (a forward's exact window from the recent ring and its new tokens) against
reference.ring_window and the window's definition, position by position."""

from __future__ import annotations

import pytest
import torch

from tq_hf import reference
from tq_hf.kernels import ring_window

from kernel_helpers import DEVICE


def _ring(rows: int, heads: int, w: int, d: int, ring_format, offset):
    """A ring of w slots: int8 records of random vectors less `offset` (ring_format "int8"), else exact vectors of
    that dtype."""
    x = torch.randn(rows, heads, w, d, device=DEVICE) * 3
    if ring_format == "int8":
        return reference.encode_ring(x, None if offset is None else reference.ring_offset(offset))
    return x.to(ring_format)


def _by_definition(ring, new, start, offset):
    """Position p in [start - W, start + NEW) at slot p % (W + NEW): the ring's slot p % W before start, else new
    token p - start (a loop over positions, no gather index)."""
    w, m = ring.shape[2], new.shape[2]
    vectors = reference.ring_vectors(ring, None if offset is None else reference.ring_offset(offset)).to(new.dtype)
    out = torch.full((*new.shape[:2], w + m, new.shape[3]), float("nan"), dtype=new.dtype, device=new.device)
    for p in range(start - w, start + m):
        out[:, :, p % (w + m)] = vectors[:, :, p % w] if p < start else new[:, :, p - start]
    return out


@pytest.mark.parametrize("ring_format,offset_rows,dtype,d", [
    ("int8", None, torch.float16, 128), ("int8", 0, torch.float16, 128), ("int8", 2, torch.bfloat16, 64),
    ("int8", 2, torch.float32, 80), (torch.float16, None, torch.float16, 128), (torch.bfloat16, None, torch.bfloat16, 64),
    (torch.float32, None, torch.float32, 48)])
def test_ring_window_matches_the_reference_bitwise(ring_format, offset_rows, dtype, d):
    """Every start modulo the ring (the relaunch path keeps a plan across starts: 0, 1 and multiples of 16 among
    them), 1 to 50 new tokens (a chat turn's too), rings of 7 to 40 slots, int8 records with a shared or per-row
    mean or none, exact rings of three dtypes, head_dims of full and partial power-of-two tiles: equal to
    reference.ring_window and to the definition."""
    rows, heads = 2, 3
    offset = None if offset_rows is None else torch.randn(*([offset_rows] if offset_rows else []), heads, d,
                                                          device=DEVICE)
    for w, new_count in ((16, 1), (16, 5), (16, 16), (7, 3), (40, 9), (8, 50)):  # rings of any width, long forwards
        ring = _ring(rows, heads, w, d, ring_format, offset)
        new = torch.randn(rows, heads, new_count, d, device=DEVICE).to(dtype)
        for start in [0, 1, 3, 15, 16, 17, 31, 32, 40]:
            got = ring_window(ring, new, start, offset)
            want = reference.ring_window(ring, new, start, offset)
            assert got.dtype == dtype and got.shape == want.shape
            assert torch.equal(got, want), (w, new_count, start, (got != want).nonzero()[:4].tolist())
            assert torch.equal(got, _by_definition(ring, new, start, offset)), (w, new_count, start)


def test_ring_window_of_a_long_ring_on_strided_inputs():
    """A 128-slot int8 ring (the presets' W) read through a strided view, new tokens as a transposed [B, L, H, D]
    projection's view: the strides reach the kernel as given."""
    d, heads = 128, 4
    offset = torch.randn(heads, d, device=DEVICE)
    big = _ring(2, heads, 160, d, "int8", offset)
    ring = big[:, :, 16:144]
    new = torch.randn(2, 7, heads, d, device=DEVICE, dtype=torch.float16).transpose(1, 2)
    for start in (128, 200, 255):
        assert torch.equal(ring_window(ring, new, start, offset), reference.ring_window(ring, new, start, offset))


def test_ring_window_rejects_what_it_cannot_read():
    new = torch.randn(1, 2, 3, 64, device=DEVICE, dtype=torch.float16)
    records = _ring(1, 2, 8, 64, "int8", None)
    with pytest.raises(ValueError, match="ring must be"):
        ring_window(records[..., :64], new, 8)
    with pytest.raises(ValueError, match="host int start"):
        ring_window(records, new, torch.tensor(8))
    with pytest.raises(ValueError, match="int8 key records only"):
        ring_window(torch.randn(1, 2, 8, 64, device=DEVICE), new, 8, torch.zeros(2, 64, device=DEVICE))
    with pytest.raises(ValueError, match="offset must be"):
        ring_window(records, new, 8, torch.zeros(3, 64, device=DEVICE))
