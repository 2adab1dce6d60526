"""The unified attention kernel over the compressed paged cache: prefill, chunked prefill and decode.

One kernel body. A program owns BLOCK_M query rows of one KV head of one sequence: the rows are the
(query position, query head of the group) pairs flattened, so all G query heads of a KV head share every
dequantized K/V tile (GQA/MQA), and it walks the KV range of one split. Prefill runs one split per row tile
(2-D grid over row tiles x heads); decode uses many splits per sequence and a segment reduction (reduce.py) to
fill the GPU. The launch choices (unified_plan.py) pick the variant through the constexprs.

The walk over the pool runs tile by tile (tiles.pool_tile); tiles whose positions are all in range and visible
to every row of the program skip every mask. Per tile the kernel only unpacks codes: the query is rotated once
in the prologue (q_rot = q @ R^T, in steps of ROTATION_STEP coordinates to keep the rotation tiles out of the registers
the walk needs), so score_t = key_scale_t * q_rot . centroid[code_t] with the key scale applied per token after
the dot. 4-bit codebook keys in decode launches on CUDA are looked up by byte permutes (key_lut.py) on codes
loaded as [D/2, N], so the lookup lands in the MMA's operand layout and the fp16 key tile never goes through
shared memory; or as 16-bit code words [D/4, N] (KEY_WORDS: two words of a token per operand register, four
dots over the coordinate sets 2w, 2w + 1, D/2 + 2w, D/2 + 2w + 1, so the query's operand loads by ldmatrix;
the centroids' magnitudes are bytes on a grid (reference.on_byte_grid), decoded as fp16 subnormals with the
sign bit set from the code, one 8-byte table, the scores scaled once by KEY_UNIT); elsewhere the centroids are
gathered. With code words (or 3-bit key planes at head_dim 128, each head's query windows zero outside its rows) a
program may take two KV heads (HEADS_PER_PROGRAM = 2): their query rows share one
16-row tile (rows 0-7, 8-15), each head's dots see only its rows (the query and P zero elsewhere), so the
softmax, its cross-warp reductions and P's trip through shared memory serve both heads (the exact tiles
likewise: one softmax step, a dot per head; each row's q . mu from its head's mean).

Values use P.V = (P * value_scale) . code + P . bias with bias_t = value_mid_t - value_scale_t * (2**bits - 1)
/ 2, a rank-1 term; in decode tiles 4-bit value codes are loaded as 16-bit words (two tokens per MMA operand
register) and decoded as fp16 subnormals (value_nibbles.py) into four accumulators, elsewhere as bytes into
two. The per-token metadata (key scale, value scale and mid) is read as bf16, as 32-bit words of two tokens
(META_PAIRS), or each token's fields from its pair's 32-bit word (META_WORDS), which the pipeliner prefetches.
Format options: key_centering adds q . mu (computed once per row from the unrotated query) to every raw score
before the softcap; value_rotation multiplies each program's output rows by Rv once in the epilogue (split
partials too: the log-sum-exp merge is linear in them), or with ROT_IN_REDUCE (split launches at head_dim > 128,
where the epilogue's Rv tiles spilled) leaves the partials in the rotated space for the reduction to rotate once
per row. 3-bit codes are read one 3-byte group (8 codes) at a time, or as code planes (layout.key_planes,
layout.value_planes).

exact_prefix_tokens: positions kv_start + s (s < P) come from dense side buffers of original keys/values
instead of the pool, and the compressed walk starts after them. The exact program attends over them after its
walk (so none of their state is live through it), as one dense tile: scores q . k from the unrotated query
(exact keys need no q . mu), values folded into the code accumulators, or under value_rotation into an
accumulator in the original space (acc_x), rescaled with the others and added after the epilogue's rotation.
recent_window: positions [ring_lo, seq_len), ring_lo = max(recent_from, seq_len - W), come from a dense ring of
exact keys/values (position j at slot j % W) and win over the prefix and the pool there: the compressed walk
ends at ring_lo, the prefix tile drops positions >= ring_lo, and the exact program then walks the ring range in
dense tiles of RING_TILE tokens (tiles.exact_tile). Where the query and the buffers share a 16-bit dtype (EXACT_16)
the exact scores are that dtype's MMA and the values' dots one tf32 pass; else three tf32 passes (fp32).
The exact program: in split decode with programs to spare, one program more than the pool's splits
(EXACT_PROG), so the dense tiles run alongside the compressed walks (RING_PROGRAMS: one per ring tile, the first
also the prefix's); otherwise split 0 (prefix) and the last split (ring), or without splits the row tile's only
program.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .code_decoders import code_unit, value_col
from .rotation import (hadamard_dot, hadamard_entries, hadamard_input, hadamard_signs, matmul_square, row_norm, split_dot,
                       unit_rotation_rows)
from .rounding import store_rounded
from .tiles import exact_tile, pool_tile

@triton.jit
def _blocks_of_16(x, BLOCK_M: tl.constexpr):
    """[BLOCK_M, 64] -> its four 16-column blocks (columns 0-15, 16-31, 32-47, 48-63)."""
    t = tl.permute(tl.reshape(x, (BLOCK_M, 2, 2, 16)), (0, 3, 1, 2))  # [m, c, i, j]: column 32 i + 16 j + c
    even, odd = tl.split(t)  # j = 0, 1: [m, c, i]
    b0, b2 = tl.split(even)
    b1, b3 = tl.split(odd)
    return b0, b1, b2, b3


@triton.jit
def _pair(a, b, BLOCK_M: tl.constexpr, W: tl.constexpr = 16):
    """[BLOCK_M, W] blocks a, b -> [BLOCK_M, 2 W] = [a | b]."""
    return tl.reshape(tl.permute(tl.join(a, b), (0, 2, 1)), (BLOCK_M, 2 * W))


@triton.jit
def _plane_windows_128(q_lo, q_hi, BLOCK_M: tl.constexpr):
    """The six 32-row windows of head_dim 128's key planes (the coordinates the KEY_PLANES prologue computes one
    window at a time) from the rotated query's halves: [b0 | b2], [b1 | b3], then [b_k | 0] for k = 4..7, b_k its
    16-coordinate blocks."""
    b0, b1, b2, b3 = _blocks_of_16(q_lo, BLOCK_M)
    b4, b5, b6, b7 = _blocks_of_16(q_hi, BLOCK_M)
    zero = tl.zeros((BLOCK_M, 16), tl.float32)
    return (_pair(b0, b2, BLOCK_M), _pair(b1, b3, BLOCK_M), _pair(b4, zero, BLOCK_M), _pair(b5, zero, BLOCK_M),
            _pair(b6, zero, BLOCK_M), _pair(b7, zero, BLOCK_M))


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
def _signed_quarter(q_row, ok, rot_ptr, c, K: tl.constexpr, Q: tl.constexpr, D: tl.constexpr):
    """The query's coordinates K Q + c times R's signs there (R = H diag(s) / sqrt(D)), fp32."""
    idx = K * Q + c
    return tl.load(q_row[:, None] + idx[None, :], mask=ok, other=0.0).to(tl.float32) * hadamard_signs(rot_ptr, idx, D)[None, :]


@triton.jit
def _hadamard_quarters(q_row, row_ok, rot_ptr, D: tl.constexpr, BLOCK_M: tl.constexpr):
    """q @ R^T for the randomized Hadamard rotation R = H diag(s) / sqrt(D) as its four quarters (coordinates
    [k D/4, (k+1) D/4)), fp32 [BLOCK_M, D/4] each, without reading R: H_D = H_4 (x) H_{D/4} (Sylvester), so two
    butterflies fold the signed query's quarters x_k into t_c = sum_k H_4[k, c] x_k and one H_{D/4} built in
    registers serves the four (a sixteenth of H_D's entries, a quarter of _hadamard_query's)."""
    Q: tl.constexpr = D // 4
    c = tl.arange(0, Q)
    ok = row_ok[:, None] & (c[None, :] < Q)
    x0 = _signed_quarter(q_row, ok, rot_ptr, c, 0, Q, D)
    x1 = _signed_quarter(q_row, ok, rot_ptr, c, 1, Q, D)
    x2 = _signed_quarter(q_row, ok, rot_ptr, c, 2, Q, D)
    x3 = _signed_quarter(q_row, ok, rot_ptr, c, 3, Q, D)
    s02 = x0 + x2
    d02 = x0 - x2
    s13 = x1 + x3
    d13 = x1 - x3
    t0 = s02 + s13  # H_4's columns: (+ + + +), (+ - + -), (+ + - -), (+ - - +)
    t1 = s02 - s13
    t2 = d02 + d13
    t3 = d02 - d13
    n = tl.maximum(tl.maximum(row_norm(t0), row_norm(t1)), tl.maximum(row_norm(t2), row_norm(t3)))[:, None]
    h = hadamard_entries(c, c, c < Q)
    zero = tl.zeros((BLOCK_M, Q), tl.float32)
    scale = n * (1.0 / tl.sqrt(D * 1.0))
    return (split_dot(t0 / n, h, zero) * scale, split_dot(t1 / n, h, zero) * scale,
            split_dot(t2 / n, h, zero) * scale, split_dot(t3 / n, h, zero) * scale)


@triton.jit
def _halves(x, BLOCK_M: tl.constexpr, W: tl.constexpr):
    """[BLOCK_M, 2 W] -> its columns < W and >= W."""
    return tl.split(tl.permute(tl.reshape(x, (BLOCK_M, 2, W)), (0, 2, 1)))


@triton.jit
def _plane_windows_256(y0, y1, y2, y3, BLOCK_M: tl.constexpr):
    """The eight 32-coordinate windows of head_dim 256's key planes (window w: coordinates 32 w + j) from the rotated
    query's quarters."""
    w0, w1 = _halves(y0, BLOCK_M, 32)
    w2, w3 = _halves(y1, BLOCK_M, 32)
    w4, w5 = _halves(y2, BLOCK_M, 32)
    w6, w7 = _halves(y3, BLOCK_M, 32)
    return w0, w1, w2, w3, w4, w5, w6, w7


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
    vrot_ptr,  # [D, D] fp32 value rotation Rv (values stored as v @ Rv^T), if VALUE_ROT; under ROT16_UNITS Rv x sqrt(D) in fp16
    pout_ptr,  # [B, Hk, row tiles, NS, BLOCK_M, DP] fp32 split partial outputs, if SPLIT
    plse_ptr,  # [B, Hk, row tiles, NS, BLOCK_M] fp32 split log2-sum-exp, if SPLIT
    pk_ptr, s_pkb, s_pkh, s_pkp,  # [B, Hk, P, D] fp16/bf16/fp32 exact prefix keys, if HAS_PREFIX
    pv_ptr, s_pvb, s_pvh, s_pvp,  # [B, Hk, P, D] fp16/bf16/fp32 exact prefix values, if HAS_PREFIX
    prefix_len,  # P: positions kv_start + s, s < P, are read from the prefix buffers
    rk_ptr, s_rkb, s_rkh, s_rkp,  # [B, Hk, W, D] recent keys (ring: position j at slot j % W; or int8 records), if HAS_RECENT
    rv_ptr, s_rvb, s_rvh, s_rvp,  # [B, Hk, W, D] recent values (or int8 records), if HAS_RECENT
    recent_size, recent_from,  # W; positions [max(recent_from, seq_len - W), seq_len) are read from the ring
    Lq, num_splits, sm_scale, softcap, window, block_bytes, plane_bytes,
    D: tl.constexpr, DP: tl.constexpr, HALF_DP: tl.constexpr, CODE_GROUPS: tl.constexpr, G: tl.constexpr,
    T: tl.constexpr, KB: tl.constexpr, VB: tl.constexpr, META: tl.constexpr,
    KEY_BITS: tl.constexpr, VALUE_BITS: tl.constexpr, NC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, QUARTER_DP: tl.constexpr,  # QUARTER_DP: next_pow2(D / 4), 16-bit value words per token
    VALUE_WORDS: tl.constexpr,  # 4-bit values read as 16-bit words into 4 accumulators (else bytes into 2)
    HAS_KV_START: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, SPLIT: tl.constexpr, HAS_KEY_OFFSET: tl.constexpr, VALUE_ROT: tl.constexpr,
    HAS_PREFIX: tl.constexpr, PREFIX_TILE: tl.constexpr, HAS_RECENT: tl.constexpr, RING_TILE: tl.constexpr,
    EXACT_ACC: tl.constexpr,  # VALUE_ROT and (HAS_PREFIX or HAS_RECENT): exact values accumulate unrotated
    EXACT_16: tl.constexpr,  # the query and the exact buffers share a 16-bit dtype (exact_tile's dots)
    RING_Q8: tl.constexpr,  # the ring holds int8 records (layout.ring_spec)
    ROTATION_STEP: tl.constexpr,  # input coordinates per step of the prologue's 4-bit query rotation
    EXACT_PROG: tl.constexpr,  # SPLIT with exact prefix/ring: programs beyond the pool's splits attend them (1, or
    # RING_PROGRAMS: one per ring tile), in parallel with the walks
    RING_SPREAD: tl.constexpr,  # SPLIT: ring tile t goes to split program t % ns_all (else one program walks them all)
    RING_PROGRAMS: tl.constexpr,  # ring tile t goes to exact program t % EXACT_PROG; the pool's splits walk none
    KEY_LUT: tl.constexpr, LUT_LO: tl.constexpr, LUT_HI: tl.constexpr,  # codebook keys by key_lut.py's asm (else gathered)
    KEY_WORDS: tl.constexpr,  # 4-bit keys by the lookup as 16-bit code words (4 dots over coordinate sets)
    KEY_UNIT: tl.constexpr,  # the scores' factor: the word asm's subnormal byte magnitudes -> centroids (else 1)
    KEY_PLANES: tl.constexpr,  # 3-bit keys as 8 code planes of D/8 coordinates (D/8 a power of two >= 16)
    VALUE_PTX: tl.constexpr,  # VALUE_WORDS / VALUE_PLANES by value_nibbles.py's asm (0: integer ops; 2: planes from bytes)
    VALUE_BOUNDARY: tl.constexpr,  # (a GPU's decode tiles) the value codes enter their dots in 16-bit operand layouts (operand_boundary)
    PLANES_IN_PLACE: tl.constexpr,  # 3-bit value plane codes decoded where they sit, each accumulator in its code_unit
    VALUE_PLANES: tl.constexpr,  # 3-bit values as a 2-bit plane and a bit plane (layout.value_planes): 4 accumulators
    META_PAIRS: tl.constexpr,  # per-token metadata loaded as 32-bit token pairs (load_meta_pairs), prefetched a tile ahead
    META_WORDS: tl.constexpr,  # (else) each token's metadata from its pair's 32-bit word (load_meta), prefetched too
    VMID_CHAIN: tl.constexpr,  # v_mid's load joins the value MMA operand's chain, so the pipeliner prefetches it
    BT_NEXT: tl.constexpr,  # the unmasked walk loads the next tile's block-table entries an iteration ahead
    POOL32: tl.constexpr,  # the pool has < 2**31 bytes: its addresses are int32 offsets (else int64)
    HADAMARD: tl.constexpr,  # rotation="hadamard": the query's (and bit-stream values' output) rotation without reading R (Rv)
    QUERY_BUTTERFLY: tl.constexpr,  # under HADAMARD, 3-bit key planes (head_dim 128, 256) or 4-bit keys (256): the query rotated once by butterflies
    ROT16: tl.constexpr,  # 4-bit values' rotation back (Rv's entries +-1/sqrt(D)) by 16-bit dots instead of 3xTF32
    ROT16_UNITS: tl.constexpr,  # (ROT16) vrot_ptr holds Rv x sqrt(D) in fp16 (else fp32 Rv, scaled here)
    HEADS_PER_PROGRAM: tl.constexpr,  # KV heads per program: 2 put their query rows in one MMA tile, BLOCK_M / 2 apart
    ROT_IN_REDUCE: tl.constexpr,  # SPLIT and VALUE_ROT: partials stay in the rotated value space (reduce.py rotates)
    PARTIAL_W: tl.constexpr,  # fp32 values per split partial row: DP, or 2 x DP (ROT_IN_REDUCE with EXACT_ACC)
    PDL: tl.constexpr,  # programmatic dependent launch: wait for the kernel before (its writes) before any load, and
    # let the split reduction launch now (it waits for this kernel in turn)
):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    pid = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    ns_all = num_splits + EXACT_PROG  # split programs per row tile: the pool's splits (+ the exact ones)
    m_tile = pid // ns_all
    split = pid % ns_all

    # ---- rows of this program: (query i, group member g) pairs --------------------------------
    ROWS_PER_HEAD: tl.constexpr = BLOCK_M // HEADS_PER_PROGRAM  # rows per KV head
    if HEADS_PER_PROGRAM == 1:
        sub = 0
        rr = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
        hh = h
    else:
        lr = tl.arange(0, BLOCK_M)
        sub = lr // ROWS_PER_HEAD  # which of the program's heads (a function of the register: selections by it fold)
        rr = m_tile * ROWS_PER_HEAD + lr % ROWS_PER_HEAD  # the row within its head's rows (one row tile: m_tile 0)
        hh = h * HEADS_PER_PROGRAM + sub  # the row's KV head
    qi = rr // G
    qg = rr % G
    row_ok = qi < Lq
    qhead = hh * G + qg
    seq_len = tl.load(seq_ptr + b).to(tl.int32)
    qpos = seq_len - Lq + qi
    i_first = (m_tile * ROWS_PER_HEAD) // G
    i_last = tl.minimum((m_tile * ROWS_PER_HEAD + ROWS_PER_HEAD - 1) // G, Lq - 1)
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
    if EXACT_PROG:  # the last program(s) attend only the exact prefix and ring, alongside the pool's splits
        end = tl.where(split >= num_splits, start, end)
    exact_split_first = num_splits if EXACT_PROG else 0  # the split that attends the exact prefix
    exact_split_last = num_splits if EXACT_PROG else num_splits - 1  # the split that walks the ring

    # ---- prologue: load and rotate the queries, normalise each row's range for fp16 ----------
    dc = tl.arange(0, DP)
    hc = tl.arange(0, HALF_DP)
    # 4 accumulators (else 2, value_plane_bytes); 2: the codes decoded in place, each at its own unit (code_unit)
    PLANE_WORDS: tl.constexpr = ((2 if PLANES_IN_PLACE else 1) if BLOCK_M <= 32 else 0) if VALUE_PLANES else 0
    VALUE_COLS_P: tl.constexpr = QUARTER_DP if (VALUE_WORDS or PLANE_WORDS) else HALF_DP  # columns of each value accumulator
    vcol = tl.arange(0, VALUE_COLS_P)
    VALUE_COLS: tl.constexpr = D // 4 if (VALUE_WORDS or PLANE_WORDS) else D // 2  # real ones
    q_row = q_ptr + b.to(tl.int64) * s_qb + qhead.to(tl.int64) * s_qh + qi.to(tl.int64) * s_ql
    q = tl.load(q_row[:, None] + dc[None, :], mask=row_ok[:, None] & (dc[None, :] < D), other=0.0).to(tl.float32)
    q_mu = 0.0  # placeholders of what only some variants compute (the walk's helper takes them all)
    q_lo = 0.0
    q_hi = 0.0
    q16 = 0.0
    qp = 0.0
    table = 0.0
    if HAS_KEY_OFFSET:  # key_centering: q . (k_hat + mu) = q . k_hat + q . mu, the latter once per row
        if HEADS_PER_PROGRAM == 1:
            mu = tl.load(koff_ptr + b.to(tl.int64) * s_koff + h * D + dc, mask=dc < D, other=0.0)[None, :]
        else:  # each row its KV head's mean
            mu = tl.load(koff_ptr + b.to(tl.int64) * s_koff + (hh * D)[:, None] + dc[None, :], mask=dc[None, :] < D,
                         other=0.0)
        q_mu = tl.sum(q * mu, axis=1) * sm_scale
    if KEY_BITS == 4:
        if HADAMARD and QUERY_BUTTERFLY:  # (head_dim 256) R not read: two butterflies, then H_64 for each quarter
            y0, y1, y2, y3 = _hadamard_quarters(q_row, row_ok, rot_ptr, D, BLOCK_M)
            q_lo = _pair(y0, y1, BLOCK_M, 64)
            q_hi = _pair(y2, y3, BLOCK_M, 64)
        elif HADAMARD:  # R not read
            q_lo, q_hi = _hadamard_query(q_row, row_ok, rot_ptr, hc, D, BLOCK_M)
        else:
            # q @ R^T over ROTATION_STEP input coordinates at a time: [ROTATION_STEP, D/2] rotation tiles instead of [D, D/2]
            # ones, which held ~128 registers per thread through the prologue (spilled under maxnreg)
            q_lo = tl.zeros((BLOCK_M, HALF_DP), tl.float32)
            q_hi = tl.zeros((BLOCK_M, HALF_DP), tl.float32)
            for k0 in range(0, D, ROTATION_STEP):
                kk = k0 + tl.arange(0, ROTATION_STEP)
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
            q0, q1 = tl.split(tl.reshape(q_lo, (BLOCK_M, HALF_DP // 2, 2)))
            q2, q3 = tl.split(tl.reshape(q_hi, (BLOCK_M, HALF_DP // 2, 2)))
            if HEADS_PER_PROGRAM == 1:
                qp = (q0, q1, q2, q3)
            else:  # head j's dots see only its rows
                qp = ()
                for j in tl.static_range(HEADS_PER_PROGRAM):
                    sel = sub[:, None] == j
                    qp = qp + (tl.where(sel, q0, 0.0), tl.where(sel, q1, 0.0), tl.where(sel, q2, 0.0), tl.where(sel, q3, 0.0))
    elif KEY_BITS == 3 and KEY_PLANES:
        # the rotated query's coordinates of each key tile's rows (pool_tile), 0 for the rows that hold no code:
        # D = 128, six 32-row windows of the 16-byte planes; D = 256, the 8 code planes (coordinates c * 32 + j)
        r32 = tl.arange(0, 32)
        qp = ()
        qmax = tl.zeros((BLOCK_M,), tl.float32)
        if QUERY_BUTTERFLY and D == 128:  # the rotated query once (_hadamard_query), its 16-coordinate blocks put into the windows
            qr_lo, qr_hi = _hadamard_query(q_row, row_ok, rot_ptr, hc, D, BLOCK_M)
            qp = _plane_windows_128(qr_lo, qr_hi, BLOCK_M)
            qmax = tl.maximum(tl.max(tl.abs(qr_lo), axis=1), tl.max(tl.abs(qr_hi), axis=1))
        elif QUERY_BUTTERFLY:  # head_dim 256: the rotated query's quarters (_hadamard_quarters), halved into the windows
            y0, y1, y2, y3 = _hadamard_quarters(q_row, row_ok, rot_ptr, D, BLOCK_M)
            qp = _plane_windows_256(y0, y1, y2, y3, BLOCK_M)
            qmax = tl.maximum(tl.maximum(tl.max(tl.abs(y0), axis=1), tl.max(tl.abs(y1), axis=1)),
                              tl.maximum(tl.max(tl.abs(y2), axis=1), tl.max(tl.abs(y3), axis=1)))
        elif HADAMARD:
            q_unit, q_scale = hadamard_input(q, rot_ptr, dc, D)
        for w in tl.static_range(0 if QUERY_BUTTERFLY else (6 if D == 128 else 8)):
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
        if HEADS_PER_PROGRAM > 1:  # (head_dim 128) head j's windows: its rows only, as the 4-bit words' dots
            qp = ()
            for j in tl.static_range(HEADS_PER_PROGRAM):
                sel = sub[:, None] == j
                for w in tl.static_range(6):
                    qp = qp + (tl.where(sel, qh[w], 0.0),)
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
    # 4-bit values: acc_j accumulates coordinates value_col(vcol, j) (4 accumulators from words, 2 from
    # bytes) in the codes' fp16 scale (words: x 2**-24, odd j 2**-20; bytes: odd j 16 x); 3-bit value
    # planes: 4 accumulators, x 2**-24; the 3-bit bit stream: acc0 all D
    FOUR_ACC: tl.constexpr = VALUE_WORDS or PLANE_WORDS
    acc0 = tl.zeros((BLOCK_M, VALUE_COLS_P if (VALUE_BITS == 4 or VALUE_PLANES) else DP), tl.float32)
    acc1 = tl.zeros((BLOCK_M, VALUE_COLS_P if (VALUE_BITS == 4 or VALUE_PLANES) else 16), tl.float32)
    acc2 = tl.zeros((BLOCK_M, VALUE_COLS_P if FOUR_ACC else 16), tl.float32)
    acc3 = tl.zeros((BLOCK_M, VALUE_COLS_P if FOUR_ACC else 16), tl.float32)
    bias_acc = tl.zeros((BLOCK_M,), tl.float32)
    HALF: tl.constexpr = ((1 << VALUE_BITS) - 1) / 2

    pk_row = pk_ptr + b.to(tl.int64) * s_pkb + (h * HEADS_PER_PROGRAM).to(tl.int64) * s_pkh
    pv_row = pv_ptr + b.to(tl.int64) * s_pvb + (h * HEADS_PER_PROGRAM).to(tl.int64) * s_pvh
    if POOL32:  # the pool has < 2**31 bytes: addresses as int32 offsets from pool_ptr (fewer 64-bit ops per tile)
        head_off = h * HEADS_PER_PROGRAM * plane_bytes
    else:
        head_off = (h * HEADS_PER_PROGRAM).to(tl.int64) * plane_bytes
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
        blk_c = None  # pool_tile loads them
        if BT_NEXT:
            blk_c = blk_n
            blk_n = tl.load(bt_row + (t0 + BLOCK_N + tn) // T, mask=t0 + BLOCK_N + tn < body_end, other=0)
        m_i, l_i, acc0, acc1, acc2, acc3, bias_acc = pool_tile(
            t0, end, pool_first, qpos, window, softcap, m_i, l_i, acc0, acc1, acc2, acc3, bias_acc,
            bt_row, blk_c, pool_ptr, block_bytes, head_off, sub, plane_bytes, q_lo, q_hi, q16, qp, table, row_scale, row_off, q_mu, hc, dc,
            vcol, HALF, VALUE_COLS, HEADS_PER_PROGRAM, D, CODE_GROUPS, T, KB, VB, META, KEY_BITS, VALUE_BITS, BLOCK_M, BLOCK_N, HAS_KV_START, HAS_PREFIX,
            HAS_WINDOW, HAS_SOFTCAP, HAS_KEY_OFFSET, KEY_LUT, LUT_LO, LUT_HI, KEY_PLANES, KEY_WORDS, VALUE_WORDS, VALUE_PLANES,
            PLANE_WORDS, VALUE_PTX, META_PAIRS, META_WORDS, VMID_CHAIN, False, VALUE_BOUNDARY)
    for i in range(0, n_head + tl.cdiv(end - body_end, BLOCK_N)):
        t0 = tl.where(i < n_head, start, body_end + (i - n_head) * BLOCK_N)
        m_i, l_i, acc0, acc1, acc2, acc3, bias_acc = pool_tile(
            t0, end, pool_first, qpos, window, softcap, m_i, l_i, acc0, acc1, acc2, acc3, bias_acc,
            bt_row, None, pool_ptr, block_bytes, head_off, sub, plane_bytes, q_lo, q_hi, q16, qp, table, row_scale, row_off, q_mu, hc, dc, vcol,
            HALF, VALUE_COLS, HEADS_PER_PROGRAM, D, CODE_GROUPS, T, KB, VB, META, KEY_BITS, VALUE_BITS, BLOCK_M, BLOCK_N, HAS_KV_START, HAS_PREFIX,
            HAS_WINDOW, HAS_SOFTCAP, HAS_KEY_OFFSET, KEY_LUT, LUT_LO, LUT_HI, KEY_PLANES, KEY_WORDS, VALUE_WORDS, VALUE_PLANES, PLANE_WORDS, VALUE_PTX,
            META_PAIRS, META_WORDS, VMID_CHAIN, True, VALUE_BOUNDARY)

    # ---- exact tiles, after the walk (none of their state is live through it) ----------------
    acc_x = tl.zeros((BLOCK_M, DP if EXACT_ACC else 16), tl.float32)
    if HAS_PREFIX or HAS_RECENT:
        # the unrotated query, reloaded rather than kept live through the walk (16 registers per thread)
        q = tl.load(q_row[:, None] + dc[None, :], mask=row_ok[:, None] & (dc[None, :] < D), other=0.0).to(tl.float32)
    # the exact prefix: one dense tile of original keys/values
    if HAS_PREFIX:
        if split == exact_split_first:
            pc = tl.arange(0, PREFIX_TILE)
            m_i, l_i, acc0, acc1, acc2, acc3, acc_x, bias_acc = exact_tile(
                q, m_i, l_i, acc0, acc1, acc2, acc3, acc_x, bias_acc, pk_row, s_pkh, s_pkp, pv_row, s_pvh, s_pvp,
                pc, kv_first + pc, (pc < prefix_len) & (kv_first + pc < pool_hi), qpos, window, sm_scale, softcap,
                dc, vcol, sub, q_row, row_ok, q_mu, HEADS_PER_PROGRAM, EXACT_16, False, False, D, VALUE_BITS, VALUE_WORDS, VALUE_PLANES, PLANE_WORDS, VALUE_ROT, HAS_WINDOW, HAS_SOFTCAP)
    # the recent window: the last split walks the ring's positions in dense tiles
    if HAS_RECENT:
        if RING_SPREAD or RING_PROGRAMS or split == exact_split_last:
            ring_first = tl.maximum(tl.maximum(ring_lo, kv_first), win_lo)
            ring_step = RING_TILE
            if RING_PROGRAMS:  # the pool's splits start past the ring's end
                ring_first = tl.where(split >= num_splits, ring_first + (split - num_splits) * RING_TILE, kv_hi)
                ring_step = RING_TILE * EXACT_PROG
            elif RING_SPREAD:
                ring_first += split * RING_TILE
                ring_step = RING_TILE * ns_all
            k_ring = rk_ptr + b.to(tl.int64) * s_rkb + (h * HEADS_PER_PROGRAM).to(tl.int64) * s_rkh
            v_ring = rv_ptr + b.to(tl.int64) * s_rvb + (h * HEADS_PER_PROGRAM).to(tl.int64) * s_rvh
            for j0 in range(ring_first, kv_hi, ring_step):  # at most W positions
                rpos = j0 + tl.arange(0, RING_TILE)
                r_ok = rpos < kv_hi
                m_i, l_i, acc0, acc1, acc2, acc3, acc_x, bias_acc = exact_tile(
                    q, m_i, l_i, acc0, acc1, acc2, acc3, acc_x, bias_acc, k_ring, s_rkh, s_rkp, v_ring, s_rvh, s_rvp,
                    rpos % recent_size, rpos, r_ok, qpos, window, sm_scale, softcap, dc, vcol, sub, q_row, row_ok, q_mu,
                    HEADS_PER_PROGRAM, EXACT_16, RING_Q8, RING_Q8 and HAS_KEY_OFFSET, D, VALUE_BITS, VALUE_WORDS, VALUE_PLANES, PLANE_WORDS, VALUE_ROT, HAS_WINDOW, HAS_SOFTCAP)

    # ---- epilogue -----------------------------------------------------------------------------
    has = l_i > 0
    inv_l = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
    bias_out = bias_acc * inv_l
    if SPLIT:
        if HEADS_PER_PROGRAM == 1:  # [B, Hk, row tiles, NS, BLOCK_M]
            m_tiles = tl.num_programs(0) // ns_all
            prow = (((b * tl.num_programs(1) + h) * m_tiles + m_tile) * ns_all + split) * BLOCK_M + tl.arange(0, BLOCK_M)
        else:  # per KV head: ROWS_PER_HEAD rows
            prow = ((b * (tl.num_programs(1) * HEADS_PER_PROGRAM) + hh) * ns_all + split) * ROWS_PER_HEAD + rr
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), -float("inf"))
        tl.store(plse_ptr + prow, lse)
        dst = pout_ptr + prow.to(tl.int64)[:, None] * PARTIAL_W
    else:
        dst = o_ptr + b.to(tl.int64) * s_ob + qhead.to(tl.int64)[:, None] * s_oh + qi.to(tl.int64)[:, None] * s_ol
    if VALUE_BITS == 4 or VALUE_PLANES:
        # back from each accumulator's code unit
        out0 = acc0 * (inv_l / code_unit(0, VALUE_WORDS, PLANE_WORDS, VALUE_PLANES))[:, None] + bias_out[:, None]
        out1 = acc1 * (inv_l / code_unit(1, VALUE_WORDS, PLANE_WORDS, VALUE_PLANES))[:, None] + bias_out[:, None]
        if FOUR_ACC:
            out2 = acc2 * (inv_l / code_unit(2, VALUE_WORDS, PLANE_WORDS, VALUE_PLANES))[:, None] + bias_out[:, None]
            out3 = acc3 * (inv_l / code_unit(3, VALUE_WORDS, PLANE_WORDS, VALUE_PLANES))[:, None] + bias_out[:, None]
        # (here Rv is read: built in registers it measured slower, up to 64% for k3v4 with the levers)
        if VALUE_ROT and not ROT_IN_REDUCE:  # back from the rotated value space: out @ Rv, over the rows of each accumulator's coordinates
            rmask = (vcol[:, None] < VALUE_COLS) & (dc[None, :] < D)
            rv = vrot_ptr + dc[None, :]
            rv0 = rv + value_col(vcol, 0, D, VALUE_WORDS, PLANE_WORDS)[:, None] * D
            rv1 = rv + value_col(vcol, 1, D, VALUE_WORDS, PLANE_WORDS)[:, None] * D
            rv2 = rv + value_col(vcol, 2, D, VALUE_WORDS, PLANE_WORDS)[:, None] * D
            rv3 = rv + value_col(vcol, 3, D, VALUE_WORDS, PLANE_WORDS)[:, None] * D
            if ROT16:  # 16-bit dots of Rv's +-1 entries (x sqrt(D)), the rows scaled to |.| <= 1
                n = tl.maximum(row_norm(out0), row_norm(out1))
                if FOUR_ACC:
                    n = tl.maximum(n, tl.maximum(row_norm(out2), row_norm(out3)))
                n = n[:, None]
                out = split_dot(out0 / n, unit_rotation_rows(rv0, rmask, D, ROT16_UNITS), tl.zeros((BLOCK_M, DP), tl.float32))
                out = split_dot(out1 / n, unit_rotation_rows(rv1, rmask, D, ROT16_UNITS), out)
                if FOUR_ACC:
                    out = split_dot(out2 / n, unit_rotation_rows(rv2, rmask, D, ROT16_UNITS), out)
                    out = split_dot(out3 / n, unit_rotation_rows(rv3, rmask, D, ROT16_UNITS), out)
                out = out * (n * (1.0 / tl.sqrt(D * 1.0)))
            else:
                out = tl.dot(out0, tl.load(rv0, mask=rmask, other=0.0), input_precision="tf32x3")
                out = tl.dot(out1, tl.load(rv1, mask=rmask, other=0.0), out, input_precision="tf32x3")
                if FOUR_ACC:
                    out = tl.dot(out2, tl.load(rv2, mask=rmask, other=0.0), out, input_precision="tf32x3")
                    out = tl.dot(out3, tl.load(rv3, mask=rmask, other=0.0), out, input_precision="tf32x3")
            if EXACT_ACC:
                out = out + acc_x * inv_l[:, None]
            store_rounded(dst + dc[None, :], out, row_ok[:, None] & (dc[None, :] < D))
        else:
            om = row_ok[:, None] & (vcol[None, :] < VALUE_COLS)
            store_rounded(dst + value_col(vcol, 0, D, VALUE_WORDS, PLANE_WORDS)[None, :], out0, om)
            store_rounded(dst + value_col(vcol, 1, D, VALUE_WORDS, PLANE_WORDS)[None, :], out1, om)
            if FOUR_ACC:
                store_rounded(dst + value_col(vcol, 2, D, VALUE_WORDS, PLANE_WORDS)[None, :], out2, om)
                store_rounded(dst + value_col(vcol, 3, D, VALUE_WORDS, PLANE_WORDS)[None, :], out3, om)
    else:
        out = acc0 * inv_l[:, None] + bias_out[:, None]
        if VALUE_ROT and HADAMARD and not ROT_IN_REDUCE:  # out @ Rv = (out @ H) * s / sqrt(D), H built in registers
            n = row_norm(out)[:, None]
            out = hadamard_dot(out / n, dc, dc, dc < D, tl.zeros((BLOCK_M, DP), tl.float32))
            out = out * (n * (1.0 / tl.sqrt(D * 1.0))) * hadamard_signs(vrot_ptr, dc, D)[None, :]
            if EXACT_ACC:
                out = out + acc_x * inv_l[:, None]
        elif VALUE_ROT and not ROT_IN_REDUCE:
            out = matmul_square(out, vrot_ptr, D, DP, False)  # out @ Rv
            if EXACT_ACC:
                out = out + acc_x * inv_l[:, None]
        store_rounded(dst + dc[None, :], out, row_ok[:, None] & (dc[None, :] < D))
    if ROT_IN_REDUCE and EXACT_ACC:  # the exact values, original space, after the rotated ones
        store_rounded(dst + DP + dc[None, :], acc_x * inv_l[:, None], row_ok[:, None] & (dc[None, :] < D))

