"""Per-token metadata loads (key scale, value scale, value mid: bf16 planes after each block's codes).

Shared by the unified kernel and decode_warps' one-warp kernel.
"""

from __future__ import annotations

import triton
import triton.language as tl

@triton.jit
def load_meta(pool_ptr, plane, field: tl.constexpr, off, T: tl.constexpr, META: tl.constexpr, mask,
               WORDS: tl.constexpr):
    """A metadata field (bf16) of each token as fp32. WORDS: read from the 32-bit word of the token's pair (T is
    even, the planes 32-byte aligned): 4-byte loads, which Triton's pipeliner prefetches a tile ahead
    (cp.async), where 2-byte loads stall every tile on their latency."""
    if WORDS:
        ptr = (pool_ptr + (plane + META + (field * T + (off & -2)) * 2)).to(tl.pointer_type(tl.uint32))
        w = tl.load(ptr, mask=mask, other=0)
        return tl.where((off & 1) != 0, w & 0xFFFF0000, w << 16).to(tl.float32, bitcast=True)
    ptr = (pool_ptr + (plane + META + (field * T + off) * 2)).to(tl.pointer_type(tl.bfloat16))
    return tl.load(ptr, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def heads_meta(pool_ptr, plane, plane_bytes, field: tl.constexpr, off, T: tl.constexpr, META: tl.constexpr, mask,
                WORDS: tl.constexpr, sub, HEADS_PER_PROGRAM: tl.constexpr):
    """load_meta of HEADS_PER_PROGRAM KV heads (each one's planes plane_bytes on) as [rows, N]: each row its head's field (sub:
    the row's head; the selection is a function of the register, so it folds)."""
    out = load_meta(pool_ptr, plane, field, off, T, META, mask, WORDS)[None, :]
    for j in tl.static_range(1, HEADS_PER_PROGRAM):
        out = tl.where(sub[:, None] == j, load_meta(pool_ptr, plane + j * plane_bytes, field, off, T, META, mask,
                                                     WORDS)[None, :], out)
    return out


@triton.jit
def load_meta_pairs(t0, end, pool_first, bt_row, pool_ptr, block_bytes, head_off, T: tl.constexpr, META: tl.constexpr,
                BLOCK_N: tl.constexpr, HAS_KV_START: tl.constexpr, HAS_PREFIX: tl.constexpr, MASKED: tl.constexpr):
    """The three metadata fields (key scale, value scale, value mid) of tile [t0, t0 + BLOCK_N) as fp32
    [BLOCK_N], loaded as 32-bit words of two tokens (T is even: a pair shares its block). Triton's
    pipeliner prefetches loads of >= 4 bytes a tile ahead (cp.async), not 2-byte ones, which stalled
    every tile on their latency (15% of the stall samples, Nsight Compute, H200, B=16 S=32k). Masked
    tokens read 0."""
    tok = t0 + 2 * tl.arange(0, BLOCK_N // 2)  # the even token of each pair
    if MASKED:
        ok_e = tok < end
        ok_o = tok + 1 < end
        if HAS_KV_START or HAS_PREFIX:
            ok_e = ok_e & (tok >= pool_first)
            ok_o = ok_o & (tok + 1 >= pool_first)
        ok = ok_e | ok_o
    else:
        ok = tl.full((BLOCK_N // 2,), True, tl.int1)
        ok_e = ok
        ok_o = ok
    blk = tl.load(bt_row + tok // T, mask=ok, other=0).to(head_off.dtype)
    base = (pool_ptr + (blk * block_bytes + head_off + META + (tok % T) * 2)).to(tl.pointer_type(tl.uint32))
    return (_bf16_pairs(base, ok, ok_e, ok_o, BLOCK_N, MASKED),
            _bf16_pairs(base + T // 2, ok, ok_e, ok_o, BLOCK_N, MASKED),
            _bf16_pairs(base + T, ok, ok_e, ok_o, BLOCK_N, MASKED))


@triton.jit
def _bf16_pairs(ptr, ok, ok_e, ok_o, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """32-bit words of two bf16 (tokens 2i, 2i + 1) -> fp32 [BLOCK_N] in token order."""
    w = tl.load(ptr, mask=ok, other=0)
    lo = (w << 16).to(tl.float32, bitcast=True)
    hi = (w & 0xFFFF0000).to(tl.float32, bitcast=True)
    if MASKED:
        lo = tl.where(ok_e, lo, 0.0)
        hi = tl.where(ok_o, hi, 0.0)
    return tl.reshape(tl.join(lo, hi), (BLOCK_N,))


