"""The paged block layout of the compressed cache: defined here once, used by everything.

A layer's pool is one uint8 tensor of shape [num_blocks, num_kv_heads, plane_bytes]. Each
(block, KV head) pair owns one contiguous *page plane* holding that head's `block_size` tokens
as structure-of-arrays, so a kernel reading one head's tile issues a few wide, contiguous loads:

    plane of (block b, head h), T = block_size tokens, byte offsets on the left:

    0                    +---------------------------------------------+
                         | key codes    T x key_code_bytes    (uint8)  |  token t at t*KB
    T*KB                 +---------------------------------------------+
                         | value codes  T x value_code_bytes  (uint8)  |  token t at T*KB + t*VB
    T*(KB+VB)            +---------------------------------------------+
                         | key_scale    T x bf16                       |  metadata region:
                         | value_scale  T x bf16                       |  one 16-bit field per
                         | value_mid    T x bf16                       |  token per field
    T*(KB+VB+6)          +---------------------------------------------+  = plane_bytes

    block b = [plane(b, 0) | plane(b, 1) | ... | plane(b, H-1)]

With T in {16, 32, 64} every region starts on a 32-byte boundary.

Packing of the codes inside one token's row (D = head_dim):
  * 4-bit ("split-half"): byte j holds code j in its low nibble and code j + D/2 in its high
    nibble, so the two nibble halves feed two half-width dot products without shuffles.
  * 3-bit values at head_dim 128 and 256 (value_planes below, reference.pack_value_codes): a 2-bit
    plane of Q = D/4 bytes, then a bit plane of D/8 bytes. Byte j of the 2-bit plane holds the low two
    bits of the code of coordinate a*Q + j in bits 2a, 2a+1 (a = 0..3); byte i of the bit plane holds
    bit 2 of the code of coordinate t*D/8 + i in bit t (t = 0..7). So a decode kernel reads the codes
    of four column tiles (coordinates a*Q + j) from one Q-byte row and the bit plane repeated, without
    crossing bytes.
  * 3-bit values at other head_dims, and the other 3-bit keys: a little-endian bit stream; code i
    occupies bits [3i, 3i+3) and may straddle bytes.
  * 3-bit keys at head_dim 128 and 256 (key_planes below, reference.pack_key_codes):
    three byte planes of J = D/8 bytes. With p_c the code of coordinate c*J + j, byte j of plane k
    (k = 0, 1, 2) holds p_2k in bits 0-2, p_2k+1 in bits 4-6, bit k of p_6 in bit 3 and bit k of p_7
    in bit 7. So bits 0-2 and 4-6 of a byte are two codes, and (plane0 >> 3 & 0x11) |
    (plane1 >> 2 & 0x22) | (plane2 >> 1 & 0x44) two more: the decode kernel's byte-permute lookup
    (key_lut.py) reads every code without crossing a byte.
  * 8-bit (FP8 keys): one float8_e4m3fn byte per coordinate.
Codebook key codes name a centroid through reference.stored_codes: 4-bit keys are sign-magnitude
(bit 3 set for the negative half, low 3 bits the magnitude rank), 3-bit keys the level itself.

The recent ring (recent_window) beside the pool, per row and KV head: W slots, position p at slot p % W.
With recent_format "int8" a slot holds one record per key and per value of ring_record_bytes(D) bytes: D int8
codes c_i = floor(y_i / s_g + 1/2) clamped to [-127, 127], then the bfloat16 bits of each group's scale s_g (the
smallest bfloat16 >= absmax over the group's 16 elements / 127) and zero bytes to ring_tail_bytes(D)
(reference.encode_ring); y ~= c * s_g. A key record holds y = k - mu, the layer's key_centering mean (0 without
one), so the channel biases of keys (Qwen2.5's k_proj) do not set its steps; a value record holds y = v. With
"exact" a slot holds the D elements in exact_dtype.

Metadata meaning:
  * key_scale: codebook keys: the RMS of the key divided by the RMS of its codebook vector
    (norm correction) or the plain RMS; FP8 keys: amax / 448 rounded up.
  * value_scale, value_mid: value ~= value_mid + value_scale * (code - (2**bits - 1) / 2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import METADATA_FIELDS, TurboQuantConfig

KEY_SCALE, VALUE_SCALE, VALUE_MID = range(len(METADATA_FIELDS))
METADATA_DTYPE = torch.bfloat16
# an int8 ring record: a bfloat16 scale per RING_GROUP elements after its codes, then zeros to a 16-byte multiple
# (records a multiple of 16 bytes apart: the kernels' ring tiles load wide; at a 4-byte tail they loaded bytes, 4bit
# B=1 decode 1.6x slower). One scale per vector rounded keys with outlier channels coarsely (docs/performance.md,
# "The ring in int8 records").
RING_GROUP = 16
RING_CODE_MAX = 127


def ring_tail_bytes(head_dim: int) -> int:
    """Bytes after an int8 ring record's codes: head_dim / RING_GROUP bfloat16 scales, padded to 16 bytes."""
    return -(-2 * (head_dim // RING_GROUP) // 16) * 16


def ring_record_bytes(head_dim: int) -> int:
    """Bytes of one int8 ring record (recent_format "int8"): head_dim codes, then the scales (ring_tail_bytes)."""
    return head_dim + ring_tail_bytes(head_dim)


def ring_record_head_dim(record_bytes: int) -> int:
    """The head_dim of int8 ring records `record_bytes` long (the inverse of ring_record_bytes)."""
    for tail in (16, 32):
        if ring_record_bytes(record_bytes - tail) == record_bytes:
            return record_bytes - tail
    raise ValueError(f"{record_bytes} bytes is no int8 ring record's length")


def key_planes(config: TurboQuantConfig, head_dim: int) -> bool:
    """Whether this format stores its keys as code planes (above): 3-bit codebook keys whose planes
    fill an MMA's K (D/8 = 16 or 32). At other head_dims the per-coordinate plane reads measured
    slower (9/3/64 k3v4 +48%), and reading head_dim 64's three 8-byte planes as one 32-row window
    gained nothing overall (k3v4 S=32k B=16 0.183 -> 0.172 ms, B=1 0.0238 -> 0.0255): those keep the
    bit stream."""
    return config.uses_codebook and config.key_bits == 3 and head_dim // 8 in (16, 32)


def value_planes(config: TurboQuantConfig, head_dim: int) -> bool:
    """Whether this format stores its values as a 2-bit plane and a bit plane (above): 3-bit values at
    head_dim 128 and 256, where the bit stream's codes straddle bytes and cost the decode three byte
    loads, shifts and an int-to-float conversion per code (H200, 3bit S=32k 32/8/128 with key planes:
    B=16 1.348 -> 0.733 ms, B=1 0.0997 -> 0.0689). At head_dim 64 the planes' 16-byte rows measured
    slower (9/3/64 B=16 0.243 -> 0.399 ms): the bit stream stays there."""
    return config.value_bits == 3 and head_dim // 8 in (16, 32)


def default_block_size(head_dim: int) -> int:
    """Tokens per block where the config leaves it open (block_size=None): 64 at head_dim 128, 16 elsewhere.

    On an H200 decode over 64-token blocks measured 2-5% faster than over 16 at 32/8/128 (4bit B=16 S=32k
    0.1727 -> 0.1658 ms; 3bit at B=16 the exception, +2.4%) and 3-5% slower at 9/3/64, so 16 stays there; other
    head_dims are unmeasured and keep 16 (docs/performance.md)."""
    return 64 if head_dim == 128 else 16


@dataclass(frozen=True)
class BlockLayout:
    """Byte geometry of one layer's pool; every offset the kernels use comes from here."""

    config: TurboQuantConfig
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        self.config.check_head_dim(self.head_dim)
        if self.num_kv_heads < 1:
            raise ValueError(f"num_kv_heads must be >= 1, got {self.num_kv_heads}")

    @property
    def block_size(self) -> int:
        """Tokens per block: the config's, else default_block_size."""
        return self.config.block_size or default_block_size(self.head_dim)

    @property
    def key_bytes(self) -> int:
        return self.config.key_code_bytes(self.head_dim)

    @property
    def value_bytes(self) -> int:
        return self.config.value_code_bytes(self.head_dim)

    @property
    def key_offset(self) -> int:
        return 0

    @property
    def value_offset(self) -> int:
        return self.block_size * self.key_bytes

    @property
    def metadata_offset(self) -> int:
        return self.value_offset + self.block_size * self.value_bytes

    @property
    def plane_bytes(self) -> int:
        return self.metadata_offset + self.block_size * self.config.metadata_bytes

    @property
    def block_bytes(self) -> int:
        return self.num_kv_heads * self.plane_bytes

    def ring_spec(self, rows: int, window: int, exact_dtype: torch.dtype) -> tuple[tuple[int, ...], torch.dtype]:
        """(shape, dtype) of the ring's key (and value) buffer: int8 records or exact_dtype elements."""
        if self.config.ring_records:
            return (rows, self.num_kv_heads, window, ring_record_bytes(self.head_dim)), torch.int8
        return (rows, self.num_kv_heads, window, self.head_dim), exact_dtype

    def ring_width(self, ring_dtype: torch.dtype) -> int:
        """The last dimension of a ring buffer of `ring_dtype`: an int8 record's bytes, else head_dim elements."""
        return ring_record_bytes(self.head_dim) if ring_dtype == torch.int8 else self.head_dim

    def allocate(self, num_blocks: int, device: torch.device | str) -> torch.Tensor:
        """A zeroed pool of `num_blocks` blocks."""
        return torch.zeros(num_blocks, self.num_kv_heads, self.plane_bytes, dtype=torch.uint8, device=device)

    def check_pool(self, pool: torch.Tensor) -> None:
        expected = (self.num_kv_heads, self.plane_bytes)
        if pool.dtype != torch.uint8 or pool.dim() != 3 or tuple(pool.shape[1:]) != expected:
            raise ValueError(
                f"pool must be uint8 [num_blocks, {expected[0]}, {expected[1]}] for this layout, "
                f"got {pool.dtype} {list(pool.shape)}"
            )
        if not pool.is_contiguous():
            raise ValueError("pool must be contiguous")

    # ---- views of a pool (no copies) ---------------------------------------------------------
    def key_codes(self, pool: torch.Tensor) -> torch.Tensor:
        """[num_blocks, H, T, key_bytes] uint8 view."""
        t = self.block_size
        return pool[:, :, self.key_offset : self.value_offset].unflatten(-1, (t, self.key_bytes))

    def value_codes(self, pool: torch.Tensor) -> torch.Tensor:
        """[num_blocks, H, T, value_bytes] uint8 view."""
        t = self.block_size
        return pool[:, :, self.value_offset : self.metadata_offset].unflatten(-1, (t, self.value_bytes))

    def metadata(self, pool: torch.Tensor) -> torch.Tensor:
        """[num_blocks, H, 3, T] bfloat16 view (fields KEY_SCALE, VALUE_SCALE, VALUE_MID)."""
        t = self.block_size
        raw = pool[:, :, self.metadata_offset : self.plane_bytes]
        return raw.view(METADATA_DTYPE).unflatten(-1, (len(METADATA_FIELDS), t))
