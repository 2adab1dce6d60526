"""Prototype: warp-split, transposed decode of 4-bit codebook keys + 4-bit values (plain format, head pairs).

Each warp walks its own TPW tokens of every BLOCK_N = W * TPW tile with its own online-softmax state (batched
3D dots: warps on the batch dim), so no cross-warp reduction or barrier per tile; the scores are S^T = K Q^T
(tokens on the MMA's M, the 2 x 4 query rows of a head pair on its N = 8: no padded rows), the output
O^T = V^T P^T (coordinates on M). The warps' states merge once at the end."""
import torch
import triton
import triton.language as tl

from tq_hf.kernels.attention import LUT_WORDS_CONSTRAINTS, _value_nibbles


@triton.jit
def _meta(pool_ptr, plane, field: tl.constexpr, off, T: tl.constexpr, META: tl.constexpr, ok):
    ptr = (pool_ptr + (plane + META + (field * T + (off & -2)) * 2)).to(tl.pointer_type(tl.uint32))
    w = tl.load(ptr, mask=ok, other=0)
    return tl.where((off & 1) != 0, w & 0xFFFF0000, w << 16).to(tl.float32, bitcast=True)


@triton.jit
def _tile(t0, end, blk, m_i, l_i, a0, a1, a2, a3, bias, qs, rsc, pool_ptr, head_off, plane_bytes, block_bytes,
          ww, ii, uu, nn, tab_ptr, LUT: tl.constexpr, PTX: tl.constexpr, D: tl.constexpr, T: tl.constexpr, KB: tl.constexpr, VB: tl.constexpr,
          META: tl.constexpr, W: tl.constexpr, TPW: tl.constexpr, NR: tl.constexpr, RH: tl.constexpr,
          HP: tl.constexpr, HALF: tl.constexpr, SACC: tl.constexpr, BIG: tl.constexpr, MASKED: tl.constexpr):
    tok = t0 + ww[:, None] * TPW + ii[None, :]  # [W, TPW]
    if MASKED:
        ok = tok < end
    else:
        ok = tl.full((W, TPW), True, tl.int1)
    off = tok % T
    if BIG:  # a pool of >= 2**31 bytes: int64 offsets
        base = blk.to(tl.int64) * block_bytes + head_off
    else:
        base = blk * block_bytes + head_off
    col_head = (nn % HP)[None, None, :]  # columns interleave the heads: a register's index  # [1, 1, NR]
    s0 = tl.zeros((W, TPW, NR), tl.float32)
    s1 = s0
    s2 = s0
    s3 = s0
    ks = tl.zeros((W, TPW, NR), tl.float32)
    vs = tl.zeros((W, TPW, NR), tl.float32)
    vm = tl.zeros((W, TPW, NR), tl.float32)
    for j in tl.static_range(HP):
        pj = base + j * plane_bytes
        kw = tl.load((pool_ptr + (pj + off * KB)[:, :, None]).to(tl.pointer_type(tl.uint16)) + uu[None, None, :],
                     mask=ok[:, :, None], other=0)  # [W, TPW, U]
        if PTX:
            k0, k1, k2, k3 = tl.inline_asm_elementwise(LUT, LUT_WORDS_CONSTRAINTS, [kw],
                                                       dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
                                                       is_pure=True, pack=2)
        else:  # the interpreter: the asm's values (sign x magnitude byte x 2**-24) by gathers
            tab3 = tl.broadcast_to(tl.load(tab_ptr + tl.arange(0, 16))[None, None, :], (W, TPW, 16))
            k0 = tl.gather(tab3, (kw & 15).to(tl.int32), 2)
            k1 = tl.gather(tab3, ((kw >> 8) & 15).to(tl.int32), 2)
            k2 = tl.gather(tab3, ((kw >> 4) & 15).to(tl.int32), 2)
            k3 = tl.gather(tab3, (kw >> 12).to(tl.int32), 2)
        if SACC == 4:  # four independent MMA chains, summed once
            s0 = tl.dot(k0, qs[4 * j], s0)
            s1 = tl.dot(k1, qs[4 * j + 1], s1)
            s2 = tl.dot(k2, qs[4 * j + 2], s2)
            s3 = tl.dot(k3, qs[4 * j + 3], s3)
        elif SACC == 2:
            s0 = tl.dot(k0, qs[4 * j], s0)
            s1 = tl.dot(k1, qs[4 * j + 1], s1)
            s0 = tl.dot(k2, qs[4 * j + 2], s0)
            s1 = tl.dot(k3, qs[4 * j + 3], s1)
        else:
            s0 = tl.dot(k0, qs[4 * j], s0)
            s0 = tl.dot(k1, qs[4 * j + 1], s0)
            s0 = tl.dot(k2, qs[4 * j + 2], s0)
            s0 = tl.dot(k3, qs[4 * j + 3], s0)
        sel = col_head == j
        ks = tl.where(sel, _meta(pool_ptr, pj, 0, off, T, META, ok)[:, :, None], ks)
        vs = tl.where(sel, _meta(pool_ptr, pj, 1, off, T, META, ok)[:, :, None], vs)
        vm = tl.where(sel, _meta(pool_ptr, pj, 2, off, T, META, ok)[:, :, None], vm)
    if SACC == 4:
        s = (s0 + s1) + (s2 + s3)
    elif SACC == 2:
        s = s0 + s1
    else:
        s = s0
    x = s * ks
    if MASKED:
        x = tl.where(ok[:, :, None], x, -float("inf"))
    m_new = tl.maximum(m_i, tl.max(x, axis=1) * rsc[None, :])  # [W, NR]
    m_use = tl.where(m_new == -float("inf"), 0.0, m_new)
    p = tl.exp2(x * rsc[None, None, :] - m_use[:, None, :])
    alpha = tl.exp2(m_i - m_use)
    sp, spb = tl.reduce((p, p * (vm - vs * HALF)), 1, _add2)
    l_i = l_i * alpha + sp
    bias = bias * alpha + spb
    ps = (p * (vs + 0.0 * vm)).to(tl.float16)  # [W, TPW, NR]: v_mid in the MMA operand's chain (prefetched)
    a0 = a0 * alpha[:, None, :]
    a1 = a1 * alpha[:, None, :]
    a2 = a2 * alpha[:, None, :]
    a3 = a3 * alpha[:, None, :]
    for j in tl.static_range(HP):
        pj = base + j * plane_bytes
        vw = tl.load((pool_ptr + (pj + T * KB + off * VB)[:, None, :]).to(tl.pointer_type(tl.uint16))
                     + uu[None, :, None], mask=ok[:, None, :], other=0)  # [W, U, TPW]
        v0, v1, v2, v3 = _value_nibbles(vw, PTX)
        ps_j = tl.where(col_head == j, ps, 0.0)
        a0 = tl.dot(v0, ps_j, a0)
        a1 = tl.dot(v1, ps_j, a1)
        a2 = tl.dot(v2, ps_j, a2)
        a3 = tl.dot(v3, ps_j, a3)
    return m_new, l_i, a0, a1, a2, a3, bias


@triton.jit
def _add2(a0, b0, a1, b1):
    return a0 + a1, b0 + b1


@triton.jit
def _rotated_query(q_ptr, s_qb, s_qh, s_ql, rot_ptr, Lq, sm_scale, b, hp, uu, nn, KEY_UNIT: tl.constexpr,
                   D: tl.constexpr, NR: tl.constexpr, G: tl.constexpr, HP: tl.constexpr):
    """The query rows of head pair hp, rotated (q @ R^T), as HP * 4 fp16 [U, NR] word coordinate sets (column n:
    head n % HP's row n // HP, zero in the other heads' columns), and each column's log2 score scale."""
    jh = nn % HP
    r = nn // HP
    qi = r // G
    row_ok = r < G * Lq
    qhead = (hp * HP + jh) * G + r % G
    dd = tl.arange(0, D)
    q_in = tl.load(q_ptr + b.to(tl.int64) * s_qb + qhead.to(tl.int64)[None, :] * s_qh + qi.to(tl.int64)[None, :] * s_ql
                   + dd[:, None], mask=row_ok[None, :], other=0.0).to(tl.float32)  # [D, NR]
    q_big = tl.max(tl.abs(q_in), axis=0)
    q_in = q_in / tl.where(q_big > 0, q_big, 1.0)[None, :]
    q_hi = q_in.to(tl.float16)
    q_lo = (q_in - q_hi.to(tl.float32)).to(tl.float16)
    qc = ()
    qmax = tl.zeros((NR,), tl.float32)
    for c in tl.static_range(4):  # coordinates 2u, 2u + 1, D/2 + 2u, D/2 + 2u + 1 of word u
        coord = (c // 2) * (D // 2) + 2 * uu + c % 2
        r_hi = tl.load(rot_ptr + coord[:, None] * D + dd[None, :])
        r_lo = tl.load(rot_ptr + D * D + coord[:, None] * D + dd[None, :])
        q_c = tl.dot(r_hi, q_hi, tl.dot(r_hi, q_lo, tl.dot(r_lo, q_hi)))
        qmax = tl.maximum(qmax, tl.max(tl.abs(q_c), axis=0))
        qc = qc + (q_c,)
    qdiv = tl.where(qmax > 0, qmax, 1.0)
    qs = ()
    for j in tl.static_range(HP):
        for c in tl.static_range(4):
            qs = qs + (tl.where((jh == j)[None, :], qc[c] / qdiv[None, :], 0.0).to(tl.float16),)
    return qs, qdiv * tl.where(q_big > 0, q_big, 1.0) * (sm_scale * KEY_UNIT * 1.4426950408889634)


@triton.jit
def _ws_query_kernel(q_ptr, s_qb, s_qh, s_ql, rot_ptr, Lq, sm_scale, qt_ptr, rs_ptr, KEY_UNIT: tl.constexpr,
                     D: tl.constexpr, NR: tl.constexpr, G: tl.constexpr, HP: tl.constexpr):
    hp = tl.program_id(0)
    b = tl.program_id(1)
    U: tl.constexpr = D // 4
    uu = tl.arange(0, U)
    nn = tl.arange(0, NR)
    qs, rsc = _rotated_query(q_ptr, s_qb, s_qh, s_ql, rot_ptr, Lq, sm_scale, b, hp, uu, nn, KEY_UNIT, D, NR, G, HP)
    pair = b * tl.num_programs(0) + hp
    for k in tl.static_range(HP * 4):
        tl.store(qt_ptr + (pair * (HP * 4) + k) * U * NR + uu[:, None] * NR + nn[None, :], qs[k])
    tl.store(rs_ptr + pair * NR + nn, rsc)


@triton.jit
def _ws_kernel(q_ptr, s_qb, s_qh, s_ql, rot_ptr, Lq, sm_scale, qt_ptr, rs_ptr, o_ptr, s_ob, s_oh, s_ol, cnt_ptr, pool_ptr, bt_ptr, s_bt, seq_ptr, pout_ptr, plse_ptr, tab_ptr, num_splits, block_bytes,
               plane_bytes, KEY_UNIT: tl.constexpr, LUT: tl.constexpr, PTX: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, T: tl.constexpr, KB: tl.constexpr,
               VB: tl.constexpr, META: tl.constexpr, W: tl.constexpr, TPW: tl.constexpr, NR: tl.constexpr,
               RH: tl.constexpr, RHO: tl.constexpr, G: tl.constexpr, HP: tl.constexpr, HALF: tl.constexpr,
               SACC: tl.constexpr = 1, BIG: tl.constexpr = False, QPRE: tl.constexpr = False, FUSE: tl.constexpr = False):
    split = tl.program_id(0)
    hp = tl.program_id(1)
    b = tl.program_id(2)
    npairs = tl.num_programs(1)
    U: tl.constexpr = D // 4
    BLOCK_N: tl.constexpr = W * TPW
    seq_len = tl.load(seq_ptr + b)
    n_tiles = tl.cdiv(seq_len, BLOCK_N)
    per_split = tl.cdiv(n_tiles, num_splits)
    start = split * per_split * BLOCK_N
    end = tl.minimum(start + per_split * BLOCK_N, seq_len)
    body_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N
    ww = tl.arange(0, W)
    ii = tl.arange(0, TPW)
    uu = tl.arange(0, U)
    nn = tl.arange(0, NR)
    if QPRE:  # rotated by _ws_query_kernel
        qbase = qt_ptr + (b * npairs + hp) * (HP * 4 * U * NR)
        qs = ()
        for k in tl.static_range(HP * 4):
            qs = qs + (tl.broadcast_to(tl.load(qbase + k * U * NR + uu[:, None] * NR + nn[None, :])[None, :, :], (W, U, NR)),)
        rsc = tl.load(rs_ptr + (b * npairs + hp) * NR + nn)
    else:
        q2, rsc = _rotated_query(q_ptr, s_qb, s_qh, s_ql, rot_ptr, Lq, sm_scale, b, hp, uu, nn, KEY_UNIT, D, NR, G, HP)
        qs = ()
        for k in tl.static_range(HP * 4):
            qs = qs + (tl.broadcast_to(q2[k][None, :, :], (W, U, NR)),)
    m_i = tl.full((W, NR), -float("inf"), tl.float32)
    l_i = tl.zeros((W, NR), tl.float32)
    bias = tl.zeros((W, NR), tl.float32)
    a0 = tl.zeros((W, U, NR), tl.float32)
    a1 = tl.zeros((W, U, NR), tl.float32)
    a2 = tl.zeros((W, U, NR), tl.float32)
    a3 = tl.zeros((W, U, NR), tl.float32)
    head_off = hp * HP * plane_bytes
    bt_row = bt_ptr + b.to(tl.int64) * s_bt
    tk = ww[:, None] * TPW + ii[None, :]
    blk_n = tl.load(bt_row + (start + tk) // T, mask=start + tk < body_end, other=0)
    for t0 in range(start, body_end, BLOCK_N):
        blk = blk_n
        blk_n = tl.load(bt_row + (t0 + BLOCK_N + tk) // T, mask=t0 + BLOCK_N + tk < body_end, other=0)
        m_i, l_i, a0, a1, a2, a3, bias = _tile(t0, end, blk, m_i, l_i, a0, a1, a2, a3, bias, qs, rsc, pool_ptr,
                                               head_off, plane_bytes, block_bytes, ww, ii, uu, nn, tab_ptr, LUT, PTX, D, T, KB, VB,
                                               META, W, TPW, NR, RH, HP, HALF, SACC, BIG, False)
    for t0 in range(body_end, end, BLOCK_N):
        blk = tl.load(bt_row + (t0 + tk) // T, mask=t0 + tk < end, other=0)
        m_i, l_i, a0, a1, a2, a3, bias = _tile(t0, end, blk, m_i, l_i, a0, a1, a2, a3, bias, qs, rsc, pool_ptr,
                                               head_off, plane_bytes, block_bytes, ww, ii, uu, nn, tab_ptr, LUT, PTX, D, T, KB, VB,
                                               META, W, TPW, NR, RH, HP, HALF, SACC, BIG, True)
    # merge the warps' states
    mx = tl.max(m_i, axis=0)  # [NR]
    mx_use = tl.where(mx == -float("inf"), 0.0, mx)
    sc = tl.exp2(m_i - mx_use[None, :])  # [W, NR]
    l = tl.sum(l_i * sc, axis=0)
    bs = tl.sum(bias * sc, axis=0)
    has = l > 0
    inv_l = tl.where(has, 1.0 / tl.where(has, l, 1.0), 0.0)
    o0 = tl.sum(a0 * sc[:, None, :], axis=0) * (inv_l * 16777216.0)[None, :] + (bs * inv_l)[None, :]  # [U, NR]
    o1 = tl.sum(a1 * sc[:, None, :], axis=0) * (inv_l * 1048576.0)[None, :] + (bs * inv_l)[None, :]
    o2 = tl.sum(a2 * sc[:, None, :], axis=0) * (inv_l * 16777216.0)[None, :] + (bs * inv_l)[None, :]
    o3 = tl.sum(a3 * sc[:, None, :], axis=0) * (inv_l * 1048576.0)[None, :] + (bs * inv_l)[None, :]
    head = hp * HP + nn % HP
    r = nn // HP
    prow = ((b * (npairs * HP) + head) * num_splits + split) * RHO + r  # [NR]
    row_ok = r < G
    tl.store(plse_ptr + prow, tl.where(has, mx + tl.log2(tl.where(has, l, 1.0)), -float("inf")), mask=row_ok)
    dst = pout_ptr + prow.to(tl.int64)[None, :] * DP
    om = row_ok[None, :]
    tl.store(dst + (2 * uu)[:, None], o0, mask=om)
    tl.store(dst + (2 * uu + 1)[:, None], o2, mask=om)
    tl.store(dst + (2 * uu + D // 2)[:, None], o1, mask=om)
    tl.store(dst + (2 * uu + 1 + D // 2)[:, None], o3, mask=om)
    if FUSE:  # the last split of this head pair to finish merges every split's partial (no reduce launch)
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + b * npairs + hp, 1, sem="acq_rel", scope="gpu")
        if done == num_splits - 1:
            dcol = tl.arange(0, D)
            row0 = (b * (npairs * HP) + head) * num_splits * RHO + r  # [NR]: split 0's partial row
            m_all = tl.full((NR,), -float("inf"), tl.float32)
            l_all = tl.zeros((NR,), tl.float32)
            acc = tl.zeros((NR, D), tl.float32)
            for sp in range(0, num_splits):
                prow_s = row0 + sp * RHO
                lse_s = tl.load(plse_ptr + prow_s, mask=row_ok, other=-float("inf"), cache_modifier=".cg")
                m_new = tl.maximum(m_all, lse_s)
                m_use = tl.where(m_new == -float("inf"), 0.0, m_new)
                a_old = tl.exp2(m_all - m_use)
                w_s = tl.exp2(lse_s - m_use)
                part = tl.load(pout_ptr + prow_s.to(tl.int64)[:, None] * DP + dcol[None, :], mask=row_ok[:, None],
                               other=0.0, cache_modifier=".cg")
                acc = acc * a_old[:, None] + part * w_s[:, None]
                l_all = l_all * a_old + w_s
                m_all = m_new
            res = tl.where((l_all > 0)[:, None], acc / tl.where(l_all > 0, l_all, 1.0)[:, None], 0.0)
            qrow = (hp * HP + nn % HP) * G + r % G
            o_dst = o_ptr + b.to(tl.int64) * s_ob + qrow.to(tl.int64)[:, None] * s_oh + (r // G).to(tl.int64)[:, None] * s_ol
            tl.store(o_dst + dcol[None, :], res.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])
            tl.atomic_xchg(cnt_ptr + b * npairs + hp, 0)  # ready for the next launch (graph replays)



def prepare_query(query, rot, hk, sm_scale, key_unit, hp=2, nr=8):
    """query [B, Hq, 1, D] -> (qT [B, Hk/hp, hp*4, D/4, NR] fp16, rsc [B, Hk/hp, NR] fp32): the rotated query's
    word coordinate sets, column n = head n // RH's row n % RH (zero elsewhere), and each column's log2 scale."""
    b, hq, lq, d = query.shape
    g = hq // hk
    rh = nr // hp
    qr = query[:, :, 0].float() @ rot.float().T  # [B, Hq, D]
    qmax = qr.abs().amax(-1).clamp_min(1e-30)
    qn = (qr / qmax[..., None]).view(b, hk // hp, hp, g, d)
    lo, hi = qn[..., : d // 2], qn[..., d // 2:]
    sets = torch.stack([lo[..., 0::2], lo[..., 1::2], hi[..., 0::2], hi[..., 1::2]], 3)  # [B, P, hp, 4, g, D/4]
    qt = torch.zeros(b, hk // hp, hp, 4, d // 4, nr, device=query.device)
    rsc = torch.ones(b, hk // hp, nr, device=query.device)
    qm = qmax.view(b, hk // hp, hp, g)
    for j in range(hp):
        qt[:, :, j, :, :, j: j + hp * g: hp] = sets[:, :, j].transpose(-1, -2)
        rsc[:, :, j: j + hp * g: hp] = qm[:, :, j] * (sm_scale * key_unit * 1.4426950408889634)
    return qt.reshape(b, hk // hp, hp * 4, d // 4, nr).half().contiguous(), rsc.contiguous()


def split_rotation(rot):
    """R as hi + lo fp16 parts [2, D, D]."""
    r_hi = rot.half()
    return torch.stack([r_hi, (rot.float() - r_hi.float()).half()]).contiguous()


def launch(q, rot, scale, unit, pool, layout, table, seq, num_splits, lut, tab, ptx=True, tpw=32, w=4, hp=2, nr=8, g=4, rho=8, maxnreg=None,
           num_stages=3, pout=None, plse=None, sacc=1, qpre=False, qt=None, rs=None, out=None, cnt=None):
    b = q.shape[0]
    if rot.dim() == 2:
        rot = split_rotation(rot)
    hk = layout.num_kv_heads
    d = layout.head_dim
    if pout is None:
        pout = torch.empty(b * hk * num_splits * rho, d, device=q.device)
        plse = torch.empty(b * hk * num_splits * rho, device=q.device)
    extra = {"maxnreg": maxnreg} if maxnreg else {}
    if qpre:
        if qt is None:
            qt = torch.empty(b * hk // hp * hp * 4 * (d // 4) * nr, device=q.device, dtype=torch.float16)
            rs = torch.empty(b * hk // hp * nr, device=q.device)
        _ws_query_kernel[(hk // hp, b)](q, *q.stride()[:3], rot, q.shape[2], scale, qt, rs, KEY_UNIT=unit, D=d, NR=nr,
                                        G=g, HP=hp, num_warps=qpre if isinstance(qpre, int) and qpre > 1 else 1)
    else:
        qt, rs = pout, plse
    _ws_kernel[(num_splits, hk // hp, b)](
        q, *q.stride()[:3], rot, q.shape[2], scale, qt, rs, out if out is not None else q, *(out if out is not None else q).stride()[:3], cnt if cnt is not None else plse, pool, table, table.stride(0), seq, pout, plse, tab, num_splits, layout.block_bytes, layout.plane_bytes,
        KEY_UNIT=unit, LUT=lut, PTX=ptx, D=d, DP=d, T=layout.block_size, KB=layout.key_bytes, VB=layout.value_bytes, META=layout.metadata_offset,
        W=w, TPW=tpw, NR=nr, RH=nr // hp, RHO=rho, G=g, HP=hp, HALF=7.5, SACC=sacc, BIG=pool.numel() >= 2**31, QPRE=bool(qpre), FUSE=out is not None, num_warps=w, num_stages=num_stages, **extra)
    return pout, plse
