"""Lloyd-Max codebooks and rotations for TurboQuant keys.

After a random rotation, one coordinate of a unit vector in R^D follows the density
f(t) ∝ (1 - t^2)^((D-3)/2) on [-1, 1] (a shifted Beta((D-1)/2, (D-1)/2)). We quantize
sqrt(D) times that coordinate (unit variance, so the per-token scale is an RMS that stays
finite for any finite key) with the Lloyd-Max codebook of that exact density, solved once
per (head_dim, bits) on a fine grid in float64 and cached by those values.

Rotations are cached by (head_dim, kind, seed, device): by value, never by tensor address.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

_GRID_POINTS = 1 << 17


def _ordinary_tensors(fn):
    """Build cached constants outside inference mode (a tensor created under torch.inference_mode() could not be
    used by a later forward with autograd on) and on the CPU whatever torch's default device (a seeded CPU generator
    fails on another one; callers move the constants where they need them)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with torch.inference_mode(False), torch.device("cpu"):
            return fn(*args, **kwargs)

    return wrapper
_LLOYD_ITERATIONS = 400


@dataclass(frozen=True)
class Codebook:
    """Sorted reconstruction levels and the decision boundaries between them (unit variance)."""

    centroids: torch.Tensor  # [2**bits] float32, ascending
    boundaries: torch.Tensor  # [2**bits - 1] float32, midpoints of adjacent centroids

    @property
    def bits(self) -> int:
        return int(self.centroids.numel()).bit_length() - 1


def coordinate_density(head_dim: int, t: torch.Tensor) -> torch.Tensor:
    """Unnormalised density of one coordinate of a uniform unit vector in R^head_dim."""
    return (1.0 - t * t).clamp_min(0.0) ** ((head_dim - 3) / 2.0)


@functools.lru_cache(maxsize=None)
@_ordinary_tensors
def _lloyd_max_cpu(head_dim: int, bits: int) -> Codebook:
    levels = 1 << bits
    # Grid over the scaled coordinate s = sqrt(D) t in [-sqrt(D), sqrt(D)], float64.
    root = math.sqrt(head_dim)
    s = torch.linspace(-root, root, _GRID_POINTS, dtype=torch.float64)
    w = coordinate_density(head_dim, s / root)
    w = w / w.sum()
    cum_w = torch.cumsum(w, 0)
    cum_sw = torch.cumsum(w * s, 0)
    # Start from the Gaussian quantiles at cell midpoints.
    probs = (torch.arange(levels, dtype=torch.float64) + 0.5) / levels
    c = math.sqrt(2.0) * torch.erfinv(2 * probs - 1)
    for _ in range(_LLOYD_ITERATIONS):
        b = (c[1:] + c[:-1]) / 2
        idx = torch.searchsorted(s, b)  # grid index of each boundary
        edges_w = torch.cat([torch.zeros(1, dtype=torch.float64), cum_w[idx - 1], cum_w[-1:]])
        edges_sw = torch.cat([torch.zeros(1, dtype=torch.float64), cum_sw[idx - 1], cum_sw[-1:]])
        mass = edges_w[1:] - edges_w[:-1]
        new_c = (edges_sw[1:] - edges_sw[:-1]) / mass.clamp_min(1e-300)
        if torch.allclose(new_c, c, rtol=0, atol=1e-12):
            c = new_c
            break
        c = new_c
    c = c.to(torch.float32)
    return Codebook(centroids=c, boundaries=(c[1:] + c[:-1]) / 2)


def lloyd_max(head_dim: int, bits: int, device: torch.device | str = "cpu") -> Codebook:
    """Lloyd-Max codebook for sqrt(head_dim) x one coordinate of a rotated unit vector."""
    if bits not in (2, 3, 4):
        raise ValueError(f"codebook bits must be 2, 3 or 4, got {bits}")
    return _on_device(_lloyd_max_cpu(head_dim, bits), str(torch.device(device)))


@functools.lru_cache(maxsize=None)
def is_symmetric(head_dim: int, bits: int) -> bool:
    """Whether the codebook is exactly symmetric in float32 (c[L-1-n] == -c[n], middle boundary 0),
    which lets the store kernel bucket a coordinate by its magnitude and sign (computed on the CPU
    once per shape: no device sync in a decode step)."""
    book = _lloyd_max_cpu(head_dim, bits)
    c, b = book.centroids, book.boundaries
    return bool(torch.equal(c.flip(0), -c) and torch.equal(b.flip(0), -b) and b[b.numel() // 2] == 0)


@functools.lru_cache(maxsize=None)
@_ordinary_tensors
def _on_device(book: Codebook, device: str) -> Codebook:
    return Codebook(book.centroids.to(device), book.boundaries.to(device))


def codebook_mse(head_dim: int, bits: int) -> float:
    """Expected squared error per unit-variance coordinate, by numerical integration."""
    book = _lloyd_max_cpu(head_dim, bits)
    root = math.sqrt(head_dim)
    s = torch.linspace(-root, root, _GRID_POINTS, dtype=torch.float64)
    w = coordinate_density(head_dim, s / root)
    w = w / w.sum()
    c = book.centroids.double()
    q = c[torch.bucketize(s, book.boundaries.double())]
    return float((w * (s - q) ** 2).sum())


def _hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


@functools.lru_cache(maxsize=None)
@_ordinary_tensors
def _rotation_cpu(head_dim: int, kind: str, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if kind == "hadamard":
        if head_dim & (head_dim - 1):
            raise ValueError(f"hadamard rotation needs a power-of-two head_dim, got {head_dim}")
        signs = torch.randint(0, 2, (head_dim,), generator=gen, dtype=torch.int64) * 2 - 1
        rot = _hadamard(head_dim) * signs.double()[None, :] / math.sqrt(head_dim)
    elif kind == "random":
        g = torch.randn(head_dim, head_dim, generator=gen, dtype=torch.float64)
        q, r = torch.linalg.qr(g)
        rot = q * torch.sign(torch.diagonal(r))[None, :]
    else:
        raise ValueError(f"rotation {kind!r} is not supported; supported values: 'hadamard', 'random'")
    return rot.to(torch.float32)


def rotation_matrix(head_dim: int, kind: str, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Orthogonal [head_dim, head_dim] matrix R; a key k is rotated as k @ R.T (= R k)."""
    return _rotation_on_device(head_dim, kind, seed, str(torch.device(device)))


@functools.lru_cache(maxsize=None)
@_ordinary_tensors
def _rotation_on_device(head_dim: int, kind: str, seed: int, device: str) -> torch.Tensor:
    return _rotation_cpu(head_dim, kind, seed).to(device)
