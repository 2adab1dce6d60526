"""The unified kernel's two tile steps: a tile of the compressed pool (pool_tile) and a dense tile of exact
keys/values from the prefix or ring buffers (exact_tile). Each scores, updates the online softmax and
accumulates the values."""

from __future__ import annotations

import triton
import triton.language as tl

from .code_decoders import (
    LUT_CODES_CONSTRAINTS,
    LUT_CONSTRAINTS,
    LUT_WORDS_CONSTRAINTS,
    code_unit,
    codes_to_f16,
    gather_cols,
    gather_dots,
    lookup_dots,
    nibbles_to_f16,
    operand_boundaries,
    operand_boundary,
    spare_codes,
    unpack3,
    value_col,
    value_plane_bytes,
    value_plane_words,
    value_word_nibbles,
)
from .metadata import heads_meta, load_meta, load_meta_pairs
from .rounding import bf16_bits_to_f32
from .softmax import add_pairs, log2_logits, rescaled_dot, softmax_p, softmax_step

@triton.jit
def _scales(bits):
    """int8 ring records' bfloat16 scales, loaded as int16 bits, as fp32."""
    return bf16_bits_to_f32(bits.to(tl.uint16, bitcast=True).to(tl.uint32))


@triton.jit
def _exact_cols(base, s_pos, pc, p_ok, cols, col_ok, Q8: tl.constexpr, D: tl.constexpr):
    """Columns `cols` of the exact vectors [N, D] at rows `pc` (prefix or ring), as fp32; Q8: int8 ring records,
    each code times its group's bfloat16 scale (layout: the ring; exact in fp32). For cols = arange(DP) (the
    natural order) the scales are read once per group and broadcast; other columns read each one's scale."""
    mask = p_ok[:, None] & col_ok[None, :]
    x = tl.load(base + pc[:, None] * s_pos + cols[None, :], mask=mask, other=0).to(tl.float32)
    if Q8:
        scales = (base + pc * s_pos + D).to(tl.pointer_type(tl.int16))
        if cols.shape[0] >= D and cols.shape[0] % 16 == 0:  # (cols is arange(DP) whenever it spans D)
            GROUPS: tl.constexpr = cols.shape[0] // 16
            g = tl.arange(0, GROUPS)
            bits = tl.load(scales[:, None] + g[None, :], mask=p_ok[:, None] & (g[None, :] < D // 16), other=0)
            sc = _scales(bits)
            x = tl.reshape(tl.reshape(x, (x.shape[0], GROUPS, 16)) * sc[:, :, None], (x.shape[0], cols.shape[0]))
        else:
            bits = tl.load(scales[:, None] + (cols // 16)[None, :], mask=mask, other=0)
            x = x * _scales(bits)
    return x


@triton.jit
def _record_scores(q_row, row_ok, q_sel, k_base, s_k, rows, ok, EXACT_16: tl.constexpr, D: tl.constexpr):
    """q . (int8 ring key records at rows `rows`) [M, N], without their offset: per group of 16 coordinates one dot of
    the query's and the codes' 16 columns (both exact in the query's 16-bit dtype under EXACT_16: exact products,
    fp32 sums), times the group's scale; q_sel: the query rows that attend these keys (others count 0)."""
    gc = tl.arange(0, 16)
    scales = (k_base + rows * s_k + D).to(tl.pointer_type(tl.int16))
    s = tl.zeros((q_row.shape[0], rows.shape[0]), tl.float32)
    for g in tl.static_range(D // 16):
        qg = tl.load(q_row[:, None] + g * 16 + gc[None, :], mask=q_sel[:, None] & row_ok[:, None], other=0.0)
        cg = tl.load(k_base + rows[:, None] * s_k + g * 16 + gc[None, :], mask=ok[:, None], other=0)
        bits = tl.load(scales + g, mask=ok, other=0)
        sc = _scales(bits)
        if EXACT_16:
            d = tl.dot(qg, tl.trans(cg.to(qg.dtype)))
        else:
            d = tl.dot(qg.to(tl.float32), tl.trans(cg.to(tl.float32)), input_precision="tf32x3")
        s += d * sc[None, :]
    return s


@triton.jit
def _exact_values(p, acc, v_base, s_vh, s_v, rows, ok, cols, col_ok, sub, HEADS_PER_PROGRAM: tl.constexpr,
                  PREC: tl.constexpr, Q8: tl.constexpr, D: tl.constexpr):
    """acc + p . (columns `cols` of the exact values), each of the HEADS_PER_PROGRAM heads' values (s_vh apart) with
    only its own rows of p; PREC: the dots' input_precision. Q8: int8 records (_exact_cols)."""
    for j in tl.static_range(HEADS_PER_PROGRAM):
        if HEADS_PER_PROGRAM == 1:
            p_j = p
        else:
            p_j = tl.where(sub[:, None] == j, p, 0.0)
        acc = tl.dot(p_j, _exact_cols(v_base + j * s_vh, s_v, rows, ok, cols, col_ok, Q8, D), acc, input_precision=PREC)
    return acc


@triton.jit
def exact_tile(q, m_i, l_i, acc0, acc1, acc2, acc3, acc_x, bias_acc, k_base, s_kh, s_k, v_base, s_vh, s_v, rows, pos,
                ok, qpos, window, sm_scale, softcap, dc, vcol, sub, q_row, row_ok, q_mu, HEADS_PER_PROGRAM: tl.constexpr,
                EXACT_16: tl.constexpr, Q8: tl.constexpr, ADD_MU: tl.constexpr, D: tl.constexpr,
                VALUE_BITS: tl.constexpr, VALUE_WORDS: tl.constexpr, VALUE_PLANES: tl.constexpr,
                PLANE_WORDS: tl.constexpr, VALUE_ROT: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """One online-softmax step over a dense tile of exact original keys/values (prefix or ring):
    rows `rows` of the buffers hold cache positions `pos`, `ok` marks the real ones. Scores come
    from the unrotated query (exact keys need no q . mu). Values join the code accumulators (4-bit
    values and 3-bit value planes: acc_j's columns vcol are coordinates value_col(vcol, j), scaled as
    the codes' fp16), or, under value_rotation, acc_x: an accumulator in the original space that the
    epilogue adds after rotating the codes' part back
    (rotating exact values by Rv^T in here doubled the kernel's shared memory: 204,800 B, sm_90a).
    HEADS_PER_PROGRAM KV heads (buffers s_kh / s_vh apart): each head's dots see only its rows (sub), one softmax.
    EXACT_16: the query and buffers share a 16-bit dtype: the scores by that dtype's MMA (exact products,
    fp32 sums) and the values' dots in one tf32 pass (p rounded to 11 bits; the values are exact in tf32),
    instead of three tf32 passes each (offline sm_90a: fewer instructions and spills per ring tile).
    Q8: the buffers hold int8 ring records (layout.ring_spec): the keys' codes enter one dot per group of 16
    coordinates exactly (_record_scores; a dot of the dequantized keys rounded to fp16 missed the reference by
    ~2**-12 of the logits), the values dequantized (exact in fp32) enter as exact values do; ADD_MU: the key records
    hold k - mu (key_centering), and the scores get q . mu (q_mu, per row, already times sm_scale) back."""
    PREC: tl.constexpr = "tf32" if EXACT_16 else "tf32x3"
    s = None
    for j in tl.static_range(HEADS_PER_PROGRAM):
        if HEADS_PER_PROGRAM == 1:
            q_j = q
        else:
            q_j = tl.where(sub[:, None] == j, q, 0.0)
        if Q8:
            q_sel = row_ok if HEADS_PER_PROGRAM == 1 else row_ok & (sub == j)
            s_j = _record_scores(q_row, row_ok, q_sel, k_base + j * s_kh, s_k, rows, ok, EXACT_16, D)
            if j == 0:
                s = s_j
            else:
                s = s + s_j
        else:
            k = tl.load(k_base + j * s_kh + rows[:, None] * s_k + dc[None, :], mask=ok[:, None] & (dc[None, :] < D),
                        other=0)
            if EXACT_16:  # q_j holds values of k's dtype (the query's own): exact there
                s = tl.dot(q_j.to(k.dtype), tl.trans(k), s)
            else:
                s = tl.dot(q_j, tl.trans(k.to(tl.float32)), s, input_precision="tf32x3")
    s = s * sm_scale
    if ADD_MU:
        s = s + q_mu[:, None]
    s = log2_logits(s, softcap, HAS_SOFTCAP)
    vis = ok[None, :] & (pos[None, :] <= qpos[:, None])
    if HAS_WINDOW:
        vis = vis & (pos[None, :] > qpos[:, None] - window)
    p, alpha, m_i, l_i = softmax_step(tl.where(vis, s, -float("inf")), m_i, l_i)
    bias_acc = bias_acc * alpha
    if VALUE_ROT:
        acc0 = acc0 * alpha[:, None]
        acc1 = acc1 * alpha[:, None]
        acc2 = acc2 * alpha[:, None]
        acc3 = acc3 * alpha[:, None]
        acc_x = _exact_values(p, acc_x * alpha[:, None], v_base, s_vh, s_v, rows, ok, dc, dc < D, sub, HEADS_PER_PROGRAM, PREC, Q8, D)
    elif VALUE_BITS == 4 or VALUE_PLANES:
        v_ok = vcol < (D // 4 if (VALUE_WORDS or PLANE_WORDS) else D // 2)
        # each accumulator in its code unit
        acc0 = _exact_values(p * code_unit(0, VALUE_WORDS, PLANE_WORDS, VALUE_PLANES), acc0 * alpha[:, None], v_base,
                             s_vh, s_v, rows, ok, value_col(vcol, 0, D, VALUE_WORDS, PLANE_WORDS), v_ok, sub,
                             HEADS_PER_PROGRAM, PREC, Q8, D)
        acc1 = _exact_values(p * code_unit(1, VALUE_WORDS, PLANE_WORDS, VALUE_PLANES), acc1 * alpha[:, None], v_base,
                             s_vh, s_v, rows, ok, value_col(vcol, 1, D, VALUE_WORDS, PLANE_WORDS), v_ok, sub,
                             HEADS_PER_PROGRAM, PREC, Q8, D)
        if VALUE_WORDS or PLANE_WORDS:
            acc2 = _exact_values(p * code_unit(2, VALUE_WORDS, PLANE_WORDS, VALUE_PLANES), acc2 * alpha[:, None],
                                 v_base, s_vh, s_v, rows, ok, value_col(vcol, 2, D, VALUE_WORDS, PLANE_WORDS), v_ok,
                                 sub, HEADS_PER_PROGRAM, PREC, Q8, D)
            acc3 = _exact_values(p * code_unit(3, VALUE_WORDS, PLANE_WORDS, VALUE_PLANES), acc3 * alpha[:, None],
                                 v_base, s_vh, s_v, rows, ok, value_col(vcol, 3, D, VALUE_WORDS, PLANE_WORDS), v_ok,
                                 sub, HEADS_PER_PROGRAM, PREC, Q8, D)
    else:
        acc0 = _exact_values(p, acc0 * alpha[:, None], v_base, s_vh, s_v, rows, ok, dc, dc < D, sub, HEADS_PER_PROGRAM, PREC, Q8, D)
    return m_i, l_i, acc0, acc1, acc2, acc3, acc_x, bias_acc


@triton.jit
def _value_word_codes(pool_ptr, plane, head_bytes, off, tok_ok, vcol, T: tl.constexpr, KB: tl.constexpr,
                      VB: tl.constexpr, D: tl.constexpr, VALUE_COLS: tl.constexpr, VALUE_PTX: tl.constexpr,
                      WORDS4: tl.constexpr, PLANE_WORDS: tl.constexpr, VALUE_BOUNDARY: tl.constexpr):
    """A tile's value codes of the head at `plane` + head_bytes as the 4 accumulators' MMA operands: WORDS4, 4-bit
    codes from 16-bit words (value_word_nibbles); else 3-bit plane words (value_plane_words: one VALUE_COLS-byte row
    and the bit plane read twice). VALUE_BOUNDARY: the dots in 16-bit operand layouts (operand_boundary)."""
    v_row = pool_ptr + (plane[:, None] + head_bytes + T * KB + off[:, None] * VB)
    if WORDS4:
        vw = tl.load(v_row.to(tl.pointer_type(tl.uint16)) + vcol[None, :],
                     mask=tok_ok[:, None] & (vcol[None, :] < VALUE_COLS), other=0)
        v0, v1, v2, v3 = value_word_nibbles(vw, VALUE_PTX)
    else:
        vm = tok_ok[:, None] & (vcol[None, :] < VALUE_COLS)
        low = tl.load(v_row + vcol[None, :], mask=vm, other=0)
        high = tl.load(v_row + VALUE_COLS + (vcol % (D // 8))[None, :], mask=vm, other=0)
        v0, v1, v2, v3 = value_plane_words(low, high, (vcol // (D // 8))[None, :], VALUE_PTX, PLANE_WORDS == 2)
    if VALUE_BOUNDARY:
        v0, v1, v2, v3 = operand_boundaries(v0, v1, v2, v3)
    return v0, v1, v2, v3


@triton.jit
def pool_tile(t0, end, pool_first, qpos, window, softcap, m_i, l_i, acc0, acc1, acc2, acc3, bias_acc,
               bt_row, blk_pre, pool_ptr, block_bytes, head_off, sub, plane_bytes, q_lo, q_hi, q16, qp, table, row_scale,
               row_off, q_mu, hc, dc, vcol, HALF: tl.constexpr, VALUE_COLS: tl.constexpr, HEADS_PER_PROGRAM: tl.constexpr,
               D: tl.constexpr, CODE_GROUPS: tl.constexpr, T: tl.constexpr, KB: tl.constexpr, VB: tl.constexpr,
               META: tl.constexpr, KEY_BITS: tl.constexpr, VALUE_BITS: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, HAS_KV_START: tl.constexpr, HAS_PREFIX: tl.constexpr, HAS_WINDOW: tl.constexpr,
               HAS_SOFTCAP: tl.constexpr, HAS_KEY_OFFSET: tl.constexpr,
               KEY_LUT: tl.constexpr, LUT_LO: tl.constexpr, LUT_HI: tl.constexpr, KEY_PLANES: tl.constexpr,
               KEY_WORDS: tl.constexpr, VALUE_WORDS: tl.constexpr, VALUE_PLANES: tl.constexpr, PLANE_WORDS: tl.constexpr,
               VALUE_PTX: tl.constexpr, META_PAIRS: tl.constexpr, META_WORDS: tl.constexpr, VMID_CHAIN: tl.constexpr,
               MASKED: tl.constexpr, VALUE_BOUNDARY: tl.constexpr = False):
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
            for j in tl.static_range(HEADS_PER_PROGRAM):  # HEADS_PER_PROGRAM KV heads: each dot's query rows are zero outside head j's rows
                kw = tl.load((pool_ptr + (plane[None, :] + j * plane_bytes + off[None, :] * KB)).to(tl.pointer_type(tl.uint16))
                             + ww[:, None], mask=tok_ok[None, :] & (ww[:, None] < D // 4), other=0)
                if KEY_LUT:
                    k0, k1, k2, k3 = tl.inline_asm_elementwise(LUT_LO, LUT_WORDS_CONSTRAINTS, [kw],
                                                               dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
                                                               is_pure=True, pack=2)
                else:  # no PTX (the interpreter): the same coordinate sets by gathers from the centroid table
                    k0 = gather_cols(table, kw & 15)
                    k1 = gather_cols(table, (kw >> 8) & 15)
                    k2 = gather_cols(table, (kw >> 4) & 15)
                    k3 = gather_cols(table, kw >> 12)
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
        # a 2-head program: head j's planes plane_bytes on, its windows qp[6j..6j+5] (zero outside its rows)
        r32 = tl.arange(0, 32)
        s = None
        for j in tl.static_range(HEADS_PER_PROGRAM):
            head = plane if HEADS_PER_PROGRAM == 1 else plane + j * plane_bytes
            if KEY_LUT:
                kw = pool_ptr + (head[None, :] + off[None, :] * KB + r32[:, None])
                x = tl.load(kw, mask=tok_ok[None, :], other=0)
                y = tl.load(kw + 16, mask=tok_ok[None, :], other=0)
                z = tl.load(kw + 32, mask=tok_ok[None, :] & (r32[:, None] < 16), other=0)
                e = spare_codes(x, y, z, True)
                s = lookup_dots(s, qp[6 * j], qp[6 * j + 1], x, LUT_LO, LUT_HI)
                s = lookup_dots(s, qp[6 * j + 2], qp[6 * j + 3], z, LUT_LO, LUT_HI)
                s = lookup_dots(s, qp[6 * j + 4], qp[6 * j + 5], e, LUT_LO, LUT_HI)
            else:
                kw = pool_ptr + (head[:, None] + off[:, None] * KB + r32[None, :])
                x = tl.load(kw, mask=tok_ok[:, None], other=0)
                y = tl.load(kw + 16, mask=tok_ok[:, None], other=0)
                z = tl.load(kw + 32, mask=tok_ok[:, None] & (r32[None, :] < 16), other=0)
                e = spare_codes(x, y, z, False)
                s = gather_dots(s, qp[6 * j], qp[6 * j + 1], x, table)
                s = gather_dots(s, qp[6 * j + 2], qp[6 * j + 3], z, table)
                s = gather_dots(s, qp[6 * j + 4], qp[6 * j + 5], e, table)
    elif KEY_BITS == 3 and KEY_PLANES:  # qp[c]: the query's coordinates c * J + j, one dot per code plane
        J: tl.constexpr = D // 8
        jj = tl.arange(0, J)
        if KEY_LUT:  # plane bytes loaded as [J, N], the MMA's B operand, decoded in its layout
            kp = pool_ptr + (plane[None, :] + off[None, :] * KB + jj[:, None])
            p0 = tl.load(kp, mask=tok_ok[None, :], other=0)
            p1 = tl.load(kp + J, mask=tok_ok[None, :], other=0)
            p2 = tl.load(kp + 2 * J, mask=tok_ok[None, :], other=0)
            s = lookup_dots(None, qp[0], qp[1], p0, LUT_LO, LUT_HI)
            s = lookup_dots(s, qp[2], qp[3], p1, LUT_LO, LUT_HI)
            s = lookup_dots(s, qp[4], qp[5], p2, LUT_LO, LUT_HI)
            s = lookup_dots(s, qp[6], qp[7], spare_codes(p0, p1, p2, True), LUT_LO, LUT_HI)
        else:
            kp = pool_ptr + (plane[:, None] + off[:, None] * KB + jj[None, :])
            p0 = tl.load(kp, mask=tok_ok[:, None], other=0)
            p1 = tl.load(kp + J, mask=tok_ok[:, None], other=0)
            p2 = tl.load(kp + 2 * J, mask=tok_ok[:, None], other=0)
            p67 = spare_codes(p0, p1, p2, False)
            s = gather_dots(None, qp[0], qp[1], p0, table)
            s = gather_dots(s, qp[2], qp[3], p1, table)
            s = gather_dots(s, qp[4], qp[5], p2, table)
            s = gather_dots(s, qp[6], qp[7], p67, table)
    elif KEY_BITS == 3:
        kc = unpack3(pool_ptr, plane, off * KB, tok_ok, BLOCK_N, CODE_GROUPS, D // 8)
        if KEY_LUT:  # 4 codes per prmt selector (key_lut.lut3_codes_asm)
            k = tl.inline_asm_elementwise(LUT_LO, LUT_CODES_CONSTRAINTS, [kc], dtype=tl.float16, is_pure=True, pack=4)
        else:
            k = tl.gather(table, kc, 1)
        s = tl.dot(q16, tl.trans(k))
    else:
        kb = tl.load(pool_ptr + (plane[:, None] + off[:, None] * KB + dc[None, :]), mask=tok_ok[:, None] & (dc[None, :] < D), other=0)
        k = kb.to(tl.float8e4nv, bitcast=True).to(tl.float16)
        s = tl.dot(q16, tl.trans(k))
    if META_PAIRS:
        k_scale, v_scale, v_mid = load_meta_pairs(t0, end, pool_first, bt_row, pool_ptr, block_bytes, head_off, T, META,
                                              BLOCK_N, HAS_KV_START, HAS_PREFIX, MASKED)
    elif HEADS_PER_PROGRAM > 1:
        k_scale = heads_meta(pool_ptr, plane, plane_bytes, 0, off, T, META, tok_ok, META_WORDS, sub, HEADS_PER_PROGRAM)
    else:
        k_scale = load_meta(pool_ptr, plane, 0, off, T, META, tok_ok, META_WORDS)
    if MASKED:
        vis = tok_ok[None, :] & (tok[None, :] <= qpos[:, None])
        if HAS_WINDOW:
            vis = vis & (tok[None, :] > qpos[:, None] - window)
    else:
        vis = tl.full((BLOCK_M, BLOCK_N), True, tl.int1)
    if not HAS_SOFTCAP:
        # log2 logits = row_scale * (s * k_scale) + q_mu: the per-row factor and offset enter the
        # row max and the exp2's FFMA instead of every score
        x = tl.where(vis, s * (k_scale if HEADS_PER_PROGRAM > 1 else k_scale[None, :]), -float("inf"))
        m_new = tl.maximum(m_i, tl.max(x, axis=1) * row_scale + row_off)
        m_use = tl.where(m_new == -float("inf"), 0.0, m_new)
        p = tl.exp2(x * row_scale[:, None] + (row_off - m_use)[:, None])
        alpha = tl.exp2(m_i - m_use)
        m_i = m_new
    else:
        s = s * row_scale[:, None] * (k_scale if HEADS_PER_PROGRAM > 1 else k_scale[None, :])
        if HAS_KEY_OFFSET:
            s = s + q_mu[:, None]
        s = log2_logits(s, softcap, HAS_SOFTCAP)
        p, alpha, m_i = softmax_p(tl.where(vis, s, -float("inf")), m_i)

    # online softmax sums; the values' rank-1 term p . bias rides along (one cross-warp reduction)
    if HEADS_PER_PROGRAM > 1:
        v_scale = heads_meta(pool_ptr, plane, plane_bytes, 1, off, T, META, tok_ok, META_WORDS, sub, HEADS_PER_PROGRAM)
        v_mid = heads_meta(pool_ptr, plane, plane_bytes, 2, off, T, META, tok_ok, META_WORDS, sub, HEADS_PER_PROGRAM)
        sum_p, sum_pb = tl.reduce((p, p * (v_mid - v_scale * HALF)), 1, add_pairs)
    else:  # [N] fields (expanded at each use: as the pipeliner and the register allocation were measured)
        if not META_PAIRS:
            v_scale = load_meta(pool_ptr, plane, 1, off, T, META, tok_ok, META_WORDS)
            v_mid = load_meta(pool_ptr, plane, 2, off, T, META, tok_ok, META_WORDS)
        sum_p, sum_pb = tl.reduce((p, p * (v_mid - v_scale * HALF)[None, :]), 1, add_pairs)
    l_i = l_i * alpha + sum_p
    bias_acc = bias_acc * alpha + sum_pb

    # values
    if HEADS_PER_PROGRAM == 1:
        v_scale = v_scale[None, :]
        v_mid = v_mid[None, :]
    if VMID_CHAIN:  # v_mid enters the MMA operand's chain (+ 0 * v_mid): Triton's pipeliner prefetches only such loads
        ps = (p * (v_scale + 0.0 * v_mid)).to(tl.float16)
    else:
        ps = (p * v_scale).to(tl.float16)
    WORDS4: tl.constexpr = VALUE_BITS == 4 and VALUE_WORDS
    if (WORDS4 or PLANE_WORDS) and HEADS_PER_PROGRAM == 1:  # 4 accumulators (value_col), _value_word_codes
        v0, v1, v2, v3 = _value_word_codes(pool_ptr, plane, 0, off, tok_ok, vcol, T, KB, VB, D, VALUE_COLS,
                                           VALUE_PTX, WORDS4, PLANE_WORDS, VALUE_BOUNDARY)
        acc0 = rescaled_dot(ps, v0, acc0, alpha[:, None])
        acc1 = rescaled_dot(ps, v1, acc1, alpha[:, None])
        acc2 = rescaled_dot(ps, v2, acc2, alpha[:, None])
        acc3 = rescaled_dot(ps, v3, acc3, alpha[:, None])
    elif WORDS4 or PLANE_WORDS:
        t0 = tl.zeros(acc0.shape, tl.float32)  # the tile's sums from zero (rescaled_dot)
        t1 = tl.zeros(acc1.shape, tl.float32)
        t2 = tl.zeros(acc2.shape, tl.float32)
        t3 = tl.zeros(acc3.shape, tl.float32)
        for j in tl.static_range(HEADS_PER_PROGRAM):  # HEADS_PER_PROGRAM KV heads: P's rows outside head j's are zero in its dots
            v0, v1, v2, v3 = _value_word_codes(pool_ptr, plane, j * plane_bytes, off, tok_ok, vcol, T, KB, VB, D,
                                               VALUE_COLS, VALUE_PTX, WORDS4, PLANE_WORDS, VALUE_BOUNDARY)
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
        vb = tl.load(pool_ptr + (plane[:, None] + T * KB + off[:, None] * VB + vcol[None, :]), mask=tok_ok[:, None] & (vcol[None, :] < VALUE_COLS), other=0)
        n0 = nibbles_to_f16(vb, False)
        n1 = nibbles_to_f16(vb, True)
        if VALUE_BOUNDARY:
            n0 = operand_boundary(n0)
            n1 = operand_boundary(n1)
        acc0 = rescaled_dot(ps, n0, acc0, alpha[:, None])
        acc1 = rescaled_dot(ps, n1, acc1, alpha[:, None])
    elif VALUE_PLANES:  # 64-row tiles: acc_J, J = 0, 1, coordinates J * D/2 + vcol (codes a = 2J + vcol // (D/4))
        v_row = pool_ptr + (plane[:, None] + T * KB + off[:, None] * VB)
        vm = tok_ok[:, None] & (vcol[None, :] < VALUE_COLS)
        j = vcol % (D // 4)
        low = tl.load(v_row + j[None, :], mask=vm, other=0)
        high = tl.load(v_row + D // 4 + (j % (D // 8))[None, :], mask=vm, other=0)
        acc0 = rescaled_dot(ps, value_plane_bytes(low, high, vcol, 0, D), acc0, alpha[:, None])
        acc1 = rescaled_dot(ps, value_plane_bytes(low, high, vcol, 1, D), acc1, alpha[:, None])
    else:
        vc = unpack3(pool_ptr, plane, T * KB + off * VB, tok_ok, BLOCK_N, CODE_GROUPS, D // 8)
        vf = codes_to_f16(vc)
        if VALUE_BOUNDARY:
            vf = operand_boundary(vf)
        acc0 = rescaled_dot(ps, vf, acc0, alpha[:, None])
    return m_i, l_i, acc0, acc1, acc2, acc3, bias_acc


