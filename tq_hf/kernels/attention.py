"""Unified paged attention over the compressed cache: prefill, chunked prefill and decode.

One kernel body, one launcher. A program owns BLOCK_M query rows of one KV head of one
sequence: the rows are the (query position, query head of the group) pairs flattened, so all
G query heads of a KV head share every dequantized K/V tile (GQA/MQA), and it walks the
KV range of one split. Prefill runs one split per row tile (2-D grid over row tiles x heads);
decode uses many splits per sequence and a segment reduction (reduce.py) to fill the GPU.

The walk over the pool runs tile by tile (_pool_tile); tiles whose positions are all in range and
visible to every row of the program skip every mask. Per tile the kernel only unpacks codes: the query is rotated once in the prologue
(q_rot = q @ R^T, in steps of RK coordinates to keep the rotation tiles out of the registers the
walk needs), so score_t = key_scale_t * q_rot . centroid[code_t] with the key scale applied per
token after the dot. 4-bit codebook keys in decode launches on CUDA are looked up by byte
permutes (key_lut.py) on codes loaded as [D/2, N], so the lookup lands in the MMA's operand
layout and the fp16 key tile never goes through shared memory; where a program takes two KV heads
(below), or takes one while the batch fills the GPU without exact buffers, as 16-bit code words [D/4, N]
(KEY_WORDS: two words of a token per operand register, four dots over
the coordinate sets 2w, 2w + 1, D/2 + 2w, D/2 + 2w + 1, so the query's operand loads by
ldmatrix; the centroids' magnitudes are bytes on a grid (reference.on_byte_grid), decoded as fp16
subnormals with the sign bit set from the code, one 8-byte table, the scores scaled once by
KEY_UNIT); elsewhere the centroids are gathered. In that decode a program takes two
KV heads (HP = 2): their query rows share one 16-row tile (rows 0-7, 8-15), each head's dots see
only its rows (the query and P zero elsewhere), so the softmax, its cross-warp reductions and P's
trip through shared memory serve both heads (the exact tiles likewise: one softmax step, a dot per
head; each row's q . mu from its head's mean). tuning head_pairs=4 takes four (rows 0-3, 4-7, 8-11,
12-15; <= 4 rows per head): offline 591 instead of 655 instructions per head and 128-token tile
(sm_90a, 2 stages, uncapped), not yet timed on a GPU. Values use P.V = (P * value_scale) . code + P . bias with
bias_t = value_mid_t - value_scale_t * (2**bits - 1) / 2, a rank-1 term; in decode tiles 4-bit
value codes are loaded as 16-bit words (two tokens per MMA operand register) and decoded as fp16
subnormals (value_nibbles.py) into four accumulators, elsewhere as bytes into two. The per-token
metadata (key scale, value scale and mid) is read as bf16, or, in small-batch decode with the lookup
(META_PAIRS), as 32-bit words of two tokens, which the pipeliner prefetches a tile ahead; in other
decode at head_dim 128 each token's fields from its pair's 32-bit word (META_WORDS, _load_meta), prefetched too.
Format options: key_centering adds q . mu (computed once per row from the unrotated query) to
every raw score before the softcap; value_rotation multiplies each program's output rows by Rv
once in the epilogue (split partials too: the log-sum-exp merge is linear in them). 3-bit codes
are read one 3-byte group (8 codes) at a time.
exact_prefix_tokens: positions kv_start + s (s < P) come from dense side buffers of original
keys/values instead of the pool, and the compressed walk starts after them. The exact program
(below; without splits the row tile's only program) attends over them after its walk (so none of
their state is live through it), as one dense tile: scores q . k from the unrotated query (exact
keys need no q . mu), values folded into the code accumulators, or under value_rotation into an
accumulator in the original space (acc_x), rescaled with the others and added after the
epilogue's rotation by Rv.
recent_window: positions [ring_lo, seq_len), ring_lo = max(recent_from, seq_len - W), come from
a dense ring of exact keys/values (position j at slot j % W) and win over the prefix and the
pool there: the compressed walk (split across the splits) ends at ring_lo, the prefix tile drops
positions >= ring_lo, and the exact program then walks the ring range in dense tiles of RN
tokens, scored and accumulated like the prefix (_exact_tile). Where the query and the buffers share
a 16-bit dtype (the cache's case, EXACT_16) the exact scores are that dtype's MMA and the values'
dots one tf32 pass; else three tf32 passes (fp32 inputs).
The exact program: in split decode on a GPU with programs to spare, one program more than the
pool's splits (EXACT_PROG), so the dense tiles run alongside the compressed walks instead of
after one of them; otherwise split 0 (prefix) and the last split (ring), or without splits the
row tile's only program.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import triton
import triton.runtime.errors
import triton.language as tl

from ..config import MAX_EXACT_PREFIX, MAX_RECENT_WINDOW
from ..layout import BlockLayout, key_planes, value_planes
from ._common import (
    ACTIVATION_DTYPES,
    check_key_offset,
    check_layout_pool,
    check_tensor,
    codec_tensors,
    hadamard_dot,
    hadamard_input,
    hadamard_signs,
    matmul_square,
    next_pow2,
    row_norm,
    store_rounded,
    tuned_for_gpu as _tuned_for_gpu,
    value_rotation_tensor,
)
from .key_lut import CONSTRAINTS as _LUT_CONSTRAINTS, WORDS_CONSTRAINTS as _LUT_WORDS_CONSTRAINTS, config_lut3_words, config_lut_bytes, config_lut_words, lut3_asm, lut_asm, lut_words_asm
from .value_nibbles import ASM as _VALUE_NIBBLES_ASM, CONSTRAINTS as _VALUE_NIBBLES_CONSTRAINTS, PLANES_ASM as _PLANES_ASM
from .fast_launch import LaunchSite, PlanCache, argument_key, device_of, value_key
from .reduce import reduce_site

LOG2E = 1.4426950408889634
LUT_CONSTRAINTS = tl.constexpr(_LUT_CONSTRAINTS)
LUT_WORDS_CONSTRAINTS = tl.constexpr(_LUT_WORDS_CONSTRAINTS)
VALUE_NIBBLES_ASM = tl.constexpr(_VALUE_NIBBLES_ASM)
VALUE_NIBBLES_CONSTRAINTS = tl.constexpr(_VALUE_NIBBLES_CONSTRAINTS)
VALUE_PLANES_ASM = tl.constexpr(_PLANES_ASM)


@triton.jit
def _nibbles_to_f16(b, HIGH: tl.constexpr):
    """uint8 codes -> fp16 (low nibble) or fp16 16 x (high nibble), exact, by the 0x6400 trick:
    (0x6400 | n) read as fp16 is 1024 + n."""
    w = b.to(tl.uint16)
    if HIGH:
        w = (w & 0xF0) | 0x6400
    else:
        w = (w & 0x0F) | 0x6400
    return w.to(tl.float16, bitcast=True) - 1024.0


@triton.jit
def _value_nibbles(w, PTX: tl.constexpr):
    """16-bit words of 4-bit value codes (bytes 2k, 2k + 1 of a token) -> their 4 nibbles x as fp16
    subnormals x * 2**-24, exact: (byte 2k low, 16 x byte 2k high, byte 2k + 1 low, 16 x byte
    2k + 1 high); the epilogue scales by 2**24 (2**20) once. One mask per 2 codes, no offset to
    subtract. Loading words, not bytes, lets the MMA operand take 2 tokens per 32-bit register
    (bytes: a shared-memory load per code byte, H200 SASS)."""
    if PTX:
        n0, n1, n2, n3 = tl.inline_asm_elementwise(VALUE_NIBBLES_ASM, VALUE_NIBBLES_CONSTRAINTS, [w],
                                                   dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
                                                   is_pure=True, pack=2)
    else:
        n0 = (w & 0x000F).to(tl.float16, bitcast=True)
        n1 = (w & 0x00F0).to(tl.float16, bitcast=True)
        n2 = ((w >> 8) & 0x000F).to(tl.float16, bitcast=True)
        n3 = ((w >> 8) & 0x00F0).to(tl.float16, bitcast=True)
    return n0, n1, n2, n3


@triton.jit
def _value_col(c, J: tl.constexpr, D: tl.constexpr, WORDS: tl.constexpr, PLANES: tl.constexpr):
    """The coordinate behind column c of value accumulator J. 4-bit: code i sits in byte i (low
    nibble) for i < D/2, else in byte i - D/2 (high nibble). WORDS: accumulator J holds nibble J
    of 16-bit word c (_value_nibbles' order); bytes: accumulator 0 the low nibbles, 1 the high.
    PLANES (3-bit values, layout.value_planes): accumulator J holds coordinates J * D/4 + c."""
    if PLANES:
        return J * (D // 4) + c
    elif WORDS:
        return 2 * c + J // 2 + (J % 2) * (D // 2)
    else:
        return c + J * (D // 2)


@triton.jit
def _value_plane_words(low, high, half, PTX: tl.constexpr):
    """3-bit value codes (layout.value_planes) of coordinates a * D/4 + j, a = 0..3, from the 2-bit plane's
    bytes `low` and the bit plane's bytes `high` (byte j % (D/8); half = j // (D/8)), as fp16 subnormals
    code * 2**-24. One 16-bit word per token and column (low | the column's bit-plane bits << 8) feeds a
    mask-only decode of two tokens per register (value_nibbles.PLANES_ASM), as the 4-bit value words do."""
    w = low.to(tl.uint16) | (((high >> half) & 0x55).to(tl.uint16) << 8)
    if PTX:
        n0, n1, n2, n3 = tl.inline_asm_elementwise(VALUE_PLANES_ASM, VALUE_NIBBLES_CONSTRAINTS, [w],
                                                   dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
                                                   is_pure=True, pack=2)
    else:
        n0 = ((w & 0x0003) | ((w >> 6) & 0x0004)).to(tl.float16, bitcast=True)
        n1 = (((w >> 2) & 0x0003) | ((w >> 8) & 0x0004)).to(tl.float16, bitcast=True)
        n2 = (((w >> 4) & 0x0003) | ((w >> 10) & 0x0004)).to(tl.float16, bitcast=True)
        n3 = (((w >> 6) & 0x0003) | ((w >> 12) & 0x0004)).to(tl.float16, bitcast=True)
    return n0, n1, n2, n3


@triton.jit
def _value_plane_bytes(low, high, c, J: tl.constexpr, D: tl.constexpr):
    """3-bit value codes (layout.value_planes) of coordinates J * D/2 + c as fp16 codes (the 0x6400 trick),
    for 64-row (wgmma) tiles, where the plane words' 4 accumulators of D/4 columns faulted (H200): column c
    is code a = 2J + c // (D/4) of byte j = c % (D/4) (low: 2-bit plane byte j, high: bit-plane byte j % (D/8))."""
    a = (2 * J + c // (D // 4))[None, :]
    half = ((c % (D // 4)) // (D // 8))[None, :]
    code = ((low >> (2 * a)) & 3) | (((high >> (2 * a + half)) & 1) << 2)
    return (code | 0x6400).to(tl.uint16).to(tl.float16, bitcast=True) - 1024.0


@triton.jit
def _unpack3(pool_ptr, plane, row_off, tok_ok, BLOCK_N: tl.constexpr, GP: tl.constexpr, NG: tl.constexpr):
    """3-bit little-endian bit stream -> int32 codes [BLOCK_N, 8 * GP] of the rows at byte
    offsets row_off: each 3-byte group is loaded once (three strided byte loads), joined into
    a 24-bit word and split into its 8 codes (code 8g + p at bits 3p of group g)."""
    g = tl.arange(0, GP)
    ptr = pool_ptr + (plane[:, None] + row_off[:, None] + 3 * g[None, :])
    m = tok_ok[:, None] & (g[None, :] < NG)
    b0 = tl.load(ptr, mask=m, other=0).to(tl.int32)
    b1 = tl.load(ptr + 1, mask=m, other=0).to(tl.int32)
    b2 = tl.load(ptr + 2, mask=m, other=0).to(tl.int32)
    word = b0 | (b1 << 8) | (b2 << 16)
    codes = (word[:, :, None] >> (3 * tl.arange(0, 8))[None, None, :]) & 7
    return tl.reshape(codes, (BLOCK_N, GP * 8))


@triton.jit
def _spare_codes(p0, p1, p2):
    """Bytes j of the three 3-bit key planes (layout.py) -> one byte of codes 6 (bits 0-2) and 7 (bits
    4-6) of coordinates 6J + j and 7J + j, gathered from the planes' spare bits 3 and 7. Integer ops,
    which Triton moves into the MMA operand layout with the loads (a multi-input asm it would not)."""
    return ((p0 >> 3) & 0x11) | ((p1 >> 2) & 0x22) | ((p2 >> 1) & 0x44)


@triton.jit
def _lookup_dots(s, q_lo, q_hi, codes, LUT_LO: tl.constexpr, LUT_HI: tl.constexpr):
    """s (None: none yet) plus the scores of a 3-bit code byte tile [rows, N] (two codes per byte, bits 0-2 and 4-6) by
    key_lut.py's byte-permute lookup, decoded in the MMA's B-operand layout; q_lo, q_hi: the query's
    coordinates of each row's low and high code."""
    s = tl.dot(q_lo, tl.inline_asm_elementwise(LUT_LO, LUT_CONSTRAINTS, [codes], dtype=tl.float16, is_pure=True, pack=4), s)
    return tl.dot(q_hi, tl.inline_asm_elementwise(LUT_HI, LUT_CONSTRAINTS, [codes], dtype=tl.float16, is_pure=True, pack=4), s)


@triton.jit
def _gather_dots(s, q_lo, q_hi, codes, table):
    """_lookup_dots by gathers from the centroid table [N, 8]; codes [N, rows]."""
    s = tl.dot(q_lo, tl.trans(tl.gather(table, (codes & 7).to(tl.int32), 1)), s)
    return tl.dot(q_hi, tl.trans(tl.gather(table, (codes >> 4).to(tl.int32) & 7, 1)), s)


@triton.jit
def _gather_cols(table, codes):
    """Centroids of a code tile [K, N] (table: [N, NC] fp16, by stored code) as [K, N] fp16."""
    return tl.trans(tl.gather(table, tl.trans(codes.to(tl.int32)), 1))


@triton.jit
def _hadamard_query(q_row, row_ok, rot_ptr, hc, D: tl.constexpr, BLOCK_M: tl.constexpr):
    """q @ R^T for the randomized Hadamard rotation R = H diag(s) / sqrt(D) without reading R: the first
    butterfly of H_D folds the signed query's halves (u = a + b, v = a - b), then H_{D/2} (hadamard_dot).
    Returns the rotated query's two halves (coordinates < D/2 and >= D/2), fp32 [BLOCK_M, D/2]."""
    H: tl.constexpr = D // 2
    ok = row_ok[:, None] & (hc[None, :] < H)
    a = tl.load(q_row[:, None] + hc[None, :], mask=ok, other=0.0).to(tl.float32) * hadamard_signs(rot_ptr, hc, H)[None, :]
    b = tl.load(q_row[:, None] + H + hc[None, :], mask=ok, other=0.0).to(tl.float32) * hadamard_signs(rot_ptr, H + hc, D)[None, :]
    u = a + b
    v = a - b
    n = tl.maximum(row_norm(u), row_norm(v))[:, None]
    zero = tl.zeros((BLOCK_M, hc.shape[0]), tl.float32)
    q_lo = hadamard_dot(u / n, hc, hc, hc < H, zero)
    q_hi = hadamard_dot(v / n, hc, hc, hc < H, zero)
    scale = n * (1.0 / tl.sqrt(D * 1.0))
    return q_lo * scale, q_hi * scale


@triton.jit
def _load_meta(pool_ptr, plane, field: tl.constexpr, off, T: tl.constexpr, META: tl.constexpr, mask,
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
def _heads_meta(pool_ptr, plane, plane_bytes, field: tl.constexpr, off, T: tl.constexpr, META: tl.constexpr, mask,
                WORDS: tl.constexpr, sub, HP: tl.constexpr):
    """_load_meta of HP KV heads (each one's planes plane_bytes on) as [rows, N]: each row its head's field (sub:
    the row's head; the selection is a function of the register, so it folds)."""
    out = _load_meta(pool_ptr, plane, field, off, T, META, mask, WORDS)[None, :]
    for j in tl.static_range(1, HP):
        out = tl.where(sub[:, None] == j, _load_meta(pool_ptr, plane + j * plane_bytes, field, off, T, META, mask,
                                                     WORDS)[None, :], out)
    return out


@triton.jit
def _meta_pairs(t0, end, pool_first, bt_row, pool_ptr, block_bytes, head_off, T: tl.constexpr, META: tl.constexpr,
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


@triton.jit
def _add_pairs(a0, b0, a1, b1):
    return a0 + a1, b0 + b1


@triton.jit
def _rescaled_dot(a, b, acc, alpha):
    """acc * alpha + a @ b, the tile's product summed from zero and added in one fp32 FMA. The values' codes are
    unsigned (their offset rides in the bias term), so the code sums run ~7.5x the result's scale per element and
    far more once random-signed values average out; chained through the MMA's accumulator, whose additions round
    toward zero (H200), a long walk's bias grew with its length: 8% relative error at 32/8/128 B=16 S=128k
    (gpu_checks/session18, call 6). Rounded to nearest once per tile, it stays at the arithmetic's level."""
    return tl.fma(acc, alpha, tl.dot(a, b))


@triton.jit
def _log2_logits(s, softcap, HAS_SOFTCAP: tl.constexpr):
    """Scaled scores -> log2-domain logits, soft-capped first (tanh via exp of -|s|: no overflow)."""
    if HAS_SOFTCAP:
        e = tl.exp(-2.0 * tl.abs(s) / softcap)
        th = (1.0 - e) / (1.0 + e)
        s = softcap * tl.where(s < 0, -th, th)
    return s * 1.4426950408889634


@triton.jit
def _softmax_p(s, m_i):
    """Online softmax over log2 logits s [M, N] (-inf where masked): (probabilities p, rescale
    alpha of the old state, new max)."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == -float("inf"), 0.0, m_new)
    return tl.exp2(s - m_use[:, None]), tl.exp2(m_i - m_use), m_new


@triton.jit
def _softmax_step(s, m_i, l_i):
    """_softmax_p, and the new sum."""
    p, alpha, m_new = _softmax_p(s, m_i)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def _exact_value_cols(v_base, s_pos, pc, p_ok, cols, col_ok):
    """Columns `cols` of the exact values [N, D] (prefix or ring), as fp32."""
    v = tl.load(v_base + pc[:, None] * s_pos + cols[None, :], mask=p_ok[:, None] & col_ok[None, :], other=0.0)
    return v.to(tl.float32)


@triton.jit
def _exact_values(p, acc, v_base, s_vh, s_v, rows, ok, cols, col_ok, sub, HP: tl.constexpr, PREC: tl.constexpr):
    """acc + p . (columns `cols` of the exact values), each of the HP heads' values (s_vh apart) with
    only its own rows of p; PREC: the dots' input_precision."""
    for j in tl.static_range(HP):
        if HP == 1:
            p_j = p
        else:
            p_j = tl.where(sub[:, None] == j, p, 0.0)
        acc = tl.dot(p_j, _exact_value_cols(v_base + j * s_vh, s_v, rows, ok, cols, col_ok), acc, input_precision=PREC)
    return acc


@triton.jit
def _exact_tile(q, m_i, l_i, acc0, acc1, acc2, acc3, acc_x, bias_acc, k_base, s_kh, s_k, v_base, s_vh, s_v, rows, pos,
                ok, qpos, window, sm_scale, softcap, dc, vcol, sub, HP: tl.constexpr, EXACT_16: tl.constexpr, D: tl.constexpr,
                VALUE_BITS: tl.constexpr, VALUE_WORDS: tl.constexpr, VALUE_PLANES: tl.constexpr,
                PLANE_WORDS: tl.constexpr, VALUE_ROT: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """One online-softmax step over a dense tile of exact original keys/values (prefix or ring):
    rows `rows` of the buffers hold cache positions `pos`, `ok` marks the real ones. Scores come
    from the unrotated query (exact keys need no q . mu). Values join the code accumulators (4-bit
    values and 3-bit value planes: acc_j's columns vcol are coordinates _value_col(vcol, j), scaled as
    the codes' fp16), or, under value_rotation, acc_x: an accumulator in the original space that the
    epilogue adds after rotating the codes' part back
    (rotating exact values by Rv^T in here doubled the kernel's shared memory: 204,800 B, sm_90a).
    HP KV heads (buffers s_kh / s_vh apart): each head's dots see only its rows (sub), one softmax.
    EXACT_16: the query and buffers share a 16-bit dtype: the scores by that dtype's MMA (exact products,
    fp32 sums) and the values' dots in one tf32 pass (p rounded to 11 bits; the values are exact in tf32),
    instead of three tf32 passes each (offline sm_90a: fewer instructions and spills per ring tile)."""
    PREC: tl.constexpr = "tf32" if EXACT_16 else "tf32x3"
    s = None
    for j in tl.static_range(HP):
        if HP == 1:
            q_j = q
        else:
            q_j = tl.where(sub[:, None] == j, q, 0.0)
        k = tl.load(k_base + j * s_kh + rows[:, None] * s_k + dc[None, :], mask=ok[:, None] & (dc[None, :] < D), other=0.0)
        if EXACT_16:  # q_j holds values of k's dtype (the query's own): exact there
            s = tl.dot(q_j.to(k.dtype), tl.trans(k), s)
        else:
            s = tl.dot(q_j, tl.trans(k.to(tl.float32)), s, input_precision="tf32x3")
    s = _log2_logits(s * sm_scale, softcap, HAS_SOFTCAP)
    vis = ok[None, :] & (pos[None, :] <= qpos[:, None])
    if HAS_WINDOW:
        vis = vis & (pos[None, :] > qpos[:, None] - window)
    p, alpha, m_i, l_i = _softmax_step(tl.where(vis, s, -float("inf")), m_i, l_i)
    bias_acc = bias_acc * alpha
    if VALUE_ROT:
        acc0 = acc0 * alpha[:, None]
        acc1 = acc1 * alpha[:, None]
        acc2 = acc2 * alpha[:, None]
        acc3 = acc3 * alpha[:, None]
        acc_x = _exact_values(p, acc_x * alpha[:, None], v_base, s_vh, s_v, rows, ok, dc, dc < D, sub, HP, PREC)
    elif VALUE_BITS == 4 or VALUE_PLANES:
        v_ok = vcol < (D // 4 if (VALUE_WORDS or PLANE_WORDS) else D // 2)
        # the codes' fp16 scale: subnormals x 2**-24 (high nibbles 2**-20) from words, 1024-offset bytes (16 x),
        # 3-bit plane words' subnormals x 2**-24, 3-bit plane bytes the codes themselves
        p_lo = p * (5.960464477539063e-08 if (VALUE_WORDS or PLANE_WORDS) else 1.0)
        p_hi = p * (9.5367431640625e-07 if VALUE_WORDS else (5.960464477539063e-08 if PLANE_WORDS else
                                                              (1.0 if VALUE_PLANES else 16.0)))
        acc0 = _exact_values(p_lo, acc0 * alpha[:, None], v_base, s_vh, s_v, rows, ok,
                             _value_col(vcol, 0, D, VALUE_WORDS, PLANE_WORDS), v_ok, sub, HP, PREC)
        acc1 = _exact_values(p_hi, acc1 * alpha[:, None], v_base, s_vh, s_v, rows, ok,
                             _value_col(vcol, 1, D, VALUE_WORDS, PLANE_WORDS), v_ok, sub, HP, PREC)
        if VALUE_WORDS or PLANE_WORDS:
            acc2 = _exact_values(p_lo, acc2 * alpha[:, None], v_base, s_vh, s_v, rows, ok,
                                 _value_col(vcol, 2, D, VALUE_WORDS, PLANE_WORDS), v_ok, sub, HP, PREC)
            acc3 = _exact_values(p_hi, acc3 * alpha[:, None], v_base, s_vh, s_v, rows, ok,
                                 _value_col(vcol, 3, D, VALUE_WORDS, PLANE_WORDS), v_ok, sub, HP, PREC)
    else:
        acc0 = _exact_values(p, acc0 * alpha[:, None], v_base, s_vh, s_v, rows, ok, dc, dc < D, sub, HP, PREC)
    return m_i, l_i, acc0, acc1, acc2, acc3, acc_x, bias_acc


@triton.jit
def _pool_tile(t0, end, pool_first, qpos, window, softcap, m_i, l_i, acc0, acc1, acc2, acc3, bias_acc,
               bt_row, blk_pre, pool_ptr, block_bytes, head_off, sub, plane_bytes, q_lo, q_hi, q16, qp, table, row_scale,
               row_off, q_mu, hc, dc, vcol, HALF: tl.constexpr, V_N: tl.constexpr, HP: tl.constexpr,
               D: tl.constexpr, GP: tl.constexpr, T: tl.constexpr, KB: tl.constexpr, VB: tl.constexpr,
               META: tl.constexpr, KEY_BITS: tl.constexpr, VALUE_BITS: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, HAS_KV_START: tl.constexpr, HAS_PREFIX: tl.constexpr, HAS_WINDOW: tl.constexpr,
               HAS_SOFTCAP: tl.constexpr, HAS_KEY_OFFSET: tl.constexpr,
               KEY_LUT: tl.constexpr, LUT_LO: tl.constexpr, LUT_HI: tl.constexpr, KEY_PLANES: tl.constexpr,
               KEY_WORDS: tl.constexpr, VALUE_WORDS: tl.constexpr, VALUE_PLANES: tl.constexpr, PLANE_WORDS: tl.constexpr,
               VALUE_PTX: tl.constexpr, META_PAIRS: tl.constexpr, META_WORDS: tl.constexpr, VMID_CHAIN: tl.constexpr,
               MASKED: tl.constexpr):
    """One BLOCK_N tile [t0, t0 + BLOCK_N) of the compressed walk: unpack, score, online softmax,
    accumulate. MASKED=False: every position of the tile is in the walk's range, past the pool's
    first position and visible to every row (no tests, no load masks: 11% fewer instructions per
    tile in the 4-bit decode loop, sm_90a SASS)."""
    tok = t0 + tl.arange(0, BLOCK_N)
    if MASKED:
        tok_ok = tok < end
        if HAS_KV_START or HAS_PREFIX:
            tok_ok = tok_ok & (tok >= pool_first)
    else:  # a whole tile of visible positions (see the kernel's walk): masks the compiler drops
        tok_ok = tl.full((BLOCK_N,), True, tl.int1)
    if blk_pre is None:
        blk = tl.load(bt_row + tok // T, mask=tok_ok, other=0).to(head_off.dtype)
    else:  # loaded an iteration ahead by the walk (BT_NEXT)
        blk = blk_pre.to(head_off.dtype)
    off = tok % T
    plane = blk * block_bytes + head_off  # the planes' byte offsets in the pool (int32 when it has < 2**31 bytes)

    # scores
    if KEY_BITS == 4:
        if KEY_WORDS:  # 16-bit code words [D/4, N]: 4 dots over the coordinate sets of key_lut's word asm
            ww = tl.arange(0, D // 4)
            s = None
            for j in tl.static_range(HP):  # HP KV heads: each dot's query rows are zero outside head j's rows
                kw = tl.load((pool_ptr + (plane[None, :] + j * plane_bytes + off[None, :] * KB)).to(tl.pointer_type(tl.uint16))
                             + ww[:, None], mask=tok_ok[None, :] & (ww[:, None] < D // 4), other=0)
                if KEY_LUT:
                    k0, k1, k2, k3 = tl.inline_asm_elementwise(LUT_LO, LUT_WORDS_CONSTRAINTS, [kw],
                                                               dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
                                                               is_pure=True, pack=2)
                else:  # no PTX (the interpreter): the same coordinate sets by gathers from the centroid table
                    k0 = _gather_cols(table, kw & 15)
                    k1 = _gather_cols(table, (kw >> 8) & 15)
                    k2 = _gather_cols(table, (kw >> 4) & 15)
                    k3 = _gather_cols(table, kw >> 12)
                s = tl.dot(qp[4 * j], k0, s)
                s = tl.dot(qp[4 * j + 1], k1, s)
                s = tl.dot(qp[4 * j + 2], k2, s)
                s = tl.dot(qp[4 * j + 3], k3, s)
        elif KEY_LUT:  # codes loaded as [D/2, N], the MMA's B operand: decoded in its layout, no transpose
            kbt = tl.load(pool_ptr + (plane[None, :] + off[None, :] * KB + hc[:, None]), mask=tok_ok[None, :] & (hc[:, None] < D // 2), other=0)
            kt_lo = tl.inline_asm_elementwise(LUT_LO, LUT_CONSTRAINTS, [kbt], dtype=tl.float16, is_pure=True, pack=4)
            kt_hi = tl.inline_asm_elementwise(LUT_HI, LUT_CONSTRAINTS, [kbt], dtype=tl.float16, is_pure=True, pack=4)
            s = tl.dot(q_lo, kt_lo)
            s = tl.dot(q_hi, kt_hi, s)
        else:
            kb = tl.load(pool_ptr + (plane[:, None] + off[:, None] * KB + hc[None, :]), mask=tok_ok[:, None] & (hc[None, :] < D // 2), other=0)
            k_lo = tl.gather(table, (kb & 15).to(tl.int32), 1)
            k_hi = tl.gather(table, (kb >> 4).to(tl.int32), 1)
            s = tl.dot(q_lo, tl.trans(k_lo))
            s = tl.dot(q_hi, tl.trans(k_hi), s)
    elif KEY_BITS == 3 and KEY_PLANES and D == 128:
        # 16-byte planes in 32-row windows (Triton 3.6 pipelines and decodes in the MMA operand layout only
        # tiles of >= 32 i8 rows): X = bytes 0..31 (planes 0, 1), Y = 16..47 (planes 1, 2), Z = 32..47 (plane
        # 2, rows 16..31 masked); E = the spare codes of (X, Y, Z), valid in rows 0..15. qp[w] is zero where
        # a window's rows hold no code of it.
        r32 = tl.arange(0, 32)
        if KEY_LUT:
            kw = pool_ptr + (plane[None, :] + off[None, :] * KB + r32[:, None])
            x = tl.load(kw, mask=tok_ok[None, :], other=0)
            y = tl.load(kw + 16, mask=tok_ok[None, :], other=0)
            z = tl.load(kw + 32, mask=tok_ok[None, :] & (r32[:, None] < 16), other=0)
            e = _spare_codes(x, y, z)
            s = _lookup_dots(None, qp[0], qp[1], x, LUT_LO, LUT_HI)
            s = _lookup_dots(s, qp[2], qp[3], z, LUT_LO, LUT_HI)
            s = _lookup_dots(s, qp[4], qp[5], e, LUT_LO, LUT_HI)
        else:
            kw = pool_ptr + (plane[:, None] + off[:, None] * KB + r32[None, :])
            x = tl.load(kw, mask=tok_ok[:, None], other=0)
            y = tl.load(kw + 16, mask=tok_ok[:, None], other=0)
            z = tl.load(kw + 32, mask=tok_ok[:, None] & (r32[None, :] < 16), other=0)
            e = _spare_codes(x, y, z)
            s = _gather_dots(None, qp[0], qp[1], x, table)
            s = _gather_dots(s, qp[2], qp[3], z, table)
            s = _gather_dots(s, qp[4], qp[5], e, table)
    elif KEY_BITS == 3 and KEY_PLANES:  # qp[c]: the query's coordinates c * J + j, one dot per code plane
        J: tl.constexpr = D // 8
        jj = tl.arange(0, J)
        if KEY_LUT:  # plane bytes loaded as [J, N], the MMA's B operand, decoded in its layout
            kp = pool_ptr + (plane[None, :] + off[None, :] * KB + jj[:, None])
            p0 = tl.load(kp, mask=tok_ok[None, :], other=0)
            p1 = tl.load(kp + J, mask=tok_ok[None, :], other=0)
            p2 = tl.load(kp + 2 * J, mask=tok_ok[None, :], other=0)
            s = _lookup_dots(None, qp[0], qp[1], p0, LUT_LO, LUT_HI)
            s = _lookup_dots(s, qp[2], qp[3], p1, LUT_LO, LUT_HI)
            s = _lookup_dots(s, qp[4], qp[5], p2, LUT_LO, LUT_HI)
            s = _lookup_dots(s, qp[6], qp[7], _spare_codes(p0, p1, p2), LUT_LO, LUT_HI)
        else:
            kp = pool_ptr + (plane[:, None] + off[:, None] * KB + jj[None, :])
            p0 = tl.load(kp, mask=tok_ok[:, None], other=0)
            p1 = tl.load(kp + J, mask=tok_ok[:, None], other=0)
            p2 = tl.load(kp + 2 * J, mask=tok_ok[:, None], other=0)
            p67 = _spare_codes(p0, p1, p2)
            s = _gather_dots(None, qp[0], qp[1], p0, table)
            s = _gather_dots(s, qp[2], qp[3], p1, table)
            s = _gather_dots(s, qp[4], qp[5], p2, table)
            s = _gather_dots(s, qp[6], qp[7], p67, table)
    elif KEY_BITS == 3:
        kc = _unpack3(pool_ptr, plane, off * KB, tok_ok, BLOCK_N, GP, D // 8)
        k = tl.gather(table, kc, 1)
        s = tl.dot(q16, tl.trans(k))
    else:
        kb = tl.load(pool_ptr + (plane[:, None] + off[:, None] * KB + dc[None, :]), mask=tok_ok[:, None] & (dc[None, :] < D), other=0)
        k = kb.to(tl.float8e4nv, bitcast=True).to(tl.float16)
        s = tl.dot(q16, tl.trans(k))
    if META_PAIRS:
        k_scale, v_scale, v_mid = _meta_pairs(t0, end, pool_first, bt_row, pool_ptr, block_bytes, head_off, T, META,
                                              BLOCK_N, HAS_KV_START, HAS_PREFIX, MASKED)
    elif HP > 1:
        k_scale = _heads_meta(pool_ptr, plane, plane_bytes, 0, off, T, META, tok_ok, META_WORDS, sub, HP)
    else:
        k_scale = _load_meta(pool_ptr, plane, 0, off, T, META, tok_ok, META_WORDS)
    if MASKED:
        vis = tok_ok[None, :] & (tok[None, :] <= qpos[:, None])
        if HAS_WINDOW:
            vis = vis & (tok[None, :] > qpos[:, None] - window)
    else:
        vis = tl.full((BLOCK_M, BLOCK_N), True, tl.int1)
    if not HAS_SOFTCAP:
        # log2 logits = row_scale * (s * k_scale) + q_mu: the per-row factor and offset enter the
        # row max and the exp2's FFMA instead of every score (H200, B=16 S=32k, all levers: 0.440 -> 0.425 ms)
        x = tl.where(vis, s * (k_scale if HP > 1 else k_scale[None, :]), -float("inf"))
        m_new = tl.maximum(m_i, tl.max(x, axis=1) * row_scale + row_off)
        m_use = tl.where(m_new == -float("inf"), 0.0, m_new)
        p = tl.exp2(x * row_scale[:, None] + (row_off - m_use)[:, None])
        alpha = tl.exp2(m_i - m_use)
        m_i = m_new
    else:
        s = s * row_scale[:, None] * (k_scale if HP > 1 else k_scale[None, :])
        if HAS_KEY_OFFSET:
            s = s + q_mu[:, None]
        s = _log2_logits(s, softcap, HAS_SOFTCAP)
        p, alpha, m_i = _softmax_p(tl.where(vis, s, -float("inf")), m_i)

    # online softmax sums; the values' rank-1 term p . bias rides along (one cross-warp reduction)
    if HP > 1:
        v_scale = _heads_meta(pool_ptr, plane, plane_bytes, 1, off, T, META, tok_ok, META_WORDS, sub, HP)
        v_mid = _heads_meta(pool_ptr, plane, plane_bytes, 2, off, T, META, tok_ok, META_WORDS, sub, HP)
        sum_p, sum_pb = tl.reduce((p, p * (v_mid - v_scale * HALF)), 1, _add_pairs)
    else:  # [N] fields (expanded at each use: as the pipeliner and the register allocation were measured)
        if not META_PAIRS:
            v_scale = _load_meta(pool_ptr, plane, 1, off, T, META, tok_ok, META_WORDS)
            v_mid = _load_meta(pool_ptr, plane, 2, off, T, META, tok_ok, META_WORDS)
        sum_p, sum_pb = tl.reduce((p, p * (v_mid - v_scale * HALF)[None, :]), 1, _add_pairs)
    l_i = l_i * alpha + sum_p
    bias_acc = bias_acc * alpha + sum_pb

    # values
    if HP == 1:
        v_scale = v_scale[None, :]
        v_mid = v_mid[None, :]
    if VMID_CHAIN:  # v_mid enters the MMA operand's chain (+ 0 * v_mid): Triton's pipeliner prefetches only such loads
        ps = (p * (v_scale + 0.0 * v_mid)).to(tl.float16)
    else:
        ps = (p * v_scale).to(tl.float16)
    if VALUE_BITS == 4 and VALUE_WORDS and HP == 1:
        v_row = (pool_ptr + (plane[:, None] + T * KB + off[:, None] * VB)).to(tl.pointer_type(tl.uint16))
        vw = tl.load(v_row + vcol[None, :], mask=tok_ok[:, None] & (vcol[None, :] < V_N), other=0)
        v0, v1, v2, v3 = _value_nibbles(vw, VALUE_PTX)
        acc0 = _rescaled_dot(ps, v0, acc0, alpha[:, None])
        acc1 = _rescaled_dot(ps, v1, acc1, alpha[:, None])
        acc2 = _rescaled_dot(ps, v2, acc2, alpha[:, None])
        acc3 = _rescaled_dot(ps, v3, acc3, alpha[:, None])
    elif VALUE_BITS == 4 and VALUE_WORDS:
        t0 = tl.zeros(acc0.shape, tl.float32)  # the tile's sums from zero (_rescaled_dot)
        t1 = tl.zeros(acc1.shape, tl.float32)
        t2 = tl.zeros(acc2.shape, tl.float32)
        t3 = tl.zeros(acc3.shape, tl.float32)
        for j in tl.static_range(HP):  # HP KV heads: P's rows outside head j's are zero in its dots
            v_row = (pool_ptr + (plane[:, None] + j * plane_bytes + T * KB + off[:, None] * VB)).to(tl.pointer_type(tl.uint16))
            vw = tl.load(v_row + vcol[None, :], mask=tok_ok[:, None] & (vcol[None, :] < V_N), other=0)
            v0, v1, v2, v3 = _value_nibbles(vw, VALUE_PTX)
            ps_j = tl.where(sub[:, None] == j, ps, 0.0)
            t0 = tl.dot(ps_j, v0, t0)
            t1 = tl.dot(ps_j, v1, t1)
            t2 = tl.dot(ps_j, v2, t2)
            t3 = tl.dot(ps_j, v3, t3)
        acc0 = tl.fma(acc0, alpha[:, None], t0)
        acc1 = tl.fma(acc1, alpha[:, None], t1)
        acc2 = tl.fma(acc2, alpha[:, None], t2)
        acc3 = tl.fma(acc3, alpha[:, None], t3)
    elif VALUE_BITS == 4:
        vb = tl.load(pool_ptr + (plane[:, None] + T * KB + off[:, None] * VB + vcol[None, :]), mask=tok_ok[:, None] & (vcol[None, :] < V_N), other=0)
        acc0 = _rescaled_dot(ps, _nibbles_to_f16(vb, False), acc0, alpha[:, None])
        acc1 = _rescaled_dot(ps, _nibbles_to_f16(vb, True), acc1, alpha[:, None])
    elif PLANE_WORDS:  # acc_a: coordinates a * D/4 + vcol; one V_N-byte row and the bit plane read twice
        v_row = pool_ptr + (plane[:, None] + T * KB + off[:, None] * VB)
        vm = tok_ok[:, None] & (vcol[None, :] < V_N)
        low = tl.load(v_row + vcol[None, :], mask=vm, other=0)
        high = tl.load(v_row + V_N + (vcol % (D // 8))[None, :], mask=vm, other=0)
        v0, v1, v2, v3 = _value_plane_words(low, high, (vcol // (D // 8))[None, :], VALUE_PTX)
        acc0 = _rescaled_dot(ps, v0, acc0, alpha[:, None])
        acc1 = _rescaled_dot(ps, v1, acc1, alpha[:, None])
        acc2 = _rescaled_dot(ps, v2, acc2, alpha[:, None])
        acc3 = _rescaled_dot(ps, v3, acc3, alpha[:, None])
    elif VALUE_PLANES:  # 64-row tiles: acc_J, J = 0, 1, coordinates J * D/2 + vcol (codes a = 2J + vcol // (D/4))
        v_row = pool_ptr + (plane[:, None] + T * KB + off[:, None] * VB)
        vm = tok_ok[:, None] & (vcol[None, :] < V_N)
        j = vcol % (D // 4)
        low = tl.load(v_row + j[None, :], mask=vm, other=0)
        high = tl.load(v_row + D // 4 + (j % (D // 8))[None, :], mask=vm, other=0)
        acc0 = _rescaled_dot(ps, _value_plane_bytes(low, high, vcol, 0, D), acc0, alpha[:, None])
        acc1 = _rescaled_dot(ps, _value_plane_bytes(low, high, vcol, 1, D), acc1, alpha[:, None])
    else:
        vc = _unpack3(pool_ptr, plane, T * KB + off * VB, tok_ok, BLOCK_N, GP, D // 8)
        acc0 = _rescaled_dot(ps, vc.to(tl.float16), acc0, alpha[:, None])
    return m_i, l_i, acc0, acc1, acc2, acc3, bias_acc


# Runtime ints that vary step to step are not specialized (one compiled variant serves every chunk
# length and split count: a server would otherwise pay a compile for each new value class).
@triton.jit(do_not_specialize=["recent_from", "Lq", "num_splits", "prefix_len"])
def _attn_kernel(
    q_ptr, s_qb, s_qh, s_ql,  # [B, Hq, Lq, D] fp16/bf16/fp32, last dim contiguous
    o_ptr, s_ob, s_oh, s_ol,  # [B, Hq, Lq, D] query dtype
    pool_ptr,  # [num_blocks, Hk, plane_bytes] uint8
    bt_ptr, s_bt,  # [B, max_blocks] int32/int64 block table
    seq_ptr,  # [B] int: cache length per row
    kvs_ptr,  # [B] int: first visible position (left padding), if HAS_KV_START
    sink_ptr,  # [Hq] float: sink logits, if HAS_SINKS
    rot_ptr,  # [D, D] fp32 rotation R (codebook keys)
    cent_ptr,  # [2**KEY_BITS] fp32 centroids by stored code (codebook keys; reference.stored_codes)
    koff_ptr, s_koff,  # fp32 key_centering mean [Hk, D] (s_koff 0) or [B, Hk, D] per row, if HAS_KEY_OFFSET
    vrot_ptr,  # [D, D] fp32 value rotation Rv (values stored as v @ Rv^T), if VALUE_ROT
    pout_ptr,  # [B, Hk, NS, BLOCK_M, DP] fp32 split partial outputs, if SPLIT
    plse_ptr,  # [B, Hk, NS, BLOCK_M] fp32 split log2-sum-exp, if SPLIT
    pk_ptr, s_pkb, s_pkh, s_pkp,  # [B, Hk, P, D] fp16/bf16/fp32 exact prefix keys, if HAS_PREFIX
    pv_ptr, s_pvb, s_pvh, s_pvp,  # [B, Hk, P, D] fp16/bf16/fp32 exact prefix values, if HAS_PREFIX
    prefix_len,  # P: positions kv_start + s, s < P, are read from the prefix buffers
    rk_ptr, s_rkb, s_rkh, s_rkp,  # [B, Hk, W, D] exact recent keys (ring: position j at slot j % W), if HAS_RECENT
    rv_ptr, s_rvb, s_rvh, s_rvp,  # [B, Hk, W, D] exact recent values, if HAS_RECENT
    recent_size, recent_from,  # W; positions [max(recent_from, seq_len - W), seq_len) are read from the ring
    Lq, num_splits, sm_scale, softcap, window, block_bytes, plane_bytes,
    D: tl.constexpr, DP: tl.constexpr, DHP: tl.constexpr, GP: tl.constexpr, G: tl.constexpr,
    T: tl.constexpr, KB: tl.constexpr, VB: tl.constexpr, META: tl.constexpr,
    KEY_BITS: tl.constexpr, VALUE_BITS: tl.constexpr, NC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, QP: tl.constexpr,  # QP: next_pow2(D / 4), 16-bit value words per token
    VALUE_WORDS: tl.constexpr,  # 4-bit values read as 16-bit words into 4 accumulators (else bytes into 2)
    HAS_KV_START: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, SPLIT: tl.constexpr, HAS_KEY_OFFSET: tl.constexpr, VALUE_ROT: tl.constexpr,
    HAS_PREFIX: tl.constexpr, PP: tl.constexpr, HAS_RECENT: tl.constexpr, RN: tl.constexpr,
    EXACT_ACC: tl.constexpr,  # VALUE_ROT and (HAS_PREFIX or HAS_RECENT): exact values accumulate unrotated
    EXACT_16: tl.constexpr,  # the query and the exact buffers share a 16-bit dtype (_exact_tile's dots)
    RK: tl.constexpr,  # input coordinates per step of the prologue's 4-bit query rotation
    EXACT_PROG: tl.constexpr,  # SPLIT with exact prefix/ring: one more split program attends them (in parallel)
    KEY_LUT: tl.constexpr, LUT_LO: tl.constexpr, LUT_HI: tl.constexpr,  # codebook keys by key_lut.py's asm (else gathered)
    KEY_WORDS: tl.constexpr,  # 4-bit keys by the lookup as 16-bit code words (4 dots over coordinate sets)
    KEY_UNIT: tl.constexpr,  # the scores' factor: the word asm's subnormal byte magnitudes -> centroids (else 1)
    KEY_PLANES: tl.constexpr,  # 3-bit keys as 8 code planes of D/8 coordinates (D/8 a power of two >= 16)
    VALUE_PTX: tl.constexpr,  # VALUE_WORDS / VALUE_PLANES decoded by value_nibbles.py's asm (else Triton integer ops)
    VALUE_PLANES: tl.constexpr,  # 3-bit values as a 2-bit plane and a bit plane (layout.value_planes): 4 accumulators
    META_PAIRS: tl.constexpr,  # per-token metadata loaded as 32-bit token pairs (_meta_pairs), prefetched a tile ahead
    META_WORDS: tl.constexpr,  # (else) each token's metadata from its pair's 32-bit word (_load_meta), prefetched too
    VMID_CHAIN: tl.constexpr,  # v_mid's load joins the value MMA operand's chain, so the pipeliner prefetches it
    BT_NEXT: tl.constexpr,  # the unmasked walk loads the next tile's block-table entries an iteration ahead
    POOL32: tl.constexpr,  # the pool has < 2**31 bytes: its addresses are int32 offsets (else int64)
    HADAMARD: tl.constexpr,  # rotation="hadamard": the query's (and bit-stream values' output) rotation without reading R (Rv)
    HP: tl.constexpr,  # KV heads per program: 2 (4) put their query rows in one MMA tile, BLOCK_M/HP rows apart
):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    ns_all = num_splits + EXACT_PROG  # split programs per row tile: the pool's splits (+ the exact one)
    m_tile = pid // ns_all
    split = pid % ns_all

    # ---- rows of this program: (query i, group member g) pairs --------------------------------
    RH: tl.constexpr = BLOCK_M // HP  # rows per KV head
    if HP == 1:
        sub = 0
        rr = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
        hh = h
    else:
        lr = tl.arange(0, BLOCK_M)
        sub = lr // RH  # which of the program's heads (a function of the register: selections by it fold)
        rr = m_tile * RH + lr % RH  # the row within its head's rows (one row tile: m_tile 0)
        hh = h * HP + sub  # the row's KV head
    qi = rr // G
    qg = rr % G
    row_ok = qi < Lq
    qhead = hh * G + qg
    seq_len = tl.load(seq_ptr + b).to(tl.int32)
    qpos = seq_len - Lq + qi
    i_first = (m_tile * RH) // G
    i_last = tl.minimum((m_tile * RH + RH - 1) // G, Lq - 1)
    kv_hi = tl.maximum(seq_len - Lq + i_last + 1, 0)
    kv_first = 0  # first real position
    if HAS_KV_START:
        kv_first = tl.load(kvs_ptr + b).to(tl.int32)
    pool_first = kv_first  # first position read from the pool
    if HAS_PREFIX:
        pool_first = kv_first + prefix_len
    pool_hi = kv_hi  # one past the last position read from the pool (or the prefix)
    if HAS_RECENT:
        ring_lo = tl.maximum(recent_from, seq_len - recent_size)  # the ring wins over prefix and pool
        pool_hi = tl.minimum(kv_hi, ring_lo)
    kv_lo = tl.maximum(pool_first, 0)
    win_lo = 0  # first position any row of this tile may see through the window
    if HAS_WINDOW:
        win_lo = seq_len - Lq + i_first - window + 1
        kv_lo = tl.maximum(kv_lo, win_lo)
    kv_lo = (kv_lo // BLOCK_N) * BLOCK_N
    n_tiles = tl.maximum(tl.cdiv(pool_hi - kv_lo, BLOCK_N), 0)
    per_split = tl.cdiv(n_tiles, num_splits)
    start = kv_lo + split * per_split * BLOCK_N
    end = tl.minimum(start + per_split * BLOCK_N, pool_hi)
    if EXACT_PROG:  # the last program attends only the exact prefix and ring, alongside the pool's splits
        end = tl.where(split == num_splits, start, end)
    exact_split_first = num_splits if EXACT_PROG else 0  # the split that attends the exact prefix
    exact_split_last = num_splits if EXACT_PROG else num_splits - 1  # the split that walks the ring

    # ---- prologue: load and rotate the queries, normalise each row's range for fp16 ----------
    dc = tl.arange(0, DP)
    hc = tl.arange(0, DHP)
    PLANE_WORDS: tl.constexpr = VALUE_PLANES and BLOCK_M <= 32  # 4 accumulators (else 2, _value_plane_bytes)
    VW: tl.constexpr = QP if (VALUE_WORDS or PLANE_WORDS) else DHP  # columns of each value accumulator
    vcol = tl.arange(0, VW)
    V_N: tl.constexpr = D // 4 if (VALUE_WORDS or PLANE_WORDS) else D // 2  # real ones
    q_row = q_ptr + b.to(tl.int64) * s_qb + qhead.to(tl.int64) * s_qh + qi.to(tl.int64) * s_ql
    q = tl.load(q_row[:, None] + dc[None, :], mask=row_ok[:, None] & (dc[None, :] < D), other=0.0).to(tl.float32)
    q_mu = 0.0  # placeholders of what only some variants compute (the walk's helper takes them all)
    q_lo = 0.0
    q_hi = 0.0
    q16 = 0.0
    qp = 0.0
    table = 0.0
    if HAS_KEY_OFFSET:  # key_centering: q . (k_hat + mu) = q . k_hat + q . mu, the latter once per row
        if HP == 1:
            mu = tl.load(koff_ptr + b.to(tl.int64) * s_koff + h * D + dc, mask=dc < D, other=0.0)[None, :]
        else:  # each row its KV head's mean
            mu = tl.load(koff_ptr + b.to(tl.int64) * s_koff + (hh * D)[:, None] + dc[None, :], mask=dc[None, :] < D,
                         other=0.0)
        q_mu = tl.sum(q * mu, axis=1) * sm_scale
    if KEY_BITS == 4:
        if HADAMARD:  # R not read
            q_lo, q_hi = _hadamard_query(q_row, row_ok, rot_ptr, hc, D, BLOCK_M)
        else:
            # q @ R^T over RK input coordinates at a time: [RK, D/2] rotation tiles instead of [D, D/2]
            # ones, which held ~128 registers per thread through the prologue (spilled under maxnreg)
            q_lo = tl.zeros((BLOCK_M, DHP), tl.float32)
            q_hi = tl.zeros((BLOCK_M, DHP), tl.float32)
            for k0 in range(0, D, RK):
                kk = k0 + tl.arange(0, RK)
                qc = tl.load(q_row[:, None] + kk[None, :], mask=row_ok[:, None] & (kk[None, :] < D), other=0.0)
                rmask = (kk[:, None] < D) & (hc[None, :] < D // 2)
                r_lo = tl.load(rot_ptr + hc[None, :] * D + kk[:, None], mask=rmask, other=0.0)
                r_hi = tl.load(rot_ptr + (hc[None, :] + D // 2) * D + kk[:, None], mask=rmask, other=0.0)
                q_lo = tl.dot(qc.to(tl.float32), r_lo, q_lo, input_precision="tf32x3")
                q_hi = tl.dot(qc.to(tl.float32), r_hi, q_hi, input_precision="tf32x3")
        qmax = tl.maximum(tl.max(tl.abs(q_lo), axis=1), tl.max(tl.abs(q_hi), axis=1))
        qdiv = tl.where(qmax > 0, qmax, 1.0)[:, None]
        q_lo = (q_lo / qdiv).to(tl.float16)
        q_hi = (q_hi / qdiv).to(tl.float16)
        if KEY_WORDS:  # coordinates 2w, 2w + 1, D/2 + 2w, D/2 + 2w + 1 of word w
            q0, q1 = tl.split(tl.reshape(q_lo, (BLOCK_M, DHP // 2, 2)))
            q2, q3 = tl.split(tl.reshape(q_hi, (BLOCK_M, DHP // 2, 2)))
            if HP == 1:
                qp = (q0, q1, q2, q3)
            else:  # head j's dots see only its rows
                qp = ()
                for j in tl.static_range(HP):
                    sel = sub[:, None] == j
                    qp = qp + (tl.where(sel, q0, 0.0), tl.where(sel, q1, 0.0), tl.where(sel, q2, 0.0), tl.where(sel, q3, 0.0))
    elif KEY_BITS == 3 and KEY_PLANES:
        # the rotated query's coordinates of each key tile's rows (_pool_tile), 0 for the rows that hold no code:
        # D = 128, six 32-row windows of the 16-byte planes; D = 256, the 8 code planes (coordinates c * 32 + j)
        r32 = tl.arange(0, 32)
        qp = ()
        qmax = tl.zeros((BLOCK_M,), tl.float32)
        if HADAMARD:
            q_unit, q_scale = hadamard_input(q, rot_ptr, dc, D)
        for w in tl.static_range(6 if D == 128 else 8):
            if D != 128:
                coord = w * 32 + r32
                ok_r = r32 < 32
            elif w < 2:  # window X, bytes 0..31: nibble w of planes 0 (rows 0..15) and 1 (rows 16..31)
                coord = (w + 2 * (r32 // 16)) * 16 + r32 % 16
                ok_r = r32 < 32
            else:  # codes 4, 5 (window Z, plane 2) and 6, 7 (window E, the spare bits): rows 0..15
                coord = (w + 2) * 16 + r32 % 16
                ok_r = r32 < 16
            if HADAMARD:  # (q * s) @ H[:, coord] / sqrt(D), H built in registers (hadamard_dot)
                q_w = hadamard_dot(q_unit, dc, coord, ok_r, tl.zeros((BLOCK_M, 32), tl.float32)) * q_scale
            else:
                r_w = tl.load(rot_ptr + coord[None, :] * D + dc[:, None], mask=(dc[:, None] < D) & ok_r[None, :], other=0.0)
                q_w = tl.dot(q, r_w, input_precision="tf32x3")
            qmax = tl.maximum(qmax, tl.max(tl.abs(q_w), axis=1))
            qp = qp + (q_w,)
        qdiv = tl.where(qmax > 0, qmax, 1.0)[:, None]
        qh = ()
        for w in tl.static_range(6 if D == 128 else 8):
            qh = qh + ((qp[w] / qdiv).to(tl.float16),)
        qp = qh
    else:
        q_key = q  # the query in the keys' space
        if KEY_BITS == 3 and HADAMARD:  # (q * s) @ H / sqrt(D), H built in registers
            q_unit, q_scale = hadamard_input(q, rot_ptr, dc, D)
            q_key = hadamard_dot(q_unit, dc, dc, dc < D, tl.zeros((BLOCK_M, DP), tl.float32)) * q_scale
        elif KEY_BITS == 3:
            q_key = matmul_square(q, rot_ptr, D, DP, True)  # q @ R^T
        qmax = tl.max(tl.abs(q_key), axis=1)
        qdiv = tl.where(qmax > 0, qmax, 1.0)[:, None]
        q16 = (q_key / qdiv).to(tl.float16)
    row_scale = tl.where(qmax > 0, qmax, 1.0) * (sm_scale * KEY_UNIT)  # KEY_UNIT: the code words' byte magnitudes
    row_off = 0.0  # added to every compressed-walk logit (no softcap): q . mu in log2 units
    if not HAS_SOFTCAP:  # the compressed walk's logits come out in log2 units directly
        row_scale = row_scale * 1.4426950408889634
        if HAS_KEY_OFFSET:
            row_off = q_mu * 1.4426950408889634
    if not KEY_LUT and (KEY_BITS == 3 or KEY_BITS == 4):
        nc = tl.arange(0, NC)
        table = tl.broadcast_to(tl.load(cent_ptr + nc).to(tl.float16)[None, :], (BLOCK_N, NC))

    # ---- online softmax state ------------------------------------------------------------------
    m_i = tl.full((BLOCK_M,), -float("inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    if HAS_SINKS:
        sink = tl.load(sink_ptr + qhead, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        first = split == 0
        m_i = tl.where(first, sink, m_i)
        l_i = tl.where(first, 1.0, l_i)
    # 4-bit values: acc_j accumulates coordinates _value_col(vcol, j) (4 accumulators from words, 2 from
    # bytes) in the codes' fp16 scale (words: x 2**-24, odd j 2**-20; bytes: odd j 16 x); 3-bit value
    # planes: 4 accumulators, x 2**-24; the 3-bit bit stream: acc0 all D
    FOUR_ACC: tl.constexpr = VALUE_WORDS or PLANE_WORDS
    acc0 = tl.zeros((BLOCK_M, VW if (VALUE_BITS == 4 or VALUE_PLANES) else DP), tl.float32)
    acc1 = tl.zeros((BLOCK_M, VW if (VALUE_BITS == 4 or VALUE_PLANES) else 16), tl.float32)
    acc2 = tl.zeros((BLOCK_M, VW if FOUR_ACC else 16), tl.float32)
    acc3 = tl.zeros((BLOCK_M, VW if FOUR_ACC else 16), tl.float32)
    bias_acc = tl.zeros((BLOCK_M,), tl.float32)
    HALF: tl.constexpr = ((1 << VALUE_BITS) - 1) / 2

    pk_row = pk_ptr + b.to(tl.int64) * s_pkb + (h * HP).to(tl.int64) * s_pkh
    pv_row = pv_ptr + b.to(tl.int64) * s_pvb + (h * HP).to(tl.int64) * s_pvh
    if POOL32:  # the pool has < 2**31 bytes: addresses as int32 offsets from pool_ptr (fewer 64-bit ops per tile)
        head_off = h * HP * plane_bytes
    else:
        head_off = (h * HP).to(tl.int64) * plane_bytes
    bt_row = bt_ptr + b.to(tl.int64) * s_bt
    # the walk: whole tiles every row sees, without masks; then the masked ones: a first tile with
    # positions before the pool's first one (exact prefix, left padding) and the last tiles (the
    # walk's end, the causal boundary of the tile's rows); with a sliding window every tile is masked
    qpos_lo = seq_len - Lq + i_first  # the first row's position: rows see positions <= it at least
    head_end = start
    if HAS_KV_START or HAS_PREFIX:
        head_end = tl.where(start < pool_first, tl.minimum(start + BLOCK_N, end), start)
    body_end = head_end
    if not HAS_WINDOW:
        body_end = head_end + tl.maximum(tl.minimum(end, qpos_lo + 1) - head_end, 0) // BLOCK_N * BLOCK_N
    n_head = tl.cdiv(head_end - start, BLOCK_N)  # 0 or 1
    if BT_NEXT:  # each tile's block-table entries loaded an iteration ahead: its code loads are direct
        tn = tl.arange(0, BLOCK_N)
        blk_n = tl.load(bt_row + (head_end + tn) // T, mask=head_end + tn < body_end, other=0)
    for t0 in range(head_end, body_end, BLOCK_N):
        blk_c = None  # _pool_tile loads them
        if BT_NEXT:
            blk_c = blk_n
            blk_n = tl.load(bt_row + (t0 + BLOCK_N + tn) // T, mask=t0 + BLOCK_N + tn < body_end, other=0)
        m_i, l_i, acc0, acc1, acc2, acc3, bias_acc = _pool_tile(
            t0, end, pool_first, qpos, window, softcap, m_i, l_i, acc0, acc1, acc2, acc3, bias_acc,
            bt_row, blk_c, pool_ptr, block_bytes, head_off, sub, plane_bytes, q_lo, q_hi, q16, qp, table, row_scale, row_off, q_mu, hc, dc,
            vcol, HALF, V_N, HP, D, GP, T, KB, VB, META, KEY_BITS, VALUE_BITS, BLOCK_M, BLOCK_N, HAS_KV_START, HAS_PREFIX,
            HAS_WINDOW, HAS_SOFTCAP, HAS_KEY_OFFSET, KEY_LUT, LUT_LO, LUT_HI, KEY_PLANES, KEY_WORDS, VALUE_WORDS, VALUE_PLANES,
            PLANE_WORDS, VALUE_PTX, META_PAIRS, META_WORDS, VMID_CHAIN, False)
    for i in range(0, n_head + tl.cdiv(end - body_end, BLOCK_N)):
        t0 = tl.where(i < n_head, start, body_end + (i - n_head) * BLOCK_N)
        m_i, l_i, acc0, acc1, acc2, acc3, bias_acc = _pool_tile(
            t0, end, pool_first, qpos, window, softcap, m_i, l_i, acc0, acc1, acc2, acc3, bias_acc,
            bt_row, None, pool_ptr, block_bytes, head_off, sub, plane_bytes, q_lo, q_hi, q16, qp, table, row_scale, row_off, q_mu, hc, dc, vcol,
            HALF, V_N, HP, D, GP, T, KB, VB, META, KEY_BITS, VALUE_BITS, BLOCK_M, BLOCK_N, HAS_KV_START, HAS_PREFIX,
            HAS_WINDOW, HAS_SOFTCAP, HAS_KEY_OFFSET, KEY_LUT, LUT_LO, LUT_HI, KEY_PLANES, KEY_WORDS, VALUE_WORDS, VALUE_PLANES, PLANE_WORDS, VALUE_PTX,
            META_PAIRS, META_WORDS, VMID_CHAIN, True)

    # ---- exact tiles, after the walk (none of their state is live through it) ----------------
    acc_x = tl.zeros((BLOCK_M, DP if EXACT_ACC else 16), tl.float32)
    if HAS_PREFIX or HAS_RECENT:
        # the unrotated query, reloaded rather than kept live through the walk (16 registers per thread)
        q = tl.load(q_row[:, None] + dc[None, :], mask=row_ok[:, None] & (dc[None, :] < D), other=0.0).to(tl.float32)
    # the exact prefix: one dense tile of original keys/values
    if HAS_PREFIX:
        if split == exact_split_first:
            pc = tl.arange(0, PP)
            m_i, l_i, acc0, acc1, acc2, acc3, acc_x, bias_acc = _exact_tile(
                q, m_i, l_i, acc0, acc1, acc2, acc3, acc_x, bias_acc, pk_row, s_pkh, s_pkp, pv_row, s_pvh, s_pvp,
                pc, kv_first + pc, (pc < prefix_len) & (kv_first + pc < pool_hi), qpos, window, sm_scale, softcap,
                dc, vcol, sub, HP, EXACT_16, D, VALUE_BITS, VALUE_WORDS, VALUE_PLANES, PLANE_WORDS, VALUE_ROT, HAS_WINDOW, HAS_SOFTCAP)
    # the recent window: the last split walks the ring's positions in dense tiles
    if HAS_RECENT:
        if split == exact_split_last:
            ring_first = tl.maximum(tl.maximum(ring_lo, kv_first), win_lo)
            k_ring = rk_ptr + b.to(tl.int64) * s_rkb + (h * HP).to(tl.int64) * s_rkh
            v_ring = rv_ptr + b.to(tl.int64) * s_rvb + (h * HP).to(tl.int64) * s_rvh
            for j0 in range(ring_first, kv_hi, RN):  # at most W positions
                rpos = j0 + tl.arange(0, RN)
                r_ok = rpos < kv_hi
                m_i, l_i, acc0, acc1, acc2, acc3, acc_x, bias_acc = _exact_tile(
                    q, m_i, l_i, acc0, acc1, acc2, acc3, acc_x, bias_acc, k_ring, s_rkh, s_rkp, v_ring, s_rvh, s_rvp,
                    rpos % recent_size, rpos, r_ok, qpos, window, sm_scale, softcap, dc, vcol, sub, HP, EXACT_16,
                    D, VALUE_BITS, VALUE_WORDS, VALUE_PLANES, PLANE_WORDS, VALUE_ROT, HAS_WINDOW, HAS_SOFTCAP)

    # ---- epilogue -----------------------------------------------------------------------------
    has = l_i > 0
    inv_l = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
    bias_out = bias_acc * inv_l
    if SPLIT:
        if HP == 1:
            prow = ((b * tl.num_programs(1) + h) * ns_all + split) * BLOCK_M + tl.arange(0, BLOCK_M)
        else:  # per KV head: RH rows
            prow = ((b * (tl.num_programs(1) * HP) + hh) * ns_all + split) * RH + rr
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), -float("inf"))
        tl.store(plse_ptr + prow, lse)
        dst = pout_ptr + prow.to(tl.int64)[:, None] * DP
    else:
        dst = o_ptr + b.to(tl.int64) * s_ob + qhead.to(tl.int64)[:, None] * s_oh + qi.to(tl.int64)[:, None] * s_ol
    if VALUE_BITS == 4 or VALUE_PLANES:
        inv_lo = inv_l * (16777216.0 if FOUR_ACC else 1.0)  # back from the codes' fp16 scale (acc0..3 above)
        inv_hi = inv_l * (1048576.0 if VALUE_WORDS else (16777216.0 if PLANE_WORDS else (1.0 if VALUE_PLANES else 0.0625)))
        out0 = acc0 * inv_lo[:, None] + bias_out[:, None]
        out1 = acc1 * inv_hi[:, None] + bias_out[:, None]
        if FOUR_ACC:
            out2 = acc2 * inv_lo[:, None] + bias_out[:, None]
            out3 = acc3 * inv_hi[:, None] + bias_out[:, None]
        # (here Rv is read: with it built in registers the H200 measured 4bit+opts 1-2.5% and k3v4+opts up to
        # 64% slower, gpu_checks/session12/call5)
        if VALUE_ROT:  # back from the rotated value space: out @ Rv, over the rows of each accumulator's coordinates
            rmask = (vcol[:, None] < V_N) & (dc[None, :] < D)
            rv = vrot_ptr + dc[None, :]
            out = tl.dot(out0, tl.load(rv + _value_col(vcol, 0, D, VALUE_WORDS, PLANE_WORDS)[:, None] * D, mask=rmask, other=0.0),
                         input_precision="tf32x3")
            out = tl.dot(out1, tl.load(rv + _value_col(vcol, 1, D, VALUE_WORDS, PLANE_WORDS)[:, None] * D, mask=rmask, other=0.0),
                         out, input_precision="tf32x3")
            if FOUR_ACC:
                out = tl.dot(out2, tl.load(rv + _value_col(vcol, 2, D, VALUE_WORDS, PLANE_WORDS)[:, None] * D, mask=rmask, other=0.0),
                             out, input_precision="tf32x3")
                out = tl.dot(out3, tl.load(rv + _value_col(vcol, 3, D, VALUE_WORDS, PLANE_WORDS)[:, None] * D, mask=rmask, other=0.0),
                             out, input_precision="tf32x3")
            if EXACT_ACC:
                out = out + acc_x * inv_l[:, None]
            store_rounded(dst + dc[None, :], out, row_ok[:, None] & (dc[None, :] < D))
        else:
            om = row_ok[:, None] & (vcol[None, :] < V_N)
            store_rounded(dst + _value_col(vcol, 0, D, VALUE_WORDS, PLANE_WORDS)[None, :], out0, om)
            store_rounded(dst + _value_col(vcol, 1, D, VALUE_WORDS, PLANE_WORDS)[None, :], out1, om)
            if FOUR_ACC:
                store_rounded(dst + _value_col(vcol, 2, D, VALUE_WORDS, PLANE_WORDS)[None, :], out2, om)
                store_rounded(dst + _value_col(vcol, 3, D, VALUE_WORDS, PLANE_WORDS)[None, :], out3, om)
    else:
        out = acc0 * inv_l[:, None] + bias_out[:, None]
        if VALUE_ROT and HADAMARD:  # out @ Rv = (out @ H) * s / sqrt(D) (H200, 9/3/64 B=1, with the query's: 3bit+opts 0.0312 -> 0.0267 ms, plain 0.0264 -> 0.0250)
            n = row_norm(out)[:, None]
            out = hadamard_dot(out / n, dc, dc, dc < D, tl.zeros((BLOCK_M, DP), tl.float32))
            out = out * (n * (1.0 / tl.sqrt(D * 1.0))) * hadamard_signs(vrot_ptr, dc, D)[None, :]
            if EXACT_ACC:
                out = out + acc_x * inv_l[:, None]
        elif VALUE_ROT:
            out = matmul_square(out, vrot_ptr, D, DP, False)  # out @ Rv
            if EXACT_ACC:
                out = out + acc_x * inv_l[:, None]
        store_rounded(dst + dc[None, :], out, row_ok[:, None] & (dc[None, :] < D))


# ---- launcher ----------------------------------------------------------------------------------
# (constants, block_n, num_stages) -> the (block_n, num_stages, RN) that fits this GPU's shared memory
_FITTED: dict[tuple, tuple[int, int, int]] = {}


def _step_downs(block_n: int, num_stages: int, ring_n: int | None) -> list[tuple[int, int, int | None]]:
    """Variants to try, in order: fewer pipeline stages, then shorter KV tiles; with a recent-window
    ring, each of those with shorter ring tiles too (the ring tile does not shrink with the KV
    tile: a 64-row prefill tile with a 64-token ring once needed 256 KiB on the H200)."""
    tiles = [(block_n, num_stages), (block_n, 1), (max(16, block_n // 2), 1), (max(16, block_n // 4), 1)]
    rings = [ring_n] if ring_n is None else sorted({ring_n, max(16, ring_n // 2), max(16, ring_n // 4)}, reverse=True)
    out = []
    for rn in rings:
        out += [(bn, st, rn) for bn, st in tiles if (bn, st, rn) not in out]
    return out


def _launch(grid: tuple, args: tuple, constants: dict, block_n: int, num_stages: int, kernel=None) -> LaunchSite:
    """Launch, stepping down (_step_downs) when a variant needs more shared memory than the GPU has
    (e.g. 3-bit codes with dense exact tiles at head_dim 128). The failure is raised before
    anything is enqueued, so a retry is safe, also under CUDA-graph capture; the variant that fits
    is remembered, so later calls launch once. Returns the launch site of the variant that ran."""
    kernel = kernel or _attn_kernel
    key = (kernel, tuple(constants.items()), block_n, num_stages)  # one dict literal: a fixed order
    ring_n = constants["RN"] if constants.get("HAS_RECENT") else None
    tries = [_FITTED[key]] if key in _FITTED else _step_downs(block_n, num_stages, ring_n)
    for i, (bn, stages, rn) in enumerate(tries):
        variant = dict(constants if rn is None else {**constants, "RN": rn}, BLOCK_N=bn, num_stages=stages)
        try:
            compiled = kernel[grid](*args, **variant)
        except triton.runtime.errors.OutOfResources:
            if i == len(tries) - 1:
                raise
            continue
        _FITTED[key] = (bn, stages, rn)
        site = LaunchSite(kernel, grid, variant)
        site.adopt(compiled, len(args))
        return site


_WORKSPACES: dict[str, torch.Tensor] = {}
_PARTIALS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # views of the current workspaces


def split_workspace(device: torch.device, numel: int) -> torch.Tensor:
    """A persistent fp32 scratch buffer of at least `numel` elements for split partials.

    Shared by every layer and step on the device; it grows (never shrinks) to a power of two,
    so after the first call of a given shape no allocation happens (CUDA-graph friendly).
    """
    key = str(device)
    buf = _WORKSPACES.get(key)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(next_pow2(numel), dtype=torch.float32, device=device)
        _WORKSPACES[key] = buf
        for k in [k for k in _PARTIALS if k[0] == key]:  # views of the replaced buffer
            del _PARTIALS[k]
    return buf


def split_partials(device: torch.device, pout_numel: int, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial outputs, log-sum-exps): elements [0, pout_numel) and [pout_numel, numel) of the
    persistent workspace, as views kept while it stands (a decode step slices nothing)."""
    key = (str(device), pout_numel, numel)
    views = _PARTIALS.get(key)
    if views is None:
        buf = split_workspace(device, numel)
        views = _PARTIALS[key] = (buf[:pout_numel], buf[pout_numel:numel])
    return views


def check_workspace(workspace: torch.Tensor | None, numel: int, device: torch.device) -> None:
    """A caller's split scratch buffer must be fp32 on the pool's device with room for `numel` elements."""
    if workspace is not None and (workspace.dtype != torch.float32 or workspace.device != device
                                  or workspace.numel() < numel):
        raise ValueError(f"workspace must be float32 on {device} with >= {numel} elements")


def _prefix_args(t: torch.Tensor | None, placeholder: torch.Tensor) -> tuple:
    """(pointer, row, head, position strides) of a prefix or ring buffer; a device placeholder when absent."""
    if t is None:
        return placeholder, 0, 0, 0
    return t, t.stride(0), t.stride(1), t.stride(2)


def _runs_ptx(device: torch.device) -> bool:
    """Whether launches on `device` compile to PTX (inline asm): not in the interpreter, also when it
    emulates the GPU's launch choices; patched by eval.compile_check to compile those variants."""
    return device.type == "cuda"


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    if _tuned_for_gpu(device):
        return 132  # an H200's count, for the interpreter emulating GPU launches
    return 4  # interpreter: a few splits, so the split path is exercised cheaply


def _check_attention_inputs(query, pool, layout, block_table, seq_lens, kv_start, sinks, out, scale, sliding_window, softcap):
    check_layout_pool(pool, layout)
    dev = pool.device
    check_tensor("query", query, dim=4, dtypes=ACTIVATION_DTYPES, device=dev)
    b, hq, lq, d = query.shape
    if d != layout.head_dim:
        raise ValueError(f"query head_dim {d} does not match the layout's head_dim {layout.head_dim}")
    if query.stride(-1) != 1:
        raise ValueError("query must be contiguous in its last (head_dim) dimension")
    hk = layout.num_kv_heads
    if hq % hk:
        raise ValueError(f"query heads ({hq}) must be a multiple of the pool's KV heads ({hk})")
    if lq < 1 or b < 1:
        raise ValueError(f"query must have at least one row and one position, got shape {list(query.shape)}")
    check_tensor("block_table", block_table, dim=2, dtypes=(torch.int32, torch.int64), device=dev)
    if block_table.shape[0] != b or block_table.stride(1) != 1:
        raise ValueError(f"block_table must be [{b}, max_blocks] with contiguous rows, got {list(block_table.shape)}")
    check_tensor("seq_lens", seq_lens, dim=1, dtypes=(torch.int32, torch.int64), device=dev)
    if seq_lens.shape[0] != b:
        raise ValueError(f"seq_lens must be [{b}], got {list(seq_lens.shape)}")
    if kv_start is not None:
        check_tensor("kv_start", kv_start, dim=1, dtypes=(torch.int32, torch.int64), device=dev)
        if kv_start.shape[0] != b:
            raise ValueError(f"kv_start must be [{b}], got {list(kv_start.shape)}")
    if sinks is not None:
        check_tensor("sinks", sinks, dim=1, dtypes=ACTIVATION_DTYPES, device=dev)
        if sinks.shape[0] != hq:
            raise ValueError(f"sinks must be [{hq}] (one logit per query head), got {list(sinks.shape)}")
    if out is not None:
        check_tensor("out", out, dim=4, dtypes=(query.dtype,), device=dev)
        if out.shape != query.shape or out.stride(-1) != 1:
            raise ValueError(f"out must be {list(query.shape)} with a contiguous last dimension, got {list(out.shape)}")
    if not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise TypeError(f"scale must be a finite Python float, got {scale!r}")
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
    if softcap is not None and (not isinstance(softcap, (int, float)) or not softcap > 0):
        raise ValueError(f"softcap must be a positive float or None, got {softcap!r}")


def _check_exact_buffers(kind: str, keys, values, limit: int, option: str, letter: str, slot_word: str,
                         layout: BlockLayout, batch: int, device) -> int:
    """Validate a pair of dense exact-token buffers [B, Hk, N, D] ("prefix" or "recent"); return N (0: none)."""
    k_name, v_name = f"{kind}_keys", f"{kind}_values"
    if (keys is None) != (values is None):
        raise ValueError(f"{k_name} and {v_name} ({option}) must be given together, or neither")
    if keys is None:
        return 0
    expected = f"[{batch}, {layout.num_kv_heads}, {letter}, {layout.head_dim}] with 1 <= {letter} <= {limit}"
    for name, t in ((k_name, keys), (v_name, values)):
        check_tensor(name, t, dim=4, dtypes=ACTIVATION_DTYPES, device=device)
        b, hk, n, d = t.shape
        if (b, hk, d) != (batch, layout.num_kv_heads, layout.head_dim) or not 1 <= n <= limit:
            raise ValueError(f"{name} must be {expected} (rows, KV heads, {slot_word}, head_dim), got {list(t.shape)}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last (head_dim) dimension")
    if keys.shape != values.shape:
        raise ValueError(f"{k_name} {list(keys.shape)} and {v_name} {list(values.shape)} must have the same shape")
    return keys.shape[2]


def _check_prefix(prefix_keys, prefix_values, layout: BlockLayout, batch: int, device) -> int:
    """Validate the exact_prefix_tokens buffers; return P (0 when neither is given)."""
    return _check_exact_buffers("prefix", prefix_keys, prefix_values, MAX_EXACT_PREFIX, "exact_prefix_tokens", "P",
                                "prefix tokens", layout, batch, device)


def _check_recent(recent_keys, recent_values, layout: BlockLayout, batch: int, device) -> int:
    """Validate the recent_window ring buffers; return W (0 when neither is given)."""
    return _check_exact_buffers("recent", recent_keys, recent_values, MAX_RECENT_WINDOW, "recent_window", "W",
                                "ring slots", layout, batch, device)


def unified_attention(
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
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    workspace: torch.Tensor | None = None,
    tuning: dict | None = None,
    key_offset: torch.Tensor | None = None,
    prefix_keys: torch.Tensor | None = None,
    prefix_values: torch.Tensor | None = None,
    recent_keys: torch.Tensor | None = None,
    recent_values: torch.Tensor | None = None,
    recent_from: int = 0,
) -> torch.Tensor:
    """Attention of query [B, Hq, Lq, D] over the compressed pool (see reference.paged_attention).

    key_offset: the key_centering mean the keys were stored with (keys read as k_hat + mu), [Hk, D]
    shared or [B, Hk, D] per row;
    value_rotation comes from the layout's config (the output is rotated back once per row).
    prefix_keys/prefix_values: [B, Hk, P, D] exact original keys/values (exact_prefix_tokens) read
    instead of the pool at positions kv_start[b] + s, s < P (reference.overlay_prefix).
    recent_keys/recent_values: [B, Hk, W, D] ring of exact recent keys/values (recent_window),
    position j at slot j % W, read instead of the pool and the prefix for positions
    [max(recent_from, seq_lens[b] - W), seq_lens[b]) (reference.overlay_recent). recent_from is a
    host int (a kernel argument: no sync, captured as is by a CUDA graph).

    max_seq_len: host-side bound on seq_lens; picks the decode kernel and sizes its split count without a device
    sync (default: the block table's capacity). num_splits: override the split-KV heuristic.
    workspace: optional fp32 scratch for split partials (default: a persistent per-device one).
    tuning: overrides of the launch heuristics for benchmarks ({"block_m", "block_n", "num_warps", "num_stages",
    "maxnreg" (register cap per thread, None: none), "key_lut" (False: gather 4-bit centroids),
    "value_words" (4-bit value codes as 16-bit words into 4 accumulators, else bytes into 2),
    "exact_program" (split decode: attend the exact prefix/ring in a program of their own),
    "meta_pairs" (per-token metadata loaded as 32-bit words of two tokens),
    "meta_words" (else each token's metadata from its pair's 32-bit word), "vmid_chain" (v_mid's load made
    one the pipeliner prefetches), "bt_next" (the walk's block-table entries loaded an iteration ahead),
    "pool32" (False: int64 pool addresses, as pools of >= 2**31 bytes take), "key_words" (4-bit keys as 16-bit
    code words), "head_pairs" (KV heads per decode program: 1, 2 or 4), "ring_n" (recent-window tile, tokens),
    "warp_split" (decode_warps.py's one-warp programs: True/False; "block_n", "num_stages", "maxnreg" apply to it
    too)}).
    Returns `out` (allocated if None) in query's dtype.
    """
    plan = _plan_for(query, pool, layout, block_table, seq_lens, kv_start, sinks, out, key_offset, prefix_keys,
                     prefix_values, recent_keys, recent_values, workspace, scale, sliding_window, softcap,
                     max_seq_len, num_splits, tuning)
    if type(recent_from) is not int or recent_from < 0:
        raise ValueError(f"recent_from must be an int >= 0 (the first position the ring may serve), got {recent_from!r}")
    if out is None:
        out = torch.empty_like(query)
    if key_offset is not None:
        key_offset = key_offset.float().contiguous()
    cent = plan.cent
    pout = plse = cent  # placeholders when not splitting
    if plan.split:
        if workspace is None:
            pout, plse = split_partials(pool.device, plan.partial_rows * plan.dp, plan.workspace_numel)
        else:
            pout = workspace[: plan.partial_rows * plan.dp]
            plse = workspace[plan.partial_rows * plan.dp : plan.workspace_numel]
    args = (
        query, *query.stride()[:3], out, *out.stride()[:3],
        pool, block_table, block_table.stride(0), seq_lens,
        kv_start if kv_start is not None else seq_lens,
        sinks if sinks is not None else cent,
        plan.rot, cent, key_offset if key_offset is not None else cent, plan.s_koff, plan.vrot, pout, plse,
        *_prefix_args(prefix_keys, cent), *_prefix_args(prefix_values, cent), plan.prefix_len,
        *_prefix_args(recent_keys, cent), *_prefix_args(recent_values, cent), max(plan.recent_size, 1), recent_from,
        *plan.scalars,
    )
    with device_of(pool):
        if plan.attention is None:
            plan.attention = _launch(plan.grid, args, plan.constants, plan.block_n, plan.num_stages, plan.kernel)
        else:
            plan.attention(*args)
        if plan.split:
            plan.reduce(pout, plse, out, *out.stride()[:3], plan.ns_all)
    return out


@dataclasses.dataclass(slots=True)
class _AttentionPlan:
    """What a call's argument kinds decide (validated once): the launch's grid, constexprs and scalars."""

    layout: BlockLayout  # held, so the id keying this plan stays this layout's
    grid: tuple[int, int, int]
    constants: dict
    block_n: int
    num_stages: int
    split: bool
    ns_all: int
    partial_rows: int  # split partial rows, B x Hk x ns_all x BLOCK_M
    dp: int
    workspace_numel: int
    rot: torch.Tensor
    cent: torch.Tensor
    vrot: torch.Tensor
    s_koff: int
    prefix_len: int
    recent_size: int
    scalars: tuple  # (Lq, num_splits, sm_scale, softcap, window, block_bytes, plane_bytes)
    reduce: LaunchSite | None
    kernel: object = None  # the jitted kernel (_attn_kernel unless decode_warps picked its own)
    attention: LaunchSite | None = None  # set by the first launch (the variant that fits the GPU)


_PLANS = PlanCache()


def _plan_for(query, pool, layout, block_table, seq_lens, kv_start, sinks, out, key_offset, prefix_keys,
              prefix_values, recent_keys, recent_values, workspace, scale, sliding_window, softcap, max_seq_len,
              num_splits, tuning) -> _AttentionPlan:
    """The cached plan for these argument kinds, made (and the inputs validated) on first sight.
    max_seq_len only sizes the split count: rounded up to a power of two, one plan serves a decode
    step after step (a split count sized for up to 2x the length)."""
    if type(max_seq_len) is int and max_seq_len > 0:
        max_seq_len = next_pow2(max_seq_len)
    key = (id(layout), *map(argument_key, (query, pool, block_table, seq_lens, kv_start, sinks, out, key_offset,
                                          prefix_keys, prefix_values, recent_keys, recent_values, workspace)),
           *map(value_key, (scale, sliding_window, softcap, max_seq_len, num_splits)),
           tuple(sorted(tuning.items())) if tuning else None,
           # the launch heuristics and launch functions, which tests and eval.compile_check patch to take
           # a GPU's choices on the CPU: a plan made under a patch is never reused without it
           _tuned_for_gpu, _runs_ptx, _num_sms, _launch, reduce_site)
    plan = _PLANS.get(key)
    if plan is None or plan.layout is not layout:
        plan = _make_plan(query, pool, layout, block_table, seq_lens, kv_start, sinks, out, key_offset, prefix_keys,
                          prefix_values, recent_keys, recent_values, workspace, scale, sliding_window, softcap,
                          max_seq_len, num_splits, tuning)
        _PLANS.put(key, plan)
    return plan


def _make_plan(query, pool, layout, block_table, seq_lens, kv_start, sinks, out, key_offset, prefix_keys,
               prefix_values, recent_keys, recent_values, workspace, scale, sliding_window, softcap, max_seq_len,
               num_splits, tuning) -> _AttentionPlan:
    _check_attention_inputs(query, pool, layout, block_table, seq_lens, kv_start, sinks, out, scale,
                            sliding_window, softcap)
    key_offset, s_koff = check_key_offset(key_offset, layout, pool.device, rows=query.shape[0])
    b, hq, lq, d = query.shape
    prefix_len = _check_prefix(prefix_keys, prefix_values, layout, b, pool.device)
    recent_size = _check_recent(recent_keys, recent_values, layout, b, pool.device)
    hk = layout.num_kv_heads
    g = hq // hk
    cfg = layout.config
    rot, _, _, cent = codec_tensors(layout, str(pool.device))  # cent: centroids by stored code (the gather's table)
    vrot = value_rotation_tensor(layout, str(pool.device))

    rows = g * lq
    dp = next_pow2(d)
    dhp = next_pow2(d // 2)
    on_gpu = _tuned_for_gpu(pool.device)
    decode = rows <= 64
    tuning = tuning or {}
    sms = _num_sms(pool.device)
    batch_fills_gpu = 2 * b * hk >= sms  # one decode program per (row, KV head) would fill half the SMs
    # 4-bit codebook keys decode by byte permutes (key_lut.py) in decode launches that run PTX, at head_dim 128
    # and, as code words (key_words), at 64: there the byte lookup of session 4 measured slower than the gather
    # (H200, 9/3/64 B=16 S=32k: 0.187 vs 0.130 ms, eval/results/kernels_bench_session4_lookup_d64.md), the code
    # words with their byte magnitudes faster (gpu_checks/session16/call4, call5: B=16 0.1136 -> 0.0773 ms, B=4
    # 0.0392 -> 0.0296, B=1 0.0190 -> 0.0174, S=128k 0.409 -> 0.265); other head_dims are unmeasured
    wants_lut = tuning.get("key_lut", d in (64, 128))
    words = config_lut_words(cfg, d) if decode and _runs_ptx(pool.device) and wants_lut else None
    # 3-bit codebook keys stored as 8 code planes (layout.key_planes): one dot per plane, decoded by
    # key_lut.py's byte permutes under the same conditions as the 4-bit lookup
    use_planes = key_planes(cfg, d)
    words3 = config_lut3_words(cfg, d) if use_planes and decode and _runs_ptx(pool.device) and wants_lut else None
    maxnreg = None
    narrow = False  # 2 warps per program (mid-batch decode of 4-bit codebook keys, plain format)
    plain_format = not (prefix_len or recent_size or key_offset is not None or cfg.value_rotation)
    from . import decode_warps  # here: it imports this module

    capacity = block_table.shape[1] * layout.block_size
    kv_len = min(capacity if max_seq_len is None else max_seq_len, capacity)  # the host's bound on a walk
    if decode_warps.wanted(tuning, layout, rows, b, plain_format and kv_start is None and sliding_window is None
                           and sinks is None and softcap is None, on_gpu and _runs_ptx(pool.device), sms, kv_len):
        return decode_warps.make_plan(_AttentionPlan, layout, pool, b, g, lq, _runs_ptx(pool.device), cent, vrot,
                                      workspace, kv_len, num_splits, scale, sms, tuning)
    # two KV heads per program (HP): their query rows share one 16-row MMA tile (rows 0-7 and 8-15), so the
    # softmax, its reductions and P's trip through shared memory serve both heads; the 4-bit code words of both are
    # looked up. Offline sm_90a, B=16 S=32k: 1,504 instructions per 128-token tile of two heads vs 892 per head.
    # H200, S=32k plain 4bit, in 168 registers, alternated twice (gpu_checks/session14/call4): B=16 0.2437 -> 0.2320
    # ms, S=128k 0.949 -> 0.880, B=8 0.1359 -> 0.1237, B=4 0.0763 -> 0.0694 (from 2-warp programs); in 128
    # registers (spills) B=16 0.2861, with 2 pipeline stages 0.2635 (call3); with the byte magnitudes (call6) B=2
    # 0.0481 -> 0.0422 (from 2-warp programs), B=1 0.0337 -> 0.0302 (from 256-token tiles and token pairs).
    # With the levers too (16-bit exact tiles, the block-table prefetch; gpu_checks/session15/call2, main vs branch
    # alternated twice), the 4bit preset's defaults (centering, value rotation, exact prefix and ring): B=16 0.2990
    # -> 0.2535 ms, S=128k 1.0799 -> 0.9188, B=4 0.1331 -> 0.0991, B=1 0.0463 -> 0.0382; centering + value
    # rotation alone B=16 0.2472 -> 0.2261, B=4 0.0867 -> 0.0721, B=1 0.0380 -> 0.0353
    pairs = bool(words) and d == 128 and on_gpu and hk % 2 == 0 and rows <= 8
    # four heads per program (tuning head_pairs=4) measured slower at every batch: S=32k B=16 0.2131 -> 0.2283 ms
    # plain, 0.2225 -> 0.2594 with the levers, B=1 0.0297 -> 0.0346 (gpu_checks/session16/call1)
    hp = tuning.get("head_pairs", 2 if pairs else 1)
    if hp not in (1, 2, 4):
        raise ValueError(f"tuning head_pairs must be 1, 2 or 4, got {hp!r}")
    if decode:  # memory-bound: long KV tiles, few rows; defaults from the H200 sweeps (eval.bench_decode_variants)
        block_m = max(16, next_pow2(rows))
        block_n = (256 if cfg.key_bits == 4 else 128) if d <= 128 else 64
        if words and d == 128 and (prefix_len or recent_size):
            # with exact prefix/ring buffers 128-token tiles also at small batch (H200, B=1 S=32k, all
            # levers: 0.053 vs 0.061 ms and 0.056 vs 0.062 in two runs; plain keeps 256: 0.040 vs 0.046)
            block_n = 128
        if hp > 1 and words:
            # with the levers uncapped: in 168 registers their state spilled through the walk (108 bytes per thread,
            # sm_90a). H200, the 4bit preset's defaults, S=32k, 168 -> uncapped (gpu_checks/session15/call6): B=16
            # 0.2516 -> 0.2220 ms, S=128k 0.913 -> 0.818, B=4 0.0993 -> 0.0887, B=1 0.0372 -> 0.0351; centering + value
            # rotation B=16 0.2262 -> 0.2145; the plain format even (0.2139 vs 0.2129; session 14: 0.2320 vs 0.2346)
            block_n, maxnreg = 128, (168 if plain_format else None)
        elif words and d == 64:
            # 4-bit code words at head_dim 64 (key_words below) in 168 registers, 256-token tiles also with the exact
            # prefix and ring. H200, 9/3/64 S=32k, the 4bit preset's defaults (gpu_checks/session16/call5): B=16
            # 0.1252 ms (gather) -> 0.0901 (0.1106 in 128-token tiles, 0.1194 uncapped, 0.1003 in 128 registers),
            # B=4 0.0420 -> 0.0342, B=1 0.0240 -> 0.0225, S=128k 0.423 -> 0.280; the plain format even (0.0773 vs
            # 0.0768 uncapped)
            maxnreg = 168
        elif cfg.key_bits == 8 and d == 64 and on_gpu and not batch_fills_gpu:
            # FP8 keys at head_dim 64 with their metadata as token pairs (meta_pairs below), in 128 registers under
            # the levers (uncapped they took 1.3-1.5x as long). H200, 9/3/64 S=32k (gpu_checks/session16/call5):
            # plain B=16 0.1210 -> 0.1010 ms, B=4 0.0422 -> 0.0371, S=128k 0.431 -> 0.353, B=1 0.0182 -> 0.0179;
            # the preset's defaults B=16 0.1284 -> 0.1187, B=4 0.0440 -> 0.0396, S=128k 0.460 -> 0.426, B=1 even
            maxnreg = None if plain_format else 128
        elif words and d == 128 and batch_fills_gpu:
            # the batch alone nearly fills the GPU: shorter tiles in 128 registers, 4 programs per SM
            # (H200, B=16 S=32k: 0.31 vs 0.35 ms plain, 0.36 vs 0.42 ms with all levers; at B=1-4 the
            # split walks are too short to gain: eval/results/decode_lookups/session5_3)
            block_n, maxnreg = 128, 128
        elif cfg.key_bits == 8 and d == 128 and on_gpu:
            # FP8 keys in 128 registers from 4 sequences of 8 KV heads: with value rotation the epilogue took
            # 184 (253 with the exact prefix and ring), 2 programs per SM. H200, k8v4 S=32k, outputs
            # bit-identical: B=16 plain 0.2905 -> 0.2853 ms, value rotation 0.4225 -> 0.3001, the preset's
            # defaults 0.4348 -> 0.3659 (gpu_checks/session9/call8); B=8 plain 0.1556 -> 0.1533, defaults
            # 0.2471 -> 0.2171; B=4 plain 0.0876 -> 0.0867, defaults 0.1501 -> 0.1350; B=1 defaults
            # 0.0584 -> 0.0598, so not there (gpu_checks/session10/call1, call2, call5); since the exact tiles' 16-bit
            # dots, with the levers also at B=1: defaults 0.0467 -> 0.0435 (gpu_checks/session15/call4); since the
            # tile's value sums from zero (_rescaled_dot) the plain format took 138 uncapped at B=1 (128 before):
            # B=1 S=32k 0.032 -> 0.0405 ms (gpu_checks/session18, call 9), so capped at any batch
            maxnreg = 128
        elif words3 and d == 128 and batch_fills_gpu:
            # 3-bit code planes likewise (uncapped 255 registers with spills): H200, k3v4 B=16 S=32k plain
            # 0.5823 -> 0.5431 ms, the preset's defaults 0.6654 -> 0.5151; at B=1 slower (0.0647 -> 0.1110)
            # (eval/results/gpu_checks/session10/call2, call3). 3bit B=16 with the preset's defaults 0.719 ms
            # vs 0.826 in 168 registers, but its plain format 0.741 vs 0.681 (gpu_checks/session11/call7)
            maxnreg = 168 if cfg.value_bits == 3 and plain_format else 128
        elif words and d == 128 and on_gpu and b * hk >= 16 and plain_format:
            # mid batch (2-8 sequences of 8 KV heads): 2-warp programs on 128-token tiles, twice the
            # splits below (the same warps per SM). H200, S=32k plain 4bit, B=2/4/8: 0.0557 -> 0.0550,
            # 0.0920 -> 0.0876, 0.1634 -> 0.1529 ms; B=1 none. With the levers (centering, value rotation,
            # exact prefix and ring) slower at B=4/8: 0.148 -> 0.181, 0.263 -> 0.326 ms, so only the plain
            # format (eval/results/decode_variants/warps_session8/)
            block_n, narrow = 128, True
    else:
        block_m = 64 if d == 128 else 32
        block_n = 64 if d <= 128 else 32
    if d < 128:
        # Triton 3.6 on the H200 computes wrong results (and faults) for 64-row tiles at head_dim
        # 32/64 (the wgmma path; H200 sweep of 2026-11-29); 32-row tiles take the mma.sync path.
        block_m = min(block_m, 32)
    planes_v = value_planes(cfg, d)
    if not on_gpu:
        block_n = 16 if decode else 32
    block_n = tuning.get("block_n", block_n)
    block_m = tuning.get("block_m", block_m)
    maxnreg = tuning.get("maxnreg", maxnreg)
    num_warps = tuning.get("num_warps", 2 if narrow else 4)
    # 4-bit values as 16-bit words (two tokens per MMA operand register, decoded as fp16 subnormals):
    # decode tiles of <= 32 rows only (the mma.sync path: the GPU tests of 2026-11-30 failed for
    # 64-row wgmma tiles), and on a GPU only where every warp gets a column tile of its own
    # (D/4 >= 8 x warps; at head_dim 64 the words measured 2.1x slower than the bytes, H200)
    value_words = cfg.value_bits == 4 and decode and block_m <= 32 and d // 4 >= (8 * num_warps if on_gpu else 16)
    value_words = bool(tuning.get("value_words", value_words))
    if value_words and cfg.value_bits != 4:
        raise ValueError(f"tuning value_words=True needs 4-bit values, got {cfg.value_bits}-bit")
    if value_words and on_gpu and (block_m > 32 or d // 4 < 16):
        raise ValueError(f"tuning value_words=True needs row tiles of <= 32 rows and head_dim >= 64 on a GPU, got "
                         f"block_m {block_m}, head_dim {d} (64-row tiles computed wrong results on an H200)")
    # small-batch decode of 4-bit codebook keys by the lookup waits on memory latency: the metadata as 32-bit
    # token pairs, which the pipeliner prefetches, and 3 stages (H200, S=32k 4bit: B=1 0.0396 -> 0.0370 ms, B=4
    # 0.0983 -> 0.0916; at B=16 the pairs' address arithmetic costs more than their latency hides: 0.307 ->
    # 0.332; k8v4 at B=1 0.041 -> 0.049 and 9/3/64 4bit at B=16 0.120 -> 0.163 with them:
    # eval/results/gpu_checks/session6/README.md). Since then, at head_dim 64 with the code words and for FP8 keys
    # there, they gain (B=16 9/3/64 k8v4 0.1210 -> 0.1010 ms; the 4bit figures above are words with pairs:
    # gpu_checks/session16/call5); at head_dim 64 with batches that fill the GPU they are unmeasured (off)
    meta_pairs = bool(tuning.get("meta_pairs", (words is not None or (cfg.key_bits == 8 and d == 64)) and on_gpu
                                 and not batch_fills_gpu and hp == 1))
    # otherwise each token's fields from its pair's 32-bit word (4-byte loads, prefetched by the pipeliner):
    # Nsight Compute (H200, B=16 S=32k 4bit) put 15% of the stall samples on the 2-byte loads' latency;
    # B=16 S=32k 4bit 0.2867 -> 0.2663 ms, k8v4 0.2790 -> 0.2528 (gpu_checks/session13/call3); at head_dim
    # 64 (9/3/64 4bit B=16 0.1139 -> 0.1556) slower, so not there
    meta_words = bool(tuning.get("meta_words", decode and on_gpu and not meta_pairs and d == 128))
    # Triton's pipeliner prefetches only loads that feed an MMA operand: v_mid (only in the rank-1 bias term)
    # joins the value operand's chain as + 0 * v_mid. H200 S=32k (gpu_checks/session13/call5, call6): B=16
    # 4bit 0.2682 -> 0.2626 ms, k8v4 0.2518 -> 0.2344, k3v4 0.4327 -> 0.4240; 128k 4bit 1.067 -> 1.008; B=1
    # k8v4 (words alone 0.0370 -> 0.0416) 0.0370 -> 0.0326 with words. With the token pairs it did not clearly
    # pay (B=4 4bit 0.0770 -> 0.0763, B=1 0.0338 -> 0.0336, B=1 with all levers 0.0469 -> 0.0479): not there
    vmid_chain = bool(tuning.get("vmid_chain", meta_words))
    # codebook keys: the block-table entries an iteration ahead, so the codes' loads are direct and 3 stages
    # double-buffer them (B=16 4bit 0.2626 -> 0.2575 ms, k3v4 0.4240 -> 0.4107, 3bit 0.6137 -> 0.6032; B=1
    # k3v4 0.0478 -> 0.0434); FP8 keys' larger tiles lose (B=16 k8v4 0.2344 -> 0.2883, B=4 0.0728 -> 0.0958),
    # and so does the plain format's loop with centering + value rotation in one head per program (B=16 4bit 0.2725
    # -> 0.2798, call7: 893 -> 974 instructions per tile, more spills under the 128-register cap, sm_90a); with
    # head pairs (168 registers) it gains there too: B=16 0.2530 -> 0.2260 ms, all levers 0.2714 -> 0.2537, B=1
    # 0.0377 -> 0.0352; B=4 all levers even, 0.0989 vs 0.0994 (gpu_checks/session15/call2)
    bt_next = bool(tuning.get("bt_next", meta_words and cfg.uses_codebook
                              and (hp > 1 or not (cfg.key_centering or cfg.value_rotation))))
    num_stages = tuning.get("num_stages", 3 if (meta_pairs or bt_next) else 2) if on_gpu else 1
    # rotation="hadamard": the query's rotation (and the 3-bit bit stream values' output rotation) built in
    # registers (hadamard_dot), not read.
    # H200, S=32k, 32/8/128, alternated twice (gpu_checks/session12/call3, call5): 4bit B=1 0.0368 -> 0.0337 ms,
    # B=16 0.2969 -> 0.2892; k3v4 B=1 0.0568 -> 0.0515, B=16 0.4707 -> 0.4313; 3bit B=1 0.0658 -> 0.0606, B=16
    # 0.6796 -> 0.6588. With 3-bit keys in 64-row (wgmma) tiles the GPU tests computed
    # wrong results and faulted (Triton 3.6, like the value words there): those keep reading R
    hadamard = cfg.rotation == "hadamard" and (block_m <= 32 or cfg.key_bits != 3)
    # the pool's addresses as int32 offsets from its base when they fit: fewer 64-bit integer ops per tile
    # (sm_90a SASS, Triton 3.6, S=32k B=16 loop per 128-token tile: 4bit 962 -> 932, k8v4 784 -> 729). H200,
    # S=32k, alternated twice with int64 (gpu_checks/session12/call2): 32/8/128 B=16 4bit 0.3001 -> 0.2980 ms,
    # k8v4 0.2844 -> 0.2792, k3v4 0.4848 -> 0.4735; B=1 k8v4 0.0378 -> 0.0370; 9/3/64 B=16 4bit 0.1204 ->
    # 0.1170; but 3-bit values slower (3bit B=16 0.6852 -> 0.6962, 9/3/64 0.2445 -> 0.2523), so not there
    pool32 = bool(tuning.get("pool32", pool.numel() < 2**31 and cfg.value_bits != 3))
    if pool32 and pool.numel() >= 2**31:
        raise ValueError(f"tuning pool32=True needs a pool of < 2**31 bytes (int32 offsets), got {pool.numel()}")
    # 4-bit codebook keys as 16-bit code words, two of a token per MMA operand register (key_lut.lut_words_asm):
    # the query's operand then loads by ldmatrix, no register moves (sm_90a, B=16 S=32k: 1014 -> 892 instructions
    # per tile). H200 S=32k 32/8/128 4bit (gpu_checks/session14/call1, call2): B=16 0.2569 -> 0.2428 ms, with
    # centering + value rotation 0.2703 -> 0.2653, 128k 1.004 -> 0.954; one head per program, not where it did not
    # gain: with the exact prefix and ring too 0.2980 -> 0.3000, B=1 0.0333 -> 0.0334 (centering + rotation 0.0369
    # -> 0.0375), B=4 0.0768 -> 0.0763; always with head pairs. Their magnitudes as bytes (reference.on_byte_grid)
    # halve the asm's lookups: offline 1,504 -> 1,310 instructions per tile of two heads; H200, trees alternated
    # twice (call5): B=16 0.2313 -> 0.2138 ms, 128k 0.882 -> 0.807, B=8 0.1251 -> 0.1161, B=4 0.0698 -> 0.0654
    kbytes = config_lut_bytes(cfg, d) if words else None  # the word asm's magnitude bytes (reference.on_byte_grid)
    key_words = bool(tuning.get("key_words", kbytes is not None and (hp > 1 or d == 64 or (
        batch_fills_gpu and not (prefix_len or recent_size)))))
    if key_words and not (decode and cfg.uses_codebook and cfg.key_bits == 4 and d in (64, 128, 256)
                          and (kbytes is not None or words is None)):
        raise ValueError(f"tuning key_words=True needs decode (<= 64 rows) of 4-bit codebook keys at head_dim 64, 128 "
                         f"or 256, got {rows} rows, {cfg.key_bits}-bit {'codebook' if cfg.uses_codebook else 'FP8'} "
                         f"keys, head_dim {d}")
    if hp > 1 and not (key_words and value_words and decode and rows <= 16 // hp and block_m == 16 and hk % hp == 0
                       and not meta_pairs):
        raise ValueError(f"tuning head_pairs={hp} needs decode (<= {16 // hp} rows per KV head, 16-row tiles) with "
                         "4-bit key and value words (key_words, value_words), without meta_pairs, and a KV head count "
                         f"divisible by {hp}; got {rows} rows, block_m {block_m}, key_words={key_words}, "
                         f"value_words={value_words}, meta_pairs={meta_pairs}, {hk} KV heads")
    m_tiles = triton.cdiv(rows, block_m)
    kv_tiles = max(1, triton.cdiv(kv_len, block_n))
    if num_splits is None:
        programs = b * (hk // hp) * m_tiles
        # FP8 keys dequantize cheaply and want more loads in flight; codebook keys more work per split
        # a power of two splits the (power-of-two) tile counts evenly across splits. H200, k8v4 S=32k, 4 vs 8
        # waves: B=1 64 vs 128 splits 0.0375 vs 0.0402 ms, B=4 16 vs 32 0.0875 vs 0.0931, B=16 4 vs 8 0.2900
        # vs 0.2913 (eval/results/gpu_checks/session7/call6)
        waves = 4 if cfg.key_bits == 8 else 3
        if words and num_warps == 2:
            waves *= 2
        # also once every SM has a program: one per SM leaves the other slots idle (H200, S=32k, one split -> the
        # split count this gives: k8v4 B=24 0.5772 -> 0.3665 ms, B=32 0.5891 -> 0.4388, k3v4 B=24 0.8683 -> 0.6084,
        # k8v4 with its levers B=32 0.6550 -> 0.4606; B=64 within 1.5%: gpu_checks/session19, call 8)
        want = min(triton.cdiv(waves * sms, programs), kv_tiles, 128)
        num_splits = 1 if m_tiles > 1 else 1 << (want.bit_length() - 1)
    if not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
    split = num_splits > 1
    if split and m_tiles != 1:
        raise ValueError("split-KV needs all query rows of a KV head in one tile (G * Lq <= 64)")
    # split decode with exact prefix/ring buffers, when the GPU has programs to spare: one extra
    # program attends those dense tiles while the others walk the pool (appended to the first/last
    # split they made it the slowest). H200, all levers, S=32k: B=1 0.079 -> 0.063 ms; at B=16
    # (2 x B x Hk >= SMs) the extra programs cost a partial second wave: 0.52 -> 0.60 ms, so not there.
    exact_prog = bool(tuning.get("exact_program", not batch_fills_gpu)) and split and (prefix_len > 0 or recent_size > 0)
    ns_all = num_splits + exact_prog

    # the exact tiles' dots in the query's 16-bit dtype where the buffers share it (_exact_tile); not bf16 under the
    # interpreter, whose bf16 dots return garbage (ENVIRONMENT.md): the GPU tests check those
    exact16 = (query.dtype == torch.float16 or (query.dtype == torch.bfloat16 and _runs_ptx(pool.device))) and all(
        x.dtype == query.dtype for x in (prefix_keys, prefix_values, recent_keys, recent_values) if x is not None)

    ring_n = min(32, max(16, next_pow2(recent_size)))  # the recent window's tile, tokens
    if exact_prog and cfg.key_bits == 8 and d == 128 and b * hk <= 16:
        # FP8 keys' exact program on 16-token ring tiles up to 2 x 8 KV heads: H200, k8v4 with its defaults, 32/8/128,
        # two rounds each (gpu_checks/session16/call7, call8): B=1 S=32k 0.0437 -> 0.0417 ms (call 8: 0.0443 ->
        # 0.0423), B=2 0.0600 -> 0.0580 (0.0605 -> 0.0585), B=1 S=128k 0.0878 -> 0.0862; B=4 slower (0.1005 ->
        # 0.1031); for 4-bit keys within 1% either way (B=1 0.0342 -> 0.0345), at head_dim 64 slower for them
        ring_n = 16
    ring_n = tuning.get("ring_n", ring_n if on_gpu else 16)
    if ring_n not in (16, 32, 64, 128):
        raise ValueError(f"tuning ring_n must be 16, 32, 64 or 128 tokens, got {ring_n!r}")

    workspace_numel = 0
    partial_rows = b * hk * ns_all * (block_m // hp)
    if split:
        workspace_numel = partial_rows * (dp + 1)
        check_workspace(workspace, workspace_numel, pool.device)
    constants = dict(
        D=d, DP=dp, DHP=dhp, GP=next_pow2(d // 8), G=g, T=layout.block_size, KB=layout.key_bytes, VB=layout.value_bytes,
        META=layout.metadata_offset, KEY_BITS=cfg.key_bits, VALUE_BITS=cfg.value_bits,
        NC=(1 << cfg.key_bits) if cfg.uses_codebook else 1,
        BLOCK_M=block_m, QP=next_pow2(d // 4),
        HAS_KV_START=kv_start is not None, HAS_WINDOW=sliding_window is not None,
        HAS_SINKS=sinks is not None, HAS_SOFTCAP=softcap is not None, SPLIT=split,
        HAS_KEY_OFFSET=key_offset is not None, VALUE_ROT=cfg.value_rotation,
        HAS_PREFIX=prefix_len > 0, PP=max(16, next_pow2(prefix_len)),
        EXACT_ACC=cfg.value_rotation and (prefix_len > 0 or recent_size > 0), RK=min(32, dp), EXACT_PROG=exact_prog,
        EXACT_16=exact16,
        VALUE_WORDS=value_words, VALUE_PTX=(value_words or planes_v) and _runs_ptx(pool.device), KEY_LUT=words is not None or words3 is not None,
        KEY_WORDS=key_words, KEY_UNIT=kbytes[1] if words and key_words else 1.0,
        LUT_LO=(lut_words_asm(kbytes[0]) if key_words else lut_asm(words, False)) if words else (lut3_asm(words3, False) if words3 else ""),
        LUT_HI=("" if key_words else lut_asm(words, True)) if words else (lut3_asm(words3, True) if words3 else ""),
        KEY_PLANES=use_planes, VALUE_PLANES=planes_v,
        META_PAIRS=meta_pairs, META_WORDS=meta_words, VMID_CHAIN=vmid_chain, BT_NEXT=bt_next, POOL32=pool32, HADAMARD=hadamard, HAS_RECENT=recent_size > 0, RN=ring_n,
        HP=hp, num_warps=num_warps, **({"maxnreg": maxnreg} if maxnreg else {}),
    )
    return _AttentionPlan(
        layout=layout, grid=(m_tiles * ns_all, hk // hp, b), constants=constants, block_n=block_n, num_stages=num_stages,
        split=split, ns_all=ns_all, partial_rows=partial_rows, dp=dp, workspace_numel=workspace_numel,
        rot=rot, cent=cent, vrot=vrot, s_koff=s_koff, prefix_len=prefix_len, recent_size=recent_size,
        scalars=(lq, num_splits, float(scale), float(softcap or 1.0), int(sliding_window or 0),
                 layout.block_bytes, layout.plane_bytes),
        reduce=reduce_site(b, hk, g, lq, ns_all, block_m // hp, d, dp) if split else None,
    )
