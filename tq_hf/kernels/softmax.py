"""Online-softmax helpers shared by the attention kernels (log2 domain)."""

from __future__ import annotations

import triton
import triton.language as tl

@triton.jit
def add_pairs(a0, b0, a1, b1):
    return a0 + a1, b0 + b1


@triton.jit
def rescaled_dot(a, b, acc, alpha):
    """acc * alpha + a @ b, the tile's product summed from zero and added in one fp32 FMA. The values' codes are
    unsigned (their offset rides in the bias term), so the code sums run ~7.5x the result's scale per element and
    far more once random-signed values average out; chained through the MMA's accumulator, whose additions round
    toward zero (H200), a long walk's bias grew with its length: 8% relative error at 32/8/128 B=16 S=128k.
    Rounded to nearest once per tile, it stays at the arithmetic's level."""
    return tl.fma(acc, alpha, tl.dot(a, b))


@triton.jit
def log2_logits(s, softcap, HAS_SOFTCAP: tl.constexpr):
    """Scaled scores -> log2-domain logits, soft-capped first (tanh via exp of -|s|: no overflow)."""
    if HAS_SOFTCAP:
        e = tl.exp(-2.0 * tl.abs(s) / softcap)
        th = (1.0 - e) / (1.0 + e)
        s = softcap * tl.where(s < 0, -th, th)
    return s * 1.4426950408889634


@triton.jit
def softmax_p(s, m_i):
    """Online softmax over log2 logits s [M, N] (-inf where masked): (probabilities p, rescale
    alpha of the old state, new max)."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == -float("inf"), 0.0, m_new)
    return tl.exp2(s - m_use[:, None]), tl.exp2(m_i - m_use), m_new


@triton.jit
def softmax_step(s, m_i, l_i):
    """softmax_p, and the new sum."""
    p, alpha, m_new = softmax_p(s, m_i)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)


