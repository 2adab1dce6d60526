"""The chunk benchmark's command line, table and plot (CPU; the timing needs a GPU)."""

import argparse

import pytest

from eval.bench_chunks import markdown, parse_args, parse_point, plot


def test_points_parse_and_refuse_nonsense():
    assert parse_point("4x16384x256") == (4, 16384, 256)
    assert parse_point("1x0x8192") == (1, 0, 8192)  # a first prefill: no history
    for bad in ("1x32768", "0x10x5", "1x10x0", "axbxc"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_point(bad)
    args = parse_args(["--points", "1x1024x64", "--presets", "4bit"])
    assert args.points == [(1, 1024, 64)] and args.presets == ["4bit"] and args.prefill_lengths == [8192]
    recorded = parse_args(["--out-dir", "/tmp/x", "--reps", "5", "--out-dir=/y"]).argv
    assert recorded == ["--reps", "5"]  # the report's command: what was measured, not where it went


def _results():
    points = []
    for lq, unified, dense in ((1, 0.05, None), (64, 0.3, 0.2), (512, 2.0, 0.6)):
        cell = {"unified_ms": unified}
        if dense is not None:
            cell.update(dense_ms=dense, dense_vs_unified_rel=1e-3 * lq / 64)
        points.append({"B": 1, "S": 32768, "Lq": lq, "sdpa_masked_ms": 0.8, "flash_lower_right_ms": 0.4, "4bit": cell})
    prefill = [{"S": 8192, "sdpa_causal_ms": 1.0, "4bit": {"unified_ms": 3.0, "dense_ms": 1.0, "store_ms": 0.2,
                                                          "dense_vs_unified_rel": 2e-3}}]
    return {"command": "python -m eval.bench_chunks", "gpu": "GPU", "torch": "2", "triton": "3", "shape": "32/8/128",
            "timing": "medians", "points": points, "prefill": prefill}


def test_table_states_each_route_over_masked_sdpa():
    md = markdown(_results())
    assert "| 1 | 32768 | 512 | 0.8000 | 0.4000 (x0.50) | 2.0000 (x2.50) | 0.6000 (x0.75) |" in md
    assert "| 1 | 32768 | 1 | 0.8000 | 0.4000 (x0.50) | 0.0500 (x0.06) | - |" in md  # decode: no dense route
    assert "| 8192 | 1.0000 | 3.2000 (x3.20) | 1.2000 (x1.20) |" in md  # the store counted in both routes
    assert "k8v4" not in md  # presets not timed get no column
    assert "difference between the two routes' outputs: 8.00e-03" in md


def test_plot_draws_a_curve_over_the_query_count(tmp_path):
    assert plot(tmp_path / "c.png", _results()) and (tmp_path / "c.png").stat().st_size > 0
    one = _results()
    one["points"] = one["points"][:1]
    assert not plot(tmp_path / "one.png", one)
