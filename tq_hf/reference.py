"""Pure-PyTorch TurboQuant: the executable specification and the CPU execution path.

Everything the kernels do is defined here first, in readable, vectorised PyTorch:
quantize + store new tokens into a paged pool, dequantize a sequence back, and attend over
the pool. Kernel tests compare against these functions; the cache uses them on CPU.

Keys (3/4-bit): u = k / amax|k|;  y = R u / rms(u)  (unit-variance rotated coordinates);
    level_i = #{boundaries < y_i};  scale = amax * rms(u) / rms(c[level])  (norm correction);
    k_hat = scale * R^T c[level].   Attention needs only  q . k_hat = scale * (R q) . c[level].
    The stored code of a level is stored_codes(bits)[level] (4-bit: sign-magnitude).
Keys (8-bit): scale = roundup_bf16(amax / 448);  code = fp8_e4m3(k / scale).
Values: mid = bf16(amax/2 + amin/2); scale = roundup_bf16(max(amax - mid, mid - amin) / (L/2));
    code = clamp(floor((v - mid) / scale + L/2 + 1/2), 0, L);  v_hat = mid + scale (code - L/2),
    with L = 2**bits - 1. Rounding the scale up makes the grid cover the row, so every element
    is within scale/2 of its reconstruction, and no intermediate leaves the float32 range.
Options (config): key_centering quantizes k - mu (mu: a per-(layer, head) mean held by the
    cache) and dequantizes back to k_hat + mu; value_rotation quantizes v @ Rv.T and
    dequantizes (.) @ Rv, with Rv = value_rotation_matrix(config, D).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from .codebook import _ordinary_tensors, lloyd_max, rotation_matrix
from .config import TurboQuantConfig
from .layout import (
    KEY_SCALE,
    METADATA_DTYPE,
    RING_CODE_MAX,
    RING_GROUP,
    VALUE_MID,
    VALUE_SCALE,
    BlockLayout,
    key_planes,
    ring_record_head_dim,
    ring_tail_bytes,
    value_planes,
)

BF16_MAX = torch.finfo(torch.bfloat16).max
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


# ---- rounding helpers ----------------------------------------------------------------------
def bf16_round_up(x: torch.Tensor) -> torch.Tensor:
    """Smallest bfloat16 >= x, for finite x >= 0 (as float32)."""
    bits = x.float().contiguous().view(torch.int32)
    truncated = bits & -65536
    up = torch.where((bits & 0xFFFF) != 0, truncated + 65536, truncated)
    return up.view(torch.float32)


def bf16_round(x: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even to bfloat16, saturating at the bfloat16 range (as float32)."""
    return x.float().clamp(-BF16_MAX, BF16_MAX).to(torch.bfloat16).float()


# ---- bit packing -----------------------------------------------------------------------------
def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., D] integer codes in [0, 2**bits) -> [..., D * bits / 8] uint8 (see layout.py)."""
    d = codes.shape[-1]
    c = codes.to(torch.int32)
    if bits == 8:
        return codes.to(torch.uint8)
    if bits == 4:
        return (c[..., : d // 2] | (c[..., d // 2 :] << 4)).to(torch.uint8)
    if bits == 3:
        groups = c.unflatten(-1, (d // 8, 8))  # 8 codes -> 24 bits -> 3 bytes
        word = (groups << (3 * torch.arange(8, dtype=torch.int32, device=c.device))).sum(-1)
        out = torch.stack([word & 255, (word >> 8) & 255, (word >> 16) & 255], -1)
        return out.flatten(-2).to(torch.uint8)
    raise ValueError(f"cannot pack {bits}-bit codes; supported: 3, 4, 8")


def unpack_codes(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Inverse of pack_codes: [..., dim * bits / 8] uint8 -> [..., dim] int64 codes."""
    p = packed.to(torch.int64)
    if bits == 8:
        return p
    if bits == 4:
        return torch.cat([p & 15, p >> 4], -1)
    if bits == 3:
        b = p.unflatten(-1, (dim // 8, 3))
        word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
        shifts = 3 * torch.arange(8, dtype=torch.int64, device=p.device)
        return ((word[..., None] >> shifts) & 7).flatten(-2)
    raise ValueError(f"cannot unpack {bits}-bit codes; supported: 3, 4, 8")


def pack_key_codes(codes: torch.Tensor, bits: int, planes: bool) -> torch.Tensor:
    """Key codes [..., D] -> [..., D * bits / 8] uint8: with `planes` (layout.key_planes) 3-bit codes in
    three byte planes (layout.py), so a decode kernel turns each byte into two codes' lookups without
    crossing bytes; else pack_codes."""
    d = codes.shape[-1]
    if not planes:
        return pack_codes(codes, bits)
    if bits != 3 or d // 8 not in (16, 32):
        raise ValueError(f"key code planes hold 3-bit codes of head_dim 128 or 256, got {bits}-bit, head_dim {d}")
    p = codes.to(torch.int32).unflatten(-1, (8, d // 8))  # p[..., c, j]: coordinate c * D/8 + j
    plane_bytes = [p[..., 2 * k, :] | (p[..., 2 * k + 1, :] << 4) | (((p[..., 6, :] >> k) & 1) << 3)
                   | (((p[..., 7, :] >> k) & 1) << 7) for k in range(3)]
    return torch.cat(plane_bytes, -1).to(torch.uint8)


def unpack_key_codes(packed: torch.Tensor, bits: int, dim: int, planes: bool) -> torch.Tensor:
    """Inverse of pack_key_codes: [..., dim * bits / 8] uint8 -> [..., dim] int64 codes."""
    if not planes:
        return unpack_codes(packed, bits, dim)
    b = packed.to(torch.int64).unflatten(-1, (3, dim // 8))  # b[..., k, j]: plane k
    spare6 = sum(((b[..., k, :] >> 3) & 1) << k for k in range(3))
    spare7 = sum(((b[..., k, :] >> 7) & 1) << k for k in range(3))
    parts = [b[..., k, :] & 7 if h == 0 else (b[..., k, :] >> 4) & 7 for k in range(3) for h in range(2)]
    return torch.cat(parts + [spare6, spare7], -1)


def pack_value_codes(codes: torch.Tensor, bits: int, planes: bool) -> torch.Tensor:
    """Value codes [..., D] -> [..., D * bits / 8] uint8: with `planes` (layout.value_planes) 3-bit codes
    as a 2-bit plane and a bit plane (layout.py), which a decode kernel reads without crossing bytes;
    else pack_codes."""
    d = codes.shape[-1]
    if not planes:
        return pack_codes(codes, bits)
    if bits != 3 or d // 8 not in (16, 32):
        raise ValueError(f"value code planes hold 3-bit codes of head_dim 128 or 256, got {bits}-bit, head_dim {d}")
    c = codes.to(torch.int32)
    low = (c & 3).unflatten(-1, (4, d // 4))  # low[..., a, j]: coordinate a * D/4 + j
    high = ((c >> 2) & 1).unflatten(-1, (8, d // 8))  # high[..., t, i]: coordinate t * D/8 + i
    low_bytes = sum(low[..., a, :] << (2 * a) for a in range(4))
    high_bytes = sum(high[..., t, :] << t for t in range(8))
    return torch.cat([low_bytes, high_bytes], -1).to(torch.uint8)


def unpack_value_codes(packed: torch.Tensor, bits: int, dim: int, planes: bool) -> torch.Tensor:
    """Inverse of pack_value_codes: [..., dim * bits / 8] uint8 -> [..., dim] int64 codes."""
    if not planes:
        return unpack_codes(packed, bits, dim)
    b = packed.to(torch.int64)
    low, high = b[..., : dim // 4], b[..., dim // 4 :]
    lows = torch.cat([(low >> (2 * a)) & 3 for a in range(4)], -1)
    highs = torch.cat([(high >> t) & 1 for t in range(8)], -1)
    return lows | (highs << 2)


# ---- the per-layer constants ---------------------------------------------------------------
@dataclass(frozen=True)
class KeyCodec:
    """Rotation and codebook shared by every head of every layer with this head_dim."""

    rotation: torch.Tensor  # [D, D] float32, orthogonal; rotated = x @ rotation.T
    centroids: torch.Tensor  # [2**bits] float32 (unit variance), ascending: level n
    boundaries: torch.Tensor  # [2**bits - 1] float32
    codes: torch.Tensor  # [2**bits] int64: the stored code of level n (stored_codes)
    code_centroids: torch.Tensor  # [2**bits] float32: the centroid of each stored code


def stored_codes(bits: int) -> torch.Tensor:
    """Level n (ascending centroid index) -> the code stored for it. 4-bit keys are sign-magnitude:
    bit 3 set for the negative half (levels 0-7), low bits the magnitude rank (levels 8 + r and 7 - r
    share rank r), so the decode kernel's byte-permute lookup takes the rank as `code & 7` and the
    sign from bit 3 (key_lut.py). Other widths store the level itself."""
    n = torch.arange(1 << bits)
    if bits != 4:
        return n
    return torch.where(n >= 8, n - 8, 15 - n)


def on_byte_grid(centroids: torch.Tensor) -> torch.Tensor:
    """4-bit key centroids rounded to multiples of 1/255 of the largest magnitude: the decode kernel reads each
    magnitude as one byte (an fp16 subnormal, key_lut.lut_bytes) and scales the scores once. The Lloyd-Max
    boundaries stay; the expected squared error grows by 0.07-0.14% at head_dim 64-256 (tests/test_codebook.py)."""
    step = centroids.abs().max() / 255
    return torch.round(centroids / step) * step


@functools.lru_cache(maxsize=None)
@_ordinary_tensors
def key_codec(config: TurboQuantConfig, head_dim: int, device: str = "cpu") -> KeyCodec | None:
    """The codebook-key constants for (config, head_dim) on `device`; None for FP8 keys. 4-bit centroids
    sit on a byte grid (on_byte_grid)."""
    if not config.uses_codebook:
        return None
    book = lloyd_max(head_dim, config.key_bits, device)
    centroids = on_byte_grid(book.centroids) if config.key_bits == 4 else book.centroids
    rot = rotation_matrix(head_dim, config.rotation, config.seed, device)
    codes = stored_codes(config.key_bits).to(device)
    code_centroids = torch.empty_like(centroids)
    code_centroids[codes] = centroids
    return KeyCodec(rot, centroids, book.boundaries, codes, code_centroids)


def value_rotation_matrix(config: TurboQuantConfig, head_dim: int, device: str = "cpu") -> torch.Tensor | None:
    """Rv for value_rotation (seeded apart from the key rotation); None when the option is off."""
    if not config.value_rotation:
        return None
    return rotation_matrix(head_dim, config.rotation, config.seed + 1, device)


# ---- keys ----------------------------------------------------------------------------------
def quantize_keys(
    key: torch.Tensor, config: TurboQuantConfig, offset: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., D] keys -> (packed codes [..., key_bytes] uint8, scale [...] bfloat16).

    `offset` (broadcastable to key, e.g. [H, D] for key [N, H, D]) is subtracted first
    (key_centering).
    """
    x = key.float()
    if offset is not None:
        x = x - offset.float()
    amax = x.abs().amax(-1)
    nonzero = amax > 0
    if not config.uses_codebook:
        scale = torch.where(nonzero, bf16_round_up(amax / FP8_MAX), torch.zeros_like(amax))
        scaled = x / torch.where(scale > 0, scale, torch.ones_like(scale))[..., None]  # amax/448 may underflow
        codes = scaled.to(torch.float8_e4m3fn).view(torch.uint8)
        return codes, scale.to(METADATA_DTYPE)
    codec = key_codec(config, x.shape[-1], str(x.device))
    u = x / torch.where(nonzero, amax, torch.ones_like(amax))[..., None]
    rms_u = u.square().mean(-1).sqrt()
    y = (u @ codec.rotation.T) / torch.where(nonzero, rms_u, torch.ones_like(rms_u))[..., None]
    idx = torch.bucketize(y, codec.boundaries)  # = number of boundaries strictly below y
    scale = amax * rms_u
    if config.norm_correction:
        scale = scale / codec.centroids[idx].square().mean(-1).sqrt()
    return pack_key_codes(codec.codes[idx], config.key_bits, key_planes(config, x.shape[-1])), bf16_round(scale).to(METADATA_DTYPE)


def dequantize_keys(
    codes: torch.Tensor,
    scale: torch.Tensor,
    config: TurboQuantConfig,
    head_dim: int,
    offset: torch.Tensor | None = None,
) -> torch.Tensor:
    """(packed codes [..., key_bytes], scale [...]) -> keys [..., D] float32, original space."""
    if not config.uses_codebook:
        k = codes.contiguous().view(torch.float8_e4m3fn).float() * scale.float()[..., None]
    else:
        codec = key_codec(config, head_dim, str(codes.device))
        c = codec.code_centroids[unpack_key_codes(codes, config.key_bits, head_dim, key_planes(config, head_dim))]
        k = (c @ codec.rotation) * scale.float()[..., None]
    return k if offset is None else k + offset.float()


# ---- values --------------------------------------------------------------------------------
def quantize_values(
    value: torch.Tensor, bits: int, rotation: torch.Tensor | None = None, planes: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[..., D] values -> (packed codes, scale [...] bf16, mid [...] bf16); rotated first if given;
    `planes`: the codes packed as layout.value_planes says."""
    x = value.float()
    if rotation is not None:
        x = x @ rotation.T
    levels = (1 << bits) - 1
    amax, amin = x.amax(-1), x.amin(-1)
    mid = bf16_round(amax / 2 + amin / 2)
    half_range = torch.maximum(amax - mid, mid - amin)
    scale = bf16_round_up(half_range / (levels / 2))
    t = (x - mid[..., None]) / torch.where(scale > 0, scale, torch.ones_like(scale))[..., None]
    codes = torch.floor(t + (levels / 2 + 0.5)).clamp(0, levels)
    return pack_value_codes(codes, bits, planes), scale.to(METADATA_DTYPE), mid.to(METADATA_DTYPE)


def dequantize_values(
    codes: torch.Tensor,
    scale: torch.Tensor,
    mid: torch.Tensor,
    bits: int,
    head_dim: int,
    rotation: torch.Tensor | None = None,
    planes: bool = False,
) -> torch.Tensor:
    levels = (1 << bits) - 1
    c = unpack_value_codes(codes, bits, head_dim, planes).float() - levels / 2
    v = mid.float()[..., None] + scale.float()[..., None] * c
    return v if rotation is None else v @ rotation


# ---- the paged pool ------------------------------------------------------------------------
def store(
    pool: torch.Tensor,
    layout: BlockLayout,
    key: torch.Tensor,
    value: torch.Tensor,
    slots: torch.Tensor,
    key_offset: torch.Tensor | None = None,
    recent: tuple[torch.Tensor, torch.Tensor] | None = None,
    start: int = 0,
    seq_lens: torch.Tensor | None = None,
    slot_shift: int = 0,
    positions: torch.Tensor | None = None,
) -> None:
    """Quantize `key`/`value` [N, H, D] and write token n into slot slots[n] (+ slot_shift) of the pool; a decode
    step's [R, H, 1, D] (one token per row) are read as [R, H, D] (token_rows).

    A slot is block * block_size + offset; negative slots are skipped (padding). `slot_shift` (a host int >= 0) is
    added to every other slot: a decode step passes each row's first slot and the shift of its position.
    `key_offset`: the key_centering mean (None: no centering), [H, D] for every token or
    [R, H, D] per row, the tokens being R rows of N / R consecutive tokens each (row-major, as the
    cache lays out an update).
    `recent`: the ring (recent_keys, recent_values) [R, H, W, D] of recent_window, or [R, H, W, D + 16] int8 records
    (layout.ring_spec): each row's last min(L, W) tokens (of its L = N / R, at positions start .. start + L - 1) are
    written there, position p at slot p % W (write_recent). `seq_lens` [R]: set to start + L (the rows' new lengths).
    `positions`: a tensor whose first element is the first new position, instead of `start` (a compiled step's);
    skipped tokens then stay out of the ring too. Not with seq_lens.
    """
    key, value = token_rows(key), token_rows(value)
    if positions is not None and seq_lens is not None:
        raise ValueError("positions comes without seq_lens (a compiled step sets the lengths itself)")
    if recent is not None:
        keep = None
        if positions is not None:
            start, keep = int(positions.reshape(-1)[0]), slots >= 0
        write_recent(recent, key, value, start, key_offset, keep)
    if seq_lens is not None:
        seq_lens.fill_(start + key.shape[0] // max(seq_lens.shape[0], 1))
    cfg = layout.config
    key_offset = per_token_offset(key_offset, key.shape[0])
    if key_offset is not None and key_offset.dim() == 3:
        key_offset = key_offset[slots >= 0]
    keep = slots >= 0
    key, value, slots = key[keep], value[keep], slots[keep] + slot_shift
    block, offset = slots // layout.block_size, slots % layout.block_size
    k_codes, k_scale = quantize_keys(key, cfg, key_offset)
    v_rot = value_rotation_matrix(cfg, layout.head_dim, str(value.device))
    v_codes, v_scale, v_mid = quantize_values(value, cfg.value_bits, v_rot, value_planes(cfg, layout.head_dim))
    layout.key_codes(pool)[block, :, offset] = k_codes
    layout.value_codes(pool)[block, :, offset] = v_codes
    meta = layout.metadata(pool)
    meta[block, :, KEY_SCALE, offset] = k_scale
    meta[block, :, VALUE_SCALE, offset] = v_scale
    meta[block, :, VALUE_MID, offset] = v_mid


def token_rows(x: torch.Tensor) -> torch.Tensor:
    """[R, H, 1, D] (one new token per row) as [R, H, D] (a view: the same memory and strides); else x as it is."""
    return x.select(2, 0) if x.dim() == 4 and x.shape[2] == 1 else x


def write_recent(recent: tuple[torch.Tensor, torch.Tensor], key: torch.Tensor, value: torch.Tensor,
                 start: int, key_offset: torch.Tensor | None = None, keep: torch.Tensor | None = None) -> None:
    """The last min(L, W) of each row's L new tokens (key/value [R * L, H, D], row-major; row r's token t at position
    start + t) into the ring (keys, values) at slot position % W: int8 records (encode_ring; key records centered
    by key_offset, [H, D] or [R, H, D]) or the ring's dtype; keep [R * L] bool: only these tokens (the others leave
    their slots as they are)."""
    ring_k, ring_v = recent
    rows, w = ring_k.shape[0], ring_k.shape[2]
    if rows == 0 or key.shape[0] % rows:
        raise ValueError(f"a ring of {rows} rows needs a token count divisible by it, got {key.shape[0]}")
    length = key.shape[0] // rows
    m = min(length, w)
    idx = (start + torch.arange(length - m, length, device=ring_k.device)) % w
    for ring, x, offset in ((ring_k, key, ring_offset(key_offset)), (ring_v, value, None)):
        src = x.reshape(rows, length, *x.shape[1:])[:, length - m :]  # [R, m, H, D]
        new = to_ring(src.transpose(1, 2), ring.dtype, offset)
        if keep is not None:
            new = torch.where(keep.reshape(rows, 1, length, 1)[:, :, length - m :], new, ring[:, :, idx])
        ring[:, :, idx] = new


def ring_offset(key_offset: torch.Tensor | None) -> torch.Tensor | None:
    """A key_centering mean ([H, D] shared or [R, H, D] per row) as it broadcasts over a ring [R, H, W, D]."""
    return None if key_offset is None else row_offset(key_offset)[:, :, None, :]


def encode_ring(x: torch.Tensor, offset: torch.Tensor | None = None) -> torch.Tensor:
    """[..., D] -> int8 ring records [..., ring_record_bytes(D)] (layout: recent_format "int8") of y = x - offset:
    per RING_GROUP elements a scale s (the smallest bfloat16 >= the group's absmax / 127; 0 for a zero group:
    codes 0) and codes floor(y / s + 1/2) clamped to [-127, 127]; after the codes the scales' bfloat16 bits, then
    zeros."""
    y = x.float() if offset is None else x.float() - offset.float()
    d = y.shape[-1]
    groups = y.unflatten(-1, (d // RING_GROUP, RING_GROUP))
    amax = groups.abs().amax(-1)
    s = bf16_round_up(amax / torch.full_like(amax, RING_CODE_MAX))  # (a tensor divisor: CUDA divides by a scalar
    # as x * (1 / b)); the codes use the rounded scale, so |y| / s <= 127 and decoding is exact in fp32
    codes = torch.floor(groups / torch.where(s > 0, s, 1.0)[..., None] + 0.5).clamp(-RING_CODE_MAX, RING_CODE_MAX)
    # the scales' high halves as int32 words (two per word, little-endian), viewed as bytes: a view of 16-bit data
    # alone failed under inductor on CUDA ("self.stride(-1) must be 1 to view Float as Char")
    half = (s.view(torch.int32) >> 16) & 0xFFFF
    pairs = torch.nn.functional.pad(half, (0, ring_tail_bytes(d) // 2 - half.shape[-1])).unflatten(-1, (-1, 2))
    words = pairs[..., 0] | (pairs[..., 1] << 16)
    return torch.cat([codes.flatten(-2).to(torch.int8), words.view(torch.int8)], -1)


def decode_ring(records: torch.Tensor, offset: torch.Tensor | None = None) -> torch.Tensor:
    """int8 ring records [..., ring_record_bytes(D)] -> the vectors [..., D] as fp32 (codes x scale, + offset)."""
    d = ring_record_head_dim(records.shape[-1])
    s = records[..., d : d + 2 * (d // RING_GROUP)].view(torch.bfloat16).float()  # the groups' bfloat16 scales
    y = (records[..., :d].float().unflatten(-1, (d // RING_GROUP, RING_GROUP)) * s[..., None]).flatten(-2)
    return y if offset is None else y + offset.float()


def to_ring(x: torch.Tensor, ring_dtype: torch.dtype, offset: torch.Tensor | None = None) -> torch.Tensor:
    """Vectors [..., D] as a ring of `ring_dtype` holds them: int8 records (of x - offset), else cast."""
    return encode_ring(x, offset) if ring_dtype == torch.int8 else x.to(ring_dtype)


def ring_vectors(ring: torch.Tensor, offset: torch.Tensor | None = None) -> torch.Tensor:
    """The vectors a ring holds, [..., D]: int8 records decoded (fp32; key records + their offset), else the ring."""
    return decode_ring(ring, offset) if ring.dtype == torch.int8 else ring


def ring_window(ring: torch.Tensor, new: torch.Tensor, start: int, offset: torch.Tensor | None = None) -> torch.Tensor:
    """The exact window of a forward of new [B, H, NEW, D] at host position `start` over a ring [B, H, W, ...] (exact
    vectors, or int8 records of vectors less `offset`, the key-centering mean [H, D] or [B, H, D]): W + NEW slots in
    new's dtype, position p in [start - W, start + NEW) at slot p % (W + NEW), from the ring's slot p % W where
    p < start, else new token p - start. As torch ops: the ring decoded in its own order, the new tokens after it, and
    one gather."""
    w, m = ring.shape[2], new.shape[2]
    first = start - w  # the window's first position
    pos = first + (torch.arange(w + m, device=new.device) - first) % (w + m)  # the position each slot holds
    src = torch.where(pos < start, pos % w, pos - start + w)  # its index in [ring in slot order, new tokens]
    vectors = ring_vectors(ring, None if offset is None else ring_offset(offset))
    return torch.cat([vectors.to(new.dtype), new], 2).index_select(2, src)


def per_token_offset(key_offset: torch.Tensor | None, tokens: int) -> torch.Tensor | None:
    """A key_centering mean for N tokens: [H, D] as is; [R, H, D] -> [N, H, D], row r's mean for
    tokens r * N / R .. (r + 1) * N / R - 1 (an update's tokens are row-major)."""
    if key_offset is None or key_offset.dim() == 2:
        return key_offset
    rows = key_offset.shape[0]
    if rows == 0 or tokens % rows:
        raise ValueError(f"a per-row key_offset of {rows} rows needs a token count divisible by it, got {tokens}")
    return key_offset.repeat_interleave(tokens // rows, dim=0)


def row_offset(key_offset: torch.Tensor) -> torch.Tensor:
    """A key_centering mean as [B or 1, H, D] float32 (one per row, or one shared)."""
    return key_offset.float() if key_offset.dim() == 3 else key_offset.float()[None]


def gather(
    pool: torch.Tensor, layout: BlockLayout, block_table: torch.Tensor, key_offset: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantize every slot of every row's blocks: (K, V), each [B, H, NB * T, D] float32.

    key_offset: the key_centering mean, [H, D] shared or [B, H, D] per row."""
    cfg, d = layout.config, layout.head_dim
    bt = block_table.long()

    def tokens_last(x: torch.Tensor) -> torch.Tensor:  # [B, NB, H, T, ...] -> [B, H, NB*T, ...]
        return x.transpose(1, 2).flatten(2, 3)

    kc = tokens_last(layout.key_codes(pool)[bt])
    vc = tokens_last(layout.value_codes(pool)[bt])
    meta = layout.metadata(pool)[bt]  # [B, NB, H, 3, T]
    meta = meta.permute(0, 2, 3, 1, 4).flatten(3, 4)  # [B, H, 3, NB*T]
    if key_offset is not None and key_offset.dim() == 3 and key_offset.shape[0] != bt.shape[0]:
        raise ValueError(f"key_offset must be [H, D] or one mean per row [{bt.shape[0]}, H, D], "
                         f"got {list(key_offset.shape)}")
    offset = None if key_offset is None else row_offset(key_offset)[:, :, None, :]
    k = dequantize_keys(kc, meta[:, :, KEY_SCALE], cfg, d, offset)
    v_rot = value_rotation_matrix(cfg, d, str(pool.device))
    v = dequantize_values(vc, meta[:, :, VALUE_SCALE], meta[:, :, VALUE_MID], cfg.value_bits, d, v_rot,
                          value_planes(cfg, d))
    return k, v


def overlay_prefix(dense: torch.Tensor, prefix: torch.Tensor, kv_start: torch.Tensor | None) -> torch.Tensor:
    """dense [B, H, S, D] with positions kv_start[b] + s (s < P) taken from prefix [B, H, P, D]."""
    b, _, s_len, _ = dense.shape
    p = prefix.shape[2]
    start = torch.zeros(b, dtype=torch.long, device=dense.device) if kv_start is None else kv_start.long()
    offset = torch.arange(s_len, device=dense.device)[None, :] - start[:, None]  # [B, S]
    inside = (offset >= 0) & (offset < p)
    picked = prefix.float().gather(2, offset.clamp(0, p - 1)[:, None, :, None].expand(-1, dense.shape[1], -1, dense.shape[3]))
    return torch.where(inside[:, None, :, None], picked, dense)


def overlay_recent(dense: torch.Tensor, ring: torch.Tensor, seq_lens: torch.Tensor, recent_from: int,
                   key_offset: torch.Tensor | None = None) -> torch.Tensor:
    """dense [B, H, S, D] with positions j in [max(recent_from, seq_lens[b] - W), seq_lens[b]) taken
    from ring[:, :, j % W] (ring [B, H, W, D], or int8 records: ring_vectors; key records with key_offset)."""
    w = ring.shape[2]
    j = torch.arange(dense.shape[2], device=dense.device)
    lo = (seq_lens.long() - w).clamp_min(recent_from)
    inside = (j[None, :] >= lo[:, None]) & (j[None, :] < seq_lens.long()[:, None])  # [B, S]
    picked = ring_vectors(ring, ring_offset(key_offset) if ring.dtype == torch.int8 else None).float()[:, :, j % w]
    return torch.where(inside[:, None, :, None], picked, dense)


# ---- attention -------------------------------------------------------------------------------
def attention_mask(
    num_queries: int,
    num_keys: int,
    seq_lens: torch.Tensor,
    kv_start: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """[B, Lq, S] bool: which cache positions each query may see.

    Query i of row b sits at position seq_lens[b] - Lq + i (bottom-right aligned: the last
    query sees the whole cache). Keys before kv_start[b] (left padding) are never seen; a
    sliding window W keeps keys j with j > position - W.
    """
    dev = seq_lens.device
    j = torch.arange(num_keys, device=dev)
    pos = seq_lens[:, None].long() - num_queries + torch.arange(num_queries, device=dev)  # [B, Lq]
    ok = (j[None, None, :] <= pos[..., None]) & (j[None, None, :] < seq_lens[:, None, None])
    if kv_start is not None:
        ok &= j[None, None, :] >= kv_start[:, None, None]
    if sliding_window is not None:
        ok &= j[None, None, :] > pos[..., None] - sliding_window
    return ok


def dense_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """fp32 attention. query [B, Hq, Lq, D]; key/value [B, Hk, S, D]; mask [B, Lq, S] bool.

    GQA/MQA by head grouping (query head h reads KV head h // (Hq / Hk)); `sinks` [Hq] are
    per-head logits that join the softmax denominator without a value; rows that see no key
    return zeros. Returns float32 [B, Hq, Lq, D].
    """
    b, hq, lq, d = query.shape
    hk = key.shape[1]
    if hq % hk:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hk})")
    q = query.float().unflatten(1, (hk, hq // hk))  # [B, Hk, G, Lq, D]
    s = torch.einsum("bhgqd,bhkd->bhgqk", q, key.float()) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    m = mask[:, None, None]  # [B, 1, 1, Lq, S]
    s = s.masked_fill(~m, -math.inf)
    if sinks is not None:
        sink = sinks.float().view(1, hk, hq // hk, 1, 1).expand(*s.shape[:-1], 1)
        s = torch.cat([s, sink], -1)
    row_max = s.amax(-1, keepdim=True)
    p = torch.exp(s - torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max)))
    p = p / p.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    if sinks is not None:
        p = p[..., :-1]
    # zero values no query of the row sees: unwritten slots may hold NaN bits, and 0 * NaN = NaN
    out = torch.einsum("bhgqk,bhkd->bhgqd", p, value.float().masked_fill(~mask.any(1)[:, None, :, None], 0.0))
    return out.flatten(1, 2)


def paged_attention(
    query: torch.Tensor,
    pool: torch.Tensor,
    layout: BlockLayout,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    kv_start: torch.Tensor | None = None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
    max_seq_len: int | None = None,
    key_offset: torch.Tensor | None = None,
    prefix_keys: torch.Tensor | None = None,
    prefix_values: torch.Tensor | None = None,
    recent_keys: torch.Tensor | None = None,
    recent_values: torch.Tensor | None = None,
    recent_from: int = 0,
) -> torch.Tensor:
    """Attention of query [B, Hq, Lq, D] over the compressed cache; returns query's dtype.

    Row b's cache holds positions [0, seq_lens[b]) in blocks block_table[b, :]; the queries are
    its last Lq positions (causal, bottom-right aligned). fp32 throughout. `max_seq_len`, if
    given, is a host-side upper bound on seq_lens that limits how many blocks are read.
    `prefix_keys`/`prefix_values` [B, Hk, P, D] (exact_prefix_tokens) replace what the pool holds
    at positions kv_start[b] + s, s < P (see overlay_prefix). `recent_keys`/`recent_values`
    [B, Hk, W, D] (recent_window) is a ring: position j sits at j % W and replaces the pool for
    j in [max(recent_from, seq_lens[b] - W), seq_lens[b]) (see overlay_recent).
    """
    if max_seq_len is not None:
        block_table = block_table[:, : -(-max_seq_len // layout.block_size)]
    k, v = gather(pool, layout, block_table, key_offset)
    if prefix_keys is not None:
        k = overlay_prefix(k, prefix_keys, kv_start)
        v = overlay_prefix(v, prefix_values, kv_start)
    if recent_keys is not None:
        k = overlay_recent(k, recent_keys, seq_lens, recent_from, key_offset)
        v = overlay_recent(v, recent_values, seq_lens, recent_from)
    mask = attention_mask(query.shape[2], k.shape[2], seq_lens, kv_start, sliding_window)
    out = dense_attention(query, k, v, mask, scale, sinks, softcap)
    return out.to(query.dtype)
