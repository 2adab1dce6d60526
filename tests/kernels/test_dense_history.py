"""The dense route of a many-query forward: dequantize.py's elementwise dequantization and history.py's attention
through a dense copy, against reference.py.

The dequantized history is compared with reference.gather after rotating back (fp32: to float32 rounding); the
attention with reference.paged_attention within attention_tolerance plus the rounding of K/V to the query's
dtype. Outputs are poisoned with NaN, and the pool's slots that exact buffers serve hold NaN, so a position read
from the wrong place shows.
"""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch

from tq_hf import ops, reference
from tq_hf.layout import key_planes, value_planes
from tq_hf.kernels import dense_history_attention, dense_history_serves, history
from tq_hf.kernels.dequantize import code_pieces, dequantize, dequantize_rotated
from tq_hf.kernels.fast_launch import PlanCache
from tq_hf.kernels.lse_merge import merge_attention

from kernel_helpers import (DEVICE, attention_tolerance, default_scale, fill_cache, make_layout,
                            poisoned_exact_buffers, rel_error)

LEVERS = {"4bit": dict(key_centering=True, value_rotation=True), "k8v4": dict(key_centering=True),
          "k3v4": dict(value_rotation=True), "3bit": {}}


def _unpack_by_pieces(packed: torch.Tensor, pieces: torch.Tensor) -> torch.Tensor:
    """The kernel's recipe in torch: code = sum over pieces of ((row[byte] >> shift) & mask) << place."""
    byte, shift, mask, place = (pieces[:, i].long() for i in range(4))  # [P, D] each
    rows = packed.long()[..., None, :].expand(*packed.shape[:-1], byte.shape[0], packed.shape[-1])
    b = rows.gather(-1, byte.expand(*packed.shape[:-1], *byte.shape))
    return (((b >> shift) & mask) << place).sum(-2)


@pytest.mark.parametrize("preset", ["4bit", "k8v4", "k3v4", "3bit"])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
def test_code_pieces_unpack_every_format(preset, head_dim):
    """The pieces derived from reference's packers unpack random codes of keys and values exactly."""
    layout = make_layout(preset, 2, head_dim, rotation="random")
    cfg = layout.config
    gen = torch.Generator().manual_seed(head_dim)
    for values, bits in ((False, cfg.key_bits), (True, cfg.value_bits)):
        codes = torch.randint(0, 1 << bits, (50, head_dim), generator=gen)
        if values:
            packed = reference.pack_value_codes(codes, bits, value_planes(cfg, head_dim))
        else:
            packed = reference.pack_key_codes(codes, bits, key_planes(cfg, head_dim))
        got = _unpack_by_pieces(packed, code_pieces(layout, values, "cpu"))
        assert torch.equal(got, codes), f"{'values' if values else 'keys'}: {(got != codes).sum()} codes differ"


@pytest.mark.parametrize("preset,head_dim,lens,per_row_offset", [
    ("4bit", 64, [37, 53], False), ("k8v4", 64, [21], True), ("k3v4", 128, [40, 40], False),
    ("3bit", 128, [33], False), ("3bit", 64, [19, 30], True), ("4bit", 96, [25], False)])
def test_dequantize_rotated_matches_gather(preset, head_dim, lens, per_row_offset):
    """Rotated back, the dense copy equals reference.gather at every position below the length and leaves the rest
    of a larger buffer as it was."""
    options = LEVERS[preset] | ({"rotation": "random"} if head_dim == 96 else {})
    layout = make_layout(preset, 2, head_dim, **options)
    cfg = layout.config
    offset = None
    if cfg.key_centering:
        offset = torch.randn(*((len(lens),) if per_row_offset else ()), 2, head_dim, device=DEVICE)
    pool, table = fill_cache(layout, lens, key_offset=offset)
    length = min(lens)
    rot = reference.key_codec(cfg, head_dim, DEVICE)
    rot = None if rot is None else rot.rotation
    vrot = reference.value_rotation_matrix(cfg, head_dim, DEVICE)
    rotated_offset = None if offset is None else (offset @ rot.T if rot is not None else offset)
    buffers = [torch.full((len(lens), 2, length + 5, head_dim), float("nan"), device=DEVICE) for _ in range(2)]
    k, v = dequantize_rotated(pool, layout, table, length, torch.float32, rotated_offset,
                              out=tuple(b[:, :, :length] for b in buffers))
    assert all(b[:, :, length:].isnan().all() for b in buffers), "wrote past the length"
    want_k, want_v = reference.gather(pool, layout, table, offset)
    got_k = k if rot is None else k @ rot
    got_v = v if vrot is None else v @ vrot
    for name, got, want in (("keys", got_k, want_k), ("values", got_v, want_v)):
        assert not got.isnan().any(), f"{name}: unwritten positions"
        torch.testing.assert_close(got, want[:, :, :length], atol=2e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("preset,head_dim,lens,per_row_offset", [
    ("4bit", 128, [37, 70], True), ("k8v4", 64, [21], False), ("k3v4", 128, [40, 9], False), ("3bit", 64, [19], True)])
def test_dequantize_is_reference_gather(preset, head_dim, lens, per_row_offset):
    """kernels.dequantize (what ops.gather runs on CUDA) returns reference.gather's K/V, rotations undone, over a
    column slice of the block table as a cache layer passes it."""
    layout = make_layout(preset, 2, head_dim, **LEVERS[preset])
    offset = None
    if layout.config.key_centering:
        offset = torch.randn(*((len(lens),) if per_row_offset else ()), 2, head_dim, device=DEVICE)
    pool, table = fill_cache(layout, lens, key_offset=offset)
    used = table[:, : -(-max(lens) // layout.block_size)]
    k, v = dequantize(pool, layout, used, offset)
    want_k, want_v = reference.gather(pool, layout, used, offset)
    for name, got, want in (("keys", k, want_k), ("values", v, want_v)):
        assert got.shape == want.shape and got.dtype == torch.float32, (name, got.shape, got.dtype)
        for row, n in enumerate(lens):  # (slots past a row's length hold whatever the pool holds)
            torch.testing.assert_close(got[row, :, :n], want[row, :, :n], atol=2e-5, rtol=1e-5,
                                       msg=lambda m: f"{name}, row {row}: {m}")
    if offset is not None:
        with pytest.raises(ValueError, match="key_offset must be"):
            dequantize(pool, layout, used, offset[..., :-1])


def _check(preset, head_dim, rows, length, q_len, group, dtype, prefix_len=0, recent=None, per_row_offset=False,
           ring_records=False):
    """dense_history_attention vs reference.paged_attention; the pool poisoned where exact buffers serve."""
    layout = make_layout(preset, 2, head_dim, **LEVERS[preset])
    offset = None
    if layout.config.key_centering:
        shape = (rows, 2, head_dim) if per_row_offset else (2, head_dim)
        offset = torch.randn(shape, device=DEVICE)
    lens = [length] * rows
    pool, table = fill_cache(layout, lens, key_offset=offset)
    kw = poisoned_exact_buffers(pool, layout, table, lens, [0] * rows, prefix_len, recent, dtype, DEVICE,
                                ring_records=ring_records)
    query = torch.randn(rows, 2 * group, q_len, head_dim, device=DEVICE).to(dtype)
    seq_lens = torch.tensor(lens, device=DEVICE)
    scale = default_scale(head_dim)
    want = reference.paged_attention(query.float(), pool, layout, table, seq_lens, scale, key_offset=offset, **kw)
    out = torch.full_like(query, float("nan"))
    got = dense_history_attention(query, pool, layout, table, seq_lens, scale, length, out=out, key_offset=offset, **kw)
    assert got is out
    # K/V, the rotation matrices and the rotated query are rounded to the query's dtype before the products (the
    # unified kernel keeps fp32 there): three roundings of that dtype besides the output's; on CUDA flash / cuDNN
    # attention round the probabilities to fp16 / bf16 before the values' product, a fourth (4bit, D=64, 20 bf16
    # queries on an H100: 8.6e-3 against three roundings' 7.7e-3)
    roundings = 4 if query.is_cuda and dtype in (torch.float16, torch.bfloat16) else 3
    err, tol = rel_error(got, want), roundings * attention_tolerance(dtype, want)
    assert err <= tol, f"relative error {err:.3e} > {tol:.3e} ({preset}, D={head_dim}, Lq={q_len}, {dtype})"


@pytest.mark.parametrize("preset,head_dim,rows,length,q_len,group,dtype,prefix_len,recent", [
    ("4bit", 64, 2, 70, 20, 3, torch.float32, 4, (40, 3)),
    ("k8v4", 64, 1, 45, 45, 2, torch.float32, 0, None),  # a first prefill: the queries are the whole history
    ("k3v4", 128, 2, 50, 9, 1, torch.bfloat16, 2, (30, 0)),
    ("3bit", 128, 1, 36, 12, 4, torch.float16, 0, (50, 0)),  # a ring longer than the history
])
def test_dense_history_matches_reference(preset, head_dim, rows, length, q_len, group, dtype, prefix_len, recent):
    _check(preset, head_dim, rows, length, q_len, group, dtype, prefix_len, recent)


def test_history_rotated_back_where_it_has_fewer_rows_than_the_queries(monkeypatch):
    """A forward whose query rows outnumber the history's (Hq x Lq > Hk x length: a compressed prefill) rotates the
    dense copy back instead of rotating the queries and outputs; both ways match the reference."""
    seen = []
    real = history.rotates_history
    monkeypatch.setattr(history, "rotates_history", lambda *a: seen.append(real(*a)) or seen[-1])
    _check("4bit", 64, 2, 40, 40, 3, torch.float16, 4, (24, 0))  # 6 x 40 query rows against 2 x 40
    _check("k3v4", 128, 1, 30, 30, 2, torch.bfloat16, 2, (16, 0))  # value rotation only
    _check("4bit", 64, 2, 50, 30, 2, torch.float32, 3, (20, 0), per_row_offset=True)
    _check("4bit", 64, 2, 70, 20, 3, torch.float32, 4, (40, 3))  # 6 x 20 query rows against 2 x 70: queries rotated
    # the ring as int8 records (the codebook presets' default; a compressed prefill reads the layer's ring), the keys
    # less the unrotated mean: both ways
    _check("4bit", 64, 2, 40, 40, 3, torch.float16, 4, (24, 0), per_row_offset=True, ring_records=True)
    _check("4bit", 64, 1, 70, 20, 3, torch.bfloat16, 0, (40, 3), ring_records=True)
    assert seen == [True, True, True, False, True, False]


@pytest.mark.parametrize("groups", [1, 3])
def test_without_an_out_buffer_the_result_is_the_same(groups, monkeypatch):
    """No `out`: the attention's own output (rotated back) is returned, or with rows in several groups a new buffer;
    the same values as into a given buffer, and every row written."""
    if groups > 1:
        monkeypatch.setattr(history, "DENSE_HISTORY_BYTES", 2 * 2 * 40 * 64 * 2)  # one row of 40 positions, fp16
    layout = make_layout("4bit", 2, 64, **LEVERS["4bit"])
    pool, table = fill_cache(layout, [40] * 3, key_offset=torch.zeros(2, 64, device=DEVICE))
    seq = torch.full((3,), 40, device=DEVICE)
    for q_len in (12, 40):  # queries rotated, then the history rotated back
        query = torch.randn(3, 4, q_len, 64, device=DEVICE, dtype=torch.float16)
        buffer = torch.full_like(query, float("nan"))
        kw = dict(key_offset=torch.zeros(2, 64, device=DEVICE))
        into = dense_history_attention(query, pool, layout, table, seq, 0.125, 40, out=buffer, **kw)
        fresh = dense_history_attention(query, pool, layout, table, seq, 0.125, 40, **kw)
        assert into is buffer and fresh.shape == query.shape and fresh.dtype == query.dtype
        assert torch.isfinite(fresh).all()
        torch.testing.assert_close(fresh, into, atol=1e-3, rtol=1e-3)  # (a GPU may pick another matmul algorithm)


def test_rows_in_groups_and_per_row_means(monkeypatch):
    """Rows beyond the dense budget go in later groups, each with its own centering means."""
    monkeypatch.setattr(history, "DENSE_HISTORY_BYTES", 2 * 2 * 40 * 64 * 4)  # one row of 40 positions, fp32
    _check("4bit", 64, 3, 40, 10, 2, torch.float32, prefix_len=3, recent=(16, 0), per_row_offset=True)


@pytest.mark.parametrize("preset,head_dim,dtype,prefix_len,recent,records,in_kernel", [
    ("4bit", 128, torch.float16, 4, (40, 3), False, True),  # rotated keys and values (both levers), ring from 3
    ("k3v4", 128, torch.bfloat16, 2, (30, 0), False, True),  # 3-bit key planes, value rotation
    ("k8v4", 64, torch.float32, 3, (16, 0), False, True),  # FP8 keys: values rotated only where the lever is on
    ("3bit", 128, torch.float16, 0, (50, 0), False, True),  # a ring longer than the history, no prefix
    ("4bit", 64, torch.float16, 4, (24, 0), True, False),  # int8 ring records: decoded and overlaid in torch
])
def test_exact_tokens_overlaid_by_the_dequantization(preset, head_dim, dtype, prefix_len, recent, records, in_kernel,
                                                     monkeypatch):
    """The ring's and the prefix's exact tokens reach the dense history through the dequantization launch (rotated
    there, no torch copies) wherever they are in the output dtype, else through torch; either way the attention is
    reference.paged_attention's with the pool poisoned where they serve."""
    copies = []
    monkeypatch.setattr(history, "_copy_ring", lambda *a: copies.append(a) or _COPY_RING(*a))
    _check(preset, head_dim, 2, 70, 20, 2, dtype, prefix_len, recent, ring_records=records)
    assert bool(copies) != in_kernel


_COPY_RING = history._copy_ring


def test_one_sdpa_call_where_the_history_is_not_split(monkeypatch):
    """The route a GPU takes for forwards too few to fill it: one SDPA call with the causal mask at the bottom right."""
    monkeypatch.setattr(history, "splits_history", lambda *a: False)
    _check("4bit", 64, 2, 70, 20, 3, torch.float32, 4, (40, 3))
    _check("3bit", 128, 1, 36, 12, 4, torch.float16, 0, (50, 0))


@pytest.mark.parametrize("dtype,group,q_len,length", [(torch.float32, 1, 7, 40), (torch.float32, 4, 16, 16 + 33),
                                                      (torch.bfloat16, 3, 5, 64)])
def test_history_and_own_tokens_merge_to_one_causal_attention(dtype, group, q_len, length):
    """The split route (the history over stacked query rows, the own tokens causally, merged by log-sum-exp)
    equals one fp32 softmax over every position up to each query's own, also with scores of a few hundred,
    where an unshifted exp would overflow."""
    gen = torch.Generator(device=DEVICE).manual_seed(q_len)
    q = torch.randn(2, 2 * group, q_len, 32, device=DEVICE, generator=gen) * 20
    k, v = (torch.randn(2, 2, length, 32, device=DEVICE, generator=gen) for _ in range(2))
    q, k, v = (x.to(dtype) for x in (q, k, v))
    allowed = torch.arange(length, device=DEVICE)[None] <= torch.arange(q_len, device=DEVICE)[:, None] + length - q_len
    scores = q.float() @ k.float().repeat_interleave(group, 1).transpose(-1, -2) * 0.3
    want = scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v.float().repeat_interleave(group, 1)
    assert scores.abs().max() > 100
    got = history._attend_history_and_own(q, k, v, 0.3)
    assert got.dtype == dtype
    assert rel_error(got, want) <= 2 * attention_tolerance(dtype, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rotate", [False, True])
def test_merge_launch_is_the_softmax_over_both_pieces(dtype, rotate):
    """lse_merge.merge_attention against fp32 math: the rows' two outputs weighted by their log-sum-exps' softmax,
    times Rv, written into a [B, Lq, Hq, D] buffer seen as [B, Hq, Lq, D] (NaN where nothing is written), log-sum-
    exps far apart included; within one rounding of the dtype per product."""
    gen = torch.Generator(device=DEVICE).manual_seed(7)
    b, hk, g, lq, d = 2, 2, 3, 21, 64
    o_hist = torch.randn(b * hk, g * lq, d, device=DEVICE, generator=gen).to(dtype)
    o_own = torch.randn(b, hk * g, lq, d, device=DEVICE, generator=gen).to(dtype)
    lse_hist = torch.randn(b * hk, g * lq, device=DEVICE, generator=gen) * 30  # shares from ~0 to ~1
    lse_own = torch.randn(b, hk * g, lq, device=DEVICE, generator=gen) * 30
    rotation = torch.linalg.qr(torch.randn(d, d, device=DEVICE, generator=gen))[0] if rotate else None
    rotation = rotation.to(dtype).contiguous() if rotate else None
    dst = torch.full((b, lq, hk * g, d), float("nan"), device=DEVICE, dtype=dtype).transpose(1, 2)
    got = merge_attention(o_hist, lse_hist, o_own, lse_own, rotation, dst)
    share = torch.sigmoid(lse_hist.view(b, hk * g, lq, 1) - lse_own[..., None])
    want = o_own.float() + share * (o_hist.view(b, hk * g, lq, d).float() - o_own.float())
    if rotate:
        want = want @ rotation.float()
    assert got is dst and torch.isfinite(got).all()
    assert rel_error(got, want) <= 2 * attention_tolerance(dtype, want), rel_error(got, want)


def test_split_route_merges_in_one_launch(monkeypatch):
    """Each group of rows on the split route merges its two attentions (and rotates them by Rv) in one launch."""
    calls = []
    monkeypatch.setattr(history, "merge_attention", lambda *a: calls.append(a[4] is not None) or _MERGE(*a))
    # (a GPU splits only forwards that fill it, and in 16-bit dtypes: the route is forced here)
    monkeypatch.setattr(history, "splits_history", lambda q, *a: True)
    _check("4bit", 64, 2, 70, 20, 3, torch.float16, 4, (40, 3))  # value rotation on
    assert calls == [True]


_MERGE = history.merge_attention


def test_refused_cudnn_warns_once_and_takes_one_sdpa_call(monkeypatch):
    """Where the history's attention raises (cuDNN without support for the shape), the forward warns once and is
    answered by one SDPA call, correctly; later forwards of that dtype and head size go there without trying."""
    monkeypatch.setattr(history, "_CUDNN_REFUSED", set())
    calls = []

    def refuse(*args, causal, **kwargs):
        calls.append(causal)
        raise RuntimeError("cuDNN Frontend error: no valid execution plans")

    monkeypatch.setattr(history, "_attention_lse", refuse)
    monkeypatch.setattr(history, "splits_history", lambda *a: True)
    with pytest.warns(UserWarning, match="cuDNN attention refused"):
        _check("k8v4", 64, 1, 45, 12, 2, torch.float32, 0, None)
    assert calls == [False]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _check("k8v4", 64, 1, 45, 12, 2, torch.float32, 0, None)
    assert calls == [False]


def test_dense_history_serves_only_what_it_can():
    layout = make_layout("4bit", 2, 64, **LEVERS["4bit"])
    length = 8192
    # query rows x positions at the 4-bit threshold: 2 query heads per KV head
    lq = -(-history.DENSE_HISTORY_MIN_WORK // (2 * length))
    assert lq <= length
    q = torch.zeros(1, 4, lq, 64, dtype=torch.float16)
    assert dense_history_serves(q, layout, length)
    assert not dense_history_serves(q[:, :, 1:], layout, length), "less work: the unified kernel"
    assert dense_history_serves(q[:, :, 1:], layout, 2 * length), "a longer history: more work"
    assert dense_history_serves(torch.cat([q[:, :, : lq // 2 + 1]] * 2), layout, length), "work summed over rows"
    thresholds = {"3bit": history.DENSE_HISTORY_MIN_WORK_3BIT, "k3v4": history.DENSE_HISTORY_MIN_WORK_3BIT_KEYS,
                  "k8v4": history.DENSE_HISTORY_MIN_WORK_FP8_KEYS, "4bit": history.DENSE_HISTORY_MIN_WORK}
    for preset, work in thresholds.items():
        other = make_layout(preset, 2, 64)
        assert history.dense_history_min_work(other) == work, preset
        assert dense_history_serves(q[:, :, : -(-work // (2 * length))], other, length), preset
        assert not dense_history_serves(q[:, :, : work // (2 * length) - 1], other, length), preset
    assert not dense_history_serves(q, layout, None), "no common length"
    assert not dense_history_serves(q.float(), layout, length), "float32: no flash attention"
    assert not dense_history_serves(q[..., :12], layout, length), "head_dim not a multiple of 8"
    for name, value in (("kv_start", torch.zeros(1)), ("sliding_window", 64), ("softcap", 30.0),
                        ("sinks", torch.zeros(4))):
        assert not dense_history_serves(q, layout, length, **{name: value}), name
    assert not dense_history_serves(q, layout, history.DENSE_HISTORY_BYTES), "one row over the budget"


def test_bad_length_is_refused():
    layout = make_layout("4bit", 2, 64)
    pool, table = fill_cache(layout, [20])
    q = torch.randn(1, 2, 4, 64, device=DEVICE)
    seq = torch.tensor([20], device=DEVICE)
    for length in (3, table.shape[1] * layout.block_size + 1, 20.0):
        with pytest.raises(ValueError, match="length must be"):
            dense_history_attention(q, pool, layout, table, seq, 0.125, length)


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["4bit", "k8v4", "k3v4", "3bit"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 8])
def test_paged_attention_takes_the_dense_route_on_cuda(preset, dtype, rows, monkeypatch):
    """ops.paged_attention with a common length and many queries goes the dense route, at head_dim 128, an odd
    length and the levers, within tolerance of the reference and of the unified kernel: on an H100 or H200 one SDPA
    call for one row of 300 queries, the history apart (cuDNN, not refused) for 8 rows."""
    taken, split = [], []
    real, real_split = history.dense_history_attention, history.splits_history
    monkeypatch.setattr("tq_hf.kernels.dense_history_attention", lambda *a, **k: taken.append(1) or real(*a, **k))
    monkeypatch.setattr(history, "splits_history", lambda *a: split.append(real_split(*a)) or split[-1])
    monkeypatch.setattr(history, "_CUDNN_REFUSED", set())
    layout = make_layout(preset, 8, 128, block_size=64, **LEVERS[preset])
    length = 3001
    q_len = max(300, -(-history.dense_history_min_work(layout) // (rows * 4 * length)))
    offset = torch.randn(8, 128, device="cuda") if layout.config.key_centering else None
    pool, table = fill_cache(layout, [length] * rows, "cuda", key_offset=offset)
    kw = poisoned_exact_buffers(pool, layout, table, [length] * rows, [0] * rows, 4, (128 + q_len, 0), dtype, "cuda")
    query = torch.randn(rows, 32, q_len, 128, device="cuda").to(dtype)
    seq = torch.full((rows,), length, device="cuda", dtype=torch.int32)
    scale = default_scale(128)
    want = reference.paged_attention(query.float(), pool, layout, table, seq, scale, key_offset=offset, **kw)
    got = ops.paged_attention(query, pool, layout, table, seq, scale, key_offset=offset, length=length, **kw)
    unified = ops.paged_attention(query, pool, layout, table, seq, scale, key_offset=offset, **kw)
    assert taken == [1]
    tiles = rows * 8 * -(-4 * q_len // 128)  # 128-row tiles of 4 x q_len stacked query rows per KV head
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert split == [tiles >= history.SPLIT_HISTORY_TILES_PER_SM * sms]
    assert not history._CUDNN_REFUSED
    assert rel_error(got, want) <= 3 * attention_tolerance(dtype, want)  # as in _check
    assert rel_error(unified, want) <= attention_tolerance(dtype, want)


def test_strided_out_and_large_activations():
    """The attention function's out (a [B, Lq, Hq, D] buffer seen as [B, Hq, Lq, D]) is written in place; fp16
    keys whose rotated coordinates pass fp16's range saturate there instead of turning into inf/NaN."""
    layout = make_layout("4bit", 2, 64, **LEVERS["4bit"])
    pool, table = fill_cache(layout, [40])
    k = torch.full((40, 2, 64), 6e4, device=DEVICE)  # every coordinate near fp16's largest: rotated, 8x beyond it
    slots = table[0].long()[torch.arange(40, device=DEVICE) // 16] * 16 + torch.arange(40, device=DEVICE) % 16
    reference.store(pool, layout, k, torch.randn_like(k), slots, key_offset=torch.zeros(2, 64, device=DEVICE))
    buffer = torch.full((1, 12, 4, 64), float("nan"), device=DEVICE, dtype=torch.float16)
    query = torch.randn(1, 4, 12, 64, device=DEVICE, dtype=torch.float16) * 1e-3
    got = dense_history_attention(query, pool, layout, table, torch.tensor([40], device=DEVICE), 0.125, 40,
                                  out=buffer.transpose(1, 2), key_offset=torch.zeros(2, 64, device=DEVICE))
    assert got.data_ptr() == buffer.data_ptr() and torch.isfinite(buffer).all()
    # a compressed prefill's shape (every position a query): the dense copy is rotated back, and saturates too
    query = torch.randn(1, 4, 40, 64, device=DEVICE, dtype=torch.float16) * 1e-3
    assert history.rotates_history(query, layout, 40)
    got = dense_history_attention(query, pool, layout, table, torch.tensor([40], device=DEVICE), 0.125, 40,
                                  key_offset=torch.zeros(2, 64, device=DEVICE))
    assert torch.isfinite(got).all()


def test_no_room_for_the_dense_copy_falls_back_to_the_unified_kernel(monkeypatch):
    """ops.paged_attention: when the transient dense copy cannot be allocated the unified kernel answers."""
    from tq_hf import kernels

    layout = make_layout("k8v4", 2, 64, **LEVERS["k8v4"])
    pool, table = fill_cache(layout, [300])
    q = torch.randn(1, 4, 160, 64, device=DEVICE, dtype=torch.float16)
    seq = torch.tensor([300], device=DEVICE)
    monkeypatch.setattr(history, "prefers_dense_route", lambda *a: True)
    calls = []

    def no_room(*args, **kwargs):
        calls.append("dense")
        raise torch.OutOfMemoryError("no room")

    monkeypatch.setattr(ops, "use_kernels", lambda t: True)
    monkeypatch.setattr(kernels, "dense_history_attention", no_room)
    monkeypatch.setattr(kernels, "unified_attention", lambda *a, **k: calls.append("unified") or "unified result")
    assert ops.paged_attention(q, pool, layout, table, seq, 0.125, length=300) == "unified result"
    assert calls == ["dense", "unified"]


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["4bit", "k3v4"])
def test_dequantize_plan_relaunched_across_lengths_gpu(preset, monkeypatch):
    """One dequantization plan launched directly at several lengths (chunks of a prefill, a chat's turns) writes
    each length's positions as reference.gather has them, and nothing past them; lengths Triton compiles otherwise
    (divisible by 16, 1) in plans of their own."""
    dequantize_module = importlib.import_module("tq_hf.kernels.dequantize")  # (the package exports a function so named)
    monkeypatch.setattr(dequantize_module, "_PLANS", PlanCache())
    layout = make_layout(preset, 2, 128, **LEVERS[preset])
    offset = torch.randn(2, 128, device="cuda") if layout.config.key_centering else None
    pool, table = fill_cache(layout, [300, 300], "cuda", key_offset=offset)
    rot = reference.key_codec(layout.config, 128, "cuda")
    rot = None if rot is None else rot.rotation
    vrot = reference.value_rotation_matrix(layout.config, 128, "cuda")
    rotated = None if offset is None else offset @ rot.T
    want_k, want_v = reference.gather(pool, layout, table, offset)
    for length in (37, 45, 211, 48, 1, 299, 53):
        buffers = [torch.full((2, 2, length + 3, 128), float("nan"), device="cuda") for _ in range(2)]
        k, v = dequantize_rotated(pool, layout, table, length, torch.float32, rotated,
                                  out=tuple(b[:, :, :length] for b in buffers))
        assert all(b[:, :, length:].isnan().all() for b in buffers), f"length {length}: wrote past it"
        for name, got, want in (("keys", k if rot is None else k @ rot, want_k),
                                ("values", v if vrot is None else v @ vrot, want_v)):
            torch.testing.assert_close(got, want[:, :, :length], atol=2e-5, rtol=1e-5,
                                       msg=lambda m: f"{name} at length {length}: {m}")
    assert len(dequantize_module._PLANS) == 3, "one plan per kind of length: not divisible by 16, divisible, 1"
