"""The kernel benchmark's preset names: what each column of its tables measures (CPU; the timing needs a GPU)."""

import dataclasses

import pytest
import torch

from eval.bench_kernels import (DECODE_SHAPES, MAX_FP16_KV_BYTES, decode_grid, decode_plot, decode_points,
                                decode_read_bytes, exact_buffers, floor_fields, forward_buffers, fp16_kv_bytes,
                                make_config, markdown, parse_args)
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
    # field overrides after the suffix, as eval.common.split_overrides reads them
    assert make_config(preset + "+defaults@recent_window=256") == TurboQuantConfig.from_preset(preset, recent_window=256)
    assert make_config(preset + "@recent_window=64").recent_window == 64
    assert make_config(preset + "@recent_window=64").exact_prefix_tokens == 0
    # a block size in the name wins over the argument (it raised a duplicate keyword before)
    assert make_config(preset + "+defaults@block_size=64", block_size=16).block_size == 64
    assert make_config(preset + "@block_size=32").block_size == 32
    assert make_config(preset, block_size=32).block_size == 32


def test_exact_buffers_shapes():
    layout = BlockLayout(make_config("4bit+defaults"), 3, 64)
    extra = exact_buffers(layout, 2, 4, 128, device="cpu", ring_records=False)
    assert extra["prefix_keys"].shape == extra["prefix_values"].shape == (2, 3, 4, 64)
    assert extra["recent_keys"].shape == extra["recent_values"].shape == (2, 3, 128, 64)
    records = exact_buffers(layout, 2, 4, 128, device="cpu")  # 4bit's default ring: int8 records
    assert records["recent_keys"].shape == (2, 3, 128, 64 + 16) and records["recent_keys"].dtype == torch.int8
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
    assert "Causal prefill" not in md and "Store of one decode step" not in md  # sections not run: left out
    ran = _results([(1, 1024)])
    ran["store_step"] = [{"preset": "4bit", "store_ms": 0.008, "decode_ms": 0.2, "store_fraction": 0.04}]
    assert "## Store of one decode step" in markdown(ran) and "- 4bit: store 8.0 us" in markdown(ran)


def test_decode_plot_draws_curves_only(tmp_path):
    assert decode_plot(tmp_path / "lengths.png", _results([(1, 1024), (1, 4096), (1, 32768)]))
    assert decode_plot(tmp_path / "batches.png", _results([(1, 32768), (16, 32768)]))  # one length: batch on x
    assert (tmp_path / "lengths.png").stat().st_size > 0 and (tmp_path / "batches.png").exists()
    assert not decode_plot(tmp_path / "point.png", _results([(16, 32768)]))  # a single point is no curve
    assert not (tmp_path / "point.png").exists()


# Bytes per (token, KV head) from the format description (config.py, layout.py), K and V together:
# 4-bit codes D/2 bytes each for keys and values, FP8 keys one byte per coordinate, 3 bf16 metadata fields.
BY_HAND = {("4bit", 128): 64 + 64 + 6, ("4bit", 256): 128 + 128 + 6,
           ("k8v4", 128): 128 + 64 + 6, ("k8v4", 256): 256 + 128 + 6}


@pytest.mark.parametrize("preset, d", list(BY_HAND))
def test_decode_read_bytes_plain_format(preset, d):
    layout = BlockLayout(make_config(preset), 8, d)
    assert layout.plane_bytes / layout.block_size == BY_HAND[preset, d]
    assert decode_read_bytes(layout, 2, 1000, 0, 0) == 2 * 1000 * 8 * BY_HAND[preset, d]


@pytest.mark.parametrize("preset, d", list(BY_HAND))
def test_decode_read_bytes_with_prefix_and_ring(preset, d):
    """+defaults with recent_format "int8": 4 exact leading tokens read as fp16 K and V and a 128-token ring of int8
    records (D codes and a tail of a 16-bit scale per 16 of them, 16 bytes at D=128 and 32 at 256, for K and for V),
    instead of the pool."""
    layout = BlockLayout(dataclasses.replace(make_config(preset + "+defaults"), recent_format="int8"), 4, d)
    cfg = layout.config
    assert (cfg.exact_prefix_tokens, cfg.recent_window) == (4, 128)
    exact_ring = BlockLayout(dataclasses.replace(make_config(preset + "+defaults"), recent_format="exact"), 4, d)
    assert decode_read_bytes(exact_ring, 1, 130, 4, 128) == 4 * 130 * 2 * d * 2
    tail = 16 if d <= 128 else 32
    exact, ring = 2 * d * 2, 2 * (d + tail)  # fp16 K + V of one (token, head); its two ring records
    assert decode_read_bytes(layout, 3, 1024, 4, 128) == 3 * 4 * ((1024 - 4 - 128) * BY_HAND[preset, d] + 4 * exact
                                                                   + 128 * ring)
    assert decode_read_bytes(layout, 1, 100, 4, 128) == 4 * 100 * ring  # the ring covers every position
    assert decode_read_bytes(layout, 1, 130, 4, 128) == 4 * (2 * exact + 128 * ring)  # ring 2..129, prefix 0..1
    kw = exact_buffers(layout, 2, 4, 16, device="cpu")
    assert kw["recent_keys"].dtype == torch.int8 and kw["recent_keys"].shape == (2, 4, 16, d + tail)
    assert exact_buffers(layout, 2, 4, 16, device="cpu", ring_records=False)["recent_keys"].dtype == torch.float16


def test_fp16_bytes_and_floor():
    assert fp16_kv_bytes(16, 32768, 8, 128) == 2 * 16 * 32768 * 8 * 128 * 2  # 2 GiB
    cell = floor_fields(2 * 10**9, 0.5, 4000.0, "fp16_")  # 2 GB at 4000 GB/s: 0.5 ms
    assert cell == {"fp16_bytes": 2 * 10**9, "fp16_floor_ms": 0.5, "fp16_ratio_vs_floor": 1.0}
    assert floor_fields(10**9, 1.0, 4000.0)["ratio_vs_floor"] == 4.0


def test_decode_shapes_and_quick():
    assert DECODE_SHAPES[:2] == [(32, 8, 128), (9, 3, 64)]
    assert {(32, 8, 64), (8, 4, 256), (32, 16, 256)} <= set(DECODE_SHAPES)
    shapes, batches, lengths, presets = decode_grid(parse_args(["--quick"]))
    assert (shapes, batches, lengths, presets) == ([(32, 8, 128)], [1, 16], [4096, 32768], ["4bit", "k8v4"])
    shapes, batches, lengths, presets = decode_grid(parse_args([]))
    assert shapes == DECODE_SHAPES and lengths[-1] == 131072 and presets == ["4bit", "k8v4", "k3v4", "3bit"]
    args = parse_args(["--batches", "4", "--lengths", "512", "--presets", "k3v4+defaults",
                       "--skip", "prefill", "store"])
    assert decode_grid(args)[1:] == ([4], [512], ["k3v4+defaults"]) and args.skip == ["prefill", "store"]
    assert decode_grid(parse_args(["--shapes", "8/4/256", "32/16/256"]))[0] == [(8, 4, 256), (32, 16, 256)]
    for bad in ("8/4", "8/3/128", "a/4/256"):
        with pytest.raises(SystemExit):
            parse_args(["--shapes", bad])


def test_decode_points_skip_shapes_too_large_for_fp16():
    skipped = []
    points = list(decode_points(DECODE_SHAPES, [1, 16], [131072, 262144], skipped))
    assert (32, 16, 256, 16, 131072) in points  # 32 GiB of fp16 K+V
    assert (32, 16, 256, 16, 262144) not in points and (9, 3, 64, 16, 262144) in points
    assert all(fp16_kv_bytes(b, s, hk, d) <= MAX_FP16_KV_BYTES for _, hk, d, b, s in points)
    assert skipped == ["decode B=16 S=262144 32/16/256: fp16 K+V 64 GiB"]


def test_markdown_floor_table():
    results = _results([(1, 1024), (1, 4096)])
    results.update(copy_GBps=4000.0, copy_convention="copy, read + write")
    for r in results["decode"]:
        r.update(floor_fields(10**8, r["sdpa_fp16_ms"], 4000.0, "fp16_"))
        for p in ("4bit", "k8v4"):
            if p in r:
                r[p].update(floor_fields(2 * 10**7, r[p]["ms"], 4000.0))
    md = markdown(results)
    assert "## Decode byte floor: bytes read / copy bandwidth 4000 GB/s (copy, read + write)" in md
    assert "| 1 | 4096 | 32/8/128 | 0.2000 / 0.0250 (x8.00) | 0.2000 / 0.0050 (x40.00) | - |" in md
    assert "| 1 | 4096 | 32/8/128 | 0.2000 | 0.2000 (x0.50, 100 GB/s) | - |" in md  # the timing table as before
    assert "byte floor" not in markdown(_results([(1, 1024)]))  # reports measured before the floor


@pytest.mark.parametrize("recent_format", ["exact", "int8"])
def test_forward_buffers_as_the_cache_hands_them(recent_format):
    """A decode step and a compressed prefill read the layer's ring (int8 records where the format says so); a
    forward of several tokens its own fp16 window of the ring's W positions plus its new tokens, as
    TurboQuantLayer.forward_window builds it (W + Lq slots; Lq with no ring)."""
    layout = BlockLayout(dataclasses.replace(make_config("4bit+defaults"), recent_format=recent_format), 2, 64)
    records = recent_format == "int8"
    decode = forward_buffers(layout, 3, 1, device="cpu")
    assert decode["recent_keys"].shape == (3, 2, 128, 64 + 16 * records)
    assert decode["prefix_keys"].shape == (3, 2, 4, 64)
    assert forward_buffers(layout, 3, 8, device="cpu", prefill=True)["recent_keys"].dtype == decode["recent_keys"].dtype
    window = forward_buffers(layout, 3, 8, device="cpu")
    assert window["recent_keys"].shape == window["recent_values"].shape == (3, 2, 128 + 8, 64)
    assert window["recent_keys"].dtype == torch.float16
    assert forward_buffers(layout, 3, 8, prefix=0, ring=0, device="cpu")["recent_keys"].shape == (3, 2, 8, 64)
    assert forward_buffers(layout, 3, 1, prefix=0, ring=0, device="cpu") == {}
