"""store_kv against reference.store: the bytes must be equal (see compare_pools for the one
tolerated difference), on CPU through the Triton interpreter or on CUDA."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from tq_hf import reference
from tq_hf.codebook import is_symmetric, lloyd_max
from tq_hf.kernels import store_kv
from tq_hf.kernels.fast_launch import LAUNCH_OPTIONS
from tq_hf.kernels.launch_config import StoreLaunchConfig
from tq_hf.kernels.store import _bucket_sign_magnitude

from kernel_helpers import DEVICE, compare_pools, make_layout

PRESETS = ["4bit", "k8v4", "k3v4", "3bit"]


def _inputs(n: int, layout, dtype, device=DEVICE):
    h, d = layout.num_kv_heads, layout.head_dim
    key = torch.randn(n, h, d, device=device) * torch.rand(n, h, 1, device=device).mul(8)
    value = torch.randn(n, h, d, device=device) * 3 + torch.randn(n, h, 1, device=device)
    slots = torch.randperm(n + 20, device=device)[:n]
    if n > 5:  # (a store of fewer tokens, a decode step's, takes plain rows)
        key[1] = 0.0  # all-zero rows: zero scales
        value[2] = 0.0
        value[3, 0] = 7.0  # constant row
        if dtype != torch.float16:
            key[4, -1] *= 1e6  # beyond fp16 range: bf16 models produce these
            value[4, -1] *= 1e6
        slots[5] = -1  # padding token: skipped
    return key.to(dtype), value.to(dtype), slots


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("head_dim,dtype,block_size", [
    (64, torch.float16, 16), (96, torch.bfloat16, 32), (128, torch.float32, 64), (32, torch.bfloat16, 16),
    (256, torch.float16, 16),
])
def test_store_bytes_match_reference(preset, head_dim, dtype, block_size):
    layout = make_layout(preset, 3, head_dim, block_size)
    n = 37
    key, value, slots = _inputs(n, layout, dtype)
    num_blocks = (n + 20) // block_size + 1
    got = layout.allocate(num_blocks, DEVICE)
    got.fill_(0xA5)  # poison: every byte the kernel should write is compared
    want = got.to("cpu", copy=True)  # a copy also when got is on the CPU
    store_kv(got, layout, key, value, slots)
    # the spec on CPU (on CUDA, torch's division by a Python scalar multiplies by the reciprocal and can
    # round a value code differently: this test failed that way when run on an H200)
    reference.store(want, layout, key.cpu(), value.cpu(), slots.cpu())
    flips = compare_pools(got.cpu(), want, layout, key.cpu(), slots.cpu())
    print(f"{preset} D={head_dim} {dtype}: {flips} boundary code flips")


def _key_mean(layout, device=DEVICE) -> torch.Tensor:
    """A key_centering mean with large per-channel biases, as real models have."""
    return torch.randn(layout.num_kv_heads, layout.head_dim, device=device) * 5


# key_centering and value_rotation, every preset (k8v4 included), an odd head_dim on random rotations
@pytest.mark.parametrize("preset,head_dim,dtype", [
    ("4bit", 64, torch.float16), ("k8v4", 64, torch.bfloat16), ("k3v4", 64, torch.float32),
    ("3bit", 64, torch.float16), ("k8v4", 96, torch.float32), ("4bit", 96, torch.bfloat16),
    ("3bit", 96, torch.float32),  # the even/odd column split of the rotation with padded columns
])
def test_store_format_options_match_reference(preset, head_dim, dtype):
    layout = make_layout(preset, 2, head_dim, key_centering=True, value_rotation=True)
    n = 29
    key, value, slots = _inputs(n, layout, dtype)
    mu = _key_mean(layout)
    key = (key.float() + mu).to(dtype)
    key[1] = mu.to(dtype)  # centres to (nearly) zero: zero scale path
    got = layout.allocate((n + 20) // 16 + 1, DEVICE).fill_(0xA5)
    want = got.clone()
    store_kv(got, layout, key, value, slots, key_offset=mu)
    reference.store(want, layout, key, value, slots, key_offset=mu)
    compare_pools(got, want, layout, key.float() - mu, slots, value=value)


@pytest.mark.parametrize("preset", ["4bit", "k8v4", "3bit"])
def test_store_per_row_key_offset_matches_reference(preset):
    """A per-row mean [R, H, D]: token n is centred on the mean of row n // (N / R)."""
    layout = make_layout(preset, 2, 64, key_centering=True, value_rotation=True)
    rows, per_row = 3, 7
    key, value, slots = _inputs(rows * per_row, layout, torch.float16)
    mu = torch.randn(rows, 2, 64, device=DEVICE) * 4
    key = (key.float() + mu.repeat_interleave(per_row, 0)).to(torch.float16)
    got = layout.allocate((rows * per_row + 20) // 16 + 1, DEVICE).fill_(0xA5)
    want = got.clone()
    store_kv(got, layout, key, value, slots, key_offset=mu)
    reference.store(want, layout, key, value, slots, key_offset=mu)
    compare_pools(got, want, layout, key.float() - mu.repeat_interleave(per_row, 0), slots, value=value)
    shared = layout.allocate((rows * per_row + 20) // 16 + 1, DEVICE).fill_(0xA5)
    store_kv(shared, layout, key, value, slots, key_offset=mu[0])
    assert not torch.equal(shared, got), "the rows' own means must change what rows 1 and 2 store"
    with pytest.raises(ValueError, match="divisible"):
        store_kv(got, layout, key[:20], value[:20], slots[:20], key_offset=mu)


# the exact ring (recent_window) and the rows' lengths written by the same launch: a decode step (one token per row),
# prefills shorter and longer than the ring (wrapping), a ring in another dtype than the tokens
@pytest.mark.parametrize("rows,length,w,start,dtype,ring_dtype", [
    (3, 1, 16, 37, torch.float16, torch.float16),
    (2, 23, 32, 5, torch.bfloat16, torch.bfloat16),
    (2, 40, 16, 9, torch.float32, torch.float32),
    (1, 7, 8, 0, torch.bfloat16, torch.float32),
    (3, 1, 16, 37, torch.float16, torch.int8),  # int8 ring records (recent_format "int8"), bit for bit
    (2, 40, 16, 9, torch.bfloat16, torch.int8),
    (2, 23, 32, 5, torch.float32, torch.int8),
])
@pytest.mark.parametrize("ring_part", [None, True, False])  # the ring by programs of its own, or by the key/value ones
def test_store_writes_the_recent_ring_and_lengths(rows, length, w, start, dtype, ring_dtype, ring_part):
    layout = make_layout("4bit", 2, 64, key_centering=True, value_rotation=True)
    n = rows * length
    key = (torch.randn(n, 2, 64, device=DEVICE) * 3).to(dtype)
    value = torch.randn(n, 2, 64, device=DEVICE).to(dtype)
    slots = torch.randperm(n + 20, device=DEVICE)[:n]
    mu = torch.randn(rows, 2, 64, device=DEVICE)
    if ring_dtype == torch.int8:
        key[: n // 2, 1] *= 1e4 if dtype != torch.float16 else 1e2  # large activations: finite records
        key[n // 2, 0] = 0  # a zero vector: scale 0, codes 0
    poison, width = (90, 64 + 16) if ring_dtype == torch.int8 else (1234.0, 64)
    ring = torch.full((rows, 2, w, width), poison, dtype=ring_dtype, device=DEVICE)  # poison: untouched slots keep it
    got_ring, want_ring = (ring.clone(), ring.clone() - 1), (ring.clone(), ring.clone() - 1)
    got_len = torch.full((rows,), -7, dtype=torch.int32, device=DEVICE)
    want_len = got_len.clone()
    got = layout.allocate((n + 20) // 16 + 1, DEVICE).fill_(0xA5)
    want = got.clone()
    store_kv(got, layout, key, value, slots, key_offset=mu, recent=got_ring, start=start, seq_lens=got_len,
             launch=StoreLaunchConfig(ring_part=ring_part))
    reference.store(want, layout, key, value, slots, key_offset=mu, recent=want_ring, start=start, seq_lens=want_len)
    compare_pools(got, want, layout, key.float() - mu.repeat_interleave(length, 0), slots, value=value)
    for g, e, what in ((got_ring[0], want_ring[0], "keys"), (got_ring[1], want_ring[1], "values")):
        bad = (g != e).nonzero()
        assert bad.numel() == 0, f"ring {what}: {bad.shape[0]} elements differ, first at {bad[:3].tolist()}"
    written = min(length, w)  # the spec wrote this many slots per row and head; the rest still hold the poison
    assert int((want_ring[0] != poison).any(-1).sum()) == rows * 2 * written
    if ring_dtype == torch.int8:  # the records hold k - mu to half a code step of each group (an independent decode)
        scales = got_ring[0][..., 64:72].contiguous().view(torch.bfloat16).float()  # [rows, H, W, 4]
        got_k = (got_ring[0][..., :64].float().unflatten(-1, (4, 16)) * scales[..., None]).flatten(-2)
        last = key.float().reshape(rows, length, 2, 64)[:, length - written :].transpose(1, 2) - mu[:, :, None]
        slots_of = (start + torch.arange(length - written, length, device=DEVICE)) % w
        step = (last.unflatten(-1, (4, 16)).abs().amax(-1, keepdim=True) / 127).expand(-1, -1, -1, -1, 16).flatten(-2)
        assert bool(((got_k[:, :, slots_of] - last).abs() <= step * 0.5 * (1 + 2**-7)).all())
        assert torch.isfinite(got_k).all()
    assert got_len.tolist() == want_len.tolist() == [start + length] * rows


# a compiled step's store: the ring's positions from a device tensor, its skipped tokens (past a fixed capacity) out
# of the ring; the same bytes as a store from the host position where the tokens are kept, the poison where not
@pytest.mark.parametrize("rows,length,w,start,ring_dtype", [
    (2, 1, 16, 37, torch.int8), (1, 1, 8, 5, torch.float16), (2, 5, 4, 9, torch.int8), (1, 9, 16, 3, torch.float16),
])
@pytest.mark.parametrize("ring_part", [True, False])
def test_store_ring_positions_from_the_device(rows, length, w, start, ring_dtype, ring_part):
    layout = make_layout("4bit", 2, 64, key_centering=True, value_rotation=True)
    n = rows * length
    key = (torch.randn(n, 2, 64, device=DEVICE) * 3).half()
    value = torch.randn(n, 2, 64, device=DEVICE).half()
    mu = torch.randn(rows, 2, 64, device=DEVICE)
    slots = torch.randperm(n + 20, device=DEVICE)[:n]
    skipped = torch.zeros(rows, length, dtype=torch.bool, device=DEVICE)
    skipped[:, length - 1 :] = length > 1  # a row's last token past the capacity (none for a one-token step)
    skipped_slots = torch.where(skipped.flatten(), -1, slots)
    positions = start + torch.arange(length, device=DEVICE)
    poison, width = (90, 64 + 16) if ring_dtype == torch.int8 else (1234.0, 64)
    ring = torch.full((rows, 2, w, width), poison, dtype=ring_dtype, device=DEVICE)
    got_ring, want_ring, host_ring = [(ring.clone(), ring.clone()) for _ in range(3)]
    got, want, host = [layout.allocate((n + 20) // 16 + 1, DEVICE).fill_(0xA5) for _ in range(3)]
    store_kv(got, layout, key, value, skipped_slots, key_offset=mu, recent=got_ring, positions=positions,
             launch=StoreLaunchConfig(ring_part=ring_part))
    reference.store(want, layout, key, value, skipped_slots, key_offset=mu, recent=want_ring, positions=positions)
    reference.store(host, layout, key, value, slots, key_offset=mu, recent=host_ring, start=start)
    compare_pools(got, want, layout, key.float() - mu.repeat_interleave(length, 0), skipped_slots, value=value)
    ring_slots = (start + torch.arange(length, device=DEVICE)) % w
    for g, e, h in zip(got_ring, want_ring, host_ring):
        assert torch.equal(g, e)
        for t in range(max(length - w, 0), length):
            expected = ring[:, :, ring_slots[t]] if length > 1 and t == length - 1 else h[:, :, ring_slots[t]]
            assert torch.equal(g[:, :, ring_slots[t]], expected), t
    with pytest.raises(ValueError, match="positions comes without seq_lens"):
        reference.store(want, layout, key, value, slots, recent=want_ring, positions=positions,
                        seq_lens=torch.zeros(rows, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="comes without seq_lens"):
        store_kv(got, layout, key, value, slots, recent=got_ring, positions=positions,
                 seq_lens=torch.zeros(rows, dtype=torch.int32, device=DEVICE))


def test_store_ring_and_lengths_rejected_when_they_do_not_fit():
    layout = make_layout("4bit", 2, 64)
    pool = layout.allocate(4, DEVICE)
    k = torch.randn(6, 2, 64, device=DEVICE)
    s = torch.arange(6, device=DEVICE)
    ring = torch.zeros(4, 2, 8, 64, device=DEVICE)
    with pytest.raises(ValueError, match="a ring or seq_lens of 4 rows needs a token count divisible by it, got 6"):
        store_kv(pool, layout, k, k, s, recent=(ring, ring))
    with pytest.raises(ValueError, match="recent keys must be"):
        store_kv(pool, layout, k, k, s, recent=(ring[:, :1], ring[:, :1]))
    with pytest.raises(ValueError, match="one shape"):
        store_kv(pool, layout, k, k, s, recent=(ring[:3], ring[:2]))
    with pytest.raises(TypeError, match="seq_lens has dtype"):
        store_kv(pool, layout, k, k, s, seq_lens=torch.zeros(3, device=DEVICE))
    with pytest.raises(ValueError, match="seq_lens has 2 rows but the recent ring 3"):
        store_kv(pool, layout, k, k, s, recent=(ring[:3], ring[:3]), seq_lens=torch.zeros(2, dtype=torch.int32,
                                                                                        device=DEVICE))
    with pytest.raises(ValueError, match="start must be an int >= 0"):
        store_kv(pool, layout, k, k, s, recent=(ring[:3], ring[:3]), start=-1)


@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_store_slot_shift_moves_every_stored_slot(slot_dtype):
    """slot_shift (a decode step: each row's first slot plus its position's shift) lands where the summed slots do;
    a skipped slot (-1) stays skipped. The spec is handed the summed slots, not the shift."""
    layout = make_layout("4bit", 2, 64)
    key, value = torch.randn(5, 2, 64, device=DEVICE), torch.randn(5, 2, 64, device=DEVICE)
    first = torch.tensor([0, 16, 32, -1, 48], device=DEVICE, dtype=slot_dtype)  # 4 rows' first slots, one padded
    shift = 3 * 64 + 5  # position 53 of rows laid out 4 blocks of 16 apart
    got = layout.allocate(20, DEVICE).fill_(0xA5)
    want = got.clone()
    store_kv(got, layout, key, value, first, slot_shift=shift)
    summed = torch.where(first >= 0, first.long() + shift, -1)
    reference.store(want, layout, key, value, summed)
    compare_pools(got, want, layout, key, summed)
    with pytest.raises(ValueError, match="slot_shift must be an int >= 0"):
        store_kv(got, layout, key, value, first, slot_shift=-1)


def test_store_non_contiguous_inputs_and_int32_slots():
    layout = make_layout("4bit", 2, 64)
    n = 19
    key = torch.randn(2, n, 64, device=DEVICE).transpose(0, 1)  # [n, 2, 64], strided
    value = torch.randn(n, 4, 64, device=DEVICE)[:, ::2]
    slots = torch.arange(n, device=DEVICE, dtype=torch.int32) + 3
    got, want = layout.allocate(3, DEVICE), layout.allocate(3, DEVICE)
    store_kv(got, layout, key, value, slots)
    reference.store(want, layout, key, value, slots.long())
    compare_pools(got, want, layout, key, slots.long())


@pytest.mark.parametrize("tokens,block_t,warps", [
    (1, 16, 8), (16, 16, 8),  # a decode step: 8 warps
    (32, 32, 8), (1000, 64, 8),  # long prefills: 64-token tiles amortise the rotation loads
])
def test_store_launch_choices_on_a_gpu(tokens, block_t, warps):
    """What the store launcher picks on a GPU (the plan only, nothing launched)."""
    from tq_hf.kernels import store as store_kernel
    from tq_hf.kernels.device import H200

    layout = make_layout("4bit", 8, 128)
    key = torch.randn(tokens, 8, 128)
    plan = store_kernel._make_plan(layout.allocate(4, "cpu"), layout, key, key, torch.arange(tokens), None, None,
                                   traits=H200)
    assert plan.site.grid == (-(-tokens // block_t), 8, 2)
    assert (plan.site.kwargs["BLOCK_T"], plan.site.kwargs["num_warps"]) == (block_t, warps)


def test_store_rejects_bad_inputs():
    layout = make_layout("4bit", 2, 64)
    pool = layout.allocate(2, DEVICE)
    k = torch.randn(4, 2, 64, device=DEVICE)
    s = torch.arange(4, device=DEVICE)
    with pytest.raises(ValueError, match="key must be"):
        store_kv(pool, layout, torch.randn(4, 3, 64, device=DEVICE), k, s)
    with pytest.raises(TypeError, match="dtype"):
        store_kv(pool, layout, k.double(), k, s)
    with pytest.raises(ValueError, match="agree on N"):
        store_kv(pool, layout, k, k, s[:3])
    with pytest.raises(TypeError, match="slots has dtype"):
        store_kv(pool, layout, k, k, s.float())
    with pytest.raises(ValueError, match="last"):
        store_kv(pool, layout, torch.randn(4, 2, 128, device=DEVICE)[..., ::2], k, s)
    with pytest.raises(ValueError, match="pool must be"):
        store_kv(make_layout("k8v4", 2, 64).allocate(2, DEVICE), layout, k, k, s)
    with pytest.raises(TypeError, match="layout"):
        store_kv(pool, "4bit", k, k, s)
    with pytest.raises(ValueError, match="key_offset must be"):
        store_kv(pool, layout, k, k, s, key_offset=torch.zeros(2, 32, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [7, 29, 8192 + 5])  # each tile size the launcher picks: 16, 32, 64 tokens
def test_store_real_size_gpu(preset, dtype, n):
    layout = make_layout(preset, 8, 128)
    key, value, slots = _inputs(n, layout, dtype, device="cuda")
    got = layout.allocate((n + 20) // 16 + 1, "cuda").fill_(0x5A)
    want = got.to("cpu", copy=True)  # a copy also when got is on the CPU
    store_kv(got, layout, key, value, slots)
    # the spec runs on CPU: torch's CUDA division by a Python scalar multiplies by its reciprocal,
    # so reference.store on CUDA tensors can round a value scale differently from the spec
    reference.store(want, layout, key.cpu(), value.cpu(), slots.cpu())
    got, key, slots = got.cpu(), key.cpu(), slots.cpu()
    flips = compare_pools(got, want, layout, key, slots)
    print(f"{preset} {dtype} N={n}: {flips} boundary code flips of {n * 8 * 128}")


@pytest.mark.gpu
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("n", [7, 29, 8192 + 5])
def test_store_format_options_real_size_gpu(preset, n):
    layout = make_layout(preset, 8, 128, key_centering=True, value_rotation=True)
    key, value, slots = _inputs(n, layout, torch.bfloat16, device="cuda")
    mu = _key_mean(layout, "cuda")
    key = (key.float() + mu).to(torch.bfloat16)
    got = layout.allocate((n + 20) // 16 + 1, "cuda").fill_(0x5A)
    want = got.to("cpu", copy=True)  # a copy also when got is on the CPU
    store_kv(got, layout, key, value, slots, key_offset=mu)
    reference.store(want, layout, key.cpu(), value.cpu(), slots.cpu(), key_offset=mu.cpu())
    flips = compare_pools(got.cpu(), want, layout, key.cpu().float() - mu.cpu(), slots.cpu(), value=value.cpu())
    print(f"{preset} options N={n}: {flips} boundary code flips of {n * 8 * 128}")


def _stored_both_ways(preset, head_dim, n, device):
    """The pool after one store with the rotations' fp16 units read (the default) and with their entries built in
    registers (StoreLaunchConfig(rotation_units=False)), the same inputs."""
    layout = make_layout(preset, 2, head_dim, key_centering=True, value_rotation=True)
    key, value, slots = _inputs(n, layout, torch.bfloat16, device=device)
    mu = _key_mean(layout, device)
    pools = []
    for units in (True, False):
        pool = layout.allocate((n + 20) // 16 + 1, device).fill_(0xA5)
        store_kv(pool, layout, key, value, slots, key_offset=mu, launch=StoreLaunchConfig(rotation_units=units))
        pools.append(pool)
    return pools


@pytest.mark.parametrize("preset,head_dim", [("4bit", 64), ("3bit", 128), ("k8v4", 64), ("k3v4", 32)])
def test_store_rotation_units_equal_the_registers_entries(preset, head_dim):
    """Under rotation="hadamard" the store reads R's and Rv's +-1 entries as fp16 units (the signs the register-built
    path puts on the input ride in them): the same bytes, every one (a transposed or unscaled operand is far off)."""
    units, built = _stored_both_ways(preset, head_dim, 21, DEVICE)
    assert torch.equal(units, built)


def test_a_prefills_store_makes_the_units_a_decode_step_reads():
    """The eager prefill's store (many tiles) makes the fp16 units that a decode step's store then reads: that step's
    plan may first be made inside CUDA-graph capture, where a new tensor lands in the graph's private pool."""
    from tq_hf.kernels import codec_tensors
    from tq_hf.kernels.device import H200
    from tq_hf.kernels.store import _make_plan

    codec_tensors.key_rotation_units.cache_clear()
    codec_tensors.value_rotation_units.cache_clear()
    layout = make_layout("4bit", 2, 64, key_centering=True, value_rotation=True)
    pool = layout.allocate(300, "cpu")
    prefill = _make_plan(pool, layout, torch.randn(4099, 2, 64), torch.randn(4099, 2, 64), torch.arange(4099),
                         torch.zeros(2, 64), traits=H200)
    assert prefill.site.kwargs["UNITS"] is True and prefill.rot.dtype == torch.float16
    made = codec_tensors.key_rotation_units.cache_info().misses, codec_tensors.value_rotation_units.cache_info().misses
    assert made == (1, 1)
    step = _make_plan(pool, layout, torch.randn(1, 2, 64), torch.randn(1, 2, 64), torch.arange(1),
                      torch.zeros(2, 64), traits=H200)
    assert step.rot is prefill.rot and step.scalars[2] is prefill.scalars[2]  # found, not made


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["4bit", "k3v4", "3bit"])
@pytest.mark.parametrize("n", [1, 16, 4099])
def test_store_rotation_units_gpu(preset, n):
    units, built = _stored_both_ways(preset, 128, n, "cuda")
    assert torch.equal(units, built)


def test_store_without_the_symmetric_bucketing_matches_reference(monkeypatch):
    """The 15-compare bucketing + remap the store falls back to for a codebook that is not exactly
    symmetric in fp32 (none of the Lloyd-Max codebooks so far): the same bytes as the spec."""
    from tq_hf.kernels import store as store_kernel

    monkeypatch.setattr(store_kernel, "is_symmetric", lambda head_dim, bits: False)
    layout = make_layout("4bit", 3, 64)
    n = 37
    key, value, slots = _inputs(n, layout, torch.float16)
    got = layout.allocate((n + 20) // 16 + 1, DEVICE).fill_(0xA5)
    want = got.to("cpu", copy=True)  # a copy also when got is on the CPU
    store_kv(got, layout, key, value, slots)
    reference.store(want, layout, key.cpu(), value.cpu(), slots.cpu())
    compare_pools(got.cpu(), want, layout, key.cpu(), slots.cpu())


@triton.jit
def _bucket_probe(y_ptr, code_ptr, val_ptr, N, NC: tl.constexpr, BLOCK: tl.constexpr, bnd_ptr, cent_ptr):
    i = tl.arange(0, BLOCK)
    y = tl.load(y_ptr + i, mask=i < N, other=0.0)
    code, val = _bucket_sign_magnitude(y, bnd_ptr, cent_ptr, NC)
    tl.store(code_ptr + i, code, mask=i < N)
    tl.store(val_ptr + i, val, mask=i < N)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_sign_magnitude_bucket_matches_the_spec_at_the_boundaries(head_dim):
    """_bucket_sign_magnitude against reference's bucketize + stored_codes, on the boundaries themselves
    (+-b, one ulp either side), zeros of both signs and fresh random coordinates: code and centroid equal."""
    book = lloyd_max(head_dim, 4)
    assert is_symmetric(head_dim, 4)
    b = book.boundaries
    inf = torch.tensor(float("inf"))
    edges = torch.cat([b, -b, torch.nextafter(b, inf), torch.nextafter(b, -inf), torch.nextafter(-b, inf),
                       torch.nextafter(-b, -inf), torch.tensor([0.0, -0.0, 1e-40, -1e-40, 5.0, -5.0])])
    y = torch.cat([edges, torch.randn(1000) * 1.3]).to(DEVICE)
    n = y.numel()
    code = torch.full((n,), -7, dtype=torch.int32, device=DEVICE)  # poisoned
    val = torch.full((n,), float("nan"), device=DEVICE)
    block = triton.next_power_of_2(n)
    _bucket_probe[(1,)](y, code, val, n, 16, block, book.boundaries.to(DEVICE), book.centroids.to(DEVICE),
                        **LAUNCH_OPTIONS)  # compiled as the store kernel is
    level = torch.bucketize(y.cpu(), b)
    want_code = reference.stored_codes(4)[level].to(torch.int32)
    bad = (code.cpu() != want_code).nonzero().flatten()
    assert bad.numel() == 0, (f"codes differ at y={y.cpu()[bad[:6]].tolist()}: got {code.cpu()[bad[:6]].tolist()}, "
                              f"want {want_code[bad[:6]].tolist()}")
    assert torch.equal(val.cpu(), book.centroids[level]), "centroids differ"


def test_store_rotation_units_by_default():
    """Under rotation="hadamard" a store reads the rotations' fp16 units unless told not to, for one tile or many."""
    from tq_hf.kernels.device import H200
    from tq_hf.kernels.store import _make_plan

    layout = make_layout("4bit", 2, 64, key_centering=True, value_rotation=True)
    pool = layout.allocate(300, "cpu")
    for n in (1, 64, 65, 4099):
        key = torch.randn(n, 2, 64)
        for asked, units in ((None, True), (True, True), (False, False)):
            plan = _make_plan(pool, layout, key, key, torch.arange(n), torch.zeros(2, 64),
                              StoreLaunchConfig(rotation_units=asked), traits=H200)
            assert plan.site.kwargs["UNITS"] is units, (n, asked)
            assert (plan.rot.dtype == torch.float16) is units and (plan.scalars[2].dtype == torch.float16) is units
