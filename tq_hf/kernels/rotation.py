"""Rotations inside the kernels: the randomized Hadamard rotation (rotation="hadamard") built in registers
instead of read, and a general D x D rotation applied with 3xTF32 dots (or one 16-bit pass for a few rows)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .device import device_traits


@triton.jit
def hadamard_entries(rows, cols, col_ok):
    """[rows, cols] fp16 entries (-1)^popcount(rows[r] & cols[c]) of the Sylvester Hadamard matrix where col_ok[c]
    (else 0), built in registers; coordinates < 256."""
    p = rows[:, None] & cols[None, :]
    p = p ^ (p >> 4)
    p = p ^ (p >> 2)
    p = p ^ (p >> 1)
    return tl.where(col_ok[None, :], tl.where((p & 1) != 0, -1.0, 1.0), 0.0).to(tl.float16)


@triton.jit
def hadamard_dot(x, rows, cols, col_ok, acc, TERMS: tl.constexpr = 2):
    """acc + x @ M with M[r, c] = (-1)^popcount(rows[r] & cols[c]) where col_ok[c] (else 0): entries of the
    Sylvester Hadamard matrix (exact in fp16), built in registers instead of read from memory. x fp32 with
    rows scaled to |x| <= 1 (no fp16 overflow) goes through fp16 MMAs as a sum of TERMS fp16 parts: 2 are
    exact to ~2^-22 of the row's largest entry (as the 3xTF32 products of a general rotation; the attention's
    query), 3 to the fp32 accumulation (the store, whose codes must match reference.py's fp32 rotation).
    Coordinates < 256 (8 bits: head_dim <= 256, config.HEAD_DIM_RANGE)."""
    return split_dot(x, hadamard_entries(rows, cols, col_ok), acc, TERMS)


@triton.jit
def split_dot(x, m, acc, TERMS: tl.constexpr = 2):
    """acc + x @ m for fp16 m whose entries are exact there (+-1, 0) and fp32 x with |x| <= 1: x as a sum of TERMS
    fp16 parts, one 16-bit dot each (hadamard_dot's precision: 2 terms to ~2**-22 of the row's largest entry)."""
    hi = x.to(tl.float16)
    rest = x - hi.to(tl.float32)
    if TERMS == 3:
        mid = rest.to(tl.float16)
        acc = tl.dot((rest - mid.to(tl.float32)).to(tl.float16), m, acc)
        rest = mid.to(tl.float32)
    return tl.dot(hi, m, tl.dot(rest.to(tl.float16), m, acc))


@triton.jit
def unit_rotation_rows(ptr, mask, D: tl.constexpr, UNITS: tl.constexpr):
    """Rows of a rotation whose entries are +-1/sqrt(D) (a randomized Hadamard, rotation="hadamard") as fp16 +-1 for
    split_dot: read as they are where ptr holds them so (UNITS: codec_tensors.value_rotation_units), else the fp32
    rotation's rows loaded and scaled (exact)."""
    if UNITS:
        return tl.load(ptr, mask=mask, other=0.0)
    return (tl.load(ptr, mask=mask, other=0.0) * tl.sqrt(D * 1.0)).to(tl.float16)


@triton.jit
def hadamard_signs(rot_ptr, idx, n):
    """The signs s[idx] (+-1.0) of a rotation R = H diag(s) / sqrt(D) (codebook.py, rotation="hadamard"):
    R's row 0 (H[0, :] = 1); 1.0 where idx >= n."""
    return tl.where(tl.load(rot_ptr + idx, mask=idx < n, other=1.0) < 0, -1.0, 1.0)


@triton.jit
def row_norm(x):
    """Each row's largest |x| (1 where the row is all zero): x / it is within [-1, 1] for hadamard_dot."""
    amax = tl.max(tl.abs(x), axis=1)
    return tl.where(amax > 0, amax, 1.0)


@triton.jit
def hadamard_input(x, rot_ptr, idx, D: tl.constexpr):
    """x * s (the signs of R = H diag(s) / sqrt(D) at coordinates idx) with rows scaled to |.| <= 1, and the
    factor that takes a hadamard_dot of it back to x @ R^T (the rows' scale / sqrt(D))."""
    xs = x * hadamard_signs(rot_ptr, idx, D)[None, :]
    n = row_norm(xs)[:, None]
    return xs / n, n * (1.0 / tl.sqrt(D * 1.0))


@triton.jit
def matmul_square(x, m_ptr, D: tl.constexpr, DP: tl.constexpr, TRANSPOSED: tl.constexpr):
    """x [rows, DP] fp32 times the D x D fp32 matrix M at m_ptr (M^T if TRANSPOSED), zero-padded to
    DP, with 3xTF32. Two dots over the even and the odd output columns, interleaved back: each
    operand is half of one [DP, DP] fp32 tile, which at head_dim 256 (256 KiB) exceeds an H200's
    shared memory (Triton 3.6 compile for sm_90a: 262,144 B needed, 232,448 available)."""
    k = tl.arange(0, DP)
    n_even = 2 * tl.arange(0, DP // 2)
    n_odd = n_even + 1
    m_even = (k[:, None] < D) & (n_even[None, :] < D)
    m_odd = (k[:, None] < D) & (n_odd[None, :] < D)
    if TRANSPOSED:  # B[k, n] = M[n, k]
        b_even = tl.load(m_ptr + n_even[None, :] * D + k[:, None], mask=m_even, other=0.0)
        b_odd = tl.load(m_ptr + n_odd[None, :] * D + k[:, None], mask=m_odd, other=0.0)
    else:  # B[k, n] = M[k, n]
        b_even = tl.load(m_ptr + k[:, None] * D + n_even[None, :], mask=m_even, other=0.0)
        b_odd = tl.load(m_ptr + k[:, None] * D + n_odd[None, :], mask=m_odd, other=0.0)
    y_even = tl.dot(x, b_even, input_precision="tf32x3")
    y_odd = tl.dot(x, b_odd, input_precision="tf32x3")
    return tl.reshape(tl.join(y_even, y_odd), (x.shape[0], DP))


@triton.jit
def dot_square(x, m_ptr, D: tl.constexpr, DP: tl.constexpr, F32: tl.constexpr):
    """x [rows, DP] fp32 times the D x D matrix M at m_ptr, zero-padded to DP, in one tensor-core pass of M's dtype
    (x rounded to it first, as a matmul in the model's dtype rounds its input), fp32 accumulation; F32 (dot_in_f32):
    in fp32 instead. One pass where matmul_square takes six: for a few rows of exact tokens or outputs."""
    k = tl.arange(0, DP)
    m = tl.load(m_ptr + k[:, None] * D + k[None, :], mask=(k[:, None] < D) & (k[None, :] < D), other=0.0)
    if F32:
        return tl.dot(x, m.to(tl.float32), input_precision="ieee")
    return tl.dot(x.to(m.dtype), m)


def dot_in_f32(dtype: torch.dtype, device: torch.device) -> bool:
    """dot_square's F32: fp32 matrices, and 16-bit ones under the interpreter, whose bf16 dots return garbage (and
    whose casts to bf16 truncate)."""
    return dtype == torch.float32 or not device_traits(device).runs_ptx
