"""unified_attention against reference.paged_attention on the same packed cache.

Tolerance: relative Frobenius error <= 1e-3 for the kernel's own arithmetic (fp16 tensor-core
operands, fp32 accumulation) plus the rounding of the output dtype (attention_tolerance).
Outputs are poisoned with NaN first, so an unwritten element fails the check.
"""

from __future__ import annotations

import math

import pytest
import torch

from tq_hf import reference
from tq_hf.layout import value_planes
from tq_hf.kernels import DeviceTraits, LaunchConfig, plan_attention, unified_attention
from tq_hf.kernels.device import H200
from tq_hf.kernels.launch_config import NO_REGISTER_CAP
from tq_hf.kernels.reduce import reduce_site

from kernel_helpers import (DEVICE, attention_tolerance, default_scale, exact_prefix, fill_cache, make_layout,
                            poisoned_exact_buffers, recent_ring, rel_error)


def _check(layout, lens, q_len, group, dtype=torch.float32, device=DEVICE, prefix_len=0, recent=None,
           ring_records=False, **kw):
    """Kernel vs reference on a fresh cache. prefix_len P > 0: exact_prefix_tokens buffers are
    passed and the pool's slots at positions kv_start + s (s < P) are poisoned (NaN), so the
    kernel must take those positions from the buffers. recent=(W, recent_from): a recent_window
    ring is passed and the pool's slots at its positions are poisoned too, as are the prefix
    entries the ring covers (the ring wins there, as in reference.overlay_recent); ring_records: the ring as int8
    records (recent_format "int8")."""
    pool, table = fill_cache(layout, lens, device, key_offset=kw.get("key_offset"))
    b = len(lens)
    starts = [0] * b if kw.get("kv_start") is None else kw["kv_start"].tolist()
    kw.update(poisoned_exact_buffers(pool, layout, table, lens, starts, prefix_len, recent, dtype, device, ring_records))
    query = torch.randn(b, layout.num_kv_heads * group, q_len, layout.head_dim, device=device).to(dtype)
    seq_lens = torch.tensor(lens, device=device)
    scale = default_scale(layout.head_dim)
    ref_kw = {k: v for k, v in kw.items() if k not in ("num_splits", "launch", "device_traits")}
    want = reference.paged_attention(query.float(), pool, layout, table, seq_lens, scale, **ref_kw)
    out = torch.full_like(query, float("nan"))
    got = unified_attention(query, pool, layout, table, seq_lens, scale, out=out, **kw)
    assert got is out
    err, tol = rel_error(got, want), attention_tolerance(dtype, want)
    assert err <= tol, (f"relative error {err:.3e} > {tol:.3e} ({layout.config}, lens={lens}, Lq={q_len}, G={group}, "
                        f"P={prefix_len}, recent={recent})")
    return got, want


# decode (one query per row): presets x GQA groups x split / no split, odd and mixed lengths
@pytest.mark.parametrize("preset", ["4bit", "k8v4", "k3v4", "3bit"])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
def test_decode_matches_reference(preset, group):
    layout = make_layout(preset, 2, 64)
    _check(layout, [1, 37, 123], 1, group)


@pytest.mark.parametrize("num_splits", [1, 2, 5])
def test_decode_split_counts_agree(num_splits):
    layout = make_layout("4bit", 2, 64)
    _check(layout, [5, 130, 77], 1, 4, num_splits=num_splits)


@pytest.mark.parametrize("head_dim,block_size,dtype", [
    (128, 16, torch.float16), (96, 32, torch.bfloat16), (256, 64, torch.float32), (32, 16, torch.float16),
])
def test_head_dims_block_sizes_dtypes(head_dim, block_size, dtype):
    layout = make_layout("4bit", 1, head_dim, block_size)
    _check(layout, [70, 141], 2, 4, dtype=dtype)


# the pool's addresses as int32 offsets (pools of < 2**31 bytes, every other test) and as int64 (larger
# pools, forced here): decode with splits and the metadata pairs, and a prefill, for every key format
@pytest.mark.parametrize("preset", ["4bit", "k8v4", "k3v4", "3bit"])
@pytest.mark.slow
def test_pool_addresses_in_int64(preset):
    layout = make_layout(preset, 2, 128, 32)
    # (one KV head per program: on a GPU 4-bit decode pairs them by default, which the metadata pairs exclude)
    _check(layout, [5, 130, 77], 1, 4, num_splits=3, launch=LaunchConfig(pool32=False, meta_pairs=True, head_pairs=1))
    _check(layout, [40, 71], 17, 4, launch=LaunchConfig(pool32=False))


def test_pool32_refused_for_large_pools():
    layout = make_layout("4bit", 1, 64)
    blocks = 2**31 // layout.plane_bytes + 1  # just over 2**31 bytes (never touched: the plan refuses first)
    pool = torch.empty(blocks, 1, layout.plane_bytes, dtype=torch.uint8)
    q = torch.randn(1, 4, 1, 64)
    with pytest.raises(ValueError, match="pool32=True needs a pool of < 2"):
        unified_attention(q, pool, layout, torch.zeros(1, 4, dtype=torch.int32), torch.tensor([5]), 0.1,
                          launch=LaunchConfig(pool32=True))


# prefill / chunked prefill: several row tiles, causal bottom-right alignment
@pytest.mark.parametrize("preset,group,q_len,lens", [
    ("4bit", 1, 45, [45, 100]),  # first prefill (Lq == S) and a chunk at the end of a longer cache
    ("k8v4", 3, 23, [23, 61]),
    ("3bit", 4, 17, [40]),
])
def test_prefill_matches_reference(preset, group, q_len, lens):
    layout = make_layout(preset, 2, 64)
    _check(layout, lens, q_len, group)


def test_sliding_window_and_sinks():
    layout = make_layout("4bit", 2, 64)
    sinks = torch.randn(8, device=DEVICE)
    _check(layout, [37, 90], 5, 4, sliding_window=9, sinks=sinks)
    _check(layout, [37, 90], 1, 4, sliding_window=20, sinks=sinks, num_splits=3)


def test_kv_start_softcap_and_rows_that_see_nothing():
    layout = make_layout("k3v4", 2, 64)
    # row 0: queries at positions 15..19 with kv_start 18 -> the first three see no key -> zeros
    got, want = _check(layout, [20, 66], 5, 3, kv_start=torch.tensor([18, 3], device=DEVICE), softcap=4.0)
    assert torch.all(got[0, :, :3] == 0)
    _check(layout, [20, 66], 1, 3, kv_start=torch.tensor([18, 3], device=DEVICE), num_splits=4)


# key_centering + value_rotation: every preset, decode (split path) or a prefill chunk (one split),
# with sinks and softcap, where the q . mu term does not cancel
@pytest.mark.parametrize("preset,q_len,num_splits", [("4bit", 1, 3), ("k8v4", 7, 1), ("k3v4", 7, 1), ("3bit", 1, 3)])
def test_format_options_match_reference(preset, q_len, num_splits):
    layout = make_layout(preset, 2, 64, key_centering=True, value_rotation=True)
    mu = torch.randn(2, 64, device=DEVICE) * 3
    sinks = torch.randn(8, device=DEVICE)
    _check(layout, [37, 90], q_len, 4, key_offset=mu, sinks=sinks, softcap=6.0, num_splits=num_splits)


@pytest.mark.parametrize("preset,q_len,num_splits", [("4bit", 1, 3), ("k3v4", 5, 1)])
def test_per_row_key_offset_matches_reference(preset, q_len, num_splits):
    """key_centering with one mean per row [B, H, D] (the cache's, so rows never share a mean)."""
    layout = make_layout(preset, 2, 64, key_centering=True, value_rotation=True)
    mu = torch.randn(3, 2, 64, device=DEVICE) * 3
    _check(layout, [37, 90, 12], q_len, 4, key_offset=mu, sinks=torch.randn(8, device=DEVICE), softcap=6.0,
           num_splits=num_splits)
    with pytest.raises(ValueError, match="key_offset must be"):
        _check(layout, [37, 90], q_len, 4, key_offset=mu)  # 3 rows of means for 2 rows


@pytest.mark.parametrize("preset,head_dim,q_len,num_splits,options", [
    ("k3v4", 128, 1, 3, False), ("k3v4", 128, 6, 1, True), ("k3v4", 256, 1, 2, True),
])
def test_three_bit_key_planes(preset, head_dim, q_len, num_splits, options):
    """3-bit keys at head_dim 128/256 score one code plane (layout.py) at a time: 8 dots of D/8
    coordinates, the query rotated plane by plane (on the CPU the planes' codes are gathered; on a
    GPU decode looks them up by key_lut.py's asm: the gpu tests)."""
    layout = make_layout(preset, 2, head_dim, key_centering=options, value_rotation=options)
    mu = torch.randn(2, head_dim, device=DEVICE) * 3 if options else None
    _check(layout, [37, 70], q_len, 4, key_offset=mu, num_splits=num_splits, softcap=5.0 if options else None)


@pytest.mark.parametrize("preset,head_dim,q_len,options", [
    ("k3v4", 64, 1, True), ("3bit", 64, 5, False), ("3bit", 32, 1, True), ("k3v4", 96, 3, False),
    ("3bit", 48, 2, True)])
def test_three_bit_bit_stream_keys(preset, head_dim, q_len, options):
    """3-bit keys kept as a bit stream (head_dims whose planes do not fill an MMA's K), unpacked by joins: on the
    CPU gathered from the centroid table (a GPU plans the byte-permute lookup, key_lut.lut3_codes_asm: the PTX
    emulator's test and the gpu tests). Head_dim 48: rows of 18 bytes, groups
    straddling 32-bit words."""
    rotation = {} if head_dim & (head_dim - 1) == 0 else {"rotation": "random"}
    layout = make_layout(preset, 2, head_dim, key_centering=options, value_rotation=options, **rotation)
    mu = torch.randn(2, head_dim, device=DEVICE) * 3 if options else None
    _check(layout, [37, 70], q_len, 4, key_offset=mu, num_splits=2)
    args = (torch.zeros(1, 4, q_len, head_dim), layout.allocate(1, "cpu"), layout, torch.zeros(1, 1, dtype=torch.int32),
            torch.ones(1, dtype=torch.int32), 0.1)
    assert plan_attention(*args, device_traits=H200).constants["KEY_LUT"], "a GPU looks the codes up"
    assert not plan_attention(*args, device_traits=H200, launch=LaunchConfig(key_lut=False)).constants["KEY_LUT"]


@pytest.mark.parametrize("q_len,num_splits", [(1, 2), (6, 1)])
def test_three_bit_rotations_at_an_odd_head_dim(q_len, num_splits):
    """3-bit keys rotate the query, and value_rotation rotates the output, in two column halves
    (matmul_square); head_dim 96 pads them to 128 columns."""
    layout = make_layout("3bit", 2, 96, key_centering=True, value_rotation=True)
    _check(layout, [29, 50], q_len, 3, key_offset=torch.randn(2, 96, device=DEVICE), num_splits=num_splits)


def test_key_offset_is_not_dropped():
    """Without sinks the q . mu term shifts every score of a row equally; with a sink logit of
    the size of the centred scores, dropping the term moves the output far beyond tolerance."""
    layout = make_layout("4bit", 1, 64, key_centering=True)
    mu = torch.randn(1, 64, device=DEVICE) * 10
    pool, table = fill_cache(layout, [40], DEVICE, key_offset=mu)
    q = torch.randn(1, 4, 1, 64, device=DEVICE)
    seq = torch.tensor([40], device=DEVICE)
    sinks = 0.125 * (q[0, :, 0] @ mu[0]) + math.log(40)  # about the mass of the 40 keys
    centred = reference.paged_attention(q, pool, layout, table, seq, 0.125, sinks=sinks, key_offset=mu)
    uncentred = reference.paged_attention(q, pool, layout, table, seq, 0.125, sinks=sinks)
    assert rel_error(uncentred, centred) > 1e-2  # so the check below can tell them apart
    got = unified_attention(q, pool, layout, table, seq, 0.125, sinks=sinks, key_offset=mu)
    assert rel_error(got, centred) <= 1e-3


def test_strided_query_and_default_out():
    layout = make_layout("4bit", 2, 64)
    pool, table = fill_cache(layout, [50], DEVICE)
    q = torch.randn(1, 3, 8, 64, device=DEVICE).transpose(1, 2)  # [1, 8, 3, 64] non-contiguous
    seq = torch.tensor([50], device=DEVICE)
    got = unified_attention(q, pool, layout, table, seq, 0.125, max_seq_len=50)
    want = reference.paged_attention(q, pool, layout, table, seq, 0.125)
    assert rel_error(got, want) <= 1e-3


def test_attention_rejects_bad_inputs():
    layout = make_layout("4bit", 2, 64)
    pool, table = fill_cache(layout, [20], DEVICE)
    q = torch.randn(1, 4, 1, 64, device=DEVICE)
    seq = torch.tensor([20], device=DEVICE)
    with pytest.raises(ValueError, match="multiple of the pool's KV heads"):
        unified_attention(torch.randn(1, 3, 1, 64, device=DEVICE), pool, layout, table, seq, 0.1)
    with pytest.raises(ValueError, match="head_dim"):
        unified_attention(torch.randn(1, 4, 1, 32, device=DEVICE), pool, layout, table, seq, 0.1)
    with pytest.raises(TypeError, match="query has dtype"):
        unified_attention(q.double(), pool, layout, table, seq, 0.1)
    with pytest.raises(TypeError, match="block_table has dtype"):
        unified_attention(q, pool, layout, table.float(), seq, 0.1)
    with pytest.raises(ValueError, match="seq_lens must be"):
        unified_attention(q, pool, layout, table, torch.tensor([20, 3], device=DEVICE), 0.1)
    with pytest.raises(ValueError, match="sinks must be"):
        unified_attention(q, pool, layout, table, seq, 0.1, sinks=torch.zeros(2, device=DEVICE))
    with pytest.raises(ValueError, match="sliding_window"):
        unified_attention(q, pool, layout, table, seq, 0.1, sliding_window=0)
    with pytest.raises(ValueError, match="out must be"):
        unified_attention(q, pool, layout, table, seq, 0.1, out=torch.empty(1, 4, 2, 64, device=DEVICE))
    with pytest.raises(ValueError, match="pool must be"):
        unified_attention(q, pool[:, :1], layout, table, seq, 0.1)
    with pytest.raises(ValueError, match="key_offset must be"):
        unified_attention(q, pool, layout, table, seq, 0.1, key_offset=torch.zeros(4, 64, device=DEVICE))
    with pytest.raises(ValueError, match="workspace"):
        unified_attention(q, pool, layout, table, seq, 0.1, num_splits=2, workspace=torch.empty(3, device=DEVICE))


# ---- exact_prefix_tokens: positions kv_start + s (s < P) read from dense buffers, pool poisoned there ----
def _fidelity_options(layout, group, device=DEVICE) -> dict:
    """key_offset (the pool is stored centred on it) and sinks, where q . mu does not cancel."""
    hk, d = layout.num_kv_heads, layout.head_dim
    return {"key_offset": torch.randn(hk, d, device=device) * 3, "sinks": torch.randn(hk * group, device=device)}


# decode on the split path; row 0 holds fewer tokens than P, rows 1-2 are left padded
@pytest.mark.parametrize("preset,group,prefix_len,options,dtype", [
    ("4bit", 4, 4, True, torch.float32),
    ("k8v4", 1, 5, True, torch.bfloat16),
    ("3bit", 4, 19, True, torch.float16),
    ("4bit", 1, 4, False, torch.float16),  # plain 4-bit values: the prefix joins the lo/hi output halves
    ("3bit", 4, 4, False, torch.float32),
])
@pytest.mark.parametrize("exact_program", [True, False])
def test_exact_prefix_decode(preset, group, prefix_len, options, dtype, exact_program):
    """exact_program: the prefix in a split program of its own (the GPU's choice when programs are to
    spare) or in split 0's walk."""
    layout = make_layout(preset, 2, 64, key_centering=options, value_rotation=options)
    kw = _fidelity_options(layout, group) if options else {"softcap": 5.0}
    _check(layout, [3, 37, 90], 1, group, dtype=dtype, prefix_len=prefix_len, num_splits=3,
           kv_start=torch.tensor([0, 5, 20], device=DEVICE), launch=LaunchConfig(exact_program=exact_program), **kw)


@pytest.mark.parametrize("preset", ["4bit", "k3v4", "3bit"])
@pytest.mark.parametrize("exact_program", [True, False])
@pytest.mark.parametrize("rotate_in_reduce", [False, True])
def test_exact_prefix_and_ring_split_decode(preset, exact_program, rotate_in_reduce):
    """Prefix and ring together on the split path, with sinks (split 0 owns them), the exact tiles in
    their own program or in the first/last split; one row shorter than the ring. rotate_in_reduce: the
    partials stay in the rotated value space and the reduction rotates them back, the exact values apart."""
    layout = make_layout(preset, 2, 64, key_centering=True, value_rotation=True)
    launch = LaunchConfig(exact_program=exact_program, rotate_in_reduce=rotate_in_reduce)
    _check(layout, [9, 70, 133], 1, 4, prefix_len=4, recent=(16, 0), num_splits=4,
           kv_start=torch.tensor([0, 3, 0], device=DEVICE), launch=launch, **_fidelity_options(layout, 4))


@pytest.mark.parametrize("preset,records,rotate_in_reduce", [
    ("4bit", True, False), ("4bit", False, True), ("k8v4", False, False), ("3bit", True, True)])
@pytest.mark.parametrize("ring_n,programs", [(16, 3), (32, 2)])
def test_ring_tiles_in_programs_of_their_own(preset, records, rotate_in_reduce, ring_n, programs):
    """ring_programs: each of the ring's tiles in an exact program of its own beside the pool's splits (a 48-token
    ring in 16-token tiles: 3 programs; in 32-token tiles: 2, the second half empty), the first also the prefix's;
    rows shorter than the ring, one starting late (kv_start); fp16 rings and int8 records, the partials rotated in
    the split programs or in the reduction."""
    layout = make_layout(preset, 2, 64, key_centering=True, value_rotation=True)
    launch = LaunchConfig(exact_program=True, ring_programs=True, ring_n=ring_n, rotate_in_reduce=rotate_in_reduce)
    kw = dict(prefix_len=4, recent=(48, 0), num_splits=3, kv_start=torch.tensor([0, 3, 40], device=DEVICE),
              ring_records=records, launch=launch, **_fidelity_options(layout, 4))
    _check(layout, [9, 70, 133], 1, 4, **kw)
    table = torch.zeros(3, 16, dtype=torch.int32)
    ring = recent_ring(layout, 3, 48, torch.float16, "cpu")
    plan = plan_attention(torch.randn(3, 8, 1, 64), layout.allocate(1, "cpu"), layout, table, torch.full((3,), 140),
                          0.125, num_splits=3, launch=launch, recent_keys=ring[0], recent_values=ring[1],
                          prefix_keys=torch.randn(3, 2, 4, 64), prefix_values=torch.randn(3, 2, 4, 64))
    assert (plan.ns_all, plan.constants["EXACT_PROG"], plan.constants["RING_PROGRAMS"]) == (3 + programs, programs, True)
    with pytest.raises(ValueError, match="ring_programs=True needs a split decode with an exact ring"):
        plan_attention(torch.randn(3, 8, 1, 64), layout.allocate(1, "cpu"), layout, table, torch.full((3,), 140),
                       0.125, num_splits=3, launch=LaunchConfig(exact_program=False, ring_programs=True),
                       recent_keys=ring[0], recent_values=ring[1])


@pytest.mark.parametrize("rotation,head_dim,exact,sms,columns", [
    ("hadamard", 64, True, 1024, True), ("random", 48, True, 1024, True), ("random", 80, False, 1024, True),
    ("hadamard", 128, True, 4, True), ("random", 80, True, 1024, False)])
def test_value_rotation_in_the_reduction(rotation, head_dim, exact, sms, columns):
    """rotate_in_reduce: the merged row rotated back in the reduction, head_dims padded to a power of two, the exact
    values added apart; reduce_columns: by Rv's columns, shared out over several programs per row where the device
    has SMs to spare (sms=1024: 2-4 column tiles here) or taken by one program per row (sms=4), else stepping over
    the rotated coordinates. The reference's attention, and the epilogue's rotation of every split to ~2**-18 in
    fp32 (a column tile off by one, a split's weight or a column of Rv missing is far outside it)."""
    layout = make_layout("4bit", 2, head_dim, rotation=rotation, key_centering=True, value_rotation=True)
    traits = DeviceTraits(num_sms=sms, runs_ptx=False, tuned_for_gpu=False) if DEVICE == "cpu" else None
    kw = dict(kv_start=torch.tensor([0, 3, 0], device=DEVICE), num_splits=5, **_fidelity_options(layout, 4))
    if exact:
        kw.update(prefix_len=4, recent=(16, 0))
    outputs = []
    for launch in (LaunchConfig(rotate_in_reduce=True, reduce_columns=columns), LaunchConfig(rotate_in_reduce=False)):
        torch.manual_seed(5)
        outputs.append(_check(layout, [9, 70, 133], 1, 4, launch=launch, device_traits=traits, **kw))
    (got, want), (base, want_again) = outputs
    assert torch.equal(want, want_again)  # the same inputs
    assert rel_error(got, base) <= 2 ** -18, rel_error(got, base)
    dp = 1 << (head_dim - 1).bit_length()
    site = reduce_site(3, 2, 4, 1, 5, 16, head_dim, dp, 1, True, exact, sms if columns else None)
    assert site.kwargs["COL_TILES"] == (0 if not columns else dp // 32 if sms == 1024 else 1), site.kwargs
    assert site.grid[2] == 3 * max(1, site.kwargs["COL_TILES"])


@pytest.mark.parametrize("preset,head_dim,split", [("4bit", 64, True), ("4bit", 64, False), ("k8v4", 64, False),
                                                    ("k3v4", 128, True)])
def test_value_rotation_by_16_bit_dots(preset, head_dim, split):
    """rotation_16bit: the rotation back of 4-bit values by 16-bit dots of Rv's +-1 entries (a GPU's default for
    4-bit and FP8 keys): the reference's attention, and the 3xTF32 epilogue's output to ~2**-20 in fp32 (a one-part
    split of the rows, or an entry off by a sign, is far outside it)."""
    layout = make_layout(preset, 2, head_dim, key_centering=True, value_rotation=True)
    kw = dict(prefix_len=4, recent=(16, 0), kv_start=torch.tensor([0, 3, 0], device=DEVICE),
              num_splits=3 if split else 1, **_fidelity_options(layout, 4))
    torch.manual_seed(7)
    got, want = _check(layout, [9, 70, 133], 1, 4, launch=LaunchConfig(rotation_16bit=True), **kw)
    torch.manual_seed(7)
    base, want_again = _check(layout, [9, 70, 133], 1, 4, launch=LaunchConfig(rotation_16bit=False), **kw)
    assert torch.equal(want, want_again)  # the same inputs
    assert rel_error(got, base) <= 2 ** -20, rel_error(got, base)
    torch.manual_seed(7)  # Rv's entries read as fp16 units (the default) or scaled from fp32 Rv: the same operands
    converted, _ = _check(layout, [9, 70, 133], 1, 4, launch=LaunchConfig(rotation_16bit=True, rotation_units=False), **kw)
    assert torch.equal(got, converted)


def _check_lever_in_interpreter(layout, q_len: int, lever: str, tol: float) -> None:
    """LaunchConfig(lever=True) on 16-row tiles with an exact prefix and ring, left padding and 3 splits: the
    reference's attention, and the lever-off output to a relative `tol` (the same inputs both times)."""
    kw = dict(prefix_len=4, recent=(16, 0), kv_start=torch.tensor([0, 3, 0], device=DEVICE), num_splits=3,
              **_fidelity_options(layout, 4))
    outputs = []
    for launch in (LaunchConfig(**{lever: True}, block_m=16), LaunchConfig(block_m=16)):
        torch.manual_seed(11)
        outputs.append(_check(layout, [9, 70, 133], q_len, 4, launch=launch, **kw))
    (got, want), (base, want_again) = outputs
    assert torch.equal(want, want_again)
    assert rel_error(got, base) <= tol, rel_error(got, base)


@pytest.mark.parametrize("q_len,head_dim,value_rotation", [(1, 128, True), (8, 128, False), (1, 256, False)])
def test_value_plane_codes_in_place(q_len, head_dim, value_rotation):
    """planes_in_place: 3-bit value plane codes left where they sit (code a at 4**a its unit), each accumulator
    scaled by its own unit where the exact prefix and ring values join it (no value rotation) and in the epilogue:
    the reference's attention, and the shifted codes' output to 2**-20 (the same sums a power of two apart; a unit
    off by a factor of 4 on one accumulator is far outside it)."""
    layout = make_layout("3bit", 2, head_dim, key_centering=True, value_rotation=value_rotation)
    _check_lever_in_interpreter(layout, q_len, "planes_in_place", 2 ** -20)


@pytest.mark.parametrize("preset,q_len,head_dim", [("k3v4", 1, 128), ("3bit", 8, 128), ("k3v4", 1, 256), ("3bit", 8, 256),
                                                   ("4bit", 1, 256)])
def test_query_rotated_once_for_the_key_planes(preset, q_len, head_dim):
    """query_butterfly: 3-bit key planes at head_dim 128 (one butterfly, then H_64) and 256 (two, then H_64 for each
    quarter) take the query rotated once and cut into the planes' windows, 4-bit keys at 256 its quarters joined into
    halves: the reference's attention, and the window-by-window (halves') rotation's output to 2**-16 in fp32 (the two
    round the rotated query to fp16 apart: a coordinate's last bit may differ; a block put into the wrong window is
    far outside it)."""
    layout = make_layout(preset, 2, head_dim, key_centering=True, value_rotation=True)
    _check_lever_in_interpreter(layout, q_len, "query_butterfly", 2 ** -16)


def test_query_butterfly_refused_without_key_planes():
    layout = make_layout("4bit", 2, 128)
    pool, table = fill_cache(layout, [40], DEVICE)
    with pytest.raises(ValueError, match="query_butterfly=True needs 3-bit key planes at head_dim 128 or 256, or 4-bit"):
        unified_attention(torch.randn(1, 4, 1, 128, device=DEVICE), pool, layout, table,
                          torch.tensor([40], device=DEVICE), 0.1, launch=LaunchConfig(query_butterfly=True))


@pytest.mark.parametrize("preset", ["4bit", "k8v4"])
@pytest.mark.slow
def test_head_dim_256_split_decode_with_the_levers(preset):
    """head_dim 256 with every lever: the launcher's default there rotates the split partials in the reduction, by
    Rv's columns (the stepwise rotation on request gives the same)."""
    layout = make_layout(preset, 2, 256, key_centering=True, value_rotation=True)
    seq_lens = torch.tensor([70, 133])
    plan = plan_attention(torch.randn(2, 4, 1, 256), layout.allocate(40, "cpu"), layout,
                          torch.zeros(2, 20, dtype=torch.int32), seq_lens, 0.1, num_splits=3,
                          recent_keys=torch.randn(2, 2, 16, 256), recent_values=torch.randn(2, 2, 16, 256))
    assert plan.constants["ROT_IN_REDUCE"] and plan.partial_width == 2 * 256
    assert plan.reduce.kwargs["COL_TILES"] >= 1
    for launch in (None, LaunchConfig(reduce_columns=False)):
        _check(layout, [70, 133], 1, 2, prefix_len=4, recent=(16, 0), num_splits=3, launch=launch,
               **_fidelity_options(layout, 2))


@pytest.mark.parametrize("preset", ["4bit", "k3v4"])
@pytest.mark.slow
def test_head_dim_256_levers_on_long_tiles(preset):
    """head_dim 256 with every lever over 8 KV heads in all (2 rows x 4): the 128-token tiles of an H200's plan
    (there with the key lookup; the interpreter gathers)."""
    layout = make_layout(preset, 4, 256, key_centering=True, value_rotation=True)
    gpu_tiles = DeviceTraits(num_sms=132, runs_ptx=False, tuned_for_gpu=True)
    traits = {} if DEVICE == "cuda" else {"device_traits": gpu_tiles}
    _check(layout, [300, 141], 1, 2, prefix_len=4, recent=(16, 0), **_fidelity_options(layout, 2), **traits)


# a chunk of queries over a longer history (a chat's next turn): several row tiles, each split over the pool's walk,
# with a ring as the cache hands a multi-token forward (the W positions before it and its own tokens)
@pytest.mark.parametrize("preset,num_splits", [("4bit", 3), ("k3v4", 2), ("k8v4", 5)])
@pytest.mark.parametrize("exact_program", [True, False])
@pytest.mark.parametrize("rotate_in_reduce", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_split_chunk_over_several_row_tiles(preset, num_splits, exact_program, rotate_in_reduce):
    layout = make_layout(preset, 2, 64, key_centering=True, value_rotation=True)
    q_len = 23  # 4 x 23 rows: several row tiles at every tile size
    launch = LaunchConfig(exact_program=exact_program, rotate_in_reduce=rotate_in_reduce)
    _check(layout, [70, 141], q_len, 4, prefix_len=4, recent=(16 + q_len, 0), num_splits=num_splits,
           kv_start=torch.tensor([0, 5], device=DEVICE), launch=launch, **_fidelity_options(layout, 4))
    _check(layout, [70, 141], q_len, 4, sliding_window=50, num_splits=num_splits, sinks=torch.randn(8, device=DEVICE))


# prefill: several row tiles (G * Lq > 64), a first prefill (Lq == S) and a chunk of a longer cache
@pytest.mark.parametrize("preset,group,q_len,options", [
    ("4bit", 4, 23, True), ("k8v4", 1, 40, False), ("3bit", 4, 17, True),
])
def test_exact_prefix_prefill(preset, group, q_len, options):
    layout = make_layout(preset, 2, 64, key_centering=options, value_rotation=options)
    kw = _fidelity_options(layout, group) if options else {"softcap": 5.0}
    _check(layout, [q_len, 50], q_len, group, prefix_len=4, kv_start=torch.tensor([6, 0], device=DEVICE), **kw)


def test_exact_prefix_sliding_window():
    """The window drops the prefix for late queries: partly (positions 2, 3 of 0..3 stay) or fully."""
    layout = make_layout("4bit", 2, 64, key_centering=True, value_rotation=True)
    kw = _fidelity_options(layout, 2)
    _check(layout, [12, 60], 1, 2, prefix_len=4, sliding_window=10, num_splits=2, **kw)
    _check(layout, [30], 30, 2, prefix_len=4, sliding_window=8, **kw)  # early queries see it, late ones do not


def test_exact_prefix_mutations_are_detected():
    """The check above can tell a correct prefix from the plausible mistakes: ignoring it (reading
    the pool there), adding the key_centering mean to exact keys, rotating exact values by Rv."""
    layout = make_layout("4bit", 2, 64, key_centering=True, value_rotation=True)
    kw = _fidelity_options(layout, 4)
    lens, kv_start = [37, 90], torch.tensor([2, 0], device=DEVICE)
    pool, table = fill_cache(layout, lens, DEVICE, key_offset=kw["key_offset"])
    pk, pv = exact_prefix(layout, 2, 4)
    q = torch.randn(2, 8, 1, 64, device=DEVICE)
    seq, scale = torch.tensor(lens, device=DEVICE), default_scale(64)
    common = dict(kv_start=kv_start, num_splits=3, **kw)
    got = unified_attention(q, pool, layout, table, seq, scale, prefix_keys=pk, prefix_values=pv, **common)

    def ref(prefix_keys=pk, prefix_values=pv):
        kwargs = {} if prefix_keys is None else {"prefix_keys": prefix_keys, "prefix_values": prefix_values}
        return reference.paged_attention(q, pool, layout, table, seq, scale, kv_start=kv_start, **kw, **kwargs)

    assert rel_error(got, ref()) <= 1e-3
    rv = reference.value_rotation_matrix(layout.config, 64).to(DEVICE)
    mutants = {"prefix ignored": ref(None, None), "mean added to exact keys": ref(pk + kw["key_offset"][None, :, None]),
               "exact values rotated": ref(prefix_values=pv @ rv)}
    for name, mutant in mutants.items():
        assert rel_error(got, mutant) > 1e-2, f"the kernel output is as close to the mutant '{name}' as to the spec"


@pytest.mark.parametrize("kind, letter, limit", [("prefix", "P", 64), ("recent", "W", 1 << 24)])
def test_exact_buffers_reject_bad_inputs(kind, letter, limit):
    """exact_prefix_tokens (prefix_*) and recent_window (recent_*) buffers share one validator."""
    layout = make_layout("4bit", 2, 64)
    pool, table = fill_cache(layout, [20], DEVICE)
    q = torch.randn(1, 4, 1, 64, device=DEVICE)
    seq = torch.tensor([20], device=DEVICE)
    k, v = exact_prefix(layout, 1, 4) if kind == "prefix" else recent_ring(layout, 1, 8)
    kn, vn = f"{kind}_keys", f"{kind}_values"

    def call(keys=None, values=None, **kw):
        return unified_attention(q, pool, layout, table, seq, 0.1, **{kn: keys, vn: values}, **kw)

    with pytest.raises(ValueError, match="given together"):
        call(k)
    with pytest.raises(ValueError, match=rf"{vn} must be \[1, 2, {letter}, 64\]"):
        call(k, v[:, :1])
    bad_len = limit + 1 if kind == "prefix" else 0
    with pytest.raises(ValueError, match=f"1 <= {letter} <= {limit}"):
        call(torch.zeros(1, 2, bad_len, 64, device=DEVICE), torch.zeros(1, 2, bad_len, 64, device=DEVICE))
    with pytest.raises(ValueError, match="same shape"):
        call(k, v[:, :, :3])
    with pytest.raises(TypeError, match=f"{kn} has dtype"):
        call(k.double(), v)
    with pytest.raises(ValueError, match="contiguous in its last"):
        call(torch.zeros(1, 2, 4 if kind == "prefix" else 8, 128, device=DEVICE)[..., ::2], v)
    if kind == "prefix":
        with pytest.raises(ValueError, match="prefix_keys must have 4 dimensions"):
            call(k[0], v)
        with pytest.raises(TypeError, match="prefix_values must be a torch.Tensor"):
            call(k, v.cpu().numpy())
    else:
        for bad in (-1, 2.0, True, torch.tensor(3)):
            with pytest.raises(ValueError, match="recent_from must be an int >= 0"):
                call(k, v, recent_from=bad)


# ---- recent_window: positions [max(recent_from, S - W), S) read from a ring, pool poisoned there ----
# decode on the split path (the exact program, or the last split, walks the ring), GQA 4, left padding; row 0 (3 tokens) is
# all ring and overlaps the P=2 prefix; W=40 makes row 1's ring cover its padding and prefix too;
# recent_from=35 (after a crop) leaves row 0 no ring and row 1 two ring positions
@pytest.mark.parametrize("preset,options,prefix_len,recent,dtype", [
    ("4bit", True, 2, (16, 0), torch.float32),
    ("k8v4", True, 2, (40, 0), torch.bfloat16),
    ("4bit", False, 0, (16, 35), torch.float16),
    ("k8v4", False, 2, (5, 35), torch.float32),
])
def test_recent_window_decode(preset, options, prefix_len, recent, dtype):
    layout = make_layout(preset, 2, 64, key_centering=options, value_rotation=options)
    kw = _fidelity_options(layout, 4) if options else {"softcap": 5.0}
    _check(layout, [3, 37, 90], 1, 4, dtype=dtype, prefix_len=prefix_len, recent=recent, num_splits=3,
           kv_start=torch.tensor([0, 5, 20], device=DEVICE), **kw)
    if recent[0] > 16:  # the ring in 32-token tiles (a GPU's; the interpreter's default is 16)
        _check(layout, [3, 37, 90], 1, 4, dtype=dtype, prefix_len=prefix_len, recent=recent, num_splits=3,
               kv_start=torch.tensor([0, 5, 20], device=DEVICE), launch=LaunchConfig(ring_n=32), **kw)
    # without the exact program (a full GPU's choice): the last split walks the ring
    _check(layout, [3, 37, 90], 1, 4, dtype=dtype, prefix_len=prefix_len, recent=recent, num_splits=3,
           kv_start=torch.tensor([0, 5, 20], device=DEVICE), launch=LaunchConfig(exact_program=False), **kw)


# int8 ring records (recent_format "int8", the default): the exact program and the last split, 4-bit values as
# nibble columns and rotated, FP8 and 3-bit keys, two KV heads per program at head_dim 128, and a prefill
@pytest.mark.parametrize("preset,options,head_dim,dtype,exact_program", [
    ("4bit", True, 64, torch.float16, True),
    ("4bit", False, 64, torch.float32, False),
    ("k8v4", True, 64, torch.bfloat16, True),
    ("k3v4", True, 128, torch.float16, False),
    ("3bit", False, 128, torch.float32, True),
])
def test_int8_ring_records_decode(preset, options, head_dim, dtype, exact_program):
    layout = make_layout(preset, 2, head_dim, key_centering=options, value_rotation=options)
    kw = _fidelity_options(layout, 4) if options else {"softcap": 5.0}
    _check(layout, [3, 37, 90], 1, 4, dtype=dtype, prefix_len=2, recent=(16, 0), ring_records=True, num_splits=3,
           kv_start=torch.tensor([0, 5, 20], device=DEVICE), launch=LaunchConfig(exact_program=exact_program), **kw)


@pytest.mark.parametrize("records,spread,q_len,head_dim", [(True, False, 1, 64), (False, True, 1, 64),
                                                           (False, True, 6, 64), (True, False, 1, 256)])
def test_ring_tiles_spread_over_the_splits(records, spread, q_len, head_dim):
    """Split decode with the ring's tiles shared out over the split programs, or walked by one (ring_spread): both
    the reference's attention, for an exact ring and int8 records (whose default is to share them out, except at
    head_dim 256), and for a verification forward's 16-row tiles (two per KV head, each with its share of the exact
    window)."""
    layout = make_layout("4bit", 2, head_dim, key_centering=True, value_rotation=True)
    launch = LaunchConfig(ring_spread=spread, ring_n=16, **({"block_m": 16} if q_len > 1 else {}))
    _check(layout, [3, 37, 90], q_len, 4, dtype=torch.float16, prefix_len=2, recent=(48, 0), ring_records=records,
           num_splits=4, kv_start=torch.tensor([0, 5, 20], device=DEVICE), launch=launch,
           **_fidelity_options(layout, 4))


@pytest.mark.parametrize("preset,dtype", [("4bit", torch.float16), ("k8v4", torch.float32)])
def test_int8_ring_records_prefill(preset, dtype):
    layout = make_layout(preset, 2, 64, key_centering=True, value_rotation=True)
    _check(layout, [30, 61], 7, 4, dtype=dtype, prefix_len=2, recent=(12, 27), ring_records=True, sliding_window=40,
           kv_start=torch.tensor([6, 0], device=DEVICE), **_fidelity_options(layout, 4))


def test_ring_tile_refused():
    layout = make_layout("4bit", 2, 64)
    pool, table = fill_cache(layout, [40], DEVICE)
    ring = recent_ring(layout, 1, 16, torch.float32, DEVICE)
    with pytest.raises(ValueError, match="ring_n must be 16, 32, 64 or 128 tokens, got 48"):
        unified_attention(torch.randn(1, 4, 1, 64, device=DEVICE), pool, layout, table, torch.tensor([40], device=DEVICE),
                          0.1, recent_keys=ring[0], recent_values=ring[1], recent_from=0, launch=LaunchConfig(ring_n=48))


# prefill (several row tiles, Lq == S for row 0) and a chunk after a crop, with a sliding window
@pytest.mark.parametrize("preset,options,q_len,lens,prefix_len,recent,window", [
    ("4bit", True, 23, [23, 50], 2, (16, 0), None),
    ("k8v4", True, 7, [30, 61], 2, (12, 27), 9),
    ("4bit", False, 7, [30, 61], 0, (8, 0), 11),
])
def test_recent_window_prefill(preset, options, q_len, lens, prefix_len, recent, window):
    layout = make_layout(preset, 2, 64, key_centering=options, value_rotation=options)
    kw = _fidelity_options(layout, 4) if options else {}
    _check(layout, lens, q_len, 4, prefix_len=prefix_len, recent=recent, sliding_window=window,
           kv_start=torch.tensor([6, 0], device=DEVICE), **kw)


def test_recent_window_sliding_window_decode():
    """The window ends inside the ring for row 1 (sees ring positions only) and the pool for row 0."""
    layout = make_layout("4bit", 2, 64, key_centering=True, value_rotation=True)
    _check(layout, [50, 90], 1, 4, recent=(16, 0), sliding_window=10, num_splits=4, **_fidelity_options(layout, 4))
    _check(layout, [50, 90], 1, 4, recent=(8, 0), sliding_window=30, num_splits=2, **_fidelity_options(layout, 4))


def test_recent_window_mutation_is_detected():
    """With an unpoisoned pool, reading the pool instead of the ring lands far from the spec."""
    layout = make_layout("4bit", 2, 64, key_centering=True, value_rotation=True)
    kw = _fidelity_options(layout, 4)
    lens = [37, 90]
    pool, table = fill_cache(layout, lens, DEVICE, key_offset=kw["key_offset"])
    rk, rv = recent_ring(layout, 2, 16)
    q = torch.randn(2, 8, 1, 64, device=DEVICE)
    seq, scale = torch.tensor(lens, device=DEVICE), default_scale(64)
    got = unified_attention(q, pool, layout, table, seq, scale, num_splits=3, recent_keys=rk, recent_values=rv, **kw)
    want = reference.paged_attention(q, pool, layout, table, seq, scale, recent_keys=rk, recent_values=rv, **kw)
    assert rel_error(got, want) <= 1e-3
    ignored = reference.paged_attention(q, pool, layout, table, seq, scale, **kw)
    assert rel_error(got, ignored) > 1e-2, "the kernel output is as close to 'ring ignored' as to the spec"



# ---- the GPU's launch choices (tile sizes, split counts for 132 SMs), run by the interpreter -------
@pytest.mark.parametrize("lens,q_len,group,head_dim", [
    ([40], 30, 4, 64),  # one row, 120 query rows: several row tiles and few programs must not split KV
    ([300, 9], 16, 4, 32),  # 64 query rows at head_dim 32: the row tile the H200 needs (<= 32)
    ([700], 1, 8, 128),  # decode: many splits on 132 SMs
])
@pytest.mark.slow
def test_gpu_launch_choices_match_reference(lens, q_len, group, head_dim):
    gpu_tiles = DeviceTraits(num_sms=132, runs_ptx=False, tuned_for_gpu=True)  # the interpreter runs no PTX
    _check(make_layout("4bit", 2, head_dim), lens, q_len, group, device_traits=gpu_tiles)

def _gpu_launch(*args, **kw) -> dict:
    """The launch an H200 makes for unified_attention(*args, **kw) (here on CPU tensors), planned, not run (the
    interpreter runs no PTX): the kernel's constexprs with BLOCK_N, STAGES, GRID and KERNEL. The unified kernel's
    choices: decode_warps' one-warp kernel only where the launch asks (its choices: test_kernel_decode_warps.py)."""
    kw.pop("recent_from", None)
    kw.setdefault("launch", LaunchConfig(warp_split=False))
    plan = plan_attention(*args, device_traits=H200, **kw)
    return {**plan.constants, "BLOCK_N": plan.block_n, "STAGES": plan.num_stages, "GRID": plan.grid,
            "KERNEL": plan.kernel}


@pytest.mark.parametrize("preset,batch,splits", [
    ("4bit", 1, 64), ("4bit", 2, 32), ("4bit", 4, 16), ("4bit", 8, 8), ("4bit", 16, 4),  # 3 waves of the H200's
    # 132 SMs, a power of two, of half the programs (two KV heads per program)
    ("k8v4", 1, 64), ("k8v4", 4, 16), ("k8v4", 16, 4),  # FP8 keys: 4 waves
    # split also once every SM has a program, until the programs fill the waves
    ("k8v4", 32, 2), ("k8v4", 64, 2), ("k3v4", 24, 2), ("k3v4", 64, 1),
])
def test_gpu_decode_split_counts(preset, batch, splits):
    """The split count the launcher picks for S=32k decode on an H200 (captured, not launched)."""
    layout = make_layout(preset, 8, 128)
    table = torch.zeros(batch, 32768 // layout.block_size, dtype=torch.int32)
    q = torch.randn(batch, 32, 1, 128, dtype=torch.float16)
    seen = _gpu_launch(q, layout.allocate(1, "cpu"), layout, table, torch.full((batch,), 32768), 0.088,
                       max_seq_len=32768)
    assert seen["GRID"] == (splits, 4 if preset == "4bit" else 8, batch) and seen["SPLIT"] == (splits > 1)
    assert seen["num_warps"] == 4
    if preset == "4bit" and batch == 4:  # with the levers the same head pairs and splits
        lever_layout = make_layout(preset, 8, 128, key_centering=True, value_rotation=True)
        seen = _gpu_launch(q, lever_layout.allocate(1, "cpu"), lever_layout, table, torch.full((batch,), 32768), 0.088,
                           max_seq_len=32768, key_offset=torch.zeros(8, 128))
        assert seen["GRID"] == (16, 4, batch) and seen["num_warps"] == 4


@pytest.mark.parametrize("preset,batch,q_len,lookup,block_n,maxnreg", [
    ("4bit", 16, 1, True, 128, 168),  # two KV heads per program (plain format): 168 registers
    ("4bit", 4, 1, True, 128, 168),
    ("4bit", 2, 1, True, 128, 168),
    ("4bit", 1, 1, True, 128, 168),
    ("4bit", 16, 100, False, 64, None),  # prefill tiles keep the gather (the lookup is measured for decode)
    ("k8v4", 16, 1, False, 128, 128),  # FP8 keys need no lookup; 128 registers when the batch fills the GPU
    ("k8v4", 4, 1, False, 128, 128),  # from 4 x 8 KV heads
    ("k8v4", 2, 1, False, 128, 128),  # and below since the value sums from zero
    ("k3v4", 16, 1, True, 128, 128),  # 3-bit keys: the lookup reads the code planes (layout.py); capped
    ("k3v4", 1, 1, True, 128, None),
    ("3bit", 16, 1, True, 128, 168),  # 3-bit values (value planes) next to the key planes: plain in 168
])
@pytest.mark.parametrize("head_dim", [128, 64])
def test_gpu_decode_key_lookup_choices(preset, batch, q_len, lookup, block_n, maxnreg, head_dim):
    """What the launcher picks on an H200 (captured, not launched: the interpreter runs no PTX)."""
    layout = make_layout(preset, 8, head_dim)
    pool, table = fill_cache(layout, [64] * batch, "cpu")
    q = torch.randn(batch, 32, q_len, head_dim)
    seen = _gpu_launch(q, pool, layout, table, torch.full((batch,), 64 + q_len), 0.1, max_seq_len=32768)
    three = preset in ("k3v4", "3bit")
    if head_dim != 128:  # head_dim 64 (9/3/64 sweeps): 4-bit decode by the code words in 168
        # registers on 256-token tiles; FP8 keys uncapped in the plain format; 3-bit keys as a bit stream (no planes
        # at 64), looked up 4 unpacked codes at a time (key_lut.lut3_codes_asm), uncapped
        lookup = (preset == "4bit" or three) and q_len == 1
        maxnreg = 168 if lookup and not three else None
        block_n = 256 if preset == "4bit" and q_len == 1 else block_n
    assert (seen["KEY_LUT"], seen["BLOCK_N"], seen.get("maxnreg")) == (lookup, block_n, maxnreg), seen
    # two KV heads per program: 4-bit lookup decode (any batch; the levers too, below)
    head_pairs = lookup and preset == "4bit" and head_dim == 128
    assert (seen["HEADS_PER_PROGRAM"], seen["GRID"][1]) == ((2, 4) if head_pairs else (1, 8)), seen
    assert seen["num_warps"] == 4, seen
    # 4-bit keys as 16-bit code words (key_lut.lut_words_asm: one asm, LUT_HI unused); 3-bit planes by byte tables
    key_words = head_pairs or (lookup and preset == "4bit" and (batch >= 16 or head_dim == 64))  # measured there
    assert seen["KEY_WORDS"] == key_words, seen
    if key_words:
        assert "prmt.b32 c, $4, $4, 0x3120" in seen["LUT_LO"] and seen["LUT_HI"] == "", seen
    elif three and head_dim != 128:  # one asm per 4 unpacked codes
        assert "or.b32 sel, $2, t" in seen["LUT_LO"] and seen["LUT_HI"] == "", seen
    else:
        assert (seen["LUT_LO"] != "") == lookup and "prmt.b32" in seen["LUT_HI"] if lookup else seen["LUT_HI"] == ""
    assert seen["KEY_PLANES"] == (three and head_dim == 128), seen
    assert seen["VALUE_PLANES"] == (preset == "3bit" and head_dim == 128), seen
    # 4-bit values as 16-bit words in decode tiles (mma.sync) where each warp has 8 columns of its own
    words = q_len == 1 and head_dim == 128 and preset != "3bit"
    planes = preset == "3bit" and head_dim == 128  # 3-bit value planes: decoded in place from their bytes by their asm
    assert (seen["VALUE_WORDS"], seen["VALUE_PTX"]) == (words, 2 if planes else int(words)), seen
    assert seen["PLANES_IN_PLACE"] == planes, seen
    # the metadata as token pairs and 3 pipeline stages: the 4-bit lookup's decode when the batch leaves SMs free
    pairs = lookup and head_dim == 128 and batch < 16 and not three and not head_pairs
    if head_dim == 64:  # there the 4-bit code words' decode and FP8 keys', when the batch leaves SMs free
        pairs = q_len == 1 and batch < 16 and preset in ("4bit", "k8v4")
    # else each token's metadata from its pair's word: decode at head_dim 128 (slower at 64);
    # with them v_mid prefetched; for codebook keys the block-table entries an iteration ahead, 3 stages
    meta_words = not pairs and q_len == 1 and head_dim == 128
    bt_next = meta_words and preset != "k8v4"
    assert (seen["META_WORDS"], seen["VMID_CHAIN"], seen["BT_NEXT"]) == (meta_words, meta_words, bt_next), seen
    assert (seen["META_PAIRS"], seen["STAGES"]) == (pairs, 3 if pairs or bt_next else 2), seen
    if meta_words:  # with centering + value rotation (the cache's defaults): head pairs keep the block-table
        # prefetch and 3 stages; one head per program does without (2 stages)
        opts = make_layout(preset, 8, head_dim, key_centering=True, value_rotation=True)
        pool_o, table_o = fill_cache(opts, [64] * batch, "cpu")
        seen = _gpu_launch(q, pool_o, opts, table_o, torch.full((batch,), 64 + q_len), 0.1, max_seq_len=32768,
                           key_offset=torch.zeros(batch, 8, head_dim))
        paired = head_pairs or (preset == "k3v4" and head_dim == 128)  # k3v4's key planes pair with the levers
        assert (seen["META_WORDS"], seen["VMID_CHAIN"], seen["BT_NEXT"], seen["STAGES"]) == (
            True, True, paired, 3 if paired else 2), seen
        assert (seen["KEY_WORDS"], seen["HEADS_PER_PROGRAM"]) == (key_words, 2 if paired else 1), seen
        assert not paired or seen.get("maxnreg") is None, seen  # pairs with the levers uncapped
    if key_words:  # the exact prefix too: head pairs (one head per program measured no gain from the code words) at
        # head_dim 128; at 64 one head per program, 256-token tiles, 168 registers
        pre = make_layout(preset, 8, head_dim, exact_prefix_tokens=4)
        pool_p, table_p = fill_cache(pre, [64] * batch, "cpu")
        pk = torch.randn(batch, 8, 4, head_dim, dtype=torch.float16)
        seen = _gpu_launch(q, pool_p, pre, table_p, torch.full((batch,), 64 + q_len), 0.1, max_seq_len=32768,
                           prefix_keys=pk, prefix_values=pk)
        assert (seen["KEY_WORDS"], seen["HEADS_PER_PROGRAM"], seen["EXACT_16"]) == (True, 2 if head_dim == 128 else 1, False), seen
        assert head_dim == 128 or (seen["BLOCK_N"], seen["maxnreg"]) == (256, 168), seen  # fp32 query: 3 tf32 passes
        seen = _gpu_launch(q.half(), pool_p, pre, table_p, torch.full((batch,), 64 + q_len), 0.1, max_seq_len=32768,
                           prefix_keys=pk, prefix_values=pk)
        assert seen["EXACT_16"] is True, seen  # the query's and the buffers' dtype: 16-bit dots
        seen = _gpu_launch(q.bfloat16(), pool_p, pre, table_p, torch.full((batch,), 64 + q_len), 0.1, max_seq_len=32768,
                           prefix_keys=pk.bfloat16(), prefix_values=pk.bfloat16())
        assert seen["EXACT_16"] is True, seen  # bf16 too on a GPU (the interpreter's bf16 dots are broken)
    seen = _gpu_launch(q, pool, layout, table, torch.full((batch,), 64 + q_len), 0.1, launch=LaunchConfig(key_lut=False))
    assert seen["KEY_LUT"] is False


@pytest.mark.parametrize("preset", ["4bit", "k3v4", "k8v4"])
@pytest.mark.parametrize("batch,kv_heads", [(1, 4), (2, 4), (16, 4), (1, 16)])
def test_gpu_head_dim_256_decode_choices(preset, batch, kv_heads):
    """head_dim 256 (Gemma's) on an H200: codebook keys by the lookup (4-bit bytes, 3-bit planes); 128-token tiles
    except with the levers over fewer than 8 KV heads in all, where 64-token tiles were faster."""
    for levers in (False, True):
        layout = make_layout(preset, kv_heads, 256, key_centering=levers, value_rotation=levers)
        pool, table = fill_cache(layout, [64] * batch, "cpu")
        kw = {"key_offset": torch.zeros(batch, kv_heads, 256)} if levers else {}
        seen = _gpu_launch(torch.randn(batch, 2 * kv_heads, 1, 256, dtype=torch.float16), pool, layout, table,
                           torch.full((batch,), 65), 0.1, max_seq_len=32768, **kw)
        want = (preset != "k8v4", 64 if levers and batch * kv_heads < 8 else 128)
        assert (seen["KEY_LUT"], seen["BLOCK_N"]) == want, (levers, seen)


@pytest.mark.parametrize("q_len,block_m", [(1, 16), (4, 16), (8, 16), (16, 16), (17, 64)])
def test_gpu_fp8_verification_tiles(q_len, block_m):
    """FP8 keys at head_dim 128, GQA 4, on an H200: a forward of up to 16 new tokens (64 rows) takes 16-row tiles,
    each walking the history, as decode does; more rows take the prefill's 64-row tiles."""
    layout = make_layout("k8v4", 8, 128, key_centering=True, value_rotation=True)
    pool, table = fill_cache(layout, [64], "cpu")
    seen = _gpu_launch(torch.randn(1, 32, q_len, 128, dtype=torch.float16), pool, layout, table,
                       torch.tensor([64 + q_len]), 0.1, max_seq_len=32768, key_offset=torch.zeros(1, 8, 128))
    assert (seen["BLOCK_M"], seen["VALUE_WORDS"]) == (block_m, block_m == 16), seen


@pytest.mark.parametrize("preset", ["3bit", "k3v4"])
@pytest.mark.parametrize("q_len,options,block_m", [(8, True, 16), (1, True, 16), (16, True, 64), (8, False, 32)])
def test_gpu_three_bit_verification_tiles(preset, q_len, options, block_m):
    """3-bit keys with the levers at head_dim 128, GQA 4, on an H200: a forward of up to 8 new tokens (32 rows) takes
    16-row tiles, each walking the history; 16 tokens, and the plain format, keep the wider tiles."""
    layout = make_layout(preset, 8, 128, key_centering=options, value_rotation=options)
    pool, table = fill_cache(layout, [64], "cpu")
    kw = {"key_offset": torch.zeros(1, 8, 128)} if options else {}
    seen = _gpu_launch(torch.randn(1, 32, q_len, 128, dtype=torch.float16), pool, layout, table,
                       torch.tensor([64 + q_len]), 0.1, max_seq_len=32768, **kw)
    assert seen["BLOCK_M"] == block_m, seen
    if preset == "k3v4" and block_m == 16:
        assert seen["VALUE_WORDS"], seen


@pytest.mark.parametrize("q_len,levers,block_m,key_words", [(8, True, 16, True), (5, True, 16, True),
                                                           (4, True, 16, False), (8, False, 32, False)])
def test_gpu_four_bit_verification_tiles(q_len, levers, block_m, key_words):
    """4bit at head_dim 128, GQA 4, on an H200: 5-8 new tokens (17-32 rows) with the levers take two 16-row tiles
    by key and value words, each walking the history; up to 4 tokens take decode's tiles (head pairs at one token);
    the plain format keeps one 32-row tile by bytes."""
    layout = make_layout("4bit", 8, 128, key_centering=levers, value_rotation=levers)
    pool, table = fill_cache(layout, [64], "cpu")
    kw = {"key_offset": torch.zeros(1, 8, 128)} if levers else {}
    seen = _gpu_launch(torch.randn(1, 32, q_len, 128, dtype=torch.float16), pool, layout, table,
                       torch.tensor([64 + q_len]), 0.1, max_seq_len=32768, **kw)
    assert (seen["BLOCK_M"], seen["KEY_WORDS"]) == (block_m, key_words), seen
    if key_words:
        assert seen["VALUE_WORDS"], seen


@pytest.mark.parametrize("batch,splits,maxnreg", [(1, 32, 128), (2, 8, None)])
def test_gpu_four_bit_verification_splits(batch, splits, maxnreg):
    """4bit with every lever, 8 new tokens over S=32k on an H200: at B=1 the two 16-row tiles of each KV head run in
    128 registers (4 programs per SM) with the splits sized for 4 waves of them; from 2 rows uncapped, 3 waves."""
    layout = make_layout("4bit", 8, 128, key_centering=True, value_rotation=True)
    table = torch.zeros(batch, 32768 // layout.block_size, dtype=torch.int32)  # planned over S=32k, not run
    ring_k, ring_v = recent_ring(layout, batch, 128 + 8, torch.float16, "cpu")
    seen = _gpu_launch(torch.randn(batch, 32, 8, 128, dtype=torch.float16), layout.allocate(1, "cpu"), layout,
                       table, torch.full((batch,), 32768), 0.1, max_seq_len=32768, key_offset=torch.zeros(batch, 8, 128),
                       recent_keys=ring_k, recent_values=ring_v)
    assert (seen["BLOCK_M"], seen["GRID"], seen.get("maxnreg")) == (16, (2 * splits, 8, batch), maxnreg), seen


@pytest.mark.parametrize("preset,batch,q_len,exact_program,spread,ring_tile", [
    # several 16-row tiles per KV head: the ring's tiles shared out in 16 tokens up to 2 x 8 KV heads
    ("3bit", 1, 8, False, True, 16), ("4bit", 1, 8, False, True, 16), ("k3v4", 1, 8, False, True, 16),
    ("3bit", 4, 8, False, False, 32),
    ("k8v4", 1, 8, True, True, 16), ("k8v4", 4, 8, False, True, 32), ("k8v4", 1, 16, False, True, 16),  # FP8 keys:
    # two tiles at B=1 keep the exact program
    ("4bit", 1, 1, True, False, 32), ("k3v4", 1, 4, True, False, 32),  # one row tile: the exact tokens in a program
    # of their own
])
def test_gpu_exact_program_of_verification_forwards(preset, batch, q_len, exact_program, spread, ring_tile):
    """Split decode with an exact ring on an H200: the exact tokens get a program of their own unless several
    16-row tiles each walk the history (their exact programs then outlasted the splits); the ring's tiles spread
    over the splits as measured faster (docs/performance.md)."""
    layout = make_layout(preset, 8, 128, key_centering=True, value_rotation=True)
    table = torch.zeros(batch, 32768 // layout.block_size, dtype=torch.int32)  # planned over S=32k, not run
    ring_k, ring_v = recent_ring(layout, batch, 128 + q_len, torch.float16, "cpu")
    seen = _gpu_launch(torch.randn(batch, 32, q_len, 128, dtype=torch.float16), layout.allocate(1, "cpu"), layout,
                       table, torch.full((batch,), 32768), 0.1, max_seq_len=32768, key_offset=torch.zeros(batch, 8, 128),
                       recent_keys=ring_k, recent_values=ring_v)
    assert seen["SPLIT"] and seen["EXACT_PROG"] == exact_program, seen
    assert (seen["RING_SPREAD"], seen["RING_TILE"]) == (spread, ring_tile), seen


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["3bit", "k3v4"])
def test_three_bit_verification_forward_on_16_row_tiles(preset):
    """3-bit keys, 8 new tokens over a history with every lever, on a GPU's 16-row tiles (two per KV head, each split
    over the walk; k3v4's values as words), against the reference."""
    layout = make_layout(preset, 2, 128, key_centering=True, value_rotation=True)
    _check(layout, [70, 141], 8, 4, prefix_len=4, recent=(24, 0), kv_start=torch.tensor([0, 5], device=DEVICE),
           launch=LaunchConfig(block_m=16), num_splits=3, **_fidelity_options(layout, 4))


@pytest.mark.slow
def test_fp8_verification_forward():
    """8 and 16 new tokens over a history with every lever (a GPU's 16-row tiles: 2 and 4 per KV head, each split
    over the walk)."""
    layout = make_layout("k8v4", 2, 128, key_centering=True, value_rotation=True)
    for q_len in (8, 16):
        _check(layout, [70, 141], q_len, 4, prefix_len=4, recent=(16 + q_len, 0),
               kv_start=torch.tensor([0, 5], device=DEVICE), **_fidelity_options(layout, 4))


@pytest.mark.slow
def test_four_bit_verification_forward():
    """5 and 8 new tokens over a history with every lever (a GPU's 16-row tiles by key and value words, two per KV
    head, each split over the walk, the exact tokens in the splits), against the reference."""
    layout = make_layout("4bit", 2, 128, key_centering=True, value_rotation=True)
    for q_len in (5, 8):
        _check(layout, [70, 141], q_len, 4, prefix_len=4, recent=(16 + q_len, 0),
               kv_start=torch.tensor([0, 5], device=DEVICE), **_fidelity_options(layout, 4))


@pytest.mark.parametrize("exact", ["prefix", "recent", None])
@pytest.mark.parametrize("batch", [16, 1])
def test_gpu_decode_tiles_with_exact_buffers(exact, batch):
    """What the launcher picks on an H200 with exact prefix/ring buffers: 128-token tiles and two KV
    heads per program as without them, uncapped (in 168 registers, the plain format's
    cap, their state spilled through the walk)."""
    layout = make_layout("4bit", 8, 128)
    pool, table = fill_cache(layout, [64] * batch, "cpu")
    kw = {}
    if exact == "prefix":
        kw["prefix_keys"], kw["prefix_values"] = exact_prefix(layout, batch, 4, torch.float32, "cpu")
    elif exact == "recent":
        kw["recent_keys"], kw["recent_values"] = recent_ring(layout, batch, 16, torch.float32, "cpu")
    seen = _gpu_launch(torch.randn(batch, 32, 1, 128), pool, layout, table, torch.full((batch,), 65), 0.1,
                       max_seq_len=32768, **kw)
    assert (seen["BLOCK_N"], seen.get("maxnreg"), seen["HEADS_PER_PROGRAM"]) == (128, None if exact else 168, 2), seen
    # S=32k: split decode; a batch that fills the GPU has no exact program (the last split walks the ring: its tiles
    # shared out over the splits measured slower)
    long_table = torch.nn.functional.pad(table, (0, 32768 // layout.block_size - table.shape[1]))
    seen = _gpu_launch(torch.randn(batch, 32, 1, 128), pool, layout, long_table, torch.full((batch,), 32768), 0.1,
                       max_seq_len=32768, **kw)
    assert (seen["SPLIT"], seen["EXACT_PROG"]) == (True, exact is not None and batch == 1), seen
    seen = _gpu_launch(torch.randn(batch, 32, 1, 128), pool, layout, table, torch.full((batch,), 65), 0.1,
                       max_seq_len=32768, launch=LaunchConfig(head_pairs=1), **kw)  # one head: capped when the batch fills the GPU
    want = (128 if exact or batch == 16 else 256, 128 if batch == 16 else None, 1)  # plain B=1: 256-token tiles
    assert (seen["BLOCK_N"], seen.get("maxnreg"), seen["HEADS_PER_PROGRAM"]) == want, seen


@pytest.mark.parametrize("batch", [1, 2, 4, 16])
def test_gpu_fp8_keys_capped_with_the_levers(batch):
    """FP8 keys run in 128 registers at any batch on an H200: with value rotation and the exact buffers (k8v4's
    defaults; B=1 0.0467 -> 0.0435 ms) and in the plain format (B=1 S=32k uncapped since
    the tile's value sums from zero: 0.0405 vs 0.0323). Their exact program walks the
    ring in 16-token tiles."""
    for levers in (True, False):
        layout = make_layout("k8v4", 8, 128, value_rotation=levers)
        pool, table = fill_cache(layout, [64] * batch, "cpu")
        kw = dict(zip(("prefix_keys", "prefix_values"), exact_prefix(layout, batch, 4, torch.float16, "cpu"))) if levers else {}
        seen = _gpu_launch(torch.randn(batch, 32, 1, 128, dtype=torch.float16), pool, layout, table,
                           torch.full((batch,), 65), 0.1, max_seq_len=32768, **kw)
        assert seen.get("maxnreg") == 128, (levers, seen)
    # S=32k with the ring too: the exact program (batches that leave SMs free) walks it in 16-token tiles up to 2 x 8
    # KV heads (at 4 x 8 slower)
    layout = make_layout("k8v4", 8, 128, value_rotation=True)
    pool, table = fill_cache(layout, [64] * batch, "cpu")
    ring = recent_ring(layout, batch, 128, torch.float16, "cpu")
    long_table = torch.nn.functional.pad(table, (0, 32768 // layout.block_size - table.shape[1]))
    seen = _gpu_launch(torch.randn(batch, 32, 1, 128, dtype=torch.float16), pool, layout, long_table,
                       torch.full((batch,), 32768), 0.1, max_seq_len=32768, recent_keys=ring[0], recent_values=ring[1])
    assert (seen["EXACT_PROG"], seen["RING_TILE"]) == (batch < 16, 16 if batch <= 2 else 32), seen


@pytest.mark.parametrize("batch", [1, 16, 48])
@pytest.mark.parametrize("preset", ["4bit", "k8v4"])
def test_gpu_head_dim_64_decode_choices(preset, batch):
    """SmolLM2's attention shape (9 query / 3 KV heads, head_dim 64) on an H200: 4-bit keys by the code words on
    256-token tiles in 168 registers, FP8 keys uncapped (128 registers with the levers); both with token-pair
    metadata while the batch leaves SMs free (2 x 48 x 3 KV heads fill the H200's 132)."""
    for levers in (False, True):
        layout = make_layout(preset, 3, 64, key_centering=levers, value_rotation=levers)
        pool, table = fill_cache(layout, [64] * batch, "cpu")
        kw = {}
        if levers:
            kw = dict(zip(("prefix_keys", "prefix_values"), exact_prefix(layout, batch, 4, torch.float16, "cpu")))
            kw.update(zip(("recent_keys", "recent_values"), recent_ring(layout, batch, 128, torch.float16, "cpu")),
                      recent_from=0, key_offset=torch.zeros(batch, 3, 64))
        seen = _gpu_launch(torch.randn(batch, 9, 1, 64, dtype=torch.float16), pool, layout, table,
                           torch.full((batch,), 65), 0.1, max_seq_len=32768, **kw)
        words = preset == "4bit"
        want = (words, words, 256 if words else 128, 168 if words else (128 if levers and batch < 48 else None),
                batch < 48, 1)
        got = (seen["KEY_LUT"], seen["KEY_WORDS"], seen["BLOCK_N"], seen.get("maxnreg"), seen["META_PAIRS"], seen["HEADS_PER_PROGRAM"])
        assert got == want, (levers, seen)


def test_gpu_value_planes_in_64_row_tiles():
    """3-bit value planes: a prefill takes 64-row tiles on a GPU (there 2 accumulators, _value_plane_bytes);
    forcing the 4-bit value words onto 3-bit values is refused with the reason."""
    layout = make_layout("3bit", 2, 128)
    pool, table = fill_cache(layout, [40], "cpu")
    seen = _gpu_launch(torch.randn(1, 8, 40, 128), pool, layout, table, torch.tensor([40]), 0.1)
    assert seen["VALUE_PLANES"] is True and seen["BLOCK_M"] == 64, seen
    with pytest.raises(ValueError, match="value_words=True needs 4-bit values, got 3-bit"):
        _gpu_launch(torch.randn(1, 8, 1, 128), pool, layout, table, torch.tensor([40]), 0.1,
                    launch=LaunchConfig(value_words=True))


@pytest.mark.parametrize("preset,q_len,hadamard", [
    ("4bit", 1, True), ("4bit", 40, True), ("k8v4", 40, True), ("k3v4", 1, True), ("3bit", 1, True),
    ("k3v4", 40, False), ("3bit", 40, False),  # 3-bit keys in 64-row tiles: the GPU tests failed
])
def test_gpu_hadamard_choices(preset, q_len, hadamard):
    """Where a GPU builds the Hadamard rotations in registers (rotation="hadamard") and where it reads R."""
    layout = make_layout(preset, 2, 128, value_rotation=True)
    pool, table = fill_cache(layout, [40], "cpu")
    seen = _gpu_launch(torch.randn(1, 8, q_len, 128), pool, layout, table, torch.tensor([40]), 0.1)
    assert seen["HADAMARD"] is hadamard and (seen["BLOCK_M"] == 64) == (q_len > 1), seen
    layout = make_layout(preset, 2, 96, value_rotation=True)  # rotation="random": always read
    pool, table = fill_cache(layout, [40], "cpu")
    seen = _gpu_launch(torch.randn(1, 8, q_len, 96), pool, layout, table, torch.tensor([40]), 0.1)
    assert seen["HADAMARD"] is False, seen


@pytest.mark.parametrize("preset,options,maxnreg", [("3bit", False, 168), ("3bit", True, 168), ("k3v4", False, 128),
                                                    ("k3v4", True, None)])
def test_gpu_three_bit_register_caps(preset, options, maxnreg):
    """3-bit key planes at B=16 on an H200: 3bit in 168 registers (with centering and value rotation, splits for one
    wave of 3 programs per SM: test_launch_config); k3v4's plain format in 128 (measured each way), with its levers
    in head pairs uncapped (under a cap they spill)."""
    layout = make_layout(preset, 8, 128, key_centering=options, value_rotation=options)
    pool, table = fill_cache(layout, [64] * 16, "cpu")
    kw = {"key_offset": torch.zeros(8, 128)} if options else {}
    seen = _gpu_launch(torch.randn(16, 32, 1, 128), pool, layout, table, torch.full((16,), 65), 0.1,
                       max_seq_len=32768, **kw)
    assert seen.get("maxnreg") == maxnreg, seen


def test_gpu_value_words_refused_where_unverified():
    """Forcing the 16-bit value words onto a 64-row (wgmma) tile is refused with the reason; a decode
    tile takes them."""
    layout = make_layout("4bit", 2, 128)
    pool, table = fill_cache(layout, [40], "cpu")
    with pytest.raises(ValueError, match="value_words=True needs row tiles of <= 32 rows"):
        _gpu_launch(torch.randn(1, 8, 40, 128), pool, layout, table, torch.tensor([40]), 0.1,
                    launch=LaunchConfig(value_words=True))
    seen = _gpu_launch(torch.randn(1, 8, 1, 128), pool, layout, table, torch.tensor([40]), 0.1,
                       launch=LaunchConfig(value_words=True))
    assert seen["VALUE_WORDS"] is True


@pytest.mark.parametrize("q_len,words", [(1, True), (2, True), (5, False), (8, False)])
def test_gpu_value_words_in_16_row_tiles_only(q_len, words):
    """4-bit values as 16-bit words in 16-row decode tiles (1-2 queries of a GQA group of 4); 5-8 queries (a
    speculative verification's 32-row tiles) decode them as bytes, which measured 1.6-23x faster there."""
    layout = make_layout("4bit", 8, 128)
    pool, table = fill_cache(layout, [40], "cpu")
    seen = _gpu_launch(torch.randn(1, 32, q_len, 128), pool, layout, table, torch.tensor([40]), 0.1,
                       max_seq_len=32768)
    assert seen["VALUE_WORDS"] is words and seen["BLOCK_M"] == (16 if q_len <= 2 else 32), seen


def _check_graph_replay(args: tuple, kwargs: dict, next_step) -> None:
    """Capture one unified_attention call in a CUDA graph, let `next_step()` change its inputs in
    place (the next decode step), replay, and compare the output with the reference on the new inputs."""
    out = kwargs["out"]
    unified_attention(*args, **kwargs)  # warm-up: compile + workspace
    out.fill_(float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        unified_attention(*args, **kwargs)
    next_step()
    graph.replay()
    want = reference.paged_attention(*args, **{k: v for k, v in kwargs.items() if k != "out"})
    assert rel_error(out, want) <= attention_tolerance(torch.float16, want.float())


# ---- real sizes on the GPU ----------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["4bit", "k8v4", "k3v4", "3bit"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, None])  # None: the layout's default (64 tokens at head_dim 128)
def test_decode_32k_gpu(preset, dtype, block_size):
    layout = make_layout(preset, 8, 128, block_size=block_size)
    _check(layout, [32768, 32768 - 77], 1, 4, dtype=dtype, device="cuda", max_seq_len=32768)


@pytest.mark.gpu
@pytest.mark.parametrize("tuning", [{}, {"key_lut": False}, {"block_n": 256, "maxnreg": 0},
                                    {"block_n": 64, "maxnreg": 128}, {"pool32": False}, {"head_pairs": 1},
                                    {"head_pairs": 1, "key_words": False, "maxnreg": 128}])
def test_decode_key_lookup_variants_gpu(tuning):
    """16 sequences x 8 KV heads (the launcher's head pairs in 168 registers) and the other variants of 4-bit
    key decoding against the reference: the code words' byte magnitudes, the byte-code lookup, the gather, tile
    lengths, int64 addresses, one head per program."""
    layout = make_layout("4bit", 8, 128)
    lens = [8192 - 37 * i for i in range(16)]
    _check(layout, lens, 1, 4, dtype=torch.float16, device="cuda", max_seq_len=8192, launch=LaunchConfig(**tuning))


@pytest.mark.gpu
@pytest.mark.parametrize("q_len", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_head_pairs_gpu(q_len, dtype):
    """Two KV heads per program at 4 sequences of 8 KV heads (the launcher's default there), 1 or 2 query
    positions per head (4 or 8 rows of a head's 8), sinks, lengths apart by odd amounts."""
    layout = make_layout("4bit", 8, 128)
    _check(layout, [8192, 8192 - 77, 5001, 123], q_len, 4, dtype=dtype, device="cuda", max_seq_len=8192,
           sinks=torch.randn(32, device="cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["k8v4", "k3v4"])
def test_decode_batch_filling_the_gpu_gpu(preset):
    """FP8 keys and 3-bit key planes at 16 rows x 8 KV heads (their 128-register branches) with the
    preset's levers: value rotation, the exact prefix and ring."""
    layout = make_layout(preset, 8, 128, value_rotation=True)
    lens = [8192 - 37 * i for i in range(16)]
    _check(layout, lens, 1, 4, dtype=torch.float16, device="cuda", max_seq_len=8192, prefix_len=4, recent=(128, 0))


def _check_decode_lever_gpu(preset: str, head_dim: int, batch: int, q_len: int, lever: str, tol: float = 0.0,
                            value_rotation: bool = True, **fixed) -> None:
    """A decode-path LaunchConfig lever that changes only how the same operands are made (LaunchConfig(lever=True),
    other fields `fixed`): the reference's attention with the preset's levers at odd lengths, and the lever-off
    output exactly (or to a relative `tol` where the lever rounds an operand at another point)."""
    layout = make_layout(preset, 4, head_dim, key_centering=True, value_rotation=value_rotation)
    lens = [4099 - 37 * i for i in range(batch)]
    kw = dict(dtype=torch.float16, device="cuda", max_seq_len=4096 + q_len, prefix_len=4, recent=(128, 0),
              key_offset=torch.randn(4, head_dim, device="cuda"))
    outputs = []
    for on in (True, False):
        torch.manual_seed(5)
        outputs.append(_check(layout, lens, q_len, 4, launch=LaunchConfig(**{lever: on}, **fixed), **kw))
    (got, want), (off, want_again) = outputs
    assert torch.equal(want, want_again)  # the same inputs
    assert (rel_error(got, off) <= tol) if tol else torch.equal(got, off), rel_error(got, off)


@pytest.mark.gpu
@pytest.mark.parametrize("preset,head_dim,batch", [("4bit", 128, 1), ("k8v4", 128, 3), ("3bit", 128, 1),
                                                   ("k3v4", 128, 1), ("k3v4", 64, 3), ("4bit", 256, 1)])
def test_ring_programs_gpu(preset, head_dim, batch):
    """ring_programs on the GPU's plans (head pairs of 4-bit words and of k3v4's key planes, lookups, 3-bit value
    planes): the reference's attention, and the walk's output with the ring tiles in the splits to fp16 rounding
    (the partials merge in another order)."""
    _check_decode_lever_gpu(preset, head_dim, batch, 1, "ring_programs", tol=2 ** -9, exact_program=True)


@pytest.mark.gpu
@pytest.mark.parametrize("preset,batch", [("4bit", 1), ("k3v4", 1), ("k3v4", 16), ("3bit", 3)])
def test_pdl_gpu(preset, batch):
    """LaunchConfig(pdl=True), the attention and its split reduction launched as programmatic dependents: the
    reference's attention and the plan without it exactly (the same kernels; only the launches' dependency
    differs); and in a CUDA graph right after a copy kernel that writes the query, the new query's attention."""
    _check_decode_lever_gpu(preset, 128, batch, 1, "pdl")
    layout = make_layout(preset, 8, 128)
    lens = [4000 - 37 * i for i in range(batch)]
    pool, table = fill_cache(layout, lens, "cuda")
    seq = torch.tensor(lens, device="cuda")
    source = torch.randn(batch, 32, 1, 128, device="cuda", dtype=torch.float16)
    q = torch.empty_like(source)
    out = torch.full_like(q, float("nan"))
    args, kwargs = (q, pool, layout, table, seq, 0.088), dict(max_seq_len=4096, launch=LaunchConfig(pdl=True), out=out)
    q.copy_(source)
    unified_attention(*args, **kwargs)  # warm-up: compile + workspace
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q.copy_(source)  # the kernel before: the attention must wait for its write
        unified_attention(*args, **kwargs)
    for _ in range(3):
        source.copy_(torch.randn_like(source))
        out.fill_(float("nan"))
        graph.replay()
        want = reference.paged_attention(source.float(), pool, layout, table, seq, 0.088)
        assert rel_error(out, want) <= attention_tolerance(torch.float16, want)


@pytest.mark.gpu
@pytest.mark.parametrize("preset,head_dim,batch,q_len", [("3bit", 128, 1, 1), ("3bit", 128, 3, 1), ("3bit", 128, 2, 4),
                                                       ("3bit", 256, 1, 1), ("3bit", 64, 3, 1), ("k3v4", 64, 3, 1),
                                                       ("4bit", 128, 2, 1)])
def test_value_boundary_gpu(preset, head_dim, batch, q_len):
    """value_boundary on the GPU's value decoders (3-bit plane words and bit stream, 4-bit words): the reference's
    attention, and the default plan's output to fp32 rounding (the MMAs sum a tile's products in another order)."""
    _check_decode_lever_gpu(preset, head_dim, batch, q_len, "value_boundary", tol=2 ** -10)


@pytest.mark.gpu
def test_fp8_keys_at_head_dim_256_in_8_warps_gpu():
    """FP8 keys at head_dim 256 with every lever from 16 (row, KV head) pairs take 8 warps in 128 registers (each
    thread half a tile): the reference's attention at odd lengths, split, with the prefix and the ring, and the
    4-warp plan's output to fp16's resolution (the tiles' sums split over other warps)."""
    layout = make_layout("k8v4", 4, 256, key_centering=True, value_rotation=True)
    lens = [4099 - 37 * i for i in range(4)]
    kw = dict(dtype=torch.float16, device="cuda", max_seq_len=4097, prefix_len=4, recent=(128, 0),
              key_offset=torch.randn(4, 256, device="cuda"))
    torch.manual_seed(5)
    wide, want = _check(layout, lens, 1, 2, **kw)
    torch.manual_seed(5)
    narrow, _ = _check(layout, lens, 1, 2, launch=LaunchConfig(num_warps=4, maxnreg=NO_REGISTER_CAP), **kw)
    assert rel_error(wide, narrow) <= 2 ** -10, rel_error(wide, narrow)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,q_len,batch", [(128, 1, 16), (128, 1, 2), (128, 8, 1), (256, 1, 3)])
def test_value_planes_from_bytes_gpu(head_dim, q_len, batch):
    """3-bit value planes decoded from their loaded bytes by one asm (value_planes_asm), at decode and verification
    tiles: the plane words' operands exactly (the codes shifted down, as the words' asm leaves them)."""
    _check_decode_lever_gpu("3bit", head_dim, batch, q_len, "value_planes_asm", planes_in_place=False)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,q_len,batch,value_rotation", [(128, 1, 16, True), (128, 8, 1, True),
                                                                 (128, 1, 2, False), (256, 1, 3, False)])
def test_planes_in_place_gpu(head_dim, q_len, batch, value_rotation):
    """3-bit value plane codes decoded where they sit (planes_in_place), each accumulator in its own unit: the
    reference's attention, and the shifted codes' output to fp16's resolution (the same sums a power of two apart,
    yet the MMAs' fp32 sums of the larger codes rounded to 1 ulp of the output apart on an H100), with the value
    rotation and without it (there the ring's exact values join the code accumulators in those units)."""
    _check_decode_lever_gpu("3bit", head_dim, batch, q_len, "planes_in_place", tol=2 ** -10,
                            value_rotation=value_rotation)


@pytest.mark.gpu
@pytest.mark.parametrize("preset,head_dim,batch,q_len", [("k3v4", 256, 1, 1), ("3bit", 256, 3, 1), ("k3v4", 256, 1, 8),
                                                         ("3bit", 128, 1, 1), ("4bit", 256, 1, 1), ("4bit", 256, 16, 1)])
def test_query_butterfly_gpu(preset, head_dim, batch, q_len):
    """The query rotated once by butterflies (query_butterfly; 3-bit key planes, 4-bit keys at 256): the
    window-by-window (halves') rotation's output to fp16's resolution (the rotated query rounds at another point; a
    window out of place is far off)."""
    _check_decode_lever_gpu(preset, head_dim, batch, q_len, "query_butterfly", tol=2 ** -10)


@pytest.mark.gpu
@pytest.mark.parametrize("preset,batch,q_len", [("4bit", 1, 1), ("k8v4", 16, 1), ("3bit", 1, 8)])
def test_rotation_units_gpu(preset, batch, q_len):
    """The 16-bit epilogue's Rv entries read as fp16 units (rotation_units): the converted fp32 rows' output exactly."""
    _check_decode_lever_gpu(preset, 128, batch, q_len, "rotation_units")


@pytest.mark.gpu
@pytest.mark.parametrize("preset,head_dim,batch,q_len", [("4bit", 128, 16, 1), ("4bit", 128, 2, 1), ("4bit", 128, 1, 8),
                                                         ("k3v4", 128, 16, 1), ("3bit", 128, 1, 1), ("3bit", 64, 16, 1),
                                                         ("k3v4", 256, 3, 1)])
def test_table_registers_gpu(preset, head_dim, batch, q_len):
    """The key lookups' table words pinned in registers (table_registers): 4-bit code words and bytes, 3-bit planes and
    the bit stream, the constant tables' operands exactly."""
    _check_decode_lever_gpu(preset, head_dim, batch, q_len, "table_registers")


@pytest.mark.gpu
@pytest.mark.parametrize("preset,batch,stages", [("3bit", 16, 2), ("3bit", 1, 2), ("k3v4", 16, 3), ("k3v4", 1, 2)])
def test_key_planes_in_head_pairs_gpu(preset, batch, stages):
    """3-bit key planes at head_dim 128 in head pairs (asked for; uncapped, as sm_90a compiles them without spills)
    with the preset's levers at real size: key means per row and head, value rotation, the exact prefix and the int8
    ring, odd lengths."""
    layout = make_layout(preset, 8, 128, key_centering=True, value_rotation=True)
    lens = [8192 - 37 * i for i in range(batch)]
    kw = _fidelity_options(layout, 4, "cuda") | {"key_offset": torch.randn(batch, 8, 128, device="cuda") * 3}
    launch = LaunchConfig(head_pairs=2, maxnreg=NO_REGISTER_CAP, num_stages=stages)
    _check(layout, lens, 1, 4, dtype=torch.float16, device="cuda", max_seq_len=8192, prefix_len=4, recent=(128, 0),
           ring_records=True, launch=launch, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [16, 2])
def test_head_pairs_with_format_options_gpu(batch):
    """The 4bit preset's levers at real size with two KV heads per program (the launcher's default): key means per
    row and head, value rotation, the exact prefix and ring (at 2 sequences in an exact program of their own)."""
    layout = make_layout("4bit", 8, 128, key_centering=True, value_rotation=True)
    lens = [8192 - 37 * i for i in range(batch)]
    kw = _fidelity_options(layout, 4, "cuda") | {"key_offset": torch.randn(batch, 8, 128, device="cuda") * 3}
    _check(layout, lens, 1, 4, dtype=torch.bfloat16, device="cuda", max_seq_len=8192, prefix_len=4, recent=(128, 0), **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("levers", [False, True])
def test_three_bit_decode_in_one_wave_gpu(levers):
    """3bit where the batch fills the GPU (16 rows of odd lengths x 8 KV heads), as the launcher plans it: 168
    registers and splits for one wave of 3 programs per SM (not a power of two); with the levers the key means per
    row and head, value rotation, the exact prefix and ring."""
    layout = make_layout("3bit", 8, 128, key_centering=levers, value_rotation=levers)
    lens = [4096 - 37 * i for i in range(16)]
    if levers:
        kw = _fidelity_options(layout, 4, "cuda") | {"key_offset": torch.randn(16, 8, 128, device="cuda") * 3}
        kw |= {"prefix_len": 4, "recent": (128, 0)}
    else:
        kw = {}
    _check(layout, lens, 1, 4, dtype=torch.float16, device="cuda", max_seq_len=4096, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, None])
def test_prefill_8k_gpu(dtype, block_size):
    layout = make_layout("4bit", 2, 128, block_size=block_size)
    _check(layout, [8192], 8192, 4, dtype=dtype, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["4bit", "k8v4", "k3v4", "3bit"])
def test_format_options_32k_gpu(preset):
    layout = make_layout(preset, 8, 128, key_centering=True, value_rotation=True)
    mu = torch.randn(8, 128, device="cuda") * 3
    sinks = torch.randn(32, device="cuda")
    _check(layout, [32768, 32768 - 77], 1, 4, dtype=torch.bfloat16, device="cuda", max_seq_len=32768,
           key_offset=mu, sinks=sinks, softcap=30.0)
    _check(layout, [2048], 2048, 4, dtype=torch.float16, device="cuda", key_offset=mu, sinks=sinks, softcap=30.0)


@pytest.mark.gpu
def test_decode_cuda_graph_capture_gpu():
    layout = make_layout("4bit", 8, 128)
    pool, table = fill_cache(layout, [4000, 1234, 9], "cuda")
    seq = torch.tensor([4000, 1234, 9], device="cuda")
    q = torch.randn(3, 32, 1, 128, device="cuda", dtype=torch.float16)
    kwargs = dict(max_seq_len=4096, out=torch.full_like(q, float("nan")))
    _check_graph_replay((q, pool, layout, table, seq, 0.088), kwargs, lambda: q.copy_(torch.randn_like(q)))


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["4bit", "k8v4", "k3v4", "3bit"])
@pytest.mark.parametrize("options", [False, True])
def test_exact_prefix_real_size_gpu(preset, options):
    layout = make_layout(preset, 8, 128, key_centering=options, value_rotation=options)
    kw = _fidelity_options(layout, 4, "cuda") if options else {}
    _check(layout, [32768, 32768 - 77], 1, 4, dtype=torch.bfloat16, device="cuda", max_seq_len=32768,
           prefix_len=4, kv_start=torch.tensor([0, 13], device="cuda"), softcap=30.0, **kw)
    _check(layout, [2048, 1999], 1999, 4, dtype=torch.float16, device="cuda", prefix_len=64,
           kv_start=torch.tensor([5, 0], device="cuda"), sliding_window=1024, **kw)


@pytest.mark.gpu
def test_exact_prefix_cuda_graph_capture_gpu():
    layout = make_layout("4bit", 8, 128, key_centering=True, value_rotation=True)
    kw = _fidelity_options(layout, 4, "cuda")
    pool, table = fill_cache(layout, [4000, 1234, 9], "cuda", key_offset=kw["key_offset"])
    seq, kv_start = torch.tensor([4000, 1234, 9], device="cuda"), torch.tensor([0, 7, 1], device="cuda")
    pk, pv = exact_prefix(layout, 3, 4, torch.float16, "cuda")
    q = torch.randn(3, 32, 1, 128, device="cuda", dtype=torch.float16)
    kwargs = dict(kv_start=kv_start, max_seq_len=4096, out=torch.full_like(q, float("nan")), prefix_keys=pk,
                  prefix_values=pv, **kw)

    def next_step():
        q.copy_(torch.randn_like(q))
        pv.copy_(torch.randn_like(pv))

    _check_graph_replay((q, pool, layout, table, seq, 0.088), kwargs, next_step)


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["4bit", "k8v4", "k3v4", "3bit"])
def test_recent_window_real_size_gpu(preset):
    layout = make_layout(preset, 8, 128, key_centering=True, value_rotation=True)
    kw = _fidelity_options(layout, 4, "cuda")
    _check(layout, [32768, 32768 - 77, 3], 1, 4, dtype=torch.bfloat16, device="cuda", max_seq_len=32768,
           prefix_len=4, recent=(128, 0), kv_start=torch.tensor([0, 13, 0], device="cuda"), softcap=30.0, **kw)
    _check(layout, [32768, 32768 - 77, 3], 1, 4, dtype=torch.float16, device="cuda", max_seq_len=32768,
           prefix_len=4, recent=(128, 32700), kv_start=torch.tensor([0, 13, 0], device="cuda"), **kw)
    _check(layout, [2048, 1999], 1999, 4, dtype=torch.float16, device="cuda", prefix_len=4, recent=(128, 0),
           kv_start=torch.tensor([5, 0], device="cuda"), sliding_window=1024, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("preset,q_len,length", [("3bit", 8, 32768), ("k3v4", 5, 32768 - 77), ("3bit", 8, 3001)])
def test_three_bit_verification_splits_gpu(preset, q_len, length):
    """A 3-bit verification forward at B=1 with the levers (168 registers, 24 splits over 32k: a split count that
    is not a power of two, so splits of unequal tile counts; over 3k, sized for 32k, most splits empty) against the
    reference."""
    layout = make_layout(preset, 8, 128, key_centering=True, value_rotation=True)
    kw = _fidelity_options(layout, 4, "cuda")
    _check(layout, [length], q_len, 4, dtype=torch.float16, device="cuda", max_seq_len=32768, prefix_len=4,
           recent=(128 + q_len, 0), **kw)


@pytest.mark.gpu
def test_recent_window_cuda_graph_capture_gpu():
    layout = make_layout("4bit", 8, 128, key_centering=True, value_rotation=True)
    kw = _fidelity_options(layout, 4, "cuda")
    pool, table = fill_cache(layout, [4000, 1234, 9], "cuda", key_offset=kw["key_offset"])
    seq = torch.tensor([4000, 1234, 9], device="cuda")
    rk, rv = recent_ring(layout, 3, 128, torch.float16, "cuda")
    q = torch.randn(3, 32, 1, 128, device="cuda", dtype=torch.float16)
    kwargs = dict(max_seq_len=4096, out=torch.full_like(q, float("nan")), recent_keys=rk, recent_values=rv,
                  recent_from=5, **kw)

    def next_step():
        q.copy_(torch.randn_like(q))
        rv.copy_(torch.randn_like(rv))
        seq.add_(1)  # the next step: the ring range moves with seq_lens, read on the device

    _check_graph_replay((q, pool, layout, table, seq, 0.088), kwargs, next_step)



@pytest.mark.gpu
@pytest.mark.parametrize("batch", [48, 16, 2])
@pytest.mark.parametrize("levers", [False, True])
@pytest.mark.parametrize("preset", ["4bit", "k8v4", "k3v4", "3bit"])
def test_head_dim_64_decode_gpu(preset, levers, batch):
    """SmolLM2's attention shape (9 query / 3 KV heads, head_dim 64) at real size with the launcher's choices there
    (test_gpu_head_dim_64_decode_choices): the 4-bit code words on 256-token tiles, FP8 keys' token-pair metadata,
    3-bit bit-stream keys looked up 4 codes per byte permute, plain and with the presets' levers (key means, value
    rotation, sinks, the exact prefix and ring; at B=16 with them, splits that fill one wave of 4 programs per SM)."""
    layout = make_layout(preset, 3, 64, key_centering=levers, value_rotation=levers)
    lens = [8192 - 37 * i for i in range(batch)]
    kw = (_fidelity_options(layout, 3, "cuda") | dict(prefix_len=4, recent=(128, 0))) if levers else {}
    _check(layout, lens, 1, 3, dtype=torch.float16, device="cuda", max_seq_len=8192, **kw)


# Triton 3.6 on the H200 gave wrong results and illegal accesses for 64-row tiles at head_dim 32/64
# (fixed by the launcher's row-tile cap); these are the shapes of that sweep, plain and with every lever.
@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [32, 64])
@pytest.mark.parametrize("q_len,group", [(30, 2), (16, 4), (200, 2)])
@pytest.mark.parametrize("preset", ["4bit", "k8v4"])
@pytest.mark.parametrize("levers", [False, True])
def test_small_head_dim_chunks_gpu(head_dim, q_len, group, preset, levers):
    layout = make_layout(preset, 2, head_dim, key_centering=levers, value_rotation=levers)
    kw = _fidelity_options(layout, group, "cuda") if levers else {}
    extra = dict(prefix_len=4, recent=(128, 0), kv_start=torch.tensor([3, 0, 1], device="cuda")) if levers else {}
    _check(layout, [q_len + 10, q_len + 3, q_len], q_len, group, dtype=torch.float16, device="cuda", **extra, **kw)


def test_launch_steps_down_when_shared_memory_runs_out(monkeypatch):
    """A variant that needs more shared memory than the GPU has is retried with fewer pipeline
    stages, then shorter KV tiles, then (with a recent-window ring) shorter ring tiles; the
    variant that fits is remembered (one launch afterwards)."""
    import triton.runtime.errors

    from tq_hf.kernels import launch

    launches = []

    class FakeKernel:
        def __getitem__(self, grid):
            def launch(*args, BLOCK_N, num_stages, enable_fp_fusion, **constants):
                assert enable_fp_fusion is True  # asked for, not left to Triton's default (off from 3.10)
                launches.append((BLOCK_N, num_stages, constants.get("RING_TILE")))
                if BLOCK_N > 32 or constants.get("RING_TILE", 0) > 16:
                    raise triton.runtime.errors.OutOfResources(262144, 232448, "shared memory")
            return launch

    kernel = FakeKernel()
    monkeypatch.setattr(launch, "_FITTED", {})
    constants = {"D": 128, "KEY_BITS": 3}
    launch.launch_fitting(kernel, (1, 1, 1), (), constants, 128, 2)
    assert launches == [(128, 2, None), (128, 1, None), (64, 1, None), (32, 1, None)]
    launches.clear()
    launch.launch_fitting(kernel, (1, 1, 1), (), constants, 128, 2)
    assert launches == [(32, 1, None)]
    launches.clear()
    with pytest.raises(triton.runtime.errors.OutOfResources):  # nothing fits: the last error surfaces
        launch.launch_fitting(kernel, (1, 1, 1), (), {"D": 256}, 512, 2)
    assert launches == [(512, 2, None), (512, 1, None), (256, 1, None), (128, 1, None)]
    launches.clear()
    ring = {"D": 128, "HAS_RECENT": True, "RING_TILE": 64}  # the ring tile shrinks after the KV tiles
    launch.launch_fitting(kernel, (1, 1, 1), (), ring, 64, 2)
    tiles = [(64, 2), (64, 1), (32, 1), (16, 1)]
    assert launches == [(bn, st, rn) for rn in (64, 32) for bn, st in tiles] + [(64, 2, 16), (64, 1, 16), (32, 1, 16)]
    launches.clear()
    launch.launch_fitting(kernel, (1, 1, 1), (), ring, 64, 2)
    assert launches == [(32, 1, 16)]


# 4-bit values: 16-bit words into 4 accumulators (decode) or bytes into 2 (prefill, small head_dims)
@pytest.mark.parametrize("value_words", [True, False])
@pytest.mark.parametrize("preset,options", [("4bit", True), ("k8v4", False), ("k3v4", True)])
@pytest.mark.slow
def test_decode_value_paths(value_words, preset, options):
    """Both 4-bit value paths against the reference in one decode launch shape, with the exact
    prefix and ring (their values join the code accumulators in each path's scale) and value_rotation
    (the epilogue rotates each accumulator's coordinates back)."""
    layout = make_layout(preset, 2, 64, key_centering=options, value_rotation=options)
    kw = _fidelity_options(layout, 4) if options else {}
    _check(layout, [70, 33], 1, 4, prefix_len=4, recent=(16, 0), kv_start=torch.tensor([3, 0], device=DEVICE),
           num_splits=3, launch=LaunchConfig(value_words=value_words), **kw)
    _check(layout, [70, 33], 2, 4, launch=LaunchConfig(value_words=value_words), **kw)


# 3-bit values as a 2-bit plane and a bit plane (layout.value_planes): 4 accumulators of D/4 coordinates
@pytest.mark.parametrize("head_dim,options", [(128, False), (128, True), (256, True)])
@pytest.mark.slow
def test_decode_three_bit_value_planes(head_dim, options):
    """3-bit value planes against the reference, with the exact prefix and ring (their values join the
    4 accumulators in the planes' scale), left padding, splits and value_rotation (the epilogue rotates
    each accumulator's coordinates back), and a prefill (17 queries of 4 heads: 64-row tiles, 2 accumulators)."""
    layout = make_layout("3bit", 2, head_dim, key_centering=options, value_rotation=options)
    assert value_planes(layout.config, head_dim)
    kw = _fidelity_options(layout, 4) if options else {}
    _check(layout, [70, 33], 1, 4, prefix_len=4, recent=(16, 0), kv_start=torch.tensor([3, 0], device=DEVICE),
           num_splits=3, **kw)
    _check(layout, [70, 33], 2, 4, **kw)
    _check(layout, [70, 33], 17, 4, prefix_len=4, recent=(16, 0), **kw)


# per-token metadata as 32-bit token pairs (small-batch decode on a GPU): a pair's tokens may be masked
# apart (odd kv_start, the walk's end, the exact prefix's end), at every block size
# or each token's fields from its pair's 32-bit word (meta_words)
@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("options", [False, True])
@pytest.mark.parametrize("meta", ["meta_pairs", "meta_words", "meta_words+bt_next"])
@pytest.mark.slow
def test_meta_pairs_decode(block_size, options, meta):
    layout = make_layout("4bit", 2, 64, block_size, key_centering=options, value_rotation=options)
    tuning = {m: True for m in meta.split("+")} | ({"vmid_chain": True} if "bt_next" in meta else {})
    _check_decode_walks(layout, options, tuning)


def _check_decode_walks(layout, options: bool, tuning: dict) -> None:
    """Decode variants of one format: odd kv_start with splits (a softcap, or the format options), two query
    positions with a window at GQA 3, and with the options the exact prefix and ring."""
    kw = _fidelity_options(layout, 4) if options else {"softcap": 5.0}
    _check(layout, [71, 34], 1, 4, num_splits=3, kv_start=torch.tensor([3, 0], device=DEVICE), launch=LaunchConfig(**tuning), **kw)
    _check(layout, [71, 34], 2, 3, sliding_window=21, kv_start=torch.tensor([0, 5], device=DEVICE), launch=LaunchConfig(**tuning))
    if options:
        _check(layout, [71, 34], 1, 4, prefix_len=3, recent=(16, 0), kv_start=torch.tensor([3, 0], device=DEVICE),
               num_splits=3, launch=LaunchConfig(**tuning), **kw)


# 4-bit keys as 16-bit code words, 4 dots over coordinate sets (a GPU's lookup layout; gathered here) at each head_dim
# the lookup serves: odd kv_start, splits, windows, GQA 4 and 3, the format options with the exact prefix and ring,
# each metadata load (token pairs: a GPU's choice at head_dim 64)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("options", [False, True])
@pytest.mark.parametrize("meta", [None, "meta_words", "meta_pairs"])
@pytest.mark.slow
def test_key_words_decode(head_dim, options, meta):
    layout = make_layout("4bit", 2, head_dim, 16, key_centering=options, value_rotation=options)
    _check_decode_walks(layout, options, {"key_words": True} | ({meta: True} if meta else {}))


# FP8 keys with their metadata as token pairs (a GPU's choice at head_dim 64 while the batch leaves SMs free)
@pytest.mark.parametrize("options", [False, True])
def test_fp8_keys_meta_pairs_decode(options):
    layout = make_layout("k8v4", 2, 64, 16, key_centering=options, value_rotation=options)
    _check_decode_walks(layout, options, {"meta_pairs": True})


# two KV heads per program (head_pairs=2, a GPU's default in the plain format): their query rows in one tile, masked
# and causal tiles, splits, windows, sinks, Lq 2, 2 and 4 KV heads, both metadata loads
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("meta_words", [False, True])
@pytest.mark.slow
def test_head_pairs_decode(head_dim, meta_words):
    layout = make_layout("4bit", 2, head_dim, 16)
    # (value words asked for: a GPU's plan leaves them out at head_dim 64, where pairs are not its default)
    meta = {"meta_words": True, "vmid_chain": True, "bt_next": True} if meta_words else {}
    tuning = {"key_words": True, "value_words": True, "head_pairs": 2} | meta
    _check(layout, [71, 34], 1, 4, num_splits=3, kv_start=torch.tensor([3, 0], device=DEVICE), launch=LaunchConfig(**tuning), softcap=5.0)
    _check(layout, [71, 34], 1, 4, launch=LaunchConfig(**tuning))
    _check(layout, [71, 34], 2, 3, sliding_window=21, kv_start=torch.tensor([0, 5], device=DEVICE), launch=LaunchConfig(**tuning))
    _check(layout, [50], 1, 8, num_splits=2, launch=LaunchConfig(**tuning), sinks=torch.randn(16, device=DEVICE))
    _check(make_layout("4bit", 4, head_dim, 16), [71, 34], 1, 2, num_splits=3, launch=LaunchConfig(**tuning))


# head pairs under the format options (a GPU's default for the 4bit preset): each row its KV head's key mean, value
# rotation, both heads' exact prefix and ring (one softmax step per dense tile, each head's dots over its rows),
# in split programs and in an exact program of their own, per-row key means [B, Hk, D], cache blocks of 16-64 tokens
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (128, 16), (64, 32), (64, 64)])
@pytest.mark.parametrize("exact_program", [False, True])
@pytest.mark.slow
def test_head_pairs_with_format_options(head_dim, block_size, exact_program):
    layout = make_layout("4bit", 2, head_dim, block_size, key_centering=True, value_rotation=True)
    tuning = {"key_words": True, "value_words": True, "head_pairs": 2, "meta_words": True,
              "exact_program": exact_program}
    _check_decode_walks(layout, True, tuning)
    wide = make_layout("4bit", 4, head_dim, block_size, key_centering=True, value_rotation=True)
    kw = _fidelity_options(wide, 2) | {"key_offset": torch.randn(2, 4, head_dim, device=DEVICE) * 3}
    _check(wide, [71, 40], 1, 2, prefix_len=4, recent=(16, 0), num_splits=3, launch=LaunchConfig(**tuning), **kw)
    _check(wide, [71, 40], 1, 2, prefix_len=4, recent=(32, 20), launch=LaunchConfig(**tuning), **kw)
    # with a softcap q . mu joins each score before the cap (not the row offset)
    _check(wide, [71, 40], 1, 2, prefix_len=4, recent=(16, 0), num_splits=2, softcap=5.0, launch=LaunchConfig(**tuning), **kw)


# 3-bit key planes at head_dim 128 in head pairs (asked for): each head's query windows over its own rows, with
# 3-bit value planes (3bit) or 4-bit value words (k3v4); odd kv_start, splits, windows, sinks, the format options
# with both heads' exact prefix and ring, 4 KV heads, each metadata load
@pytest.mark.parametrize("preset", ["3bit", "k3v4"])
@pytest.mark.parametrize("options", [False, True])
@pytest.mark.parametrize("meta_words", [False, True])
@pytest.mark.slow
def test_key_planes_in_head_pairs_decode(preset, options, meta_words):
    layout = make_layout(preset, 2, 128, 16, key_centering=options, value_rotation=options)
    tuning = {"head_pairs": 2, "meta_words": meta_words} | ({"value_words": True} if preset == "k3v4" else {})
    _check_decode_walks(layout, options, tuning)
    _check(layout, [50], 1, 8, num_splits=2, launch=LaunchConfig(**tuning), sinks=torch.randn(16, device=DEVICE))
    wide = make_layout(preset, 4, 128, 16, key_centering=options, value_rotation=options)
    _check(wide, [71, 34], 1, 2, num_splits=3, launch=LaunchConfig(**tuning),
           **(_fidelity_options(wide, 2) if options else {}))


def test_head_pairs_refuses_what_it_cannot_pair():
    q = torch.randn(1, 6, 1, 64, device=DEVICE)
    # an odd KV head count; FP8 keys; 3-bit keys as a bit stream (head_dim 64: no planes)
    for layout in (make_layout("4bit", 3, 64), make_layout("k8v4", 2, 64), make_layout("3bit", 2, 64)):
        pool, table = fill_cache(layout, [40], DEVICE)
        qh = q[:, : layout.num_kv_heads * 2]
        with pytest.raises(ValueError, match="head_pairs=2 needs decode"):
            unified_attention(qh, pool, layout, table, torch.tensor([41], device=DEVICE), 0.1,
                              launch=LaunchConfig(head_pairs=2, key_words=layout.config.key_bits == 4))
    with pytest.raises(ValueError, match="head_pairs must be 1 or 2, got 3"):
        LaunchConfig(head_pairs=3)


def test_key_words_refuses_what_it_cannot_decode():
    for preset, head_dim, q_len in (("k8v4", 64, 1), ("k3v4", 64, 1), ("4bit", 96, 1), ("4bit", 64, 80)):
        layout = make_layout(preset, 2, head_dim)
        pool, table = fill_cache(layout, [40], DEVICE)
        q = torch.randn(1, 2, q_len, head_dim, device=DEVICE)
        with pytest.raises(ValueError, match="key_words=True needs decode"):
            unified_attention(q, pool, layout, table, torch.tensor([40 + q_len], device=DEVICE), 0.1,
                              launch=LaunchConfig(key_words=True))


# what a GPU's decode at head_dim 128 takes: the pair words, v_mid prefetched, block-table entries an iteration
# ahead, for the 3-bit code planes and FP8 keys too
@pytest.mark.parametrize("preset", ["3bit", "k8v4"])
def test_meta_words_decode_at_head_dim_128(preset):
    layout = make_layout(preset, 2, 128)
    tuning = {"meta_words": True, "vmid_chain": True, "bt_next": True}
    _check(layout, [71, 34], 1, 4, num_splits=2, kv_start=torch.tensor([0, 3], device=DEVICE), launch=LaunchConfig(**tuning))


# Long walks on the GPU: 4 splits of 32k positions per sequence (decode, both decode kernels) and a 64-query chunk
# (prefill tiles) at the end of 128k, zero-mean values (their average is ~100x smaller than they are). With the
# value sums chained through the MMA's accumulator (which rounds toward zero), the error grew with the walk's
# length: 1-5% here, 42% for the chunk (H200); softmax.rescaled_dot.
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("preset,tuning,q_len,num_splits", [
    ("4bit", {"warp_split": False}, 1, 4),
    ("4bit", {"warp_split": True}, 1, 4),
    ("k8v4", {}, 1, 4),
    ("4bit", {}, 64, None),
])
def test_long_walk_accuracy_gpu(preset, tuning, q_len, num_splits):
    layout = make_layout(preset, 8, 128)
    lens = [131072, 131071 + q_len]
    pool, table = fill_cache(layout, lens, "cuda", value_mean=0.0)
    seq_lens = torch.tensor(lens, device="cuda")
    query = torch.randn(2, 32, q_len, 128, device="cuda", dtype=torch.float16)
    scale = default_scale(128)
    want = torch.cat([reference.paged_attention(query[i:i + 1].float(), pool, layout, table[i:i + 1],
                                                seq_lens[i:i + 1], scale) for i in range(2)])
    got = unified_attention(query, pool, layout, table, seq_lens, scale, out=torch.full_like(query, float("nan")),
                            num_splits=num_splits, launch=LaunchConfig(**tuning))
    err, tol = rel_error(got, want), attention_tolerance(torch.float16, want)
    assert err <= tol, f"relative error {err:.3e} > {tol:.3e} ({preset}, tuning {tuning}, Lq={q_len})"
