"""The unified kernel's launch plan: tiles, split count, register cap and which code decoders it compiles in.

Each default below was measured on an H200 (32/8/128 unless named, S=32k decode); the one-line reasons say
why, docs/performance.md has the numbers. Overrides come from a LaunchConfig; those that the kernel cannot
run are refused with the reason.
"""

from __future__ import annotations

import torch
import triton

from ..layout import BlockLayout, key_planes, value_planes
from .codec_tensors import next_pow2, value_rotation_units
from .device import DeviceTraits
from .key_lut import (config_lut3_words, config_lut_bytes, config_lut_words, lut3_asm, lut3_codes_asm, lut_asm,
                      lut_words_asm)
from .launch_config import NO_REGISTER_CAP, LaunchConfig
from .plan import AttentionPlan
from .reduce import partial_width, pdl_options, reduce_site
from .unified import _attn_kernel
from .workspace import check_workspace


def _pick(override, default):
    """A LaunchConfig field where set, else the heuristic's value."""
    return default if override is None else override


def plan_unified(query: torch.Tensor, pool: torch.Tensor, layout: BlockLayout, *, kv_start, sinks, key_offset,
                 s_koff: int, prefix_len: int, recent_size: int, exact_buffers: tuple, workspace, scale: float,
                 sliding_window, softcap, kv_len: int, num_splits, rot, cent, vrot, launch: LaunchConfig,
                 traits: DeviceTraits) -> AttentionPlan:
    """The plan of one validated call (attention.plan_attention); kv_len: the host's bound on a walk's length."""
    b, hq, lq, d = query.shape
    hk = layout.num_kv_heads
    g = hq // hk
    cfg = layout.config
    rows = g * lq
    dp = next_pow2(d)
    dhp = next_pow2(d // 2)
    on_gpu = traits.tuned_for_gpu
    ptx = traits.runs_ptx
    decode = rows <= 64
    sms = traits.num_sms
    batch_fills_gpu = 2 * b * hk >= sms  # one decode program per (row, KV head) would fill half the SMs
    # 4-bit keys by byte permutes (key_lut.py) in decode that runs PTX, at head_dim 64 (as code words), 128 and
    # 256, where measured faster than the gather; other head_dims are unmeasured
    wants_lut = _pick(launch.key_lut, d in (64, 128, 256))
    words = config_lut_words(cfg, d) if decode and ptx and wants_lut else None
    # 3-bit keys stored as 8 code planes (layout.key_planes): one dot per plane, by the same byte permutes
    use_planes = key_planes(cfg, d)
    # 3-bit keys kept as a bit stream (head_dims whose planes do not fill an MMA's K), on a GPU: 4 unpacked codes per
    # byte permute (key_lut.lut3_codes_asm) at any such head_dim, where the gather lowered to compare-and-select chains
    stream3 = cfg.uses_codebook and cfg.key_bits == 3 and not use_planes
    lut3 = wants_lut if use_planes else stream3 and _pick(launch.key_lut, True)
    words3 = config_lut3_words(cfg, d) if lut3 and decode and ptx else None
    maxnreg = None
    narrow = False  # 2 warps per program (mid-batch decode of 4-bit codebook keys, plain format)
    wide = False  # 8 warps per program (FP8 keys at head_dim 256, below)
    plain_format = not (prefix_len or recent_size or key_offset is not None or cfg.value_rotation)
    # two KV heads per program: their query rows share one 16-row MMA tile, so the softmax, its reductions and
    # P's trip through shared memory serve both heads (faster at every batch, with and without the levers)
    # (not where the caller's LaunchConfig asks for what pairs exclude: metadata pairs, byte-wise codes)
    pairs = (bool(words) and d == 128 and on_gpu and hk % 2 == 0 and rows <= 8 and not launch.meta_pairs
             and launch.key_words is not False and launch.value_words is not False)
    # k3v4's 3-bit key planes at head_dim 128 with the levers pair too (4-bit value words): faster from B=4 to 16, at
    # B=1 with the ring in programs of its own (below); 3bit's value planes gained 2% at B=16 and lost at B=1, and the
    # plain format is unmeasured
    pairs3 = (words3 is not None and use_planes and d == 128 and cfg.value_bits == 4 and on_gpu and hk % 2 == 0
              and rows <= 8 and not plain_format and not launch.meta_pairs and launch.value_words is not False
              and launch.block_m in (None, 16))
    hp = _pick(launch.head_pairs, 2 if pairs or pairs3 else 1)
    verify4 = verify3 = False  # a verification forward of 4-bit / 3-bit keys on 16-row tiles (below)
    one_wave3 = False  # 3-bit keys and values in 168 registers once the batch fills the GPU: splits for one wave
    if decode:  # memory-bound: long KV tiles, few rows (eval.bench_decode_variants sweeps)
        block_m = max(16, next_pow2(rows))
        if cfg.key_bits == 8 and d == 128 and on_gpu:
            # FP8 keys, a verification forward (17-64 rows): 16-row tiles, each walking the history, were faster than
            # one 32- or 64-row tile, most under the 128-register cap (docs/performance.md, launch plan)
            block_m = 16
        if cfg.key_bits == 3 and d == 128 and on_gpu and rows <= 32 and not plain_format:
            # 3-bit keys with the levers, 8 queries x GQA 4: two 16-row tiles, each walking the history; one 32-row
            # tile was slower (3bit's spilled, the 16-row ones do not; docs/performance.md, launch plan)
            block_m = 16
        verify3 = cfg.key_bits == 3 and d == 128 and on_gpu and 16 < rows <= 32 and not plain_format
        verify4 = words is not None and d == 128 and on_gpu and 16 < rows <= 32 and not plain_format
        if verify4:
            # 4-bit codebook keys, 5-8 queries x GQA 4 with the levers: two 16-row tiles by key and value words, each
            # walking the history, faster than one 32-row tile by bytes (at B=1 and B=4)
            block_m = 16
        block_n = 256 if cfg.key_bits == 4 else 128
        if words3 and d == 64 and cfg.value_bits == 4 and b * hk > 8 and not batch_fills_gpu:
            # k3v4 at head_dim 64 past 8 (row, KV head) pairs until the batch fills the GPU: 256-token tiles, more
            # loads in flight per walk (slower with fewer pairs and once the batch fills the GPU)
            block_n = 256
        if d > 128:  # head_dim 256: 64-token tiles only for a few KV heads with the levers (128 were 5% slower there)
            block_n = 128 if d == 256 and (plain_format or b * hk >= 8) else 64
        if words and d == 128 and (prefix_len or recent_size):
            block_n = 128  # with exact prefix/ring buffers 128-token tiles also at small batch
        if hp > 1 and words:
            # head pairs on 128-token tiles; with the levers uncapped (in 168 registers their state spilled)
            block_n, maxnreg = 128, (168 if plain_format else None)
        elif hp > 1 and use_planes:
            # 3-bit key planes in head pairs uncapped (2 programs per SM without spills; under 128 or 168 they spill)
            block_n, maxnreg = 128, None
        elif words and d == 64:
            maxnreg = 168  # 4-bit code words at head_dim 64: 256-token tiles in 168 registers, levers too
        elif verify4 and b * hk <= 8:
            # a verification forward's two 16-row tiles at B=1: 128 registers, 4 programs per SM, and splits for
            # them (below), which pay only together: either alone was slower than the plan without both
            maxnreg = 128
        elif verify3 and b * hk <= 8:
            # 3-bit keys' two 16-row tiles at B=1: 168 registers hold 3 programs per SM, and splits fill one wave of
            # them (below); the cap alone, or those splits uncapped (over a wave of 2 per SM), were slower
            maxnreg = 168
        elif cfg.key_bits == 8 and d == 64 and on_gpu and not batch_fills_gpu:
            # FP8 keys at head_dim 64 with token-pair metadata: 128 registers under the levers (uncapped was slower)
            maxnreg = None if plain_format else 128
        elif words and d == 128 and batch_fills_gpu:
            block_n, maxnreg = 128, 128  # the batch fills the GPU: shorter tiles, 4 programs per SM
        elif cfg.key_bits == 8 and d == 128 and on_gpu:
            maxnreg = 128  # FP8 keys: 128 registers at any batch (2 programs per SM uncapped)
        elif cfg.key_bits == 8 and d == 256 and on_gpu and not plain_format and b * hk >= 16:
            # FP8 keys at head_dim 256 with the levers, from 16 (row, KV head) pairs: 8 warps in 128 registers, still 2
            # programs per SM, each thread half the tile (the other presets gained little or lost)
            wide, maxnreg = True, 128
        elif words3 and d == 128 and batch_fills_gpu:
            # 3-bit code planes: k3v4 in 128 registers; 3bit's plain format in 168; with the levers in 168 too (3
            # programs per SM) where splits fill one wave of them (below), else uncapped; one 16-row tile, as measured
            one_wave3 = cfg.value_bits == 3 and not plain_format and rows <= 16 and 3 * sms // (b * hk) >= 2
            if cfg.value_bits != 3:
                maxnreg = 128
            elif plain_format or one_wave3:
                maxnreg = 168
        elif words and d == 128 and on_gpu and b * hk >= 16 and plain_format:
            # mid batch, plain format: 2-warp programs on 128-token tiles, twice the splits (levers: slower)
            block_n, narrow = 128, True
    else:
        block_m = 64 if d == 128 else 32
        block_n = 64 if d <= 128 else 32
    if d < 128:
        # Triton 3.6 on the H200 computes wrong results (and faults) for 64-row tiles at head_dim 32/64 (the wgmma
        # path); 32-row tiles take the mma.sync path
        block_m = min(block_m, 32)
    planes_v = value_planes(cfg, d)
    if not on_gpu:
        block_n = 16 if decode else 32
    block_n = _pick(launch.block_n, block_n)
    block_m = _pick(launch.block_m, block_m)
    maxnreg = _pick(launch.maxnreg, maxnreg)
    if maxnreg == NO_REGISTER_CAP:
        maxnreg = None
    num_warps = _pick(launch.num_warps, 2 if narrow else 8 if wide else 4)
    # 4-bit values as 16-bit words (two tokens per MMA operand register): 16-row decode tiles (64-row wgmma tiles
    # computed wrong results, 32-row ones were slower), on a GPU where each warp has a column tile (D/4 >= 8 x warps)
    value_words = cfg.value_bits == 4 and decode and block_m <= 16 and d // 4 >= (8 * num_warps if on_gpu else 16)
    value_words = bool(_pick(launch.value_words, value_words))
    if value_words and cfg.value_bits != 4:
        raise ValueError(f"LaunchConfig value_words=True needs 4-bit values, got {cfg.value_bits}-bit")
    if value_words and on_gpu and (block_m > 32 or d // 4 < 16):
        raise ValueError(f"LaunchConfig value_words=True needs row tiles of <= 32 rows and head_dim >= 64 on a GPU, "
                         f"got block_m {block_m}, head_dim {d} (64-row tiles computed wrong results on an H200)")
    # small-batch decode by the lookup (and FP8 keys at head_dim 64) waits on memory latency: the metadata as
    # 32-bit token pairs, which the pipeliner prefetches, and 3 stages; at large batch their address arithmetic
    # costs more than the latency they hide
    meta_pairs = bool(_pick(launch.meta_pairs, (words is not None or (cfg.key_bits == 8 and d == 64)) and on_gpu
                            and not batch_fills_gpu and hp == 1))
    # otherwise each token's fields from its pair's 32-bit word (4-byte loads, prefetched); slower at head_dim 64
    meta_words = bool(_pick(launch.meta_words, decode and on_gpu and not meta_pairs and d == 128))
    # the pipeliner prefetches only loads that feed an MMA operand: v_mid joins the value operand as + 0 * v_mid
    vmid_chain = bool(_pick(launch.vmid_chain, meta_words))
    # codebook keys: the block-table entries an iteration ahead, so the code loads are direct and 3 stages
    # double-buffer them; FP8 keys' larger tiles lose, and so does one head per program with centering + value
    # rotation (spills under the 128-register cap)
    bt_next = bool(_pick(launch.bt_next, meta_words and cfg.uses_codebook
                         and (hp > 1 or not (cfg.key_centering or cfg.value_rotation))))
    num_stages = _pick(launch.num_stages, 3 if (meta_pairs or bt_next) else 2) if on_gpu else 1
    # rotation="hadamard": the query's rotation (and the bit-stream values' output rotation) built in registers,
    # not read; 3-bit keys in 64-row (wgmma) tiles computed wrong results that way, so those read R
    hadamard = cfg.rotation == "hadamard" and (block_m <= 32 or cfg.key_bits != 3)
    # int32 pool offsets where they fit: fewer 64-bit integer ops per tile; 3-bit values measured slower with them
    pool32 = bool(_pick(launch.pool32, pool.numel() < 2**31 and cfg.value_bits != 3))
    if pool32 and pool.numel() >= 2**31:
        raise ValueError(f"LaunchConfig pool32=True needs a pool of < 2**31 bytes (int32 offsets), got {pool.numel()}")
    # 4-bit keys as 16-bit code words, two of a token per MMA operand register (the query's operand loads by
    # ldmatrix) with byte magnitudes: always with head pairs, at head_dim 64, and once the batch fills the GPU
    # without exact buffers (one head per program elsewhere did not gain)
    kbytes = config_lut_bytes(cfg, d) if words else None
    key_words = bool(_pick(launch.key_words, kbytes is not None and (hp > 1 or d == 64 or verify4 and block_m == 16 or (
        batch_fills_gpu and not (prefix_len or recent_size)))))
    if key_words and not (decode and cfg.uses_codebook and cfg.key_bits == 4 and d in (64, 128, 256)
                          and (kbytes is not None or words is None)):
        raise ValueError(f"LaunchConfig key_words=True needs decode (<= 64 rows) of 4-bit codebook keys at head_dim "
                         f"64, 128 or 256, got {rows} rows, {cfg.key_bits}-bit "
                         f"{'codebook' if cfg.uses_codebook else 'FP8'} keys, head_dim {d}")
    # 3-bit key planes at head_dim 128 pair too (each head's windows over its rows), with 4-bit value words (k3v4's
    # default, above) or 3-bit value planes (where a LaunchConfig asks)
    planes_pair = use_planes and d == 128 and (value_words or planes_v)
    if hp > 1 and not ((key_words and value_words or planes_pair) and decode and rows <= 16 // hp and block_m == 16
                       and hk % hp == 0 and not meta_pairs):
        raise ValueError(f"LaunchConfig head_pairs={hp} needs decode (<= {16 // hp} rows per KV head, 16-row tiles) "
                         "with 4-bit key and value words (key_words, value_words) or 3-bit key planes at head_dim 128 "
                         "with 4-bit value words or 3-bit value planes, without meta_pairs, and a KV head count "
                         f"divisible by {hp}; got {rows} rows, block_m {block_m}, {cfg.key_bits}-bit keys, "
                         f"{cfg.value_bits}-bit values, head_dim {d}, key_words={key_words}, "
                         f"value_words={value_words}, meta_pairs={meta_pairs}, {hk} KV heads")
    m_tiles = triton.cdiv(rows, block_m)
    kv_tiles = max(1, triton.cdiv(kv_len, block_n))
    programs = b * (hk // hp) * m_tiles
    auto_splits = num_splits is None
    if num_splits is None:
        # waves of programs per SM: FP8 keys dequantize cheaply and want more loads in flight; a power of two
        # splits the (power-of-two) tile counts evenly; also once every SM has a program (one per SM left the
        # other program slots idle)
        # FP8 keys at head_dim 256 hold 2 programs per SM: sized for 4, a few rows' splits took nearly two waves, so
        # up to 16 (row, KV head) pairs they are sized for 2 (at B=16 half the splits were slower)
        waves = (2 if d > 128 and b * hk <= 16 else 4) if cfg.key_bits == 8 else 3
        if verify4 and maxnreg == 128:
            waves = 4
        if words and num_warps == 2:
            waves *= 2
        # (several row tiles too: a chunk of queries over a long history, which few programs would walk alone)
        want = min(triton.cdiv(waves * sms, programs), kv_tiles, 128)
        num_splits = 1 << (want.bit_length() - 1)
        if (verify3 or one_wave3) and maxnreg == 168:
            # one full wave of 3 programs per SM, not a power of two (24 at 8 KV heads, 3 at B=16)
            num_splits = max(1, min(3 * sms // programs, kv_tiles))
    if not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
    # one extra program attends the exact tiles beside the pool's walks while the GPU has programs to spare (in a split
    # they made it the slowest); not where several row tiles each walk the history: it walked alone after the splits
    fp8_two_tiles = cfg.key_bits == 8 and m_tiles == 2 and b * hk <= 8  # kept: faster with it (docs/performance.md)
    tiles_walk_apart = decode and m_tiles > 1 and not fp8_two_tiles
    exact_default = not batch_fills_gpu and not tiles_walk_apart
    cappable64 = decode and on_gpu and d == 64 and launch.maxnreg is None and (words or words3 and cfg.value_bits == 3)
    # head_dim 64 with the exact program, from 48 (row, KV head) pairs until the batch fills the GPU: splits for one
    # full wave of 4 programs per SM (FP8 keys' 128 registers, or the cap below), where the power of two with the
    # exact program left a fifth of a wave of 4 idle or spilled past a wave of 3 (smaller batches unmeasured)
    exact_wanted = (bool(_pick(launch.exact_program, exact_default)) and (prefix_len > 0 or recent_size > 0)
                    and not batch_fills_gpu and m_tiles == 1)
    if (auto_splits and exact_wanted and 48 <= b * hk and (maxnreg == 128 and cfg.key_bits == 8 or cappable64)):
        num_splits = max(1, min(4 * sms // programs - 1, kv_tiles))
    # 4-bit words in head pairs at head_dim 128 with an int8 ring, up to 2 x 8 KV heads (3-bit key planes in pairs:
    # 1 x 8, as measured): the ring's 32-token tiles in exact programs of their own beside splits sized for one wave
    # of 1 program per SM while those walk <= 1,024 tokens each, of 2 past that (the ring walked after a split's walk
    # was the levers' fixed cost)
    ring_q8 = exact_buffers[2] is not None and exact_buffers[2].dtype == torch.int8
    rings_apart = (auto_splits and exact_wanted and on_gpu and decode and d == 128 and hp > 1 and ring_q8
                   and (key_words and b * hk <= 16 or use_planes and b * hk <= 8) and recent_size > 0
                   and launch.ring_n is None and bool(_pick(launch.ring_programs, True)))
    apart_ring_n = 32  # the ring's tile in programs of its own
    if rings_apart:
        ring_tiles = triton.cdiv(recent_size, apart_ring_n)
        apart_splits = min(sms // programs - ring_tiles, kv_tiles)
        if kv_len > 1024 * apart_splits:
            apart_splits = min(2 * sms // programs - ring_tiles, kv_tiles)
        rings_apart = apart_splits > 1
        num_splits = apart_splits if rings_apart else num_splits
    if cappable64 and programs * num_splits > 3 * sms:
        # 4-bit code words and 3-bit keys and values at head_dim 64 hold 3 programs per SM: where the splits overflow
        # one wave of those, 128 registers hold 4, spilling outside the tile loops only (within one wave it lost)
        maxnreg = 128
    split = num_splits > 1
    if split and m_tiles != 1 and hp != 1:
        raise ValueError("split-KV over several row tiles needs one KV head per program (head_pairs=1)")
    exact_prog = int(bool(_pick(launch.exact_program, exact_default)) and split and (prefix_len > 0 or recent_size > 0))

    # the exact tiles' dots in the query's 16-bit dtype where the buffers share it (tiles.exact_tile); not bf16
    # under the interpreter, whose bf16 dots return garbage (the GPU tests check those)
    # (int8 ring records: key codes enter per-group dots exactly in either 16-bit dtype; tiles._record_scores)
    exact16 = (query.dtype == torch.float16 or (query.dtype == torch.bfloat16 and ptx)) and all(
        x.dtype in (query.dtype, torch.int8) for x in exact_buffers if x is not None)

    ring_n = min(32, max(16, next_pow2(recent_size)))  # the recent window's tile, tokens
    if exact_prog and cfg.key_bits == 8 and d == 128 and b * hk <= 16:
        ring_n = 16  # FP8 keys' exact program on 16-token ring tiles up to 2 x 8 KV heads
    if ring_q8 and split and decode and m_tiles == 1 and d == 128 and b * hk <= 16:
        # int8 records shared out over a split decode's programs in 16-token tiles up to 2 x 8 KV heads: a little
        # faster at B=1, slower at B=16
        ring_n = 16
    # a verification forward's row tiles each walk the history; its exact window (W + Lq fp16 slots) shared out in
    # 16-token tiles over the splits (docs/performance.md, "Forwards of several tokens")
    verify_spread = tiles_walk_apart and not batch_fills_gpu and d == 128 and b * hk <= 16
    if verify_spread:
        ring_n = 16
    if rings_apart:
        ring_n = apart_ring_n
    ring_n = _pick(launch.ring_n, ring_n if on_gpu else 16)
    # each ring tile in an exact program of its own: its latency (a record tile's chain of loads, shared-memory
    # layout conversions and barriers) then runs beside the pool's walks instead of after one of them
    ring_programs = bool(_pick(launch.ring_programs, rings_apart))
    if ring_programs and not (exact_prog and recent_size > 0):
        raise ValueError("LaunchConfig ring_programs=True needs a split decode with an exact ring in programs of its "
                         f"own (exact_program); got {num_splits} splits, exact_program={bool(exact_prog)}, ring of "
                         f"{recent_size}")
    if ring_programs:
        exact_prog = triton.cdiv(recent_size, ring_n)
    ns_all = num_splits + exact_prog
    # the ring's tiles shared out over a split decode's programs, where one program walking them all was the slowest:
    # int8 records, FP8 keys' exact ring while SMs are free; head_dim 256 from 16 rows (fewer: the split given one lags)
    spread_default = ((ring_q8 or (cfg.key_bits == 8 and not batch_fills_gpu) or verify_spread) and d <= 128
                      or d > 128 and b * hk >= 16)
    ring_spread = bool(_pick(launch.ring_spread, decode and spread_default)) and split and recent_size > 0

    # split partials left in the rotated value space, rotated back once per row by the reduction: at head_dim 256
    # the epilogue's product with Rv spilled under the levers
    rot_in_reduce = split and cfg.value_rotation and bool(_pick(launch.rotate_in_reduce, d > 128))
    # that rotation by Rv's columns, each row's partials merged first, over several programs per row (reduce.py),
    # where one program per row stepped over the rotated coordinates loading every split's slice each step
    reduce_columns = rot_in_reduce and bool(_pick(launch.reduce_columns, True))
    # the query of 3-bit key planes (and of 4-bit keys at head_dim 256) rotated once by butterflies and H_64 built in
    # registers, not per window: fewer prologue instructions; at head_dim 128 no faster once the batch fills the GPU
    bfly_ok = hadamard and ((use_planes and d in (128, 256)) or (cfg.key_bits == 4 and d == 256))
    query_butterfly = bool(_pick(launch.query_butterfly, on_gpu and decode and bfly_ok
                                 and (d == 256 or not batch_fills_gpu)))
    if query_butterfly and not bfly_ok:
        raise ValueError("LaunchConfig query_butterfly=True needs 3-bit key planes at head_dim 128 or 256, or 4-bit "
                         f"keys at head_dim 256, under rotation='hadamard'; got {cfg.key_bits}-bit keys, head_dim {d}, "
                         f"rotation {cfg.rotation!r}")
    # Rv's entries are +-1/sqrt(D) under rotation="hadamard": the decode epilogue's rotation back of 4-bit (or plane)
    # values by 16-bit dots, each row in two fp16 parts, not 3xTF32 (a third of the MMAs); at head_dim 128 only
    rot16_default = on_gpu and decode and d == 128
    rot16 = bool(_pick(launch.rotation_16bit, rot16_default)) and cfg.value_rotation and cfg.rotation == "hadamard"
    # Rv's +-1 entries read as fp16 (value_rotation_units), where each program converted 64 KB of fp32 Rv in its
    # epilogue
    rot16_units = (rot16 and not rot_in_reduce and (cfg.value_bits == 4 or planes_v)
                   and bool(_pick(launch.rotation_units, True)))
    if rot16_units:
        vrot = value_rotation_units(layout, str(pool.device))
    # 3-bit value planes' bytes into codes by one asm (value_nibbles.PLANE_BYTES_ASM) where Triton's 16-bit integer
    # ops built each token's plane word: fewer loop instructions, faster at every batch timed
    planes_asm = bool(_pick(launch.value_planes_asm, True)) and planes_v and ptx and block_m <= 32  # (plane words)
    # the plane codes decoded in place (value_nibbles.PLANE_SCALED_ASM; by integer ops under the interpreter, for the
    # tests): fewer value-decode instructions; at head_dim 256 no faster once the batch fills the GPU
    in_place = bool(_pick(launch.planes_in_place, planes_asm and (d == 128 or not batch_fills_gpu)))
    if in_place and not (planes_v and block_m <= 32 and (planes_asm or not ptx)):
        raise ValueError("LaunchConfig planes_in_place=True needs 3-bit value planes (head_dim 128 or 256) in decode "
                         "tiles of <= 32 rows, decoded from their bytes (value_planes_asm) on a GPU; got "
                         f"{cfg.value_bits}-bit values, head_dim {d}, block_m {block_m}, value_planes_asm={planes_asm}")
    value_ptx = 2 if planes_asm else int(bool((value_words or planes_v) and ptx))  # (unified._attn_kernel's VALUE_PTX)
    # the decoded value codes behind an asm boundary (code_decoders.operand_boundary): their dots in 16-bit operand
    # layouts, without the 4 register moves per MMA of the 8-bit ones: faster for 3-bit values (docs/performance.md),
    # slower for 4-bit ones; the bit stream (head_dim 64) only under a register cap, since uncapped (B=1) it takes
    # 201 registers for 156 and 2 programs per SM for 3
    value_boundary = bool(_pick(launch.value_boundary, cfg.value_bits == 3 and decode and ptx
                                and (block_m <= 32 if planes_v else maxnreg is not None)))
    if value_boundary and not (decode and ptx and not (planes_v and block_m > 32)):
        raise ValueError("LaunchConfig value_boundary=True needs decode tiles on a GPU, of <= 32 rows for 3-bit value "
                         f"planes; got {rows} rows (block_m {block_m}), {cfg.value_bits}-bit values at head_dim {d}, "
                         f"{'PTX' if ptx else 'the interpreter'}")
    # the key lookups' table words pinned in registers (key_lut._tables), else ptxas copies one from a uniform
    # register before each byte permute; 3bit gains only with the byte-plane asm above, so the two go together
    pinned = bool(_pick(launch.table_registers, True))
    # programmatic dependent launch, asked for only (untimed): Hopper's griddepcontrol, PTX only
    pdl = bool(_pick(launch.pdl, False))
    if pdl and not (ptx and (not pool.is_cuda or torch.cuda.get_device_capability(pool.device) >= (9, 0))):
        got = torch.cuda.get_device_name(pool.device) if ptx else "the interpreter"
        raise ValueError("LaunchConfig pdl=True needs a GPU of compute capability 9.0 or newer (sm_90: H100, H200) "
                         f"running PTX; got {got}")
    exact_acc = cfg.value_rotation and (prefix_len > 0 or recent_size > 0)
    width = partial_width(dp, rot_in_reduce and exact_acc)
    workspace_numel = 0
    partial_rows = b * hk * m_tiles * ns_all * (block_m // hp)
    if split:
        workspace_numel = partial_rows * (width + 1)
        check_workspace(workspace, workspace_numel, pool.device)
    constants = dict(
        D=d, DP=dp, HALF_DP=dhp, CODE_GROUPS=next_pow2(d // 8), G=g, T=layout.block_size, KB=layout.key_bytes, VB=layout.value_bytes,
        META=layout.metadata_offset, KEY_BITS=cfg.key_bits, VALUE_BITS=cfg.value_bits,
        NC=(1 << cfg.key_bits) if cfg.uses_codebook else 1,
        BLOCK_M=block_m, QUARTER_DP=next_pow2(d // 4),
        HAS_KV_START=kv_start is not None, HAS_WINDOW=sliding_window is not None,
        HAS_SINKS=sinks is not None, HAS_SOFTCAP=softcap is not None, SPLIT=split,
        HAS_KEY_OFFSET=key_offset is not None, VALUE_ROT=cfg.value_rotation,
        HAS_PREFIX=prefix_len > 0, PREFIX_TILE=max(16, next_pow2(prefix_len)),
        EXACT_ACC=exact_acc, ROT_IN_REDUCE=rot_in_reduce, PARTIAL_W=width, ROTATION_STEP=min(32, dp), EXACT_PROG=exact_prog, RING_SPREAD=ring_spread and not ring_programs,
        RING_PROGRAMS=ring_programs,
        EXACT_16=exact16, RING_Q8=ring_q8,
        VALUE_WORDS=value_words, VALUE_PTX=value_ptx, PLANES_IN_PLACE=in_place, KEY_LUT=words is not None or words3 is not None,
        KEY_WORDS=key_words, KEY_UNIT=kbytes[1] if words and key_words else 1.0,
        LUT_LO=(lut_words_asm(kbytes[0], pinned) if key_words else lut_asm(words, False, pinned)) if words else (
            (lut3_codes_asm(words3, pinned) if stream3 else lut3_asm(words3, False, pinned)) if words3 else ""),
        LUT_HI=("" if key_words else lut_asm(words, True, pinned)) if words else (
            lut3_asm(words3, True, pinned) if words3 and not stream3 else ""),
        KEY_PLANES=use_planes, VALUE_PLANES=planes_v,
        META_PAIRS=meta_pairs, META_WORDS=meta_words, VMID_CHAIN=vmid_chain, BT_NEXT=bt_next, POOL32=pool32, HADAMARD=hadamard, QUERY_BUTTERFLY=query_butterfly, VALUE_BOUNDARY=value_boundary, ROT16=rot16, ROT16_UNITS=rot16_units, HAS_RECENT=recent_size > 0, RING_TILE=ring_n,
        HEADS_PER_PROGRAM=hp, num_warps=num_warps, **({"maxnreg": maxnreg} if maxnreg else {}), **pdl_options(pdl),
    )
    return AttentionPlan(
        layout=layout, kernel=_attn_kernel, grid=(m_tiles * ns_all, hk // hp, b), constants=constants, block_n=block_n,
        num_stages=num_stages, split=split, ns_all=ns_all, partial_rows=partial_rows, dp=dp, partial_width=width,
        workspace_numel=workspace_numel, rot=rot, cent=cent, vrot=vrot, s_koff=s_koff, prefix_len=prefix_len,
        recent_size=recent_size, scalars=(lq, num_splits, float(scale), float(softcap or 1.0), int(sliding_window or 0),
                                          layout.block_bytes, layout.plane_bytes),
        reduce=reduce_site(b, hk, g, lq, ns_all, block_m // hp, d, dp, m_tiles, rot_in_reduce, exact_acc,
                           sms if reduce_columns else None, pdl) if split else None,
    )
