"""A forward's exact window from the recent ring and its new tokens, one launch per tensor.

A verification forward of speculative decoding (a few new tokens at a host position) attends its own tokens and
the ring's W before them exactly, as one window of W + new slots (reference.ring_window). In torch that is the
ring's records decoded (4 ops for int8 key records), a cast, a cat and a gather: 7 device ops for keys and 6 for
values in every layer of every forward, each with its launch's host time. Here one program per (row, KV head) and
tile of slots finds each slot's position from `start`, reads the ring record or the new token it holds, decodes,
and writes it in the new tokens' dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..layout import RING_GROUP, ring_record_bytes
from .codec_tensors import next_pow2
from .fast_launch import LaunchSite, PlanCache, argument_key, device_of, variant_key
from .rounding import store_rounded
from .tiles import _exact_cols

WINDOW_SLOTS = 16  # slots per program: a verification forward's window (W + a few) in W / 16 + 1 programs per head


@triton.jit(do_not_specialize=["start"])
def _window_kernel(ring, new, offset, out, start, W, NEW, H,
                   s_rb, s_rh, s_rw, s_nb, s_nh, s_nt, s_or, s_oh,
                   D: tl.constexpr, DP: tl.constexpr, Q8: tl.constexpr, HAS_OFFSET: tl.constexpr,
                   BLOCK_T: tl.constexpr):
    """out[b, h, j] for slots j of this program's tile: the position p in [start - W, start + NEW) with p % n == j
    (n = W + NEW) comes from the ring's slot p % W where p < start, else from new token p - start."""
    n = W + NEW
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    j = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = j < n
    first = start - W  # the window's first position
    p = first + ((j - first) % n + n) % n
    from_ring = p < start
    slot = (p % W + W) % W
    cols = tl.arange(0, DP)
    col_ok = cols < D
    r = _exact_cols(ring + b * s_rb + h * s_rh, s_rw, slot, ok & from_ring, cols, col_ok, Q8, D)
    if HAS_OFFSET:  # int8 key records hold the key less its key-centering mean
        r += tl.load(offset + b * s_or + h * s_oh + cols, mask=col_ok, other=0.0)[None, :]
    mask = ok[:, None] & col_ok[None, :]
    x = tl.load(new + b * s_nb + h * s_nh + (p - start)[:, None] * s_nt + cols[None, :],
                mask=mask & ~from_ring[:, None], other=0.0).to(tl.float32)
    x = tl.where(from_ring[:, None], r, x)
    store_rounded(out + bh * n * D + j[:, None] * D + cols[None, :], x, mask)


_PLANS = PlanCache()  # by shapes and strides
_KINDS = PlanCache()  # by the kinds Triton specializes on


def ring_window(ring: torch.Tensor, new: torch.Tensor, start: int, offset: torch.Tensor | None = None) -> torch.Tensor:
    """reference.ring_window on CUDA (or the interpreter): ring [B, H, W, D] of exact vectors, or int8 records
    [B, H, W, ring_record_bytes(D)]; new [B, H, NEW, D]; offset: the key-centering mean ([H, D] or [B, H, D]) the
    int8 records were taken less of. Returns [B, H, W + NEW, D] in new's dtype."""
    b, h, m, d = new.shape
    w = ring.shape[2]
    q8 = ring.dtype == torch.int8
    if ring.dim() != 4 or ring.shape[:2] != (b, h) or ring.shape[3] != (ring_record_bytes(d) if q8 else d):
        width = ring_record_bytes(d) if q8 else d
        raise ValueError(f"ring must be [B, H, W, {width}] for new tokens {tuple(new.shape)} "
                         f"({'int8 records' if q8 else 'exact vectors'}), got {tuple(ring.shape)}")
    if w < 1 or m < 1 or d % RING_GROUP or type(start) is not int:
        raise ValueError(f"ring_window needs W >= 1 ring slots, >= 1 new tokens, a head_dim divisible by {RING_GROUP} "
                         f"and a host int start; got W {w}, {m} new, head_dim {d}, start {start!r}")
    if ring.device != new.device or ring.stride(3) != 1 or new.stride(3) != 1:
        raise ValueError("ring and new must share a device and be contiguous in their last axis")
    if offset is not None and not q8:
        raise ValueError("an offset applies to int8 key records only (an exact ring holds the keys themselves)")
    if offset is not None:
        offset = offset.float()
        if offset.dim() == 2:
            offset = offset[None].expand(b, -1, -1)
        if offset.shape != (b, h, d) or offset.stride(2) != 1:
            raise ValueError(f"offset must be [{h}, {d}] or [{b}, {h}, {d}], got {tuple(offset.shape)}")
    out = torch.empty(b, h, w + m, d, dtype=new.dtype, device=new.device)
    s_or, s_oh = (0, 0) if offset is None else offset.stride()[:2]
    ints = (w, m, h, *ring.stride()[:3], *new.stride()[:3], s_or, s_oh)
    key = (argument_key(ring), argument_key(new), argument_key(offset))
    site = _PLANS.get(key)
    if site is None:
        # a new shape: the plan of its kind (what int_key / pointer_key tell of each argument decides the compiled
        # variant), so a chat's next turn of a new length relaunches that plan's kernel without Triton's binder;
        # repeated shapes (a verification forward's few lengths) find theirs by the cheaper key above
        kind = (d, q8, offset is not None, *variant_key((ring, new, out, ring if offset is None else offset) + ints))
        site = _KINDS.get(kind) or _KINDS.put(kind, LaunchSite(_window_kernel, (1, 1, 1), dict(
            D=d, DP=next_pow2(d), Q8=q8, HAS_OFFSET=offset is not None, BLOCK_T=WINDOW_SLOTS, num_warps=4)))
        _PLANS.put(key, site)
    with device_of(new):
        site.regrid((triton.cdiv(w + m, WINDOW_SLOTS), b * h, 1))(ring, new, ring if offset is None else offset, out,
                                                                  start, *ints)
    return out
