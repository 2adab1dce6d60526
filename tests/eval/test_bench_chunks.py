"""The chunk benchmark's command line, table and plot (CPU; the timing needs a GPU)."""

import argparse

import pytest

from eval.bench_chunks import host_ms, markdown, parse_args, parse_point, plot


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
        cell = {"unified_ms": unified, "cache_route": "dense" if lq == 512 else "unified"}
        if dense is not None:
            cell.update(dense_ms=dense, dense_vs_unified_rel=1e-3 * lq / 64, unified_host_ms=0.045,
                        dense_host_ms=0.3 + lq / 1e4)
        points.append({"B": 1, "S": 32768, "Lq": lq, "sdpa_masked_ms": 0.8, "flash_lower_right_ms": 0.4, "4bit": cell})
    prefill = [{"S": 8192, "sdpa_causal_ms": 1.0, "4bit": {"unified_ms": 3.0, "dense_ms": 1.0, "store_ms": 0.2,
                                                          "dense_vs_unified_rel": 2e-3, "cache_route": "dense"}}]
    return {"command": "python -m eval.bench_chunks", "gpu": "GPU", "torch": "2", "triton": "3", "shape": "32/8/128",
            "timing": "medians", "points": points, "prefill": prefill}


def test_table_states_each_route_over_masked_sdpa():
    md = markdown(_results())
    # in bold the route the cache takes
    assert "| 1 | 32768 | 512 | 0.8000 | 0.4000 (x0.50) | 2.0000 (x2.50) | **0.6000 (x0.75)** |" in md
    assert "| 1 | 32768 | 64 | 0.8000 | 0.4000 (x0.50) | **0.3000 (x0.37)** | 0.2000 (x0.25) |" in md
    assert "| 1 | 32768 | 1 | 0.8000 | 0.4000 (x0.50) | **0.0500 (x0.06)** | - |" in md  # decode: no dense route
    assert "| 8192 | 1.0000 | 3.2000 (x3.20) | **1.2000 (x1.20)** |" in md  # the store counted in both routes
    assert "k8v4" not in md  # presets not timed get no column
    assert "difference between the two routes' outputs: 8.00e-03" in md


def test_host_time_table_lists_the_points_with_both_routes():
    md = markdown(_results())
    assert "| 1 | 32768 | 64 | 0.045 / 0.306 |" in md and "| 1 | 32768 | 512 | 0.045 / 0.351 |" in md
    assert "| 1 | 32768 | 1 |" not in md.split("Host time per call")[1]  # decode: no dense route, no row


def test_host_ms_times_the_call_not_the_device():
    """The call's own duration, median over the reps, with the busy-keeper run before each (not timed)."""
    import time

    order = []
    busy = lambda: order.append("busy") or time.sleep(0.05)  # noqa: E731
    call = lambda: order.append("call") or time.sleep(0.002)  # noqa: E731
    ms = host_ms(call, 3, keep_busy=busy)
    assert 1.5 <= ms < 40
    assert order == ["call"] + ["busy", "call"] * 3


def test_plot_draws_a_curve_over_the_query_count(tmp_path):
    assert plot(tmp_path / "c.png", _results()) and (tmp_path / "c.png").stat().st_size > 0
    one = _results()
    one["points"] = one["points"][:1]
    assert not plot(tmp_path / "one.png", one)


def test_points_past_the_time_budget_are_listed_and_each_point_is_checkpointed(monkeypatch):
    """run() on the CPU with the GPU's parts stubbed and a clock that advances 100 s per timed point: with a budget
    of 150 s the first two points are timed (the second starts at 100 s), the rest and the prefill are listed as
    skipped, and the checkpoint sees the results after each timed point."""
    import eval.bench_chunks as bc

    clock = iter(range(0, 10_000, 100))
    now = [0.0]
    monkeypatch.setattr(bc.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(bc, "_flush_buffer", lambda: None)
    monkeypatch.setattr(bc.torch.cuda, "get_device_name", lambda *a: "GPU")

    def baselines(b, s, lq, reps, flush):
        now[0] = float(next(clock) + 100)
        return 1.0, 0.5

    monkeypatch.setattr(bc, "sdpa_baselines", baselines)
    # a cell as time_routes gives it: figures and the cache's route as a word (the progress lines print both)
    monkeypatch.setattr(bc, "time_routes", lambda *a, **k: {"unified_ms": 0.25, "cache_route": "unified",
                                                             "dense_ms": 0.5})
    args = parse_args(["--points", "1x1024x8", "1x1024x64", "1x1024x512", "--presets", "4bit", "--prefill-lengths",
                       "8192", "--time-budget", "150"])
    seen = []
    results = bc.run(args, lambda r: seen.append([p["Lq"] for p in r["points"]]))
    assert [p["Lq"] for p in results["points"]] == [8, 64]
    assert results["skipped"] == ["1x1024x512", "prefill 8192"] and results["prefill"] == []
    assert seen == [[8], [8, 64]]
    assert "Not timed (time budget of 150 s spent): 1x1024x512, prefill 8192" in markdown(results)
    assert parse_args([]).time_budget is None  # no budget unless asked
