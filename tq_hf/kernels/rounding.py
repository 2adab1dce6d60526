"""Bit-exact rounding on integer bit patterns, so that the Triton interpreter (CPU) and the GPU round
identically and both match reference.py, whatever each backend's float casts do."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def bf16_rne_bits(x):
    """fp32 -> bfloat16 bit pattern (uint32, low 16 bits): round to nearest even, saturating."""
    x = tl.minimum(tl.maximum(x, -3.3895313892515355e38), 3.3895313892515355e38)
    b = x.to(tl.uint32, bitcast=True)
    b = b + 0x7FFF + ((b >> 16) & 1)
    return b >> 16


@triton.jit
def bf16_up_bits(x):
    """fp32 >= 0 -> bit pattern (uint32, low 16 bits) of the smallest bfloat16 >= x."""
    b = x.to(tl.uint32, bitcast=True)
    t = b >> 16
    return tl.where((b & 0xFFFF) != 0, t + 1, t)


@triton.jit
def bf16_bits_to_f32(bits):
    """bfloat16 bit pattern (uint32, low 16 bits) -> fp32 value."""
    return (bits << 16).to(tl.float32, bitcast=True)


@triton.jit
def fp8e4m3_bits(x):
    """fp32 with |x| <= 448 -> float8_e4m3fn bit pattern (uint32), round to nearest even."""
    b = x.to(tl.uint32, bitcast=True)
    sign = (b >> 24) & 0x80
    mag = b & 0x7FFFFFFF
    # normal range (>= 2**-6): round the fp32 mantissa to 3 bits; a carry bumps the exponent
    r = mag + 0x7FFFF + ((mag >> 20) & 1)
    normal = (r >> 20) - (120 << 3)
    # subnormal range: multiples of 2**-9, rounded to nearest even by the 2**23 trick
    m = mag.to(tl.float32, bitcast=True) * 512.0 + 8388608.0
    sub = m.to(tl.uint32, bitcast=True) & 0xF
    return sign | tl.where(mag >= 0x3C800000, normal, sub)


@triton.jit
def store_rounded(ptr, x, mask):
    """Store fp32 `x` into ptr's dtype; bfloat16 is rounded to nearest even by bit operations
    (the Triton interpreter's fp32 -> bf16 cast truncates)."""
    if ptr.dtype.element_ty == tl.bfloat16:
        tl.store(ptr.to(tl.pointer_type(tl.int16)), bf16_rne_bits(x).to(tl.int16), mask=mask)
    else:
        tl.store(ptr, x.to(ptr.dtype.element_ty), mask=mask)
