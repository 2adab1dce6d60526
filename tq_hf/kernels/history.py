"""A forward of many queries over a compressed history, through a dense copy and flash attention.

The unified kernel decodes the history once per tile of 64 query rows: from a few hundred queries up it
re-reads and re-decodes the whole history several times and runs 2-4.6x fp16 SDPA (docs/performance.md). Here the
history is dequantized once (dequantize.py, in the rotation spaces), the exact tokens (prefix, ring, the
forward's own) written over their positions, and torch attends over it. Queries and outputs are rotated instead
of the history (a few rows against every position), unless the history has the fewer rows (a compressed prefill).

Where a forward's queries fill the GPU, the history and the forward's own tokens are attended apart and merged by
their log-sum-exp: the history without a mask, with each KV head's G x Lq query rows stacked into one sequence
(cuDNN attention), so each dense K/V tile is read once per KV head instead of once per query head; the own
tokens causally (flash attention). Elsewhere one SDPA call takes both with the causal mask aligned to the bottom
right (docs/performance.md has the figures behind the switch).

The dense copy is transient: a group of rows at a time, within DENSE_HISTORY_BYTES. It serves unpadded rows of
one common length without a sliding window, logit softcapping or attention sinks (dense_history_serves); the
unified kernel serves everything else and forwards of less work (fewer queries or a shorter history).
"""

from __future__ import annotations

import functools
import math
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from ..layout import BlockLayout
from ..reference import ring_offset, ring_vectors
from .checks import check_attention_inputs, check_key_offset, check_prefix, check_recent
from .codec_tensors import codec_tensors, value_rotation_tensor
from .dequantize import ExactTokens, dequantize_rotated, rotated_mean
from .device import device_traits
from .fast_launch import device_of
from .lse_merge import merge_attention

# The dense route from this much work, query rows (query heads per KV head x queries, over the batch) x positions: it
# decodes the history once, not per query-row tile, but costs host time: set between two hosts' crossovers, by format:
DENSE_HISTORY_MIN_WORK_3BIT = 112 << 16  # 3-bit keys and values (3bit): 56 queries over 32k
DENSE_HISTORY_MIN_WORK_3BIT_KEYS = 144 << 16  # 3-bit keys, 4-bit values (k3v4): 72 queries over 32k
DENSE_HISTORY_MIN_WORK_FP8_KEYS = 160 << 16  # FP8 keys (k8v4): 80 queries over 32k
DENSE_HISTORY_MIN_WORK = 256 << 16  # 4-bit keys and anything else: 128 queries over 32k, 256 over 16k
DENSE_HISTORY_BYTES = 1 << 30  # the dense K/V of one group of rows; rows beyond it go in later groups
FLASH_DTYPES = (torch.float16, torch.bfloat16)
# the history attended apart from the forward's own tokens once its stacked query rows make this many 128-row
# tiles per SM: faster than one SDPA call at a tile per SM, slower at half of one (docs/performance.md)
SPLIT_HISTORY_TILES_PER_SM = 0.75
_CUDNN_REFUSED: set[tuple] = set()  # (device, dtype, head_dim) where cuDNN attention raised: one SDPA call there


def dense_history_serves(query: torch.Tensor, layout: BlockLayout, length: int | None, kv_start=None,
                         sliding_window=None, sinks=None, softcap=None, **_) -> bool:
    """Whether dense_history_attention takes this forward: enough work for the unified kernel (prefers_dense_route),
    a flash-attention dtype and head size, unpadded rows of a known common length, one row's dense K/V within the
    budget, none of the features SDPA lacks (sliding window, softcap, sinks)."""
    lq, d = query.shape[2], query.shape[3]
    return (length is not None and lq <= length and kv_start is None and sliding_window is None and sinks is None
            and softcap is None and query.dtype in FLASH_DTYPES and d % 8 == 0 and d <= 256
            and _row_bytes(layout, length, query.element_size()) <= DENSE_HISTORY_BYTES
            and prefers_dense_route(query, layout, length))


def prefers_dense_route(query: torch.Tensor, layout: BlockLayout, length: int) -> bool:
    """Whether query [B, Hq, Lq, D] over `length` positions is enough work to pay for the dense route."""
    b, hq, lq, _ = query.shape
    return b * (hq // layout.num_kv_heads) * lq * length >= dense_history_min_work(layout)


def dense_history_min_work(layout: BlockLayout) -> int:
    """Query rows x positions from which a forward over this format takes the dense route."""
    cfg = layout.config
    if cfg.uses_codebook and cfg.key_bits == 3:
        return DENSE_HISTORY_MIN_WORK_3BIT if cfg.value_bits == 3 else DENSE_HISTORY_MIN_WORK_3BIT_KEYS
    if not cfg.uses_codebook and cfg.key_bits == 8:
        return DENSE_HISTORY_MIN_WORK_FP8_KEYS
    return DENSE_HISTORY_MIN_WORK


def _row_bytes(layout: BlockLayout, length: int, element_size: int) -> int:
    return 2 * layout.num_kv_heads * length * layout.head_dim * element_size


def dense_history_attention(query: torch.Tensor, pool: torch.Tensor, layout: BlockLayout, block_table: torch.Tensor,
                            seq_lens: torch.Tensor, scale: float, length: int, out: torch.Tensor | None = None,
                            key_offset: torch.Tensor | None = None, prefix_keys: torch.Tensor | None = None,
                            prefix_values: torch.Tensor | None = None, recent_keys: torch.Tensor | None = None,
                            recent_values: torch.Tensor | None = None, recent_from: int = 0) -> torch.Tensor:
    """reference.paged_attention for rows that all hold `length` positions, no padding: query [B, Hq, Lq, D], the
    last Lq positions of each row; seq_lens (each row's `length`) is not read. The exact buffers and key_offset are
    as unified_attention takes them. Returns `out`, or without one a new tensor, in query's dtype."""
    check_attention_inputs(query, pool, layout, block_table, seq_lens, None, None, out, scale, None, None)
    b, lq = query.shape[0], query.shape[2]
    if not isinstance(length, int) or not lq <= length <= block_table.shape[1] * layout.block_size:
        raise ValueError(f"length must be an int from the query count {lq} to the block table's capacity "
                         f"{block_table.shape[1] * layout.block_size}, got {length!r}")
    key_offset, _ = check_key_offset(key_offset, layout, pool.device, rows=b)
    prefix_len = check_prefix(prefix_keys, prefix_values, layout, b, pool.device)
    check_recent(recent_keys, recent_values, layout, b, pool.device)
    dtype = query.dtype
    rot_t, vrot, vrot_t = _rotations(layout, str(pool.device), dtype)
    # the dense copy comes out in the rotation spaces: rotated back where it has fewer rows than the queries (a
    # compressed prefill: Hq x Lq > Hk x length), else the queries and outputs are rotated instead
    unrotate = rotates_history(query, layout, length) and (rot_t is not None or vrot is not None)
    q = query if rot_t is None or unrotate else query @ rot_t
    if unrotate:  # the exact tokens then join the history as they are
        rot_t, vrot, vrot_t, back_k, back_v = None, None, None, rot_t, vrot_t
    mean = key_offset  # (int8 ring key records hold keys less the unrotated mean)
    key_offset = rotated_mean(layout, key_offset)
    group = max(1, DENSE_HISTORY_BYTES // _row_bytes(layout, length, query.element_size()))
    if out is None and not 0 < b <= group:
        out = torch.empty_like(query)
    # the ring serves [lo, length), over the prefix where they meet
    lo = length if recent_keys is None else max(recent_from, length - recent_keys.shape[2], 0)
    p = min(prefix_len, lo)
    with device_of(pool):
        for r0 in range(0, b, group):
            rows = slice(r0, min(b, r0 + group))
            offset = key_offset[rows] if key_offset is not None and key_offset.dim() == 3 else key_offset
            exact = None if unrotate else _kernel_overlay(layout, dtype, rows, lo, p, rot_t, vrot_t, prefix_keys,
                                                           prefix_values, recent_keys, recent_values)
            k, v = dequantize_rotated(pool, layout, block_table[rows], length, dtype, offset, exact=exact)
            if unrotate:  # (K R^T) R = K, (V Rv^T) Rv = V; fp16 saturates as the dequantization does
                k, v = (x if back is None else _saturated(x @ back.T) for x, back in ((k, back_k), (v, back_v)))
            if exact is None:
                if recent_keys is not None:
                    ring_mean = None if mean is None or recent_keys.dtype != torch.int8 else ring_offset(
                        mean[rows] if mean.dim() == 3 else mean)
                    _copy_ring(k, _rotated(ring_vectors(recent_keys[rows], ring_mean), rot_t, dtype), lo, length)
                    _copy_ring(v, _rotated(ring_vectors(recent_values[rows]), vrot_t, dtype), lo, length)
                if p:
                    k[:, :, :p] = _rotated(prefix_keys[rows, :, :p], rot_t, dtype)
                    v[:, :, :p] = _rotated(prefix_values[rows, :, :p], vrot_t, dtype)
            o = _attend(q[rows], k, v, scale, vrot, None if out is None else out[rows])
            if out is None:  # every row in one group and no buffer given: the attention's output is the result
                return o
    return out


def _kernel_overlay(layout: BlockLayout, dtype: torch.dtype, rows: slice, lo: int, p: int, rot_t, vrot_t,
                    prefix_keys, prefix_values, recent_keys, recent_values) -> ExactTokens | None:
    """The exact tokens as dequantize_rotated overlays them on the device (ExactTokens), or None where torch does:
    int8 ring records (decoded in torch), buffers not in the output dtype with D contiguous, a head_dim under 16.
    One launch for both tensors where torch took per tensor two matmuls and up to three copies into the dense
    history, each a launch with its host time."""
    buffers = [x for x in (recent_keys, recent_values, prefix_keys, prefix_values) if x is not None]
    if not buffers or any(x.dtype != dtype or x.stride(-1) != 1 for x in buffers):
        return None
    pairs = ((recent_keys, recent_values), (prefix_keys, prefix_values))
    if any(a is not None and a.stride() != b.stride() for a, b in pairs):
        return None
    if layout.head_dim < 16:  # (the rotation's tensor-core product spans the padded head_dim)
        return None
    ring = recent_keys is not None and recent_keys.shape[2] > 0  # (the kernel reads slot p % n)
    return ExactTokens(recent_keys[rows] if ring else None, recent_values[rows] if ring else None, lo,
                       prefix_keys[rows] if p else None, prefix_values[rows] if p else None, p, rot_t, vrot_t)


def rotates_history(query: torch.Tensor, layout: BlockLayout, length: int) -> bool:
    """Whether the dense history is rotated back rather than the queries and outputs rotated: it has fewer rows."""
    return query.shape[1] * query.shape[2] > layout.num_kv_heads * length


def _saturated(x: torch.Tensor) -> torch.Tensor:
    """x with fp16's overflow to inf clamped back to its largest finite value (in place; other dtypes as they are)."""
    return x.clamp_(-65504.0, 65504.0) if x.dtype == torch.float16 else x


def _matmul_into(dst: torch.Tensor, x: torch.Tensor, m: torch.Tensor) -> None:
    """dst = x @ m, written in place without a temporary where dst's strides are a permutation of a contiguous
    layout with the last axis last (a fresh output, or the attention function's [B, Lq, Hq, D] buffer seen as
    [B, Hq, Lq, D]); else through one."""
    order = sorted(range(dst.dim() - 1), key=lambda i: -dst.stride(i)) + [dst.dim() - 1]
    target = dst.permute(order)
    if target.is_contiguous():
        torch.matmul(x.permute(order), m, out=target)
    else:
        dst.copy_(x @ m)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, rotation: torch.Tensor | None = None,
            dst: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of q [R, Hq, Lq, D], the last Lq of the `length` positions of k, v [R, Hk, length, D], each query
    over the positions up to its own; in q's dtype, times rotation (Rv, [D, D]) when given; into dst [R, Hq, Lq, D]
    when given (any strides, D contiguous), else a new tensor."""
    b, hq, lq, d = q.shape
    hk, length = k.shape[1], k.shape[2]
    if splits_history(q, hk, length) and (q.device, q.dtype, d) not in _CUDNN_REFUSED:
        try:
            pieces = _history_and_own(q, k, v, scale)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as err:  # cuDNN without support for this shape, dtype or device: one SDPA call
            _CUDNN_REFUSED.add((q.device, q.dtype, d))
            warnings.warn(f"tq_hf: cuDNN attention refused the history of a {lq}-query forward ({q.dtype}, head_dim "
                          f"{d}): {err}; such forwards take one SDPA call instead, which is slower", stacklevel=3)
        else:
            return _merged(q, *pieces, rotation, dst)
    mask = None if lq == length else causal_lower_right(lq, length)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                       enable_gqa=hq != hk)
    return _rotated_into(o, rotation, dst)


def _rotated_into(o: torch.Tensor, rotation: torch.Tensor | None, dst: torch.Tensor | None) -> torch.Tensor:
    """o @ rotation (o without one), into dst when given."""
    if dst is None:
        return o if rotation is None else o @ rotation
    if rotation is None:
        dst.copy_(o)
    else:
        _matmul_into(dst, o, rotation)
    return dst


def splits_history(q: torch.Tensor, num_kv_heads: int, length: int) -> bool:
    """Whether q [R, Hq, Lq, D] over `length` positions attends the history apart from its own tokens: always
    off CUDA (the tests' path), on CUDA in fp16/bf16 once the history's stacked query rows fill the GPU."""
    b, hq, lq, _ = q.shape
    if lq >= length:
        return False
    if q.device.type != "cuda":
        return True
    tiles = b * num_kv_heads * math.ceil(hq // num_kv_heads * lq / 128)
    return (q.dtype in FLASH_DTYPES and torch.backends.cudnn.is_available()
            and tiles >= SPLIT_HISTORY_TILES_PER_SM * device_traits(q.device).num_sms)


def _attend_history_and_own(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                            rotation: torch.Tensor | None = None, dst: torch.Tensor | None = None) -> torch.Tensor:
    """_attend as two attentions merged by log-sum-exp: every query over the history [0, length - Lq), each KV
    head's G x Lq query rows as one sequence; and causally over the forward's own Lq positions."""
    return _merged(q, *_history_and_own(q, k, v, scale), rotation, dst)


def _history_and_own(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, ...]:
    """The two attentions _attend_history_and_own merges: (o_hist [R * Hk, G * Lq, D], lse_hist [R * Hk, G * Lq],
    o_own [R, Hq, Lq, D], lse_own [R, Hq, Lq]), each log-sum-exp read as [.., rows] (a backend may add a trailing
    unit axis or pad the rows)."""
    b, hq, lq, d = q.shape
    hk, length = k.shape[1], k.shape[2]
    h = length - lq
    q = q.contiguous()
    stacked = q.view(b * hk, 1, hq // hk * lq, d)  # head kv * G + g's rows at g * Lq + i of KV head kv's
    o_hist, lse_hist = _attention_lse(stacked, k[:, :, :h].reshape(b * hk, 1, h, d),
                                      v[:, :, :h].reshape(b * hk, 1, h, d), scale, causal=False)
    o_own, lse_own = _attention_lse(q, k[:, :, h:], v[:, :, h:], scale, causal=True)
    return o_hist[:, 0], lse_hist.flatten(2)[:, 0, : hq // hk * lq], o_own, lse_own.flatten(2)[..., :lq]


def _merged(q: torch.Tensor, o_hist: torch.Tensor, lse_hist: torch.Tensor, o_own: torch.Tensor,
            lse_own: torch.Tensor, rotation: torch.Tensor | None, dst: torch.Tensor | None) -> torch.Tensor:
    """The softmax over both pieces (the history's share of each row's weight is sigmoid(lse_hist - lse_own)),
    times rotation, into dst: one launch (lse_merge.py) where the head_dim allows its tensor-core product."""
    b, hq, lq, d = o_own.shape
    if (d >= 16 and all(x.stride(-1) == 1 for x in (o_hist, lse_hist, o_own, lse_own))
            and (rotation is None or rotation.is_contiguous()) and (dst is None or dst.stride(-1) == 1)):
        return merge_attention(o_hist, lse_hist, o_own, lse_own, rotation, torch.empty_like(q) if dst is None else dst)
    share = torch.sigmoid(lse_hist.reshape(b, hq, lq, 1) - lse_own.reshape(b, hq, lq, 1))
    o = torch.lerp(o_own.float(), o_hist.reshape(b, hq, lq, d).float(), share).to(q.dtype)
    return _rotated_into(o, rotation, dst)


def _attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                   causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(attention of q [B, Hq, L, D] over k, v [B, Hk, S, D] in q's dtype, the log-sum-exp of each row's scaled
    scores in fp32); causal: L == S, each row over the positions up to its own. On CUDA in fp16/bf16 the history
    (no mask) by cuDNN attention, the causal piece by flash attention (GQA-aware); elsewhere fp32 math."""
    if q.is_cuda and q.dtype in FLASH_DTYPES:
        if causal:
            result = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)
        else:
            result = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, False, False,
                                                                        scale=scale)
        return result[0], result[1]
    if k.shape[1] != q.shape[1]:
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], 1) for x in (k, v))
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    if causal:
        scores.masked_fill_(torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return (scores.softmax(-1) @ v.float()).to(q.dtype), scores.logsumexp(-1)


@functools.lru_cache(maxsize=None)
def _rotations(layout: BlockLayout, device: str, dtype: torch.dtype) -> tuple[torch.Tensor | None, ...]:
    """(R^T, Rv, Rv^T) in `dtype` (None where the format does not rotate): the queries, outputs and exact tokens
    are rotated in the model's dtype (one matmul each; fp32 accumulation), as flash attention reads them."""
    cfg = layout.config
    rot = codec_tensors(layout, device)[0] if cfg.uses_codebook else None
    vrot = value_rotation_tensor(layout, device) if cfg.value_rotation else None
    return (None if rot is None else rot.T.to(dtype).contiguous(), None if vrot is None else vrot.to(dtype),
            None if vrot is None else vrot.T.to(dtype).contiguous())


def _rotated(x: torch.Tensor, rot_t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """x in `dtype`, times rot_t when given."""
    x = x.to(dtype)
    return x if rot_t is None else x @ rot_t


def _copy_ring(dense: torch.Tensor, ring: torch.Tensor, lo: int, length: int) -> None:
    """Positions [lo, length) of dense [.., S, D] from the ring [.., W, D] (position p at slot p % W): at most two
    runs of slots, copied as slices."""
    w = ring.shape[2]
    p = lo
    while p < length:
        slot = p % w
        n = min(length - p, w - slot)
        dense[:, :, p : p + n] = ring[:, :, slot : slot + n]
        p += n
