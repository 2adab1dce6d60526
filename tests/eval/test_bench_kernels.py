"""The kernel benchmark's preset names: what each column of its tables measures (CPU; the timing needs a GPU)."""

import pytest
import torch

from eval.bench_kernels import exact_buffers, make_config
from tq_hf.config import TurboQuantConfig
from tq_hf.layout import BlockLayout


@pytest.mark.parametrize("preset", ["4bit", "k8v4", "k3v4", "3bit"])
def test_preset_names(preset):
    plain, opts, defaults = make_config(preset), make_config(preset + "+opts"), make_config(preset + "+defaults")
    levers = ("key_centering", "value_rotation", "exact_prefix_tokens", "recent_window")
    assert [getattr(plain, f) for f in levers] == [False, False, 0, 0]  # the plain format
    assert [getattr(opts, f) for f in levers] == [True, True, 0, 0]
    assert defaults == TurboQuantConfig.from_preset(preset)  # as TurboQuantCache takes it
    assert defaults.exact_prefix_tokens > 0 and defaults.recent_window > 0
    for cfg in (plain, opts):  # the levers aside, the same format
        assert (cfg.key_bits, cfg.value_bits, cfg.block_size) == (defaults.key_bits, defaults.value_bits, None)


def test_exact_buffers_shapes():
    layout = BlockLayout(make_config("4bit+defaults"), 3, 64)
    extra = exact_buffers(layout, 2, 4, 128, device="cpu")
    assert extra["prefix_keys"].shape == extra["prefix_values"].shape == (2, 3, 4, 64)
    assert extra["recent_keys"].shape == extra["recent_values"].shape == (2, 3, 128, 64)
    assert extra["recent_from"] == 0 and extra["prefix_keys"].dtype == torch.float16
    assert not torch.equal(extra["prefix_keys"], extra["prefix_values"])
    assert exact_buffers(layout, 2, 0, 0, device="cpu") == {}
