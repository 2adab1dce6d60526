"""eval.decode_loop runs its compiled manual loop end to end (on CPU: a tiny model, inductor, no figures)."""

import json

import pytest

from eval import decode_loop


@pytest.mark.slow
def test_cli_end_to_end(tmp_path):
    decode_loop.main(["--lengths", "40", "--caches", "fp16", "4bit", "--steps", "2", "--warmup", "2",
                      "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "results.json").read_text())["results"]
    assert [(r["cache"], r["context"]) for r in rows] == [("fp16", 40), ("4bit", 40)]
    assert rows[1]["cache_bytes"] > 0
    for row in rows:  # the compiled call's host time, and without guard evaluation (the same graph, less work)
        assert 0 < row["host_call_unguarded_ms"] and 0 < row["host_call_ms"]
    assert "| 40 | 4bit |" in (tmp_path / "table.md").read_text()


def test_kernel_profile_counts_device_kernels_per_step():
    """Only device kernels count; per step: their number, busy time, the costliest first."""
    import torch
    from types import SimpleNamespace

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    events = [SimpleNamespace(name="attn", device_type=cuda, device_time=30.0)] * 4 + [
        SimpleNamespace(name="store", device_type=cuda, device_time=10.0)] * 2 + [
        SimpleNamespace(name="aten::mm", device_type=cpu, device_time=0.0, self_cpu_time_total=3.0)] * 5 + [
        SimpleNamespace(name="aten::empty", device_type=cpu, device_time=0.0, self_cpu_time_total=0.0)]
    prof = decode_loop.kernel_profile(events, steps=2, top=1)
    assert prof["kernels_per_step"] == 3 and prof["busy_ms_per_step"] == 0.07
    assert prof["top"] == [{"kernel": "attn", "per_step": 2.0, "us_per_call": 30.0}]
    assert prof["host_top"] == [{"op": "aten::mm", "per_step": 2.5, "us_per_step": 7.5}]  # ops of no own time left out
    table = decode_loop.profile_tables([{"context": 40, "cache": "4bit", "profile": prof}, {"profile": None}])
    assert "S=40, 4bit: 3 kernels and 0.070 ms" in table and "| attn | 2.0 | 30.00 | 60.0 |" in table
    assert "| aten::mm | 2.5 | 7.5 |" in table
