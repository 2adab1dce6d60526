"""fast_launch.LaunchSite (direct calls of a compiled kernel) and the launchers' plan caches.

The direct call is a Triton internal: on the CPU it is checked against a fake kernel (argument
order, when it falls back to Triton's own path); on the GPU against the reference, with fresh
tensors per call, a pointer of another alignment and a launch hook installed.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from tq_hf import reference
from tq_hf.kernels import attention as attention_kernel, fast_launch, store as store_kernel, workspace
from tq_hf.kernels import store_kv, unified_attention

from kernel_helpers import (DEVICE, attention_tolerance, compare_pools, default_scale, fill_cache, make_layout,
                            rel_error)

dequantize_kernel = importlib.import_module("tq_hf.kernels.dequantize")  # (the package exports a function of that name)


class FakeDriver:
    def __init__(self):
        self.device = 0

    def get_current_device(self):
        return self.device

    def get_current_stream(self, device):
        return 1000 + device


class FakeCompiled:
    function, packed_metadata = "function", "metadata"

    def __init__(self):
        self.runs = []

    def run(self, *args):
        self.runs.append(args)


class FakeKernel:
    """A JIT function's surface: arg_names, constexprs (indices), fn[grid](*args, **kwargs)."""

    def __init__(self, arg_names, constexprs):
        self.arg_names, self.constexprs = arg_names, constexprs
        self.compiled = FakeCompiled()
        self.jit_calls = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.jit_calls.append((grid, args, kwargs))
            return self.compiled
        return launch


@pytest.fixture
def fake_triton(monkeypatch):
    driver = FakeDriver()
    monkeypatch.setattr(fast_launch, "_driver", lambda: driver)
    monkeypatch.setattr(fast_launch, "_ENABLED", True)
    hooks = []
    monkeypatch.setattr(fast_launch, "_hooks_installed", lambda: bool(hooks))
    return driver, hooks


def test_launch_site_calls_the_compiled_kernel_after_the_first_launch(fake_triton):
    kernel = FakeKernel(["x_ptr", "n", "BLOCK", "FLAG"], [2, 3])
    site = fast_launch.LaunchSite(kernel, (3, 2, 1), {"BLOCK": 64, "FLAG": True, "num_warps": 4})
    site("t0", 7)
    # (with the compile options every launch passes: FMA contraction, as the kernels were tuned)
    assert kernel.jit_calls == [((3, 2, 1), ("t0", 7), {"BLOCK": 64, "FLAG": True, "num_warps": 4,
                                                        "enable_fp_fusion": True})]
    site("t1", 9)
    site("t2", 11)
    assert len(kernel.jit_calls) == 1, "later calls must not go through Triton's binder"
    assert kernel.compiled.runs == [
        (3, 2, 1, 1000, "function", "metadata", None, None, None, "t1", 9, 64, True),
        (3, 2, 1, 1000, "function", "metadata", None, None, None, "t2", 11, 64, True),
    ]


def test_launch_site_falls_back_to_triton(fake_triton, monkeypatch):
    driver, hooks = fake_triton
    kernel = FakeKernel(["x_ptr", "BLOCK"], [1])
    site = fast_launch.LaunchSite(kernel, (1, 1, 1), {"BLOCK": 16})
    site("t0")
    driver.device = 1  # another current device: the compiled kernel belongs to device 0
    site("t1")
    driver.device = 0
    hooks.append("profiler")  # a launch hook wants Triton's launch metadata
    site("t2")
    hooks.clear()
    site("t3")
    assert [c[1] for c in kernel.jit_calls] == [("t0",), ("t1",), ("t2",)]
    assert [r[-2] for r in kernel.compiled.runs] == ["t3"]


def test_direct_tells_whether_a_call_skips_triton_and_run_direct_passes_addresses(fake_triton):
    driver, hooks = fake_triton
    kernel = FakeKernel(["x_ptr", "n", "BLOCK"], [2])
    site = fast_launch.LaunchSite(kernel, (2, 1, 1), {"BLOCK": 32})
    assert not site.direct()  # nothing compiled yet
    site("t0", 1)
    assert site.direct()
    site.run_direct(0x7F00, 5)
    assert kernel.compiled.runs[-1] == (2, 1, 1, 1000, "function", "metadata", None, None, None, 0x7F00, 5, 32)
    driver.device = 1
    assert not site.direct()
    driver.device = 0
    hooks.append("profiler")
    assert not site.direct()
    t = torch.zeros(3)
    assert fast_launch.addresses((t, 4, None, t[1:])) == (t.data_ptr(), 4, None, t.data_ptr() + 4)


def _adopted_fake(site: fast_launch.LaunchSite) -> FakeCompiled:
    """Make a planned site call a fake compiled kernel directly (as an adopted one on device 0 would)."""
    site._kernel, site._suffix, site._device = FakeCompiled(), ("CONSTEXPRS",), 0
    return site._kernel


def test_held_attention_launches_by_address_on_the_direct_path(fake_triton, monkeypatch):
    """A held decode launch on the direct path passes every tensor, the lasting ones and the new query and out, as
    its address, in the order and with the scalars of the tensor call (the reduction's too); with a launch hook
    installed it takes Triton's path with the tensors and still computes the reference's attention."""
    driver, hooks = fake_triton
    monkeypatch.setattr(attention_kernel, "_PLANS", fast_launch.PlanCache())
    layout = make_layout("4bit", 2, 64)
    q, pool, table, seq = _attention_call(layout, [70])
    held = attention_kernel.HeldAttention()
    out = torch.full_like(q, float("nan"))
    unified_attention(q, pool, layout, table, seq, default_scale(64), out=out, max_seq_len=70, num_splits=2,
                      held=held)
    plan = held._plan
    assert plan.split
    attention, reduce = _adopted_fake(plan.attention), _adopted_fake(plan.reduce)
    q2, out2 = torch.randn_like(q), torch.empty_like(q)
    held.launch(q2, out2, 0)
    want = attention_kernel._call_arguments(q2, out2, held._middle, 0, plan.scalars)
    (run,), (red,) = attention.runs, reduce.runs
    assert run[9:] == (*fast_launch.addresses(want), "CONSTEXPRS")
    assert not any(isinstance(a, torch.Tensor) for a in run + red)
    pout, plse = held._partials
    assert red[9:] == (*fast_launch.addresses((pout, plse, out2, *out2.stride()[:3], plan.ns_all, plan.vrot)),
                       "CONSTEXPRS")
    hooks.append("profiler")  # Triton's own path: tensors, the real kernel
    plan.attention._kernel = plan.reduce._kernel = None
    out3 = torch.full_like(q, float("nan"))
    held.launch(q2, out3, 0)
    expect = reference.paged_attention(q2.float(), pool, layout, table, seq, default_scale(64))
    assert rel_error(out3, expect) <= attention_tolerance(q2.dtype, expect)


def test_held_store_launches_by_address_on_the_direct_path(fake_triton, monkeypatch):
    """A held decode store on the direct path passes the new tokens and every lasting tensor (slots, the ring, the
    lengths) as addresses, in the tensor call's order."""
    monkeypatch.setattr(store_kernel, "_PLANS", fast_launch.PlanCache())
    layout = make_layout("4bit", 2, 64)
    pool = layout.allocate(4, DEVICE)
    ring_k, ring_v = (torch.zeros(2, 2, 8, 64, device=DEVICE) for _ in range(2))
    seq = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    slots = torch.tensor([3, 20], device=DEVICE)
    held = store_kernel.HeldStore()
    k, v = (torch.randn(2, 2, 64, device=DEVICE) for _ in range(2))
    store_kv(pool, layout, k, v, slots, recent=(ring_k, ring_v), start=5, seq_lens=seq, held=held)
    plan = held._plan
    compiled = _adopted_fake(plan.site)
    k2, v2 = torch.randn_like(k), torch.randn_like(v)
    held.launch(k2, v2, 6, 1)
    want = store_kernel._store_arguments(k2, v2, slots, 1, held._lasting, ring_k, ring_v, plan.ring_scalars, 6, seq,
                                         plan.tokens_per_row)
    (run,) = compiled.runs
    assert run[9:] == (*fast_launch.addresses(want), "CONSTEXPRS")
    assert not any(isinstance(a, torch.Tensor) for a in run)


def test_dequantize_plan_serves_every_length_of_a_kind(fake_triton, monkeypatch):
    """The dense route's dequantization launches through one plan for lengths Triton compiles alike (grid set per
    call: a block per T positions), a new plan where the variant differs (a length divisible by 16) or the kind
    of offset does."""
    monkeypatch.setattr(dequantize_kernel, "_PLANS", fast_launch.PlanCache())
    names = dequantize_kernel._dequantize_kernel.arg_names  # the runtime arguments, then the constexprs from H
    kernel = FakeKernel(names, list(range(names.index("H"), len(names))))
    monkeypatch.setattr(dequantize_kernel, "_dequantize_kernel", kernel)
    layout = make_layout("4bit", 2, 64)
    pool = layout.allocate(6, DEVICE)
    table = torch.arange(6, dtype=torch.int32, device=DEVICE).view(2, 3)
    k, v = dequantize_kernel.dequantize_rotated(pool, layout, table, 37, torch.float16)
    k2, v2 = dequantize_kernel.dequantize_rotated(pool, layout, table, 45, torch.float16)
    assert len(kernel.jit_calls) == 1 and len(dequantize_kernel._PLANS) == 1
    (grid, args, _), (run,) = kernel.jit_calls[0], kernel.compiled.runs
    t = layout.block_size
    assert grid == (-(-37 // t), 2, 2) and run[:3] == (-(-45 // t), 2, 2)
    assert args[3] is k and args[-1] == 37
    passed = run[9:9 + len(args)]  # (the constexprs follow)
    assert passed[:3] == (pool, table, 3) and passed[3] is k2 and passed[4] is v2
    assert passed[5:8] == k2.stride()[:3] and passed[-1] == 45
    dequantize_kernel.dequantize_rotated(pool, layout, table, 48, torch.float16)  # divisible by 16
    dequantize_kernel.dequantize_rotated(pool, layout, table, 45, torch.float16, torch.zeros(2, 64))
    assert len(dequantize_kernel._PLANS) == 3 and len(kernel.jit_calls) == 3


def test_exact_overlay_plan_serves_every_ring_start(fake_triton, monkeypatch):
    """The exact tokens' launch after the dequantization keeps one plan wherever the ring starts and however long
    the prefix is (not specialized: a chat's every turn moves them), its grid one program per 16 positions of the
    prefix's and the ring's ranges; a rotation makes another plan."""
    monkeypatch.setattr(dequantize_kernel, "_OVERLAYS", fast_launch.PlanCache())
    names = dequantize_kernel._overlay_kernel.arg_names
    kernel = FakeKernel(names, list(range(names.index("OT"), len(names))))
    monkeypatch.setattr(dequantize_kernel, "_overlay_kernel", kernel)
    k = torch.empty(2, 2, 100, 64, dtype=torch.float16)
    v = torch.empty_like(k)
    ring, prefix = torch.randn(2, 2, 40, 64, dtype=torch.float16), torch.randn(2, 2, 4, 64, dtype=torch.float16)
    for lo, p_len in ((60, 4), (64, 3)):
        dequantize_kernel._overlay(dequantize_kernel.ExactTokens(ring, ring, lo, prefix, prefix, p_len, None, None),
                                   k, v, 100)
    assert len(kernel.jit_calls) == 1 and len(dequantize_kernel._OVERLAYS) == 1
    (grid, args, _), (run,) = kernel.jit_calls[0], kernel.compiled.runs
    assert grid == (1 + 7 - 3, 2, 2) and run[:3] == (1 + 7 - 4, 2, 2)  # prefix tile, ring tiles from lo // 16 to 7
    passed = run[9:9 + len(args)]
    assert passed[names.index("lo")] == 64 and passed[names.index("p_len")] == 3
    assert passed[names.index("ring_tile0")] == 4 and passed[names.index("ek_ptr")] is ring
    rotation = torch.eye(64, dtype=torch.float16)
    dequantize_kernel._overlay(dequantize_kernel.ExactTokens(ring, ring, 64, None, None, 0, rotation, None), k, v, 100)
    assert len(dequantize_kernel._OVERLAYS) == 2 and kernel.jit_calls[-1][0] == (3, 2, 2)


def test_window_plan_serves_every_forward_length_of_a_kind(fake_triton, monkeypatch):
    """A forward's exact window launches through one plan for new-token counts Triton compiles alike (a chat's next
    turns: grid set per call, a program per 16 slots), a new plan where the variant differs (16 new tokens, one
    new token) or the ring's kind does; a shape seen before finds its plan without working out its kind."""
    window_kernel = importlib.import_module("tq_hf.kernels.window")
    monkeypatch.setattr(window_kernel, "_PLANS", fast_launch.PlanCache())
    monkeypatch.setattr(window_kernel, "_KINDS", fast_launch.PlanCache())
    names = window_kernel._window_kernel.arg_names  # the runtime arguments, then the constexprs from D
    kernel = FakeKernel(names, list(range(names.index("D"), len(names))))
    monkeypatch.setattr(window_kernel, "_window_kernel", kernel)
    ring = torch.randn(1, 2, 24, 64, dtype=torch.float16)
    first = window_kernel.ring_window(ring, torch.randn(1, 2, 37, 64, dtype=torch.float16), 100)
    new = torch.randn(1, 2, 45, 64, dtype=torch.float16)
    second = window_kernel.ring_window(ring, new, 300)
    assert len(kernel.jit_calls) == 1 and len(window_kernel._KINDS) == 1 and len(window_kernel._PLANS) == 2
    (grid, args, _), (run,) = kernel.jit_calls[0], kernel.compiled.runs
    assert grid == (-(-(24 + 37) // 16), 2, 1) and run[:3] == (-(-(24 + 45) // 16), 2, 1)
    assert args[3] is first and args[4:7] == (100, 24, 37)
    passed = run[9:9 + len(args)]  # (the constexprs follow)
    assert passed[0] is ring and passed[1] is new and passed[3] is second and passed[4:7] == (300, 24, 45)
    assert passed[7:] == (2, *ring.stride()[:3], *new.stride()[:3], 0, 0)
    for count in (48, 1):  # divisible by 16; a single token
        window_kernel.ring_window(ring, torch.randn(1, 2, count, 64, dtype=torch.float16), 300)
    records = reference.encode_ring(ring.float())
    window_kernel.ring_window(records, new, 300, torch.zeros(2, 64))
    assert len(window_kernel._KINDS) == 4 and len(kernel.jit_calls) == 4
    window_kernel.ring_window(ring, new, 500)  # a shape seen before: its plan by the shape's key, launched directly
    assert len(kernel.jit_calls) == 4 and kernel.compiled.runs[-1][9 + 4] == 500


@pytest.mark.parametrize("case", ["unverified triton", "constexpr among the arguments", "constexpr by default"])
def test_launch_site_never_calls_directly_when_unsure(fake_triton, monkeypatch, case):
    names, constexprs, kwargs = ["x_ptr", "BLOCK"], [1], {"BLOCK": 16}
    if case == "unverified triton":
        monkeypatch.setattr(fast_launch, "_ENABLED", False)
    elif case == "constexpr among the arguments":
        names, constexprs = ["BLOCK", "x_ptr"], [0]
    else:
        names, constexprs, kwargs = ["x_ptr", "BLOCK", "EXTRA"], [1, 2], {"BLOCK": 16}
    kernel = FakeKernel(names, constexprs)
    site = fast_launch.LaunchSite(kernel, (1, 1, 1), kwargs)
    for t in ("t0", "t1", "t2"):
        site(t)
    assert len(kernel.jit_calls) == 3 and kernel.compiled.runs == []


def test_argument_key_tells_alignment_strides_and_kinds():
    buf = torch.zeros(65, dtype=torch.float16)
    a, b = buf[:64], buf[1:]
    assert fast_launch.argument_key(a) != fast_launch.argument_key(b)  # 2-byte offset: another pointer class
    assert fast_launch.argument_key(a) == fast_launch.argument_key(torch.zeros(64, dtype=torch.float16))
    assert fast_launch.argument_key(a.view(8, 8)) != fast_launch.argument_key(a.view(8, 8).t())
    assert fast_launch.argument_key([1, 2]) is list and fast_launch.argument_key(None) is type(None)


def _attention_call(layout, lens, dtype=torch.float16, **kw):
    pool, table = fill_cache(layout, lens, DEVICE)
    q = torch.randn(len(lens), 4 * layout.num_kv_heads, 1, layout.head_dim, device=DEVICE).to(dtype)
    seq = torch.tensor(lens, device=DEVICE)
    return q, pool, table, seq


def test_attention_plan_is_reused_and_bad_input_still_fails(monkeypatch):
    """A second call with arguments of the same kinds reuses the plan (and stays correct on fresh
    data); arguments of another kind make a new plan, so validation runs for them."""
    monkeypatch.setattr(attention_kernel, "_PLANS", fast_launch.PlanCache())
    layout = make_layout("4bit", 2, 64)
    for _ in range(2):
        q, pool, table, seq = _attention_call(layout, [37, 90])
        out = torch.full_like(q, float("nan"))
        unified_attention(q, pool, layout, table, seq, default_scale(64), out=out, max_seq_len=90)
        want = reference.paged_attention(q.float(), pool, layout, table, seq, default_scale(64))
        assert rel_error(out, want) <= attention_tolerance(q.dtype, want)
    assert len(attention_kernel._PLANS) == 1
    unified_attention(q, pool, layout, table, seq, default_scale(64), out=out, max_seq_len=100)
    assert len(attention_kernel._PLANS) == 1, "max_seq_len 90 and 100 round to one plan (128)"
    with pytest.raises(TypeError, match="query has dtype"):
        unified_attention(q.to(torch.int16), pool, layout, table, seq, default_scale(64))
    with pytest.raises(ValueError, match="out must be"):
        unified_attention(q, pool, layout, table, seq, default_scale(64), out=out[:1])
    with pytest.raises(ValueError, match="seq_lens must be"):
        unified_attention(q, pool, layout, table, seq[:1], default_scale(64), out=out)
    with pytest.raises(ValueError, match="recent_from must be"):
        unified_attention(q, pool, layout, table, seq, default_scale(64), out=out, max_seq_len=90, recent_from=-1)
    with pytest.raises(TypeError, match="scale must be"):
        unified_attention(q, pool, layout, table, seq, float("nan"), out=out, max_seq_len=90)


def test_store_plan_is_reused_and_bad_input_still_fails(monkeypatch):
    monkeypatch.setattr(store_kernel, "_PLANS", fast_launch.PlanCache())
    layout = make_layout("4bit", 2, 64)
    for _ in range(2):
        k, v = (torch.randn(3, 2, 64, device=DEVICE) for _ in range(2))
        slots = torch.tensor([0, 5, -1], device=DEVICE)
        got, want = layout.allocate(2, DEVICE), layout.allocate(2, DEVICE)
        store_kv(got, layout, k, v, slots)
        reference.store(want, layout, k, v, slots)
        assert torch.equal(got, want)
    assert len(store_kernel._PLANS) == 1
    with pytest.raises(TypeError, match="slots has dtype"):
        store_kv(got, layout, k, v, slots.float())
    with pytest.raises(ValueError, match="must agree on N"):
        store_kv(got, layout, k, v[:2], slots)


def test_plan_cache_drops_everything_when_full():
    cache = fast_launch.PlanCache()
    cache.limit = 3
    for i in range(3):
        cache.put(i, str(i))
    assert cache.put(3, "3") == "3" and list(cache) == [3]


# ---- the direct call on the GPU ------------------------------------------------------------------
@pytest.mark.gpu
def test_direct_launch_matches_reference_gpu():
    """Decode at B=1 (split, so the reduction's site too) through the direct call: fresh tensors per
    call, a query at a 2-byte offset (another specialization: a new plan), and a launch hook
    installed (Triton's own path, the hook sees the launch)."""
    from triton import knobs

    layout = make_layout("4bit", 8, 128)
    scale = default_scale(128)

    def check(q, pool, table, seq):
        out = torch.full_like(q, float("nan"))
        unified_attention(q, pool, layout, table, seq, scale, out=out, max_seq_len=4096)
        want = reference.paged_attention(q.float(), pool, layout, table, seq, scale)
        assert rel_error(out, want) <= attention_tolerance(q.dtype, want)

    for _ in range(3):
        pool, table = fill_cache(layout, [4000], "cuda")
        q = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.float16)
        check(q, pool, table, torch.tensor([4000], device="cuda"))
    plans = [p for p in attention_kernel._PLANS.values() if p.layout is layout]
    assert len(plans) == 1 and plans[0].split
    if fast_launch._ENABLED:
        assert plans[0].attention._kernel is not None and plans[0].reduce._kernel is not None
    seq = torch.tensor([4000], device="cuda")
    buf = torch.randn(32 * 128 + 1, device="cuda", dtype=torch.float16)
    check(buf[1:].view(1, 32, 1, 128), pool, table, seq)
    assert len([p for p in attention_kernel._PLANS.values() if p.layout is layout]) == 2
    seen = []
    hook = lambda metadata: seen.append(metadata)  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        check(q, pool, table, seq)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert len(seen) == 2  # the attention kernel and the reduction, through Triton's path


@pytest.mark.gpu
def test_direct_store_matches_reference_gpu():
    """Decode-sized stores through the direct call, fresh tensors per call, the last at a 2-byte offset;
    bytes as the spec on the CPU (compare_pools tolerates only boundary code flips)."""
    layout = make_layout("4bit", 8, 128)
    for offset in (0, 0, 0, 1):
        buf = torch.randn(2, 3 * 8 * 128 + 1, device="cuda", dtype=torch.float16)
        k, v = (b[offset:offset + 3 * 8 * 128].view(3, 8, 128) for b in buf)
        slots = torch.tensor([7, 0, 100], device="cuda")
        got = layout.allocate(8, "cuda").fill_(0x5A)
        want = got.cpu()
        store_kv(got, layout, k, v, slots)
        reference.store(want, layout, k.cpu(), v.cpu(), slots.cpu())
        compare_pools(got.cpu(), want, layout, k.cpu(), slots.cpu())
    plans = [p for p in store_kernel._PLANS.values() if p.layout is layout]
    assert len(plans) == 2
    if fast_launch._ENABLED:
        assert all(p.site._kernel is not None for p in plans)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_launches_run_on_the_device_of_the_pool_gpu():
    """Under a device_map a layer's cache sits on another GPU than the current device: its store and
    attention must launch there, on that GPU's current stream (where its inputs were produced), and
    match the reference, through Triton's path (a hook sees the stream) and the direct call."""
    from triton import knobs

    layout = make_layout("4bit", 8, 128)
    scale = default_scale(128)
    with torch.cuda.device(0):
        k, v = (torch.randn(3000, 8, 128, device="cuda:1", dtype=torch.float16) for _ in range(2))
        pool = layout.allocate(3000 // 16 + 2, "cuda:1").fill_(0x5A)
        want_pool = pool.cpu()
        slots = torch.arange(3000, device="cuda:1")
        streams = []
        hook = lambda metadata: streams.append(metadata.get()["stream"])  # noqa: E731
        knobs.runtime.launch_enter_hook.add(hook)
        try:
            store_kv(pool, layout, k, v, slots)
        finally:
            knobs.runtime.launch_enter_hook.remove(hook)
        reference.store(want_pool, layout, k.cpu(), v.cpu(), slots.cpu())
        compare_pools(pool.cpu(), want_pool, layout, k.cpu(), slots.cpu())
        table = torch.arange(3000 // 16 + 1, device="cuda:1", dtype=torch.int32)[None]
        seq = torch.tensor([3000], device="cuda:1")
        for with_hook in (True, False, False):
            q = torch.randn(1, 32, 1, 128, device="cuda:1", dtype=torch.float16)
            out = torch.full_like(q, float("nan"))
            if with_hook:
                knobs.runtime.launch_enter_hook.add(hook)
            try:
                unified_attention(q, pool, layout, table, seq, scale, out=out, max_seq_len=3000)
            finally:
                knobs.runtime.launch_enter_hook.remove(hook)
            want = reference.paged_attention(q.float(), pool, layout, table, seq, scale)
            assert rel_error(out, want) <= attention_tolerance(q.dtype, want)
        assert torch.cuda.current_device() == 0
    assert len(streams) >= 2 and set(streams) == {torch.cuda.current_stream(1).cuda_stream}


def test_plans_hold_no_caller_tensors():
    """A plan outlives the call that made it: it must not keep the caller's pool, query, output or
    tables alive (a decode server frees and reallocates them)."""
    import gc
    import weakref

    layout = make_layout("4bit", 2, 64)
    q, pool, table, seq = _attention_call(layout, [37, 90])
    out = torch.empty_like(q)
    unified_attention(q, pool, layout, table, seq, default_scale(64), out=out, max_seq_len=90)
    k = torch.randn(3, 2, 64, device=DEVICE)
    store_kv(pool, layout, k, k, torch.tensor([0, 1, 2], device=DEVICE))
    refs = [weakref.ref(t) for t in (q, pool, table, seq, out, k)]
    del q, pool, table, seq, out, k
    gc.collect()
    assert all(r() is None for r in refs)


def test_split_partials_follow_the_workspace(monkeypatch):
    """The cached partial views always lie in the current workspace, also after it grew."""
    monkeypatch.setattr(workspace, "_WORKSPACES", {})
    monkeypatch.setattr(workspace, "_PARTIALS", {})
    cpu = torch.device("cpu")
    pout, plse = workspace.split_partials(cpu, 64, 80)
    buf = workspace._WORKSPACES["cpu"]
    assert (pout.data_ptr(), pout.numel(), plse.data_ptr(), plse.numel()) == (buf.data_ptr(), 64, buf.data_ptr() + 256, 16)
    assert workspace.split_partials(cpu, 64, 80)[0] is pout  # cached: no slicing per call
    workspace.split_partials(cpu, 1000, 1200)  # a larger launch: the workspace is replaced
    grown = workspace._WORKSPACES["cpu"]
    assert grown.data_ptr() != buf.data_ptr()
    pout, plse = workspace.split_partials(cpu, 64, 80)
    assert pout.data_ptr() == grown.data_ptr() and plse.data_ptr() == grown.data_ptr() + 256
