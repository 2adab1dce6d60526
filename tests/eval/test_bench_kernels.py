"""The kernel benchmark's preset names: what each column of its tables measures (CPU; the timing needs a GPU)."""

import pytest
import torch

from eval.bench_kernels import decode_plot, exact_buffers, make_config, markdown
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


def _results(points):
    """A benchmark report with one decode row per (B, S); k8v4 left out of the last row (not timed there)."""
    rows = []
    for i, (b, s) in enumerate(points):
        cell = {"ms": 0.1 * (i + 1), "ratio_vs_fp16": 0.5, "GBps": 100.0}
        rows.append({"B": b, "S": s, "Hq": 32, "Hk": 8, "D": 128, "sdpa_fp16_ms": 0.2, "4bit": cell,
                     **({"k8v4": dict(cell)} if i < len(points) - 1 else {})})
    return {"gpu": "test GPU", "command": "python -m eval.bench_kernels --x", "torch": "t", "triton": "t", "python": "p",
            "block_size": None, "decode": rows, "prefill": [], "store_step": [], "skipped": []}


def test_markdown_starts_with_the_command_and_marks_cells_not_timed():
    md = markdown(_results([(1, 1024), (1, 4096)]))
    assert md.splitlines()[2].startswith("Command: `python -m eval.bench_kernels --x`")
    assert "| 1 | 4096 | 32/8/128 | 0.2000 | 0.2000 (x0.50, 100 GB/s) | - |" in md


def test_decode_plot_draws_curves_only(tmp_path):
    assert decode_plot(tmp_path / "lengths.png", _results([(1, 1024), (1, 4096), (1, 32768)]))
    assert decode_plot(tmp_path / "batches.png", _results([(1, 32768), (16, 32768)]))  # one length: batch on x
    assert (tmp_path / "lengths.png").stat().st_size > 0 and (tmp_path / "batches.png").exists()
    assert not decode_plot(tmp_path / "point.png", _results([(16, 32768)]))  # a single point is no curve
    assert not (tmp_path / "point.png").exists()
