"""LaunchConfig / StoreLaunchConfig validation, DeviceTraits, and how both key the launch plans (plans only:
nothing is launched)."""

from __future__ import annotations

import pytest
import torch

from tq_hf.kernels import DeviceTraits, LaunchConfig, StoreLaunchConfig, device_traits, plan_attention
from tq_hf.kernels import attention as attention_kernel, fast_launch
from tq_hf.kernels.decode_warps import _warp_kernel
from tq_hf.kernels.device import H200, INTERPRETER
from tq_hf.kernels.unified import _attn_kernel

from kernel_helpers import make_layout, recent_ring


@pytest.mark.parametrize("kwargs,error,match", [
    ({"block_n": 48}, ValueError, "LaunchConfig.block_n must be a power of two >= 16, got 48"),
    ({"block_m": 8}, ValueError, "LaunchConfig.block_m must be a power of two >= 16, got 8"),
    ({"num_warps": 3}, ValueError, "LaunchConfig.num_warps must be 1, 2, 4, 8 or 16, got 3"),
    ({"num_stages": 0}, ValueError, "LaunchConfig.num_stages must be an int >= 1, got 0"),
    ({"maxnreg": 300}, ValueError, "LaunchConfig.maxnreg must be 0 \\(no cap\\) or 24 to 255 registers, got 300"),
    ({"head_pairs": 4}, ValueError, "LaunchConfig.head_pairs must be 1 or 2, got 4"),
    ({"ring_n": 24}, ValueError, "LaunchConfig.ring_n must be 16, 32, 64 or 128 tokens, got 24"),
    ({"key_lut": 1}, TypeError, "LaunchConfig.key_lut must be True, False or None, got 1"),
    ({"block_n": 64.0}, TypeError, "LaunchConfig.block_n must be an int or None, got 64.0"),
])
def test_launch_config_refuses_bad_values(kwargs, error, match):
    with pytest.raises(error, match=match):
        LaunchConfig(**kwargs)


def test_store_launch_config_refuses_bad_values():
    with pytest.raises(ValueError, match="StoreLaunchConfig.block_t must be a power of two >= 16, got 24"):
        StoreLaunchConfig(block_t=24)
    with pytest.raises(TypeError, match="StoreLaunchConfig.num_warps must be an int or None"):
        StoreLaunchConfig(num_warps="8")
    with pytest.raises(TypeError, match="StoreLaunchConfig.ring_part must be True, False or None, got 1"):
        StoreLaunchConfig(ring_part=1)


def test_launch_config_overrides():
    assert not LaunchConfig().overrides()
    assert LaunchConfig(warp_split=False).overrides() and LaunchConfig(maxnreg=0).overrides()


def test_device_traits_refuse_bad_values_and_read_the_cpu_as_the_interpreter():
    with pytest.raises(ValueError, match="num_sms must be a positive int, got 0"):
        DeviceTraits(num_sms=0, runs_ptx=True, tuned_for_gpu=True)
    with pytest.raises(TypeError, match="runs_ptx must be a bool"):
        DeviceTraits(num_sms=132, runs_ptx=1, tuned_for_gpu=True)
    assert device_traits(torch.device("cpu")) == INTERPRETER
    assert INTERPRETER == DeviceTraits(num_sms=4, runs_ptx=False, tuned_for_gpu=False)


def _decode_args(layout, batch: int = 16):
    table = torch.zeros(batch, 32768 // layout.block_size, dtype=torch.int32)
    q = torch.randn(batch, 4 * layout.num_kv_heads, 1, layout.head_dim, dtype=torch.float16)
    return q, layout.allocate(1, "cpu"), layout, table, torch.full((batch,), 32768), 0.088


def test_plans_are_keyed_on_the_traits_and_launch_values(monkeypatch):
    """Equal DeviceTraits / LaunchConfig values share a plan; other values make their own (a plan made for an H200
    on CPU tensors is never taken by a call that plans for the interpreter)."""
    monkeypatch.setattr(attention_kernel, "_PLANS", fast_launch.PlanCache())
    args = _decode_args(make_layout("4bit", 8, 128))
    h200 = plan_attention(*args, max_seq_len=32768, device_traits=H200)
    assert plan_attention(*args, max_seq_len=32768, device_traits=DeviceTraits(132, True, True)) is h200
    local = plan_attention(*args, max_seq_len=32768)
    assert local is not h200 and local is plan_attention(*args, max_seq_len=32768, device_traits=INTERPRETER)
    assert (h200.kernel, local.kernel) == (_warp_kernel, _attn_kernel)  # the H200 takes the one-warp kernel there
    unified = plan_attention(*args, max_seq_len=32768, device_traits=H200, launch=LaunchConfig(warp_split=False))
    assert unified is not h200 and unified.kernel is _attn_kernel
    assert plan_attention(*args, max_seq_len=32768, device_traits=H200,
                          launch=LaunchConfig(warp_split=False)) is unified
    assert len(attention_kernel._PLANS) == 3


def test_split_counts_follow_the_sm_count():
    """The traits' SM count sizes the split count (FP8 keys, 32 programs: 4 waves of the SMs, a power of two)."""
    layout = make_layout("k8v4", 8, 128)
    splits = [plan_attention(*_decode_args(layout, 4), max_seq_len=32768,
                             device_traits=DeviceTraits(num_sms=sms, runs_ptx=True, tuned_for_gpu=True)).grid[0]
              for sms in (33, 132)]
    assert splits == [4, 16]


def test_launch_arguments_of_the_wrong_type_are_refused():
    args = _decode_args(make_layout("4bit", 2, 64), 1)
    with pytest.raises(TypeError, match="launch must be a tq_hf.kernels.LaunchConfig or None, got dict"):
        plan_attention(*args, launch={"block_n": 64})
    with pytest.raises(TypeError, match="device_traits must be a tq_hf.kernels.DeviceTraits or None, got str"):
        plan_attention(*args, device_traits="h200")


@pytest.mark.parametrize("preset,records", [("k8v4", False), ("4bit", True), ("3bit", True)])
@pytest.mark.parametrize("batch,kv_heads,spread_default", [(1, 4, False), (1, 16, True), (4, 4, True)])
def test_head_dim_256_ring_tiles_spread_from_16_rows(preset, records, batch, kv_heads, spread_default):
    """At head_dim 256 an H200's split decode shares the ring's tiles out over its programs once 16 (sequence, KV
    head) rows share the GPU; below, the exact program keeps them (a 32-token record tile there costs a pool tile's
    instructions, and the splits that took one outlasted the rest). An override decides either way."""
    layout = make_layout(preset, kv_heads, 256)
    ring = torch.zeros((batch, kv_heads, 128, 288 if records else 256),
                       dtype=torch.int8 if records else torch.float16)
    args = _decode_args(layout, batch)
    for launch, spread in ((None, spread_default), (LaunchConfig(ring_spread=not spread_default), not spread_default)):
        plan = plan_attention(*args, max_seq_len=32768, device_traits=H200, recent_keys=ring, recent_values=ring,
                              launch=launch)
        assert plan.split and plan.constants["EXACT_PROG"]
        assert plan.constants["RING_SPREAD"] is spread, (launch, plan.constants["RING_SPREAD"])


@pytest.mark.parametrize("preset,records", [("k8v4", False), ("3bit", True)])
def test_ring_tiles_spread_over_the_splits_by_default(preset, records):
    """An H200's split decode shares the ring's tiles out over its programs: int8 records at every batch (16-token
    tiles at B=1), an exact ring while the batch leaves SMs free (B=1), not once it fills them (B=16); an override
    decides either way. (4-bit words and k3v4's key planes in head pairs at B=1 give the ring programs of their own,
    below.)"""
    layout = make_layout(preset, 8, 128)
    spread, tiles = {}, {}
    for batch in (1, 16):
        shape = (batch, 8, 128, 144 if records else 128)
        ring = torch.zeros(shape, dtype=torch.int8 if records else torch.float16)
        args = _decode_args(layout, batch)
        plan = plan_attention(*args, max_seq_len=32768, device_traits=H200, recent_keys=ring, recent_values=ring)
        assert plan.split
        spread[batch] = plan.constants["RING_SPREAD"]
        tiles[batch] = plan.constants["RING_TILE"]
        forced = plan_attention(*args, max_seq_len=32768, device_traits=H200, recent_keys=ring, recent_values=ring,
                                launch=LaunchConfig(ring_spread=not spread[batch]))
        assert forced.constants["RING_SPREAD"] is (not spread[batch])
    assert spread == {1: True, 16: records}
    if records:  # 16-token record tiles while the batch leaves SMs free, 32 once it fills them
        assert tiles == {1: 16, 16: 32}


@pytest.mark.parametrize("batch,kv_len,splits,per_sm", [
    (1, 2048, 16, 1),  # one split per 128-token tile
    (1, 16384, 29, 1), (1, 32768, 62, 2), (2, 2048, 12, 1), (2, 32768, 29, 2),
    (4, 32768, None, None),  # 32 (row, KV head) pairs: the spread ring
])
def test_four_bit_words_give_the_ring_programs_of_their_own(batch, kv_len, splits, per_sm):
    """An H200's split decode of 4-bit words in head pairs with int8 ring records, up to 2 x 8 KV heads, gives each
    32-token ring tile an exact program of its own beside splits for one wave of 1 program per SM while they walk
    <= 1,024 tokens each, of 2 past that; larger batches and explicit splits, ring tiles or ring_programs=False keep
    the spread ring."""
    layout = make_layout("4bit", 8, 128)
    ring = torch.zeros(batch, 8, 128, 144, dtype=torch.int8)
    args = _decode_args(layout, batch)
    kwargs = dict(max_seq_len=kv_len, device_traits=H200, recent_keys=ring, recent_values=ring)
    plan = plan_attention(*args, **kwargs)
    apart = (plan.constants["RING_PROGRAMS"], plan.constants["EXACT_PROG"], plan.constants["RING_TILE"],
             plan.constants["RING_SPREAD"])
    if splits is None:
        assert apart[0] is False and apart[3] is True, apart
        return
    assert apart == (True, 4, 32, False) and plan.grid[0] == splits + 4, (apart, plan.grid)
    programs = plan.grid[0] * plan.grid[1] * plan.grid[2]
    assert per_sm * 132 - 2 * batch * 4 < programs <= per_sm * 132 or splits == kv_len // 128, programs
    for launch in (LaunchConfig(ring_programs=False), LaunchConfig(ring_n=16)):
        spread = plan_attention(*args, **kwargs, launch=launch)
        assert spread.constants["RING_PROGRAMS"] is False and spread.constants["RING_SPREAD"] is True
    assert plan_attention(*args, **kwargs, num_splits=8).constants["RING_PROGRAMS"] is False


@pytest.mark.parametrize("batch,splits,exact_programs", [(1, 62, 4), (2, 32, 1), (4, 16, 1), (16, 4, 0)])
def test_k3v4_key_planes_pair_heads_where_measured_faster(batch, splits, exact_programs):
    """k3v4 with its levers on an H200 (3-bit key planes, 4-bit value words, int8 ring records) pairs two KV heads
    per program in decode at head_dim 128, uncapped, 3 stages, 128-token tiles; at B=1 the ring's 32-token tiles
    in programs of their own beside 62 splits (from B=2 one exact program per pair until the batch fills the GPU).
    3bit (value planes), the plain format, head_dim 64, the interpreter and a LaunchConfig of one head, metadata
    pairs or 32-row tiles keep one head per program."""
    def plan_of(preset="k3v4", head_dim=128, traits=H200, levers=True, **kw):
        layout = make_layout(preset, 8, head_dim, key_centering=levers, value_rotation=levers)
        ring = torch.zeros(batch, 8, 128, head_dim + 16, dtype=torch.int8)
        q, *rest = _decode_args(layout, batch)
        exact = dict(key_offset=torch.zeros(batch, 8, head_dim), recent_keys=ring, recent_values=ring) if levers else {}
        return plan_attention(q, *rest, max_seq_len=32768, device_traits=traits, **exact, **kw)

    plan = plan_of()
    c = plan.constants
    assert (c["HEADS_PER_PROGRAM"], c.get("maxnreg"), plan.num_stages, plan.block_n, c["VALUE_WORDS"]) == (
        2, None, 3, 128, True)
    assert (c["RING_PROGRAMS"], plan.grid[:2]) == (batch == 1, (splits + exact_programs, 4)), plan.grid
    for one in (plan_of("3bit"), plan_of(levers=False), plan_of(head_dim=64), plan_of(traits=INTERPRETER),
                plan_of(launch=LaunchConfig(head_pairs=1)), plan_of(launch=LaunchConfig(meta_pairs=True)),
                plan_of(launch=LaunchConfig(block_m=32))):
        assert one.constants["HEADS_PER_PROGRAM"] == 1 and not one.constants["RING_PROGRAMS"]


def test_pdl_is_asked_for_only_and_needs_sm_90():
    """Programmatic dependent launch is off by default; asked for, the attention and its split reduction carry the
    PDL constexpr and Triton's launch_pdl option; the interpreter and decode_warps' kernel refuse it with the reason."""
    args = _decode_args(make_layout("k3v4", 8, 128), 1)
    default = plan_attention(*args, max_seq_len=32768, device_traits=H200)
    assert default.constants["PDL"] is False and "launch_pdl" not in default.constants
    assert default.reduce.kwargs["PDL"] is False and "launch_pdl" not in default.reduce.kwargs
    asked = plan_attention(*args, max_seq_len=32768, device_traits=H200, launch=LaunchConfig(pdl=True))
    assert asked.split and asked.constants["PDL"] is True and asked.constants["launch_pdl"] is True
    assert asked.reduce.kwargs["PDL"] is True and asked.reduce.kwargs["launch_pdl"] is True
    with pytest.raises(ValueError, match="pdl=True needs a GPU of compute capability 9.0"):
        plan_attention(*args, max_seq_len=32768, device_traits=INTERPRETER, launch=LaunchConfig(pdl=True))
    four = _decode_args(make_layout("4bit", 8, 128), 16)
    with pytest.raises(ValueError, match="pdl=True needs the unified kernel"):
        plan_attention(*four, max_seq_len=32768, device_traits=H200, launch=LaunchConfig(pdl=True, warp_split=True))


def test_value_boundary_where_measured_faster():
    """value_boundary (16-bit operand layouts for the decoded value codes) on by default for 3-bit values in decode on
    a GPU: the planes (head_dim 128, 256) at any batch, the bit stream (head_dim 64) under a register cap only; off for
    4-bit values (measured slower) and under the interpreter; asked for, 4-bit values take it too, while the
    interpreter and 3-bit planes in 64-row tiles (the bytes path) refuse it with the reason."""
    def boundary(preset, head_dim, batch=1, traits=H200, **kw):
        args = _decode_args(make_layout(preset, 8, head_dim), batch)
        plan = plan_attention(*args, max_seq_len=32768, device_traits=traits, **kw)
        return plan.constants["VALUE_BOUNDARY"], plan.constants.get("maxnreg")

    assert boundary("3bit", 128) == (True, None) and boundary("3bit", 256, 16)[0] is True
    assert boundary("3bit", 64) == (False, None)  # uncapped: the boundary's registers would cost a program per SM
    assert boundary("3bit", 64, launch=LaunchConfig(maxnreg=128)) == (True, 128)
    for preset, head_dim in (("k3v4", 128), ("4bit", 128), ("k8v4", 64)):
        assert boundary(preset, head_dim)[0] is False
    assert boundary("3bit", 128, traits=INTERPRETER)[0] is False
    asked = LaunchConfig(value_boundary=True)
    for preset, head_dim in (("3bit", 64), ("k3v4", 64), ("4bit", 128)):
        assert boundary(preset, head_dim, launch=asked)[0] is True
    assert boundary("3bit", 128, launch=LaunchConfig(value_boundary=False))[0] is False
    args = _decode_args(make_layout("3bit", 8, 128), 1)
    q64 = torch.randn(1, 32, 16, 128, dtype=torch.float16)  # 16 queries x GQA 4: one 64-row tile
    for call_args, traits in ((args, INTERPRETER), ((q64, *args[1:]), H200)):
        with pytest.raises(ValueError, match="value_boundary=True needs decode tiles on a GPU"):
            plan_attention(*call_args, max_seq_len=32768, device_traits=traits, launch=asked)


def test_value_rotation_by_16_bit_dots_where_measured_faster():
    """An H200 rotates 4-bit values back by 16-bit dots in decode at head_dim 128 for every key format (measured faster
    or within 1%, B=1 and B=16); other head_dims, prefill tiles and the interpreter keep 3xTF32; an override decides
    either way."""
    seen = {}
    for preset, head_dim in (("4bit", 128), ("k8v4", 128), ("k3v4", 128), ("3bit", 128), ("4bit", 64)):
        layout = make_layout(preset, 8, head_dim, key_centering=True, value_rotation=True)
        args = _decode_args(layout)
        seen[preset, head_dim] = plan_attention(*args, max_seq_len=32768, device_traits=H200).constants["ROT16"]
        assert plan_attention(*args, max_seq_len=32768).constants["ROT16"] is False
        forced = plan_attention(*args, max_seq_len=32768, launch=LaunchConfig(rotation_16bit=True))
        assert forced.constants["ROT16"] is True
    assert seen == {("4bit", 128): True, ("k8v4", 128): True, ("k3v4", 128): True, ("3bit", 128): True,
                    ("4bit", 64): False}
    layout = make_layout("4bit", 8, 128, key_centering=True, value_rotation=True)
    q, *rest = _decode_args(layout, 1)
    prefill = plan_attention(q.expand(-1, -1, 64, -1).contiguous(), *rest, max_seq_len=32768, device_traits=H200)
    assert prefill.constants["ROT16"] is False  # 64-row prefill tiles: unmeasured, 3xTF32
    plain = make_layout("4bit", 8, 128)  # no value rotation: nothing to rotate back
    assert plan_attention(*_decode_args(plain, 1), max_seq_len=32768, device_traits=H200).constants["ROT16"] is False


def test_query_butterfly_where_measured_faster():
    """An H200 rotates the query of 3-bit key planes once (query_butterfly) in decode and verification tiles while the
    batch leaves SMs free (measured faster at B=1, one and 8 queries), not once it fills them (B=16), nor for other
    key formats, head_dims or the interpreter; an override turns it off. At head_dim 256 (3-bit planes, 4-bit keys;
    two butterflies) at every batch (measured faster at B=1 and 16)."""
    seen = {}
    for preset, head_dim, batch, q_len in (("k3v4", 128, 1, 1), ("3bit", 128, 1, 1), ("3bit", 128, 1, 8),
                                           ("k3v4", 128, 16, 1), ("4bit", 128, 1, 1), ("3bit", 64, 1, 1),
                                           ("k3v4", 256, 1, 1), ("4bit", 256, 1, 1), ("3bit", 256, 16, 1),
                                           ("4bit", 256, 16, 1), ("k8v4", 256, 1, 1)):
        layout = make_layout(preset, 8, head_dim, key_centering=True, value_rotation=True)
        q, *rest = _decode_args(layout, batch)
        q = q.expand(-1, -1, q_len, -1).contiguous()
        plan = plan_attention(q, *rest, max_seq_len=32768, device_traits=H200)
        seen[preset, head_dim, batch, q_len] = plan.constants["QUERY_BUTTERFLY"]
        assert plan_attention(q, *rest, max_seq_len=32768).constants["QUERY_BUTTERFLY"] is False
        if plan.constants["QUERY_BUTTERFLY"]:
            off = plan_attention(q, *rest, max_seq_len=32768, device_traits=H200,
                                 launch=LaunchConfig(query_butterfly=False))
            assert off.constants["QUERY_BUTTERFLY"] is False
    assert seen == {("k3v4", 128, 1, 1): True, ("3bit", 128, 1, 1): True, ("3bit", 128, 1, 8): True,
                    ("k3v4", 128, 16, 1): False, ("4bit", 128, 1, 1): False, ("3bit", 64, 1, 1): False,
                    ("k3v4", 256, 1, 1): True, ("4bit", 256, 1, 1): True, ("3bit", 256, 16, 1): True,
                    ("4bit", 256, 16, 1): True, ("k8v4", 256, 1, 1): False}


def test_value_planes_from_bytes_where_measured_faster():
    """value_planes_asm (3-bit value planes' bytes decoded by one asm) is on by default for the 3-bit value planes of
    a PTX device (VALUE_PTX 2); it leaves 4-bit values and the interpreter as they were, and turns off when asked."""
    for preset, want in (("3bit", 2), ("k3v4", 1)):
        args = _decode_args(make_layout(preset, 8, 128, key_centering=True, value_rotation=True))
        default = plan_attention(*args, max_seq_len=32768, device_traits=H200)
        off = plan_attention(*args, max_seq_len=32768, device_traits=H200, launch=LaunchConfig(value_planes_asm=False))
        interpreted = plan_attention(*args, max_seq_len=32768)
        assert (default.constants["VALUE_PTX"], off.constants["VALUE_PTX"]) == (want, 1)
        assert interpreted.constants["VALUE_PTX"] == 0


def test_planes_in_place_where_measured_faster_or_asked():
    """planes_in_place (the plane codes decoded where they sit, value_nibbles.PLANE_SCALED_ASM) is on by default
    where measured faster: head_dim 128 at any batch, 256 while the batch leaves SMs free (at B=16 no faster); off
    when asked and in the interpreter unless asked (there by integer ops, for the tests); asked where the plane codes
    are not decoded from their bytes on a GPU (4-bit values, the asm off) it is refused by name."""
    for head_dim, batch, want in ((128, 1, True), (128, 16, True), (256, 1, True), (256, 16, False)):
        args = _decode_args(make_layout("3bit", 8, head_dim, key_centering=True, value_rotation=True), batch)
        plan = plan_attention(*args, max_seq_len=32768, device_traits=H200)
        assert (plan.constants["PLANES_IN_PLACE"], plan.constants["VALUE_PTX"]) == (want, 2)
        off = plan_attention(*args, max_seq_len=32768, device_traits=H200, launch=LaunchConfig(planes_in_place=False))
        assert off.constants["PLANES_IN_PLACE"] is False
    args = _decode_args(make_layout("3bit", 8, 128, key_centering=True, value_rotation=True))
    assert plan_attention(*args, max_seq_len=32768).constants["PLANES_IN_PLACE"] is False
    interpreted = plan_attention(*args, max_seq_len=32768, launch=LaunchConfig(planes_in_place=True))
    assert (interpreted.constants["PLANES_IN_PLACE"], interpreted.constants["VALUE_PTX"]) == (True, 0)
    k3v4 = _decode_args(make_layout("k3v4", 8, 128, key_centering=True, value_rotation=True))
    for where, launch in ((k3v4, dict(device_traits=H200)), (k3v4, {}),
                          (args, dict(device_traits=H200, value_planes_asm=False))):
        asm = {"value_planes_asm": launch.pop("value_planes_asm")} if "value_planes_asm" in launch else {}
        with pytest.raises(ValueError, match="planes_in_place"):
            plan_attention(*where, max_seq_len=32768, launch=LaunchConfig(planes_in_place=True, **asm), **launch)


def test_table_registers_where_measured_faster():
    """table_registers (the key lookups' table words pinned in registers) is on by default: every codebook key
    lookup the plan builds reads the lane id (4-bit bytes and words, 3-bit planes, the 3-bit bit stream); asked
    off, none does."""
    for preset, head_dim, batch in (("4bit", 128, 16), ("4bit", 128, 1), ("k3v4", 128, 16), ("3bit", 64, 16)):
        args = _decode_args(make_layout(preset, 8, head_dim, key_centering=True, value_rotation=True), batch)
        default = plan_attention(*args, max_seq_len=32768, device_traits=H200)
        off = plan_attention(*args, max_seq_len=32768, device_traits=H200, launch=LaunchConfig(table_registers=False))
        assert off.constants["LUT_LO"] and "%laneid" not in off.constants["LUT_LO"] + off.constants["LUT_HI"]
        assert "%laneid" in default.constants["LUT_LO"], (preset, head_dim, batch)
        assert default.constants["LUT_HI"] == "" or "%laneid" in default.constants["LUT_HI"]


def test_rotation_units_with_the_16_bit_epilogue():
    """rotation_units: where the 16-bit epilogue rotates the values back (a GPU's decode at head_dim 128), the plan
    hands it Rv x sqrt(D) in fp16 (exact +-1); asked off, or with the 3xTF32 epilogue, the fp32 Rv."""
    import math
    for preset in ("4bit", "3bit"):
        layout = make_layout(preset, 8, 128, key_centering=True, value_rotation=True)
        args = _decode_args(layout)
        default = plan_attention(*args, max_seq_len=32768, device_traits=H200)
        off = plan_attention(*args, max_seq_len=32768, device_traits=H200, launch=LaunchConfig(rotation_units=False))
        tf32 = plan_attention(*args, max_seq_len=32768, device_traits=H200, launch=LaunchConfig(rotation_16bit=False))
        assert default.constants["ROT16"] and default.constants["ROT16_UNITS"], preset
        assert default.vrot.dtype == torch.float16 and set(default.vrot.unique().tolist()) == {-1.0, 1.0}
        # the entries the converting epilogue makes of fp32 Rv (rotation.unit_rotation_rows): the same operand
        assert torch.equal(default.vrot, (off.vrot * torch.tensor(128.0).sqrt()).half())
        assert torch.allclose(off.vrot.double() * math.sqrt(128), default.vrot.double(), rtol=0, atol=1e-6)
        for plan in (off, tf32):
            assert not plan.constants["ROT16_UNITS"] and plan.vrot.dtype == torch.float32


@pytest.mark.parametrize("preset,shape,batch,maxnreg", [
    ("4bit", (32, 8, 64), 16, 128), ("3bit", (32, 8, 64), 16, 128),  # 512 split programs: over 3 x 132
    ("4bit", (9, 3, 64), 16, 168), ("4bit", (9, 3, 64), 32, 168), ("3bit", (9, 3, 64), 32, None),  # 384: one wave
    ("4bit", (32, 8, 64), 8, 168), ("k3v4", (32, 8, 64), 16, None),
])
def test_head_dim_64_caps_registers_where_the_splits_overflow_a_wave(preset, shape, batch, maxnreg):
    """At head_dim 64 an H200's split decode of 4-bit code words or 3-bit keys and values (3 programs per SM
    uncapped) runs in 128 registers (4 per SM) only where its programs overflow one wave of 3 per SM; an override
    decides."""
    hq, hk, d = shape
    layout = make_layout(preset, hk, d)
    q, *rest = _decode_args(layout, batch)
    q = torch.randn(batch, hq, 1, d, dtype=torch.float16)
    plan = plan_attention(q, *rest, max_seq_len=32768, device_traits=H200)
    assert plan.constants.get("maxnreg") == maxnreg, (plan.grid, plan.constants.get("maxnreg"))
    forced = plan_attention(q, *rest, max_seq_len=32768, device_traits=H200, launch=LaunchConfig(maxnreg=200))
    assert forced.constants.get("maxnreg") == 200


@pytest.mark.parametrize("preset,batch,splits,maxnreg", [
    ("k8v4", 16, 10, 128), ("4bit", 16, 10, 128), ("3bit", 16, 10, 128),  # 48 pairs: 11 x 48 = 4 x 132
    ("k3v4", 16, 8, None),  # 3 programs per SM: the power of two
    ("k8v4", 8, 16, 128), ("3bit", 8, 16, None),  # 24 pairs (unmeasured): the power of two
])
def test_head_dim_64_exact_program_splits_fill_one_wave_of_four_programs_per_sm(preset, batch, splits, maxnreg):
    """At head_dim 64 with an exact ring, from 48 (row, KV head) pairs until the batch fills an H200, the split
    decode of FP8 keys, 4-bit code words and 3-bit keys and values takes as many splits as, with the exact program,
    fill one wave of 4 programs per SM (in 128 registers); k3v4 and smaller batches keep the power of two; an
    override decides."""
    layout = make_layout(preset, 3, 64, key_centering=True, value_rotation=True)
    table = torch.zeros(batch, 32768 // layout.block_size, dtype=torch.int32)
    ring_k, ring_v = recent_ring(layout, batch, 128, torch.float16, "cpu")
    args = (torch.randn(batch, 9, 1, 64, dtype=torch.float16), layout.allocate(1, "cpu"), layout, table,
            torch.full((batch,), 32768), 0.125)
    kwargs = dict(max_seq_len=32768, device_traits=H200, key_offset=torch.zeros(batch, 3, 64), recent_keys=ring_k,
                  recent_values=ring_v)
    plan = plan_attention(*args, **kwargs)
    assert (plan.grid, plan.constants["EXACT_PROG"], plan.constants.get("maxnreg")) == (
        (splits + 1, 3, batch), True, maxnreg)
    assert plan_attention(*args, **kwargs, num_splits=8).grid[0] == 9


@pytest.mark.parametrize("shape,batch,block_n", [
    ((9, 3, 64), 1, 128), ((32, 8, 64), 1, 128), ((9, 3, 64), 4, 256), ((9, 3, 64), 16, 256), ((32, 8, 64), 8, 256),
    ((32, 8, 64), 16, 128),
])
def test_k3v4_head_dim_64_walks_256_token_tiles_past_8_rows_until_a_full_gpu(shape, batch, block_n):
    """k3v4 at head_dim 64 walks 256-token tiles past 8 (row, KV head) pairs until the batch fills the GPU."""
    hq, hk, d = shape
    layout = make_layout("k3v4", hk, d)
    q, *rest = _decode_args(layout, batch)
    q = torch.randn(batch, hq, 1, d, dtype=torch.float16)
    assert plan_attention(q, *rest, max_seq_len=32768, device_traits=H200).block_n == block_n


@pytest.mark.parametrize("kv_heads,batch,splits", [(4, 1, 64), (16, 1, 16), (4, 16, 8)])
def test_fp8_keys_at_head_dim_256_size_a_few_rows_splits_for_2_programs_per_sm(kv_heads, batch, splits):
    """FP8 keys at head_dim 256 hold 2 programs per SM: up to 16 (row, KV head) pairs the split count fills 2 per
    SM (64 for 4 pairs, not the 128 sized for 4 per SM); a larger batch keeps 4 (8 splits for 64 pairs)."""
    layout = make_layout("k8v4", kv_heads, 256)
    q, *rest = _decode_args(layout, batch)
    q = torch.randn(batch, 2 * kv_heads, 1, 256, dtype=torch.float16)
    assert plan_attention(q, *rest, max_seq_len=32768, device_traits=H200).grid[0] == splits


@pytest.mark.parametrize("kv_heads,batch,levers,warps,maxnreg", [
    (16, 1, True, 8, 128), (4, 16, True, 8, 128), (16, 16, True, 8, 128),  # from 16 (row, KV head) pairs
    (4, 1, True, 4, None), (16, 1, False, 4, None),  # 4 pairs; the plain format (unmeasured)
])
def test_fp8_keys_at_head_dim_256_walk_in_8_warps_from_16_rows(kv_heads, batch, levers, warps, maxnreg):
    """FP8 keys at head_dim 256 with the levers run 8 warps in 128 registers from 16 (row, KV head) pairs (2
    programs per SM either way, each thread half the tile); an override decides."""
    layout = make_layout("k8v4", kv_heads, 256, value_rotation=levers, key_centering=levers)
    q, *rest = _decode_args(layout, batch)
    q = torch.randn(batch, 2 * kv_heads, 1, 256, dtype=torch.float16)
    plan = plan_attention(q, *rest, max_seq_len=32768, device_traits=H200)
    assert (plan.constants["num_warps"], plan.constants.get("maxnreg")) == (warps, maxnreg)
    forced = plan_attention(q, *rest, max_seq_len=32768, device_traits=H200, launch=LaunchConfig(num_warps=4))
    assert forced.constants["num_warps"] == 4


@pytest.mark.parametrize("preset,batch,q_len,grid,maxnreg", [
    ("3bit", 1, 8, 2 * 24, 168), ("k3v4", 1, 5, 2 * 24, 168),  # two 16-row tiles x 8 KV heads: 3 x 132 // 16 splits
    ("3bit", 2, 8, 2 * 8, None),  # a second row: power-of-two splits, uncapped
    ("3bit", 1, 4, 32 + 1, None),  # one 16-row tile: 32 splits and the exact tokens' program
])
def test_three_bit_verification_fills_one_wave_of_three_programs_per_sm(preset, batch, q_len, grid, maxnreg):
    """3-bit keys with the levers, 5-8 new tokens at B=1 on an H200: each KV head's two 16-row tiles run in 168
    registers (3 programs per SM) with as many splits as fill one wave of them; elsewhere the power-of-two splits
    stay, uncapped; an override decides."""
    layout = make_layout(preset, 8, 128, key_centering=True, value_rotation=True)
    table = torch.zeros(batch, 32768 // layout.block_size, dtype=torch.int32)
    ring_k, ring_v = recent_ring(layout, batch, 128 + q_len, torch.float16, "cpu")
    args = (torch.randn(batch, 32, q_len, 128, dtype=torch.float16), layout.allocate(1, "cpu"), layout, table,
            torch.full((batch,), 32768), 0.088)
    kwargs = dict(max_seq_len=32768, device_traits=H200, key_offset=torch.zeros(batch, 8, 128), recent_keys=ring_k,
                  recent_values=ring_v)
    plan = plan_attention(*args, **kwargs)
    assert (plan.constants["BLOCK_M"], plan.grid[0], plan.constants.get("maxnreg")) == (16, grid, maxnreg)
    if maxnreg:  # uncapped: 2 programs per SM, the power-of-two splits (16) for 3 waves
        uncapped = plan_attention(*args, **kwargs, launch=LaunchConfig(maxnreg=0))
        assert (uncapped.grid[0], uncapped.constants.get("maxnreg")) == (2 * 16, None)


@pytest.mark.parametrize("batch,splits,maxnreg", [(16, 3, 168), (12, 4, 168), (32, 2, None)])
def test_three_bit_decode_with_its_levers_fills_one_wave_of_three_programs_per_sm(batch, splits, maxnreg):
    """3bit with its levers at head_dim 128 once the batch fills an H200: 168 registers (3 programs per SM) and as
    many splits as fill one wave of them (3 x 132 // (batch x 8 KV heads)), not the power of two above it; where
    that is one split (B=32), uncapped with the power-of-two splits, as are tiles of more rows; the plain format keeps
    168 registers and the power of two; an override decides."""
    layout = make_layout("3bit", 8, 128, key_centering=True, value_rotation=True)
    args = _decode_args(layout, batch)
    plan = plan_attention(*args, max_seq_len=32768, device_traits=H200)
    assert (plan.grid[0], plan.constants.get("maxnreg")) == (splits, maxnreg), plan.grid
    uncapped = plan_attention(*args, max_seq_len=32768, device_traits=H200, launch=LaunchConfig(maxnreg=0))
    assert (uncapped.grid[0], uncapped.constants.get("maxnreg")) == (4 if batch < 32 else 2, None), uncapped.grid
    plain = plan_attention(*_decode_args(make_layout("3bit", 8, 128), batch), max_seq_len=32768, device_traits=H200)
    assert (plain.grid[0], plain.constants.get("maxnreg")) == (4 if batch < 32 else 2, 168), plain.grid
    q, *rest = args  # 8 new tokens per row (32 rows per KV head: a 32-row tile, unmeasured in 168): uncapped
    verify = plan_attention(torch.randn(batch, 32, 8, 128, dtype=torch.float16), *rest, max_seq_len=32768,
                            device_traits=H200)
    assert verify.constants.get("maxnreg") is None, verify.grid
