"""eval.launch_overhead: the held launches it replays and its write check (no timing asserted; the timing needs a
GPU and runs there)."""

from __future__ import annotations

import torch

from eval.host_overhead import LAUNCHES, stubbed_launches
from eval.launch_overhead import _layer_with_held_launches, _same_writes


def test_the_cache_holds_its_launches_and_the_tensor_way_replays_them():
    """On CPU tensors with the launches stubbed: a layer's decode steps hold the store and the attention, the recorded
    calls replay through both ways, and the tensor way launches what a held step does (store, attention, reduction)."""
    with stubbed_launches():
        layer, store_call, attention_call = _layer_with_held_launches("4bit", 300, device="cpu")
        held_s, held_a = layer.launches.store, layer.launches.attention
        before = LAUNCHES[0]
        held_s.launch_tensors(*store_call)
        held_a.launch_tensors(*attention_call)
        by_tensors = LAUNCHES[0] - before
        held_s.launch(*store_call)
        held_a.launch(*attention_call)
        assert LAUNCHES[0] - before == 2 * by_tensors and by_tensors == 2 + held_a._plan.split


def test_same_writes_needs_equal_bytes_and_a_write():
    target = torch.zeros(4)
    assert _same_writes(lambda: target.__setitem__(1, 3.0), lambda: target.__setitem__(1, 3.0), [target])
    assert not _same_writes(lambda: target.__setitem__(1, 3.0), lambda: target.__setitem__(2, 3.0), [target])
    assert not _same_writes(lambda: None, lambda: None, [target]), "nothing written must not count as the same"
    assert torch.equal(target, torch.zeros(4)), "the target is restored"
