"""eval.host_overhead: a decode layer step on the kernel path with the launches stubbed (no timing asserted)."""

from __future__ import annotations

import pytest

from eval.host_overhead import layer_step, main, stubbed_launches


def test_stubbed_step_takes_the_kernel_path_and_is_restored(monkeypatch):
    from tq_hf import ops, reference
    from tq_hf.kernels import fast_launch

    step = layer_step("4bit", 2, 40)  # the prefill stores through the reference (CPU tensors, no stub yet)
    original = (ops.use_kernels, fast_launch.LaunchSite.__call__)

    def spec_called(*args, **kwargs):
        raise AssertionError("the stubbed step reached reference.py instead of the kernel launchers")

    monkeypatch.setattr(reference, "store", spec_called)
    monkeypatch.setattr(reference, "paged_attention", spec_called)
    with stubbed_launches():
        step()
        step()
    assert (ops.use_kernels, fast_launch.LaunchSite.__call__) == original
    with pytest.raises(AssertionError, match="reached reference.py"):
        step()  # unstubbed on the CPU: the reference path again


def test_report(tmp_path):
    report = main(["--presets", "4bit,k8v4", "--steps", "3", "--rounds", "2", "--context", "40", "--out", str(tmp_path)])
    assert [r["preset"] for r in report["rows"]] == ["4bit", "k8v4"]
    assert all(r["us_per_layer_step"] > 0 and len(r["rounds_us"]) == 2 for r in report["rows"])
    table = (tmp_path / "table.md").read_text()
    assert (tmp_path / "results.json").exists() and "us per layer step" in table
    assert table.splitlines()[2] == f"Command: `{report['meta']['command']}`"  # the command right under the title
