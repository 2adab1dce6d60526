"""decode_warps.py (one-warp split decode) against reference.paged_attention on the same packed cache.

On the CPU the kernel runs under the interpreter with its gather path (LaunchConfig warp_split=True); its launch
choice is checked as an H200 would plan it; on a GPU (marker gpu) the asm path at real sizes. Tolerance as
test_kernel_attention.py: relative Frobenius error <= 1e-3 plus the output dtype's rounding; outputs and the
split workspace are poisoned with NaN first.
"""

from __future__ import annotations

import pytest
import torch

from tq_hf import reference
from tq_hf.kernels import LaunchConfig, decode_warps, device_traits, plan_attention, unified_attention, warp_plan
from tq_hf.kernels.device import H200

from kernel_helpers import DEVICE, attention_tolerance, default_scale, fill_cache, make_layout, rel_error

WARPS = LaunchConfig(warp_split=True)


def _check(layout, lens, group, q_len=1, dtype=torch.float16, device=DEVICE, scale_query=1.0, **kw):
    pool, table = fill_cache(layout, lens, device)
    b = len(lens)
    query = (torch.randn(b, layout.num_kv_heads * group, q_len, layout.head_dim, device=device) * scale_query).to(dtype)
    seq_lens = torch.tensor(lens, device=device)
    scale = default_scale(layout.head_dim)
    want = reference.paged_attention(query.float(), pool, layout, table, seq_lens, scale)
    workspace = torch.full((1 << 20,), float("nan"), device=device)
    out = torch.full_like(query, float("nan"))
    got = unified_attention(query, pool, layout, table, seq_lens, scale, out=out, workspace=workspace,
                            launch=WARPS, **kw)
    assert got is out and got.isfinite().all()
    err, tol = rel_error(got, want), attention_tolerance(dtype, want)
    assert err <= tol, f"relative error {err:.3e} > {tol:.3e} ({layout.config}, lens={lens}, Lq={q_len}, G={group})"


# GQA groups 1/3/4 (G x Lq <= 4 rows per KV head), odd and mixed lengths (a row of one token, one of none)
@pytest.mark.parametrize("group,q_len,head_dim,lens", [
    (4, 1, 128, [300, 77, 1]),
    (3, 1, 64, [123, 5, 0, 64]),
    (1, 1, 128, [45, 200]),
    (2, 2, 64, [90, 33]),  # two query positions: the causal boundary inside the last tile
    (1, 4, 128, [70, 19]),
])
@pytest.mark.slow
def test_warp_decode_matches_reference(group, q_len, head_dim, lens):
    _check(make_layout("4bit", 4, head_dim), lens, group, q_len)


@pytest.mark.parametrize("block_size", [32, 64])
def test_warp_decode_block_sizes(block_size):
    """Blocks of 32 and 64 tokens (64: the layout's default at head_dim 128), walks ending mid-block."""
    _check(make_layout("4bit", 2, 128, block_size=block_size), [300, 77, 1], 4)


@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_warp_decode_split_counts_agree(num_splits):
    _check(make_layout("4bit", 2, 128), [250, 61], 4, num_splits=num_splits)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_warp_decode_random_rotation(head_dim):
    """A general rotation: the prologue reads R (its high and low fp16 halves) instead of building H."""
    _check(make_layout("4bit", 2, head_dim, rotation="random"), [140, 33], 4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_warp_decode_large_activations(dtype):
    """Queries far beyond fp16's range (bf16/fp32 inputs): the prologue scales them before its fp16 MMAs."""
    _check(make_layout("4bit", 2, 128, block_size=32), [150, 40], 4, dtype=dtype, scale_query=3e5)


@pytest.mark.parametrize("preset,heads,group,q_len,options,extra,need", [
    ("k8v4", 2, 4, 1, {}, {}, "4-bit codebook keys and 4-bit values"),
    ("k3v4", 2, 4, 1, {}, {}, "4-bit codebook keys and 4-bit values"),
    ("4bit", 3, 1, 1, {}, {}, "an even KV head count"),
    ("4bit", 2, 4, 2, {}, {}, "<= 4 query rows per KV head"),
    ("4bit", 2, 8, 1, {}, {}, "<= 4 query rows per KV head"),
    ("4bit", 2, 4, 1, {"value_rotation": True}, {}, "the plain format"),
    ("4bit", 2, 4, 1, {}, {"sliding_window": 64}, "the plain format"),
    ("4bit", 2, 4, 1, {}, {"sinks": "sinks"}, "the plain format"),
])
def test_warp_decode_refuses_what_it_cannot_run(preset, heads, group, q_len, options, extra, need):
    layout = make_layout(preset, heads, 128, **options)
    pool, table = fill_cache(layout, [40], "cpu")
    query = torch.randn(1, heads * group, q_len, 128)
    if extra.get("sinks"):
        extra = {"sinks": torch.zeros(heads * group)}
    with pytest.raises(ValueError, match=f"warp_split=True needs .*{need}"):
        unified_attention(query, pool, layout, table, torch.tensor([40]), 0.1, launch=WARPS, **extra)


def _h200_plan(*args, **kw):
    """The plan an H200 makes for unified_attention(*args, **kw) on these CPU tensors (planned, not run)."""
    return plan_attention(*args, device_traits=H200, **kw)


@pytest.mark.parametrize("batch,heads,length,splits", [
    (16, 8, 32768, 16),  # one wave of 8 one-warp programs per SM: 16 x 4 head pairs x 16 = 1,024 <= 1,056
    (8, 8, 32768, 32),
    (16, 8, 131072, 16),
    (32, 8, 32768, 8),
    (16, 8, 256, 8),  # at most one 32-token tile per split
    (4, 8, 32768, 64),  # 4 x 4 x 8 KV heads < 132 SMs, but a walk of 4 x 8 x 32k >= WALK_TOKENS
    (1, 8, 131072, 256),
    (1, 8, 32768, None),  # neither: the unified kernel
    (2, 8, 16384, None),
])
def test_gpu_warp_decode_choice(batch, heads, length, splits):
    """Where an H200 decode of the plain 4bit format (32/8/128) takes the one-warp kernel, and its split count."""
    layout = make_layout("4bit", heads, 128)
    table = torch.zeros(batch, length // layout.block_size, dtype=torch.int32)
    q = torch.randn(batch, heads * 4, 1, 128, dtype=torch.float16)
    plan = _h200_plan(q, layout.allocate(1, "cpu"), layout, table, torch.full((batch,), length), 0.088,
                      max_seq_len=length)
    seen = plan.constants
    if splits is None:
        assert plan.kernel is not decode_warps._warp_kernel and seen["num_warps"] == 4
        return
    assert plan.kernel is decode_warps._warp_kernel
    assert plan.grid == (splits, heads // 2, batch)
    assert (seen["num_warps"], plan.block_n, plan.num_stages, seen["QUERY_COLS"], seen["PTX"]) == (1, 32, 3, 8, True)
    assert "maxnreg" not in seen and seen["LUT"]


@pytest.mark.parametrize("options,extra", [
    ({"key_centering": True, "value_rotation": True}, {"key_offset": torch.zeros(8, 128)}),  # the preset's levers
    ({}, {"sinks": torch.zeros(32)}),
])
def test_gpu_warp_decode_not_with_levers(options, extra):
    layout = make_layout("4bit", 8, 128, **options)
    table = torch.zeros(16, 2048, dtype=torch.int32)
    plan = _h200_plan(torch.randn(16, 32, 1, 128, dtype=torch.float16), layout.allocate(1, "cpu"), layout, table,
                      torch.full((16,), 32768), 0.088, max_seq_len=32768, **extra)
    assert plan.kernel is not decode_warps._warp_kernel


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("batch,lens,dtype,block_size", [
    (16, [32768, 32767, 20001, 4099] * 4, torch.float16, None),  # as the launcher and the layout choose (64 tokens)
    (8, [8191, 1, 5000, 300] * 2, torch.bfloat16, 16),
])
def test_warp_decode_gpu(batch, lens, dtype, block_size):
    """The asm path at real sizes against the reference, and against the unified kernel on the same cache."""
    layout = make_layout("4bit", 8, 128, block_size=block_size)
    pool, table = fill_cache(layout, lens, "cuda")
    query = torch.randn(batch, 32, 1, 128, device="cuda").to(dtype)
    seq_lens = torch.tensor(lens, device="cuda")
    scale = default_scale(128)
    want = reference.paged_attention(query.float(), pool, layout, table, seq_lens, scale)
    got = unified_attention(query, pool, layout, table, seq_lens, scale, out=torch.full_like(query, float("nan")),
                            launch=WARPS)
    err, tol = rel_error(got, want), attention_tolerance(dtype, want)
    assert err <= tol, f"relative error {err:.3e} > {tol:.3e} (B={batch})"
    other = unified_attention(query, pool, layout, table, seq_lens, scale, launch=LaunchConfig(warp_split=False))
    assert rel_error(got, other) <= 2 * tol


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_warp_decode_cuda_graph_replay_gpu():
    """Captured once in a CUDA graph (as the launcher picks it, B=16 x 8 KV heads), replayed after the next step's
    new query and shorter lengths are written in place: no host sync, the lengths read on the device."""
    layout = make_layout("4bit", 8, 128)
    assert warp_plan.wanted(LaunchConfig(), layout, 4, 16, True, device_traits(torch.device("cuda")), 4096)
    lens = [4000, 1234, 9, 2048] * 4
    pool, table = fill_cache(layout, lens, "cuda")
    seq = torch.tensor(lens, device="cuda")
    q = torch.randn(16, 32, 1, 128, device="cuda", dtype=torch.float16)
    out = torch.full_like(q, float("nan"))
    unified_attention(q, pool, layout, table, seq, 0.088, max_seq_len=4096, out=out)  # compile, workspace
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        unified_attention(q, pool, layout, table, seq, 0.088, max_seq_len=4096, out=out)
    q.copy_(torch.randn_like(q))
    seq.sub_(torch.arange(16, device="cuda") % 3)
    out.fill_(float("nan"))
    graph.replay()
    want = reference.paged_attention(q.float(), pool, layout, table, seq, 0.088)
    assert rel_error(out, want) <= attention_tolerance(torch.float16, want)
