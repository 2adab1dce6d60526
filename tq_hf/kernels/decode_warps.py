"""Split decode in one-warp programs: 4-bit codebook keys and 4-bit values, plain format, KV heads in pairs.

Why: the unified kernel's decode spreads each tile's tokens over 4 warps, so every tile's online softmax
needs cross-warp reductions, and P crosses shared memory, behind CTA barriers (Nsight Compute: issue slots
45% busy). Here a program is one warp with its own softmax state; more split programs take the place of the
warps and the split reduction (reduce.py) merges them. The scores are S^T = K Q^T: the tokens on the MMA's M,
the query rows of two KV heads on its N = 8 (a 16-row tile held 4 real rows per head), so a tile of 32 tokens
of both heads takes 64 MMAs and a softmax over 8 scores per thread, against 128 and 16; the values' product is
O^T = V^T P^T, and no CTA barrier is left in the loop. The levers (centering, value rotation, exact prefix and
ring) keep the unified kernel: in this one they spilled and ran slower.

The key and value codes are decoded by the same asm as the unified kernel's code words (key_lut.py,
value_nibbles.py): keys as the MMA's A operand [tokens, words] (two words of a token per register), values
as its A operand [words, tokens] (two tokens' words per register); each tile's value sums start from zero
(softmax.rescaled_dot). The query is rotated in the prologue by fp16 MMAs: with rotation="hadamard" (the
default) by H_{D/4} built in registers over signed sums of the query's quarters (all programs reading R from
L2 at once had taken most of the prologue), else over R's high and low halves (rotation_halves).
warp_plan.py decides when a launch takes this kernel and with what grid.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..layout import BlockLayout
from .code_decoders import LUT_WORDS_CONSTRAINTS, value_word_nibbles
from .codec_tensors import codec_tensors
from .metadata import load_meta
from .rotation import hadamard_entries, hadamard_signs
from .softmax import add_pairs


@functools.lru_cache(maxsize=None)
def rotation_halves(layout: BlockLayout, device: str) -> torch.Tensor:
    """R [D, D] as fp16 high and low parts [2, D, D] (R = hi + lo to ~2**-22): the prologue's q @ R^T in
    fp16 MMAs with fp32 sums."""
    rot = codec_tensors(layout, device)[0]
    hi = rot.half()
    return torch.stack([hi, (rot - hi.float()).half()]).contiguous()


@triton.jit
def _query_rows(q_ptr, s_qb, s_qh, s_ql, Lq, b, hp, coords, nn, G: tl.constexpr, HEADS_PER_PROGRAM: tl.constexpr):
    """Coordinates `coords` of the query rows of the program's KV heads (hp * H .. hp * H + H - 1, H =
    HEADS_PER_PROGRAM) as fp32 [len(coords), QUERY_COLS] (column n: head n % H, row n // H; zero past G * Lq rows)."""
    r = nn // HEADS_PER_PROGRAM
    qhead = (hp * HEADS_PER_PROGRAM + nn % HEADS_PER_PROGRAM) * G + r % G
    return tl.load(q_ptr + b.to(tl.int64) * s_qb + qhead.to(tl.int64)[None, :] * s_qh
                   + (r // G).to(tl.int64)[None, :] * s_ql + coords[:, None], mask=(r < G * Lq)[None, :],
                   other=0.0).to(tl.float32)


@triton.jit
def _split_dot(m, x, acc):
    """acc + m @ x for fp16 m and fp32 x with |x| <= 1: x's high and low fp16 parts in two MMAs (to ~2**-22)."""
    hi = x.to(tl.float16)
    return tl.dot(m, hi, tl.dot(m, (x - hi.to(tl.float32)).to(tl.float16), acc))


@triton.jit
def _rotated_query(q_ptr, s_qb, s_qh, s_ql, rot_ptr, Lq, sm_scale, b, hp, uu, nn, KEY_UNIT: tl.constexpr,
                   D: tl.constexpr, QUERY_COLS: tl.constexpr, G: tl.constexpr, HEADS_PER_PROGRAM: tl.constexpr,
                   HADAMARD: tl.constexpr):
    """The query rows of the program's H = HEADS_PER_PROGRAM KV heads, rotated (q @ R^T), as H * 4 fp16
    [1, D/4, QUERY_COLS] tiles: tile 4j + c holds coordinate (c // 2) * D/2 + 2u + c % 2 of word u (key_lut's
    order) in the columns of head j (column n: head n % H, row n // H), zero in the others; and each column's log2
    score scale. The query is scaled to its largest magnitude first, so any range fits fp16 (_split_dot).
    General R: its high and low fp16 parts (rotation_halves) meet the query's in three MMAs per tile (the low x low
    term is below fp32 rounding). HADAMARD (R = H diag(s) / sqrt(D), Sylvester H; R's first row gives s): as
    coordinate (c // 2) * D/2 + 2u + c % 2 of H's index splits into bits, H[(c, u), (a, v, e)] =
    (-1)^((c // 2) a + (c % 2) e) H_{D/4}[u, v] for query coordinate a * D/2 + 2v + e, so tile c is H_{D/4} (built
    in registers) times a signed sum of the four quarters of s * q: no read of R, 8 small MMAs in all (every program
    reading the same 64 KiB of R from L2 at once had taken most of the prologue)."""
    rotated = ()
    qmax = tl.zeros((QUERY_COLS,), tl.float32)
    if HADAMARD:
        U: tl.constexpr = D // 4
        quarters = ()
        for a in tl.static_range(2):
            for e in tl.static_range(2):
                coords = a * (D // 2) + 2 * uu + e
                quarters = quarters + (_query_rows(q_ptr, s_qb, s_qh, s_ql, Lq, b, hp, coords, nn, G, HEADS_PER_PROGRAM)
                                       * hadamard_signs(rot_ptr, coords, D)[:, None],)
        sums = ()
        q_big = tl.zeros((QUERY_COLS,), tl.float32)
        for c in tl.static_range(4):  # quarter (a, e) signed by (-1)^((c // 2) a + (c % 2) e)
            y = quarters[0]
            y = y - quarters[1] if c % 2 else y + quarters[1]
            y = y - quarters[2] if c // 2 else y + quarters[2]
            y = y + quarters[3] if (c // 2 + c % 2) % 2 == 0 else y - quarters[3]
            q_big = tl.maximum(q_big, tl.max(tl.abs(y), axis=0))
            sums = sums + (y,)
        q_big = tl.where(q_big > 0, q_big, 1.0)
        h = hadamard_entries(uu, uu, uu < U)
        for c in tl.static_range(4):
            q_c = _split_dot(h, sums[c] / q_big[None, :], tl.zeros((U, QUERY_COLS), tl.float32))
            qmax = tl.maximum(qmax, tl.max(tl.abs(q_c), axis=0))
            rotated = rotated + (q_c,)
    else:
        dd = tl.arange(0, D)
        q = _query_rows(q_ptr, s_qb, s_qh, s_ql, Lq, b, hp, dd, nn, G, HEADS_PER_PROGRAM)
        q_big = tl.max(tl.abs(q), axis=0)
        q_big = tl.where(q_big > 0, q_big, 1.0)
        q = q / q_big[None, :]
        for c in tl.static_range(4):
            coord = (c // 2) * (D // 2) + 2 * uu + c % 2
            r_hi = tl.load(rot_ptr + coord[:, None] * D + dd[None, :])
            r_lo = tl.load(rot_ptr + D * D + coord[:, None] * D + dd[None, :])
            q_c = _split_dot(r_hi, q, tl.dot(r_lo, q.to(tl.float16)))
            qmax = tl.maximum(qmax, tl.max(tl.abs(q_c), axis=0))
            rotated = rotated + (q_c,)
    qdiv = tl.where(qmax > 0, qmax, 1.0)
    tiles = ()
    for j in tl.static_range(HEADS_PER_PROGRAM):
        for c in tl.static_range(4):
            tile = tl.where((nn % HEADS_PER_PROGRAM == j)[None, :], rotated[c] / qdiv[None, :], 0.0).to(tl.float16)
            # [1, D/4, QUERY_COLS] for batched (3D) dots: Triton then converts the tile to the MMA operand layout once,
            # before the walk; as a 2D operand the conversion (32 shuffles + 32 byte permutes) ran in every
            # iteration (offline sm_90a SASS: 1,163 -> 1,095 instructions per tile)
            tiles = tiles + (tl.broadcast_to(tile[None, :, :], (1, D // 4, QUERY_COLS)),)
    unit = sm_scale * KEY_UNIT * 1.4426950408889634
    if HADAMARD:
        unit = unit / tl.sqrt(D * 1.0)
    return tiles, qdiv * q_big * unit


@triton.jit
def _warp_tile(t0, end, qpos, blk, m_i, l_i, a0, a1, a2, a3, bias, qs, rsc, pool_ptr, cent_ptr, head_off,
               plane_bytes, block_bytes, ii, uu, nn, LUT: tl.constexpr, PTX: tl.constexpr, KEY_UNIT: tl.constexpr,
               D: tl.constexpr, T: tl.constexpr, KB: tl.constexpr, VB: tl.constexpr, META: tl.constexpr,
               BLOCK_N: tl.constexpr, QUERY_COLS: tl.constexpr, HEADS_PER_PROGRAM: tl.constexpr, HALF: tl.constexpr, POOL64: tl.constexpr,
               MASKED: tl.constexpr):
    """One BLOCK_N-token tile [t0, t0 + BLOCK_N) of both heads: scores, online softmax, values. MASKED: the
    tile may reach past `end` or past a row's position (causal, Lq > 1); else every score is visible."""
    tok = t0 + ii
    if MASKED:
        ok = tok < end
    else:
        ok = tl.full((BLOCK_N,), True, tl.int1)
    off = tok % T
    if POOL64:  # a pool of >= 2**31 bytes
        base = blk.to(tl.int64) * block_bytes + head_off
    else:
        base = blk * block_bytes + head_off
    col_head = (nn % HEADS_PER_PROGRAM)[None, :]  # the heads interleave in the columns: a function of the register, folded
    s = tl.zeros((1, BLOCK_N, QUERY_COLS), tl.float32)
    k_scale = tl.zeros((BLOCK_N, QUERY_COLS), tl.float32)
    v_scale = tl.zeros((BLOCK_N, QUERY_COLS), tl.float32)
    v_mid = tl.zeros((BLOCK_N, QUERY_COLS), tl.float32)
    for j in tl.static_range(HEADS_PER_PROGRAM):
        plane = base + j * plane_bytes
        kw = tl.load((pool_ptr + (plane + off * KB)[:, None]).to(tl.pointer_type(tl.uint16)) + uu[None, :],
                     mask=ok[:, None], other=0)  # [N, D/4] code words, the MMA's A operand
        if PTX:
            k0, k1, k2, k3 = tl.inline_asm_elementwise(LUT, LUT_WORDS_CONSTRAINTS, [kw],
                                                       dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
                                                       is_pure=True, pack=2)
        else:  # the interpreter: the asm's values (centroid / KEY_UNIT, fp16 subnormals) by gathers
            table = tl.broadcast_to((tl.load(cent_ptr + tl.arange(0, 16)) / KEY_UNIT).to(tl.float16)[None, :],
                                    (BLOCK_N, 16))
            k0 = tl.gather(table, (kw & 15).to(tl.int32), 1)
            k1 = tl.gather(table, ((kw >> 8) & 15).to(tl.int32), 1)
            k2 = tl.gather(table, ((kw >> 4) & 15).to(tl.int32), 1)
            k3 = tl.gather(table, (kw >> 12).to(tl.int32), 1)
        s = tl.dot(k0[None, :, :], qs[4 * j], s)
        s = tl.dot(k1[None, :, :], qs[4 * j + 1], s)
        s = tl.dot(k2[None, :, :], qs[4 * j + 2], s)
        s = tl.dot(k3[None, :, :], qs[4 * j + 3], s)
        mine = col_head == j
        k_scale = tl.where(mine, load_meta(pool_ptr, plane, 0, off, T, META, ok, True)[:, None], k_scale)
        v_scale = tl.where(mine, load_meta(pool_ptr, plane, 1, off, T, META, ok, True)[:, None], v_scale)
        v_mid = tl.where(mine, load_meta(pool_ptr, plane, 2, off, T, META, ok, True)[:, None], v_mid)
    x = tl.reshape(s, (BLOCK_N, QUERY_COLS)) * k_scale
    if MASKED:
        x = tl.where(ok[:, None] & (tok[:, None] <= qpos[None, :]), x, -float("inf"))
    m_new = tl.maximum(m_i, tl.max(x, axis=0) * rsc)
    m_use = tl.where(m_new == -float("inf"), 0.0, m_new)
    p = tl.exp2(x * rsc[None, :] - m_use[None, :])
    alpha = tl.exp2(m_i - m_use)
    sum_p, sum_pb = tl.reduce((p, p * (v_mid - v_scale * HALF)), 0, add_pairs)
    l_i = l_i * alpha + sum_p
    bias = bias * alpha + sum_pb
    ps = (p * (v_scale + 0.0 * v_mid)).to(tl.float16)  # v_mid joins the MMA operand's chain: prefetched
    t0 = tl.zeros(a0.shape, tl.float32)  # the tile's sums from zero (rescaled_dot)
    t1 = tl.zeros(a1.shape, tl.float32)
    t2 = tl.zeros(a2.shape, tl.float32)
    t3 = tl.zeros(a3.shape, tl.float32)
    for j in tl.static_range(HEADS_PER_PROGRAM):
        plane = base + j * plane_bytes
        vw = tl.load((pool_ptr + (plane + T * KB + off * VB)[None, :]).to(tl.pointer_type(tl.uint16)) + uu[:, None],
                     mask=ok[None, :], other=0)  # [D/4, N] value words, the MMA's A operand
        v0, v1, v2, v3 = value_word_nibbles(vw, PTX)
        ps_j = tl.where(col_head == j, ps, 0.0)
        t0 = tl.dot(v0, ps_j, t0)
        t1 = tl.dot(v1, ps_j, t1)
        t2 = tl.dot(v2, ps_j, t2)
        t3 = tl.dot(v3, ps_j, t3)
    a0 = tl.fma(a0, alpha[None, :], t0)
    a1 = tl.fma(a1, alpha[None, :], t1)
    a2 = tl.fma(a2, alpha[None, :], t2)
    a3 = tl.fma(a3, alpha[None, :], t3)
    return m_new, l_i, a0, a1, a2, a3, bias


# The same runtime arguments as unified._attn_kernel (unified_attention builds one tuple); the exact prefix,
# ring, key offset, value rotation, sinks and window are not this kernel's (the launcher never picks it there).
@triton.jit(do_not_specialize=["recent_from", "Lq", "num_splits", "prefix_len"])
def _warp_kernel(
    q_ptr, s_qb, s_qh, s_ql, o_ptr, s_ob, s_oh, s_ol, pool_ptr, bt_ptr, s_bt, seq_ptr, kvs_ptr, sink_ptr,
    rot_ptr,  # [2, D, D] fp16: R's high and low parts (rotation_halves)
    cent_ptr,  # [16] fp32 centroids by stored code (the interpreter's gathers)
    koff_ptr, s_koff, vrot_ptr,
    pout_ptr,  # [B, Hk, NS, ROWS_PER_HEAD, DP] fp32 split partial outputs
    plse_ptr,  # [B, Hk, NS, ROWS_PER_HEAD] fp32 split log2-sum-exp
    pk_ptr, s_pkb, s_pkh, s_pkp, pv_ptr, s_pvb, s_pvh, s_pvp, prefix_len,
    rk_ptr, s_rkb, s_rkh, s_rkp, rv_ptr, s_rvb, s_rvh, s_rvp, recent_size, recent_from,
    Lq, num_splits, sm_scale, softcap, window, block_bytes, plane_bytes,
    D: tl.constexpr, DP: tl.constexpr, T: tl.constexpr, KB: tl.constexpr, VB: tl.constexpr, META: tl.constexpr,
    G: tl.constexpr, QUERY_COLS: tl.constexpr, HEADS_PER_PROGRAM: tl.constexpr, ROWS_PER_HEAD: tl.constexpr,  # ROWS_PER_HEAD: partial rows per KV head
    BLOCK_N: tl.constexpr, KEY_UNIT: tl.constexpr, LUT: tl.constexpr, PTX: tl.constexpr, POOL64: tl.constexpr,
    HALF: tl.constexpr, HADAMARD: tl.constexpr,
):
    split = tl.program_id(0)
    hp = tl.program_id(1)
    b = tl.program_id(2)
    npairs = tl.num_programs(1)
    U: tl.constexpr = D // 4
    seq_len = tl.load(seq_ptr + b).to(tl.int32)
    n_tiles = tl.cdiv(seq_len, BLOCK_N)
    per_split = tl.cdiv(n_tiles, num_splits)
    start = split * per_split * BLOCK_N
    end = tl.minimum(start + per_split * BLOCK_N, seq_len)
    # whole tiles every row sees (positions <= seq_len - Lq), then the masked rest
    body_end = start + tl.maximum(tl.minimum(end, seq_len - Lq + 1) - start, 0) // BLOCK_N * BLOCK_N
    ii = tl.arange(0, BLOCK_N)
    uu = tl.arange(0, U)
    nn = tl.arange(0, QUERY_COLS)
    r = nn // HEADS_PER_PROGRAM
    qpos = seq_len - Lq + r // G
    qs, rsc = _rotated_query(q_ptr, s_qb, s_qh, s_ql, rot_ptr, Lq, sm_scale, b, hp, uu, nn, KEY_UNIT, D, QUERY_COLS, G, HEADS_PER_PROGRAM,
                             HADAMARD)

    m_i = tl.full((QUERY_COLS,), -float("inf"), tl.float32)
    l_i = tl.zeros((QUERY_COLS,), tl.float32)
    bias = tl.zeros((QUERY_COLS,), tl.float32)
    # accumulator c holds coordinate (c % 2) * D/2 + 2u + c // 2 of word u (value_word_nibbles' order), in the codes'
    # fp16 scale (x 2**-24, odd c x 2**-20)
    a0 = tl.zeros((U, QUERY_COLS), tl.float32)
    a1 = tl.zeros((U, QUERY_COLS), tl.float32)
    a2 = tl.zeros((U, QUERY_COLS), tl.float32)
    a3 = tl.zeros((U, QUERY_COLS), tl.float32)
    head_off = hp * HEADS_PER_PROGRAM * plane_bytes
    bt_row = bt_ptr + b.to(tl.int64) * s_bt
    # the walk's block-table entries an iteration ahead, so the codes' loads are direct (prefetched a tile ahead)
    blk_n = tl.load(bt_row + (start + ii) // T, mask=start + ii < body_end, other=0)
    for t0 in range(start, body_end, BLOCK_N):
        blk = blk_n
        blk_n = tl.load(bt_row + (t0 + BLOCK_N + ii) // T, mask=t0 + BLOCK_N + ii < body_end, other=0)
        m_i, l_i, a0, a1, a2, a3, bias = _warp_tile(
            t0, end, qpos, blk, m_i, l_i, a0, a1, a2, a3, bias, qs, rsc, pool_ptr, cent_ptr, head_off, plane_bytes,
            block_bytes, ii, uu, nn, LUT, PTX, KEY_UNIT, D, T, KB, VB, META, BLOCK_N, QUERY_COLS, HEADS_PER_PROGRAM, HALF, POOL64, False)
    for t0 in range(body_end, end, BLOCK_N):
        blk = tl.load(bt_row + (t0 + ii) // T, mask=t0 + ii < end, other=0)
        m_i, l_i, a0, a1, a2, a3, bias = _warp_tile(
            t0, end, qpos, blk, m_i, l_i, a0, a1, a2, a3, bias, qs, rsc, pool_ptr, cent_ptr, head_off, plane_bytes,
            block_bytes, ii, uu, nn, LUT, PTX, KEY_UNIT, D, T, KB, VB, META, BLOCK_N, QUERY_COLS, HEADS_PER_PROGRAM, HALF, POOL64, True)

    # this split's normalised partial and log2-sum-exp per (KV head, row), as the unified kernel writes them
    has = l_i > 0
    inv_l = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
    bias_out = (bias * inv_l)[None, :]
    row_ok = r < G * Lq
    prow = ((b * (npairs * HEADS_PER_PROGRAM) + hp * HEADS_PER_PROGRAM + nn % HEADS_PER_PROGRAM) * num_splits + split) * ROWS_PER_HEAD + r
    tl.store(plse_ptr + prow, tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), -float("inf")), mask=row_ok)
    dst = pout_ptr + prow.to(tl.int64)[None, :] * DP
    om = row_ok[None, :]
    lo = (inv_l * 16777216.0)[None, :]
    hi = (inv_l * 1048576.0)[None, :]
    tl.store(dst + (2 * uu)[:, None], a0 * lo + bias_out, mask=om)
    tl.store(dst + (2 * uu + D // 2)[:, None], a1 * hi + bias_out, mask=om)
    tl.store(dst + (2 * uu + 1)[:, None], a2 * lo + bias_out, mask=om)
    tl.store(dst + (2 * uu + 1 + D // 2)[:, None], a3 * hi + bias_out, mask=om)
