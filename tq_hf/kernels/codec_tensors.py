"""The codec's constants as device tensors for the launchers (cached per layout and device), and tile sizing."""

from __future__ import annotations

import functools

import torch

from ..layout import BlockLayout
from ..reference import key_codec, value_rotation_matrix


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.lru_cache(maxsize=None)
def codec_tensors(layout: BlockLayout, device: str) -> tuple[torch.Tensor, ...]:
    """(rotation [D, D] fp32, centroids [2**bits] fp32 by level (ascending), boundaries [2**bits - 1]
    fp32, centroids by stored code [2**bits] fp32) on device.

    FP8 keys have no codec; they get 1-element placeholders so launch signatures stay fixed.
    """
    codec = key_codec(layout.config, layout.head_dim, device)
    if codec is None:
        one = torch.ones(1, dtype=torch.float32, device=device)
        return one, one, one, one
    return (codec.rotation.contiguous(), codec.centroids.contiguous(), codec.boundaries.contiguous(),
            codec.code_centroids.contiguous())


@functools.lru_cache(maxsize=None)
def value_rotation_tensor(layout: BlockLayout, device: str) -> torch.Tensor:
    """Rv [D, D] fp32 on device for value_rotation (values are stored as v @ Rv^T); a
    1-element placeholder when the option is off, so launch signatures stay fixed."""
    rot = value_rotation_matrix(layout.config, layout.head_dim, device)
    if rot is None:
        return torch.ones(1, dtype=torch.float32, device=device)
    return rot.float().contiguous()


@functools.lru_cache(maxsize=None)
def value_rotation_units(layout: BlockLayout, device: str) -> torch.Tensor:
    """Rv x sqrt(D) [D, D] in fp16 for the 16-bit rotations of the values (rotation="hadamard": every entry +-1,
    exact): the attention's epilogue and the store load it as an MMA operand, half the bytes of Rv and no
    conversion (the store: instead of building the entries in registers)."""
    return _units(value_rotation_tensor(layout, device), layout.head_dim)


@functools.lru_cache(maxsize=None)
def key_rotation_units(layout: BlockLayout, device: str) -> torch.Tensor:
    """R x sqrt(D) [D, D] in fp16 for the store's key rotation under rotation="hadamard" (every entry +-1)."""
    return _units(codec_tensors(layout, device)[0], layout.head_dim)


def _units(rot: torch.Tensor, d: int) -> torch.Tensor:
    """A +-1/sqrt(d) rotation times sqrt(d), rounded to fp16 (exact +-1) as the kernels' conversion does."""
    return (rot * torch.tensor(float(d)).sqrt()).to(torch.float16).contiguous()
