"""Held launch plans (HeldAttention, HeldStore): a decode step reuses the previous step's plan and lasting
arguments only while it names the same tensors and settings; after anything that replaces them it plans anew.

Stale reuse would read or write buffers the cache no longer uses, so every replaced buffer is poisoned (0xFF pool
bytes are NaN scales, NaN exact buffers) and every output is compared with reference.py's over the live state.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig

from tq_hf import TurboQuantCache, ops, reference
from tq_hf.attention import turboquant_attention_forward
from tq_hf.config import TurboQuantConfig
from tq_hf.kernels import HeldAttention, HeldStore, store_kv, unified_attention
from tq_hf.kernels import attention as attention_kernel

from kernel_helpers import (DEVICE, attention_tolerance, compare_pools, default_scale, exact_prefix, fill_cache,
                            make_layout, rel_error)

HEADS, KV_HEADS, DIM = 4, 2, 64  # block_size 16 at head_dim 64


@pytest.fixture(autouse=True)
def on_the_kernels_device():
    """Every tensor these tests make lives where fill_cache's pools do (the GPU where there is one)."""
    with torch.device(DEVICE):
        yield


@pytest.fixture
def holds(monkeypatch):
    """Counts of plans held (a call that could not reuse the held one), by launcher."""
    counts = {"store": 0, "attention": 0}
    for name, cls in (("store", HeldStore), ("attention", HeldAttention)):
        original = cls.hold

        def counting(self, *args, _name=name, _original=original):
            counts[_name] += 1
            return _original(self, *args)
        monkeypatch.setattr(cls, "hold", counting)
    return counts


def test_held_attention_replans_for_replaced_tensors_and_settings(holds):
    """unified_attention with a HeldAttention: same tensors -> reused; a new block table or pool, another
    max_seq_len bucket or scale -> planned anew; each output (written into a NaN-poisoned buffer) matches
    reference.py over the tensors of that call."""
    layout = make_layout("4bit", KV_HEADS, DIM)
    held = HeldAttention()
    pool, table = fill_cache(layout, [37, 90])
    seq = torch.tensor([37, 90], dtype=torch.int32)
    scale = default_scale(DIM)

    def check(pool, table, seq, max_seq_len, scale=scale):
        q = torch.randn(2, HEADS, 1, DIM)
        out = torch.full_like(q, float("nan"))
        unified_attention(q, pool, layout, table, seq, scale, out=out, max_seq_len=max_seq_len, held=held)
        want = reference.paged_attention(q, pool, layout, table, seq, scale)
        assert rel_error(out, want) <= attention_tolerance(q.dtype, want)

    check(pool, table, seq, 90)
    check(pool, table, seq, 100)  # the same bucket (128): reused
    assert holds["attention"] == 1
    pool2, table2 = fill_cache(layout, [37, 90])  # another pool and (scattered) table: what a regrowth does
    pool.fill_(0xFF)
    check(pool2, table2, seq, 100)
    assert holds["attention"] == 2
    seq.fill_(20)  # in place (a crop): the same tensor, read by the kernel at launch
    check(pool2, table2, seq, 20)  # another bucket (32)
    check(pool2, table2, seq, 20, scale=0.5)
    assert holds["attention"] == 4
    check(pool2, table2, seq, 20, scale=0.5)
    assert holds["attention"] == 4


def test_a_converted_key_offset_is_never_held(holds):
    """A key_offset the launcher converts (here fp16) is not kept by a held launch: a copy would miss in-place
    writes to the caller's tensor. Each call reads the offset as it is then."""
    layout = make_layout("4bit", KV_HEADS, DIM, key_centering=True)
    mu = torch.randn(KV_HEADS, DIM)
    pool, table = fill_cache(layout, [37, 50], key_offset=mu)
    seq = torch.tensor([37, 50], dtype=torch.int32)
    offset = mu.half()
    # exact prefix keys are not centred: moving the offset moves the pool's keys against them
    prefix_keys, prefix_values = exact_prefix(layout, 2, 4)
    held = HeldAttention()
    for _ in range(2):
        q = torch.randn(2, HEADS, 1, DIM) * 3
        out = torch.full_like(q, float("nan"))
        unified_attention(q, pool, layout, table, seq, 0.1, out=out, max_seq_len=50, key_offset=offset,
                          prefix_keys=prefix_keys, prefix_values=prefix_values, held=held)
        want = reference.paged_attention(q, pool, layout, table, seq, 0.1, key_offset=offset.float(),
                                         prefix_keys=prefix_keys, prefix_values=prefix_values)
        assert rel_error(out, want) <= attention_tolerance(q.dtype, want)
        offset.add_(2.0)  # the caller moves its offset in place
    assert holds["attention"] == 0, "a converted key_offset must not be held"


def test_held_store_replans_for_replaced_tensors(holds):
    """store_kv with a HeldStore: the same pool, slots, ring and lengths -> reused, with each call's tokens (a decode
    step's [R, H, 1, D]), start and slot_shift; another pool or other slots -> planned anew. Pools, ring and lengths
    match reference.store's (given [N, H, D] tokens and the summed slots)."""
    layout = make_layout("4bit", KV_HEADS, DIM)
    held = HeldStore()
    first = torch.tensor([0, 16])  # 2 rows, one block of 16 tokens apart

    def check(pool, slots, ring, lens, start, shift):
        key, value = torch.randn(2, KV_HEADS, DIM), torch.randn(2, KV_HEADS, DIM)
        want, want_ring, want_lens = pool.clone(), (ring[0].clone(), ring[1].clone()), lens.clone()
        # as a decode step passes them: [rows, H, 1, D], one token per row
        store_kv(pool, layout, key.unsqueeze(2), value.unsqueeze(2), slots, recent=ring, start=start, seq_lens=lens,
                 slot_shift=shift, held=held)
        summed = slots + shift
        reference.store(want, layout, key, value, summed, recent=want_ring, start=start, seq_lens=want_lens)
        compare_pools(pool, want, layout, key, summed)
        assert torch.equal(lens, want_lens)
        assert torch.equal(ring[0], want_ring[0]) and torch.equal(ring[1], want_ring[1])

    pool = layout.allocate(8, DEVICE)
    ring = (torch.zeros(2, KV_HEADS, 4, DIM), torch.zeros(2, KV_HEADS, 4, DIM))
    lens = torch.zeros(2, dtype=torch.int32)
    check(pool, first, ring, lens, 3, 3)
    check(pool, first, ring, lens, 4, 4)
    assert holds["store"] == 1
    grown = layout.allocate(16, DEVICE)
    pool.fill_(0xFF)
    check(grown, first, ring, lens, 5, 5)
    check(grown, torch.tensor([0, 32]), ring, lens, 6, 6)  # rows laid out further apart (a grown pool's table)
    assert holds["store"] == 3


def test_held_attention_follows_a_replaced_split_workspace(holds, monkeypatch):
    """A held split plan keeps views of the shared split workspace; when a larger plan replaces that workspace the
    held plan is made anew (it must not keep the old buffer alive, nor write where others do not read)."""
    from tq_hf.kernels import workspace

    monkeypatch.setattr(workspace, "_WORKSPACES", {})
    monkeypatch.setattr(workspace, "_PARTIALS", {})
    layout = make_layout("4bit", KV_HEADS, DIM)
    held = HeldAttention()
    pool, table = fill_cache(layout, [300, 301])
    seq = torch.tensor([300, 301], dtype=torch.int32)
    q = torch.randn(2, HEADS, 1, DIM)
    out = torch.full_like(q, float("nan"))
    unified_attention(q, pool, layout, table, seq, 0.1, out=out, max_seq_len=301, held=held)
    assert attention_kernel.plan_attention(q, pool, layout, table, seq, 0.1, max_seq_len=301).split
    workspace.split_workspace(pool.device, 1 << 22)  # another launch needed more: replaced
    out.fill_(float("nan"))
    unified_attention(q, pool, layout, table, seq, 0.1, out=out, max_seq_len=301, held=held)
    want = reference.paged_attention(q, pool, layout, table, seq, 0.1)
    assert rel_error(out, want) <= attention_tolerance(q.dtype, want)
    assert holds["attention"] == 2


class Twins:
    """One-layer TurboQuantCaches fed the same tokens: `kernels` through the launchers (held plans, the Triton
    interpreter on CPU), `reference` through reference.py; each decode step's attention outputs are compared."""

    def __init__(self, monkeypatch):
        self.use = {"kernels": False}
        monkeypatch.setattr(ops, "use_kernels", lambda t: self.use["kernels"])
        cfg = LlamaConfig(hidden_size=HEADS * DIM, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                          head_dim=DIM, num_hidden_layers=1, intermediate_size=16, vocab_size=16)
        cfg._attn_implementation = "turboquant"
        # a short ring and prefix, so most positions are read from the pool; no per-layer dense check
        tq = TurboQuantConfig.from_preset("4bit", recent_window=4, exact_prefix_tokens=2, dense_layer_kl=None)
        self.caches = {"kernels": TurboQuantCache(cfg, tq_config=tq), "reference": TurboQuantCache(cfg, tq_config=tq)}
        self.module = torch.nn.Module()
        self.module.is_causal = True

    @property
    def layer(self):
        return self.caches["kernels"].layers[0]

    def prefill(self, rows: int, tokens: int) -> None:
        k, v = torch.randn(rows, KV_HEADS, tokens, DIM), torch.randn(rows, KV_HEADS, tokens, DIM)
        for path, cache in self.caches.items():
            self.use["kernels"] = path == "kernels"
            cache.update(k, v, 0)

    def decode(self, steps: int = 1, **attention_kwargs) -> None:
        for _ in range(steps):
            rows = self.layer.rows
            q = torch.randn(rows, HEADS, 1, DIM)
            k, v = torch.randn(rows, KV_HEADS, 1, DIM), torch.randn(rows, KV_HEADS, 1, DIM)
            out = {}
            for path, cache in self.caches.items():
                self.use["kernels"] = path == "kernels"
                keys, values = cache.update(k, v, 0)
                out[path] = turboquant_attention_forward(self.module, q, keys, values, None,
                                                         scaling=default_scale(DIM), **attention_kwargs)[0]
            want = out["reference"]
            assert rel_error(out["kernels"], want) <= attention_tolerance(q.dtype, want) + 2e-3

    def both(self, method: str, *args) -> None:
        for path, cache in self.caches.items():
            self.use["kernels"] = path == "kernels"
            getattr(cache, method)(*args)

    def poison(self, buffers: list[torch.Tensor]) -> None:
        """Buffers the kernel-path layer no longer uses: any stale read or write shows."""
        for t in buffers:
            t.fill_(0xFF if t.dtype == torch.uint8 else 127 if t.dtype == torch.int8 else float("nan"))


@pytest.mark.parametrize("drops", [True, False], ids=["layer drops", "signature alone"])
def test_decode_steps_reuse_plans_and_replan_after_cache_events(monkeypatch, holds, drops):
    """A decode step reuses the layer's held plans; growth of the pool, a beam reorder, a batch selection, a crop
    and a reset with another batch each make it plan anew, and every step matches the reference path. The layer
    drops its held plans when it replaces buffers (to free them early); without those drops the signature check
    alone must still replan."""
    if not drops:
        def keep(self):  # only the first call (from __init__) sets the slots
            if not hasattr(self, "store"):
                self.store = self.attention = self.kernels = None
        monkeypatch.setattr(ops.HeldLaunches, "drop", keep)
    twins = Twins(monkeypatch)
    twins.prefill(3, 40)  # 3 blocks of 16 per row
    twins.decode(3)
    assert holds == {"store": 1, "attention": 1}, "steps after the first reuse the held plans"

    old = twins.layer.pool
    twins.decode(9)  # past 48 tokens: the pool grows (a new pool and block table)
    assert twins.layer.pool is not old
    twins.poison([old])
    twins.decode(2)
    assert holds["store"] == holds["attention"] == 2

    old = [twins.layer.pool, twins.layer.recent_keys, twins.layer.recent_values]
    twins.both("reorder_cache", torch.tensor([2, 0, 1]))
    twins.poison(old)
    twins.decode(2)
    assert holds["store"] == holds["attention"] == 3

    old = [twins.layer.pool, twins.layer.recent_keys, twins.layer.recent_values]
    twins.both("batch_select_indices", torch.tensor([0, 2]))
    twins.poison(old)
    twins.decode(2)
    assert holds["store"] == holds["attention"] == 4

    twins.both("crop", -5)  # the same buffers, a lower length and ring start: per-call arguments
    twins.decode(2)
    assert holds["store"] == 4

    old = [twins.layer.pool, twins.layer.recent_keys, twins.layer.recent_values]
    twins.both("reset")
    twins.prefill(1, 20)
    twins.poison(old)
    twins.decode(2)
    assert holds["store"] == holds["attention"] == 5


def test_settled_decode_steps_launch_their_held_plans_directly(monkeypatch, holds):
    """A settled layer's one-token step whose held launches serve it skips the general calls (ops.store,
    ops.paged_attention and the launchers' keyword plumbing): only steps that plan anew take them (the first, after
    the pool grows, with a sliding window that the held attention plan lacks), and every step matches the reference
    path."""
    twins = Twins(monkeypatch)
    general = {"store": [], "paged_attention": []}
    for name, calls in general.items():
        def counting(*args, _calls=calls, _original=getattr(ops, name), **kwargs):
            _calls.append(twins.use["kernels"])
            return _original(*args, **kwargs)
        monkeypatch.setattr(ops, name, counting)

    def general_calls(name: str) -> int:
        return general[name].count(True)
    twins.prefill(2, 40)
    twins.decode(1)  # (this step also settles what the prefill left open: its calls are not counted)
    assert holds == {"store": 1, "attention": 1}
    for calls in general.values():
        calls.clear()
    twins.decode(4)
    assert general_calls("store") == 0, "held stores go straight to their launch"
    assert general_calls("paged_attention") == 0, "held attention too"
    assert general["paged_attention"].count(False) == 4, "the reference path has no held launch"
    twins.decode(9)  # the pool grows past 48 tokens: one step plans anew
    assert general_calls("store") == holds["store"] - 1 == 1
    assert general_calls("paged_attention") == holds["attention"] - 1 == 1
    twins.decode(2, sliding_window=8)  # another attention setting: planned anew once, then held
    assert general_calls("paged_attention") == holds["attention"] - 1 == 2
    twins.decode(2)
    assert general_calls("paged_attention") == holds["attention"] - 1 == 3
    assert general_calls("store") == holds["store"] - 1 == 1


def test_reset_lets_go_of_held_buffers(monkeypatch):
    """The held plans reference the layer's buffers: a reset (a new batch to come) drops them, so the old pool can
    be freed before the next prefill allocates."""
    twins = Twins(monkeypatch)
    twins.prefill(2, 20)
    twins.decode(2)
    launches = twins.layer.launches
    assert launches.store is not None and launches.attention is not None
    twins.both("reset")
    assert launches.store is None and launches.attention is None


def test_a_copied_cache_holds_nothing_and_decodes_on_its_own_tensors(monkeypatch):
    """copy.deepcopy of a cache (reusing a prompt's cache) copies no held plan (nor a compiled kernel); the copy's
    decode steps plan over its own tensors and match the reference path, the original's too."""
    twins = Twins(monkeypatch)
    twins.prefill(2, 20)
    twins.decode(2)
    originals = dict(twins.caches)
    twins.caches = {path: copy.deepcopy(cache) for path, cache in originals.items()}
    launches = twins.layer.launches
    assert launches.store is None and launches.attention is None
    twins.decode(2)
    twins.caches = originals
    twins.decode(1)
