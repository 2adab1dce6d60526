"""Two attentions of the same queries merged by their log-sum-exp, rotated and written, one launch.

The dense route attends a forward's history and its own tokens apart (history.py) and merges them: the history's
share of each row's softmax weight is sigmoid(lse_history - lse_own). In torch that was a subtraction, a sigmoid,
two casts, a lerp, a cast back and the value rotation's matmul into the output: seven launches per layer of every
such forward, each with its host time. Here one program per 16 query rows of a (row, query head) reads both
outputs and log-sum-exps, merges in fp32, rounds to the output dtype (as the torch ops did), rotates by Rv
(rotation.dot_square) and stores into the caller's buffer, whatever its strides.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .codec_tensors import next_pow2
from .fast_launch import LaunchSite, PlanCache, device_of, variant_key
from .rotation import dot_square, dot_in_f32
from .rounding import store_rounded

MERGE_ROWS = 16  # query rows per program (a tensor-core product's narrowest M)


@triton.jit
def _merge_kernel(oh_ptr, s_ohb, s_ohr, lh_ptr, s_lhb, s_lhr, oo_ptr, s_oob, s_ooh, s_ooi, lo_ptr, s_lob, s_loh, s_loi,
                  rot_ptr, dst_ptr, s_db, s_dh, s_di, LQ, G, HK,
                  D: tl.constexpr, DP: tl.constexpr, BLOCK: tl.constexpr, ROT: tl.constexpr,
                  DOT_F32: tl.constexpr):
    """Program (t, h, b): query rows t * BLOCK + [0, BLOCK) of row b, query head h = kv * G + g. The history's output
    and log-sum-exp sit at row kv of b's KV heads (b * HK + kv), position g * LQ + i (each KV head's G x Lq query
    rows stacked); the own tokens' at [b, h, i]."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    kv = h // G
    g = h % G
    i = t * BLOCK + tl.arange(0, BLOCK)
    ok = i < LQ
    cols = tl.arange(0, DP)
    mask = ok[:, None] & (cols[None, :] < D)
    hist = b * HK + kv
    o_hist = tl.load(oh_ptr + hist * s_ohb + ((g * LQ + i) * s_ohr)[:, None] + cols[None, :], mask=mask,
                     other=0.0).to(tl.float32)
    o_own = tl.load(oo_ptr + b * s_oob + h * s_ooh + (i * s_ooi)[:, None] + cols[None, :], mask=mask,
                    other=0.0).to(tl.float32)
    l_hist = tl.load(lh_ptr + hist * s_lhb + (g * LQ + i) * s_lhr, mask=ok, other=0.0)
    l_own = tl.load(lo_ptr + b * s_lob + h * s_loh + i * s_loi, mask=ok, other=0.0)
    # sigmoid(l_hist - l_own): the history's part of the weight (the exponent capped: e**80 already makes it 0)
    share = 1.0 / (1.0 + tl.exp(tl.minimum(l_own - l_hist, 80.0)))
    y = o_own + share[:, None] * (o_hist - o_own)
    if ROT:  # (the merged rows rounded to the output dtype first, as torch's lerp and cast did)
        y = dot_square(y, rot_ptr, D, DP, DOT_F32)
    store_rounded(dst_ptr + b * s_db + h * s_dh + (i * s_di)[:, None] + cols[None, :], y, mask)


_PLANS = PlanCache()


def merge_attention(o_hist: torch.Tensor, lse_hist: torch.Tensor, o_own: torch.Tensor, lse_own: torch.Tensor,
                    rotation: torch.Tensor | None, dst: torch.Tensor) -> torch.Tensor:
    """dst [B, Hq, Lq, D] = (the two attentions of each query merged by log-sum-exp) @ rotation: o_hist
    [B * Hk, G * Lq, D] (each KV head's G x Lq query rows stacked) with lse_hist [B * Hk, G * Lq] fp32; o_own
    [B, Hq, Lq, D] with lse_own [B, Hq, Lq] fp32; rotation [D, D] in dst's dtype (Rv) or None. Every tensor's last
    axis contiguous; the caller checks the shapes (history.py). Returns dst."""
    b, hq, lq, d = o_own.shape
    hk = o_hist.shape[0] // b
    tensors = (o_hist, lse_hist, o_own, lse_own, dst)
    if any(x.stride(-1) != 1 for x in tensors) or d < 16 or rotation is not None and not rotation.is_contiguous():
        raise ValueError("merge_attention needs a head_dim of at least 16, every tensor's last axis contiguous and a "
                         "contiguous rotation")
    args = (o_hist, *o_hist.stride()[:2], lse_hist, *lse_hist.stride(), o_own, *o_own.stride()[:3], lse_own,
            *lse_own.stride(), rotation if rotation is not None else dst, dst, *dst.stride()[:3], lq, hq // hk, hk)
    key = (rotation is not None, d, *variant_key(args))
    site = _PLANS.get(key)
    if site is None:
        site = _PLANS.put(key, LaunchSite(_merge_kernel, (1, 1, 1), dict(
            D=d, DP=next_pow2(d), BLOCK=MERGE_ROWS, ROT=rotation is not None,
            DOT_F32=dot_in_f32(dst.dtype, dst.device), num_warps=4)))
    with device_of(dst):
        site.regrid((triton.cdiv(lq, MERGE_ROWS), hq, b))(*args)
    return dst
