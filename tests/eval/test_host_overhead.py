"""eval.host_overhead: a decode layer step on the kernel path with the launches stubbed (no timing asserted)."""

from __future__ import annotations

import pytest

import torch

from eval.host_overhead import DENSE, dense_layer_step, layer_step, main, stubbed_dense_ops, stubbed_launches


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
    assert [r["preset"] for r in report["rows"]] == [DENSE, "4bit", "k8v4"]
    assert all(r["us_per_layer_step"] > 0 and len(r["rounds_us"]) == 2 for r in report["rows"])
    dense = report["rows"][0]["us_per_layer_step"]
    assert [r["vs_dense"] for r in report["rows"]] == [1.0] + [r["us_per_layer_step"] / dense for r in report["rows"][1:]]
    best = min(report["rows"][0]["rounds_us"])
    assert [r["best_vs_dense"] for r in report["rows"]] == [min(r["rounds_us"]) / best for r in report["rows"]]
    table = (tmp_path / "table.md").read_text()
    assert (tmp_path / "results.json").exists() and "us per layer step" in table
    assert table.splitlines()[2] == f"Command: `{report['meta']['command']}`"  # the command right under the title


def test_dense_stubs_keep_shapes_and_are_restored():
    """The fp16 sdpa row's stubs: torch.cat gives the concatenated shape, sdpa the output's; both restored after."""
    saved = (torch.cat, torch.nn.functional.scaled_dot_product_attention)
    a, b = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 1, 4)
    with stubbed_dense_ops():
        assert torch.cat([a, b], dim=-2).shape == (2, 3, 6, 4)
        assert torch.cat([torch.cat([a, b], dim=2), b], dim=2).shape == (2, 3, 7, 4)
        q, kv = torch.randn(2, 6, 1, 4), torch.randn(2, 3, 9, 4)
        assert torch.nn.functional.scaled_dot_product_attention(q, kv, kv, enable_gqa=True).shape == (2, 6, 1, 4)
        step = dense_layer_step(2, 16, heads=(6, 3, 4))
        step()
    assert (torch.cat, torch.nn.functional.scaled_dot_product_attention) == saved
    assert torch.equal(torch.cat([a, b], dim=-2)[:, :, :5], a)  # the real cat again


def test_generate_rows(tmp_path):
    """--generate-layers: the whole eager generate() step, fp16 then each preset, as marginal ms per token."""
    report = main(["--presets", "4bit", "--steps", "2", "--rounds", "2", "--context", "40", "--generate-layers", "2",
                   "--generate-tokens", "3", "--out", str(tmp_path)])
    rows = report["generate_rows"]
    assert [r["preset"] for r in rows] == [DENSE, "4bit"] and all(len(r["rounds_ms"]) == 2 for r in rows)
    assert rows[0]["vs_dense"] == 1.0 and rows[1]["vs_dense"] == rows[1]["ms_per_token"] / rows[0]["ms_per_token"]
    assert "The whole eager generate() step: 2 layers" in (tmp_path / "table.md").read_text()


def test_whole_model_stubs_keep_token_ids_real_and_are_restored():
    """Under stubbed_model_ops the projections and sdpa give zeros of their shapes, K/V appends a view, and the token
    ids generate() concatenates stay real; everything restored after."""
    from eval.host_overhead import stubbed_model_ops, generate_timer

    functional = torch.nn.functional
    saved = (torch.cat, functional.scaled_dot_product_attention, functional.linear)
    ids = torch.tensor([[1, 2]])
    with stubbed_model_ops():
        assert torch.equal(torch.cat([ids, torch.tensor([[3]])], -1), torch.tensor([[1, 2, 3]]))
        y = torch.nn.Linear(4, 6)(torch.randn(2, 4))
        assert y.shape == (2, 6) and not y.any()
        q = torch.randn(1, 4, 1, 8)
        assert not functional.scaled_dot_product_attention(q, q, q).any()
        assert generate_timer(DENSE, 1, 16, heads=(4, 2, 8))(2) > 0
    assert (torch.cat, functional.scaled_dot_product_attention, functional.linear) == saved


def test_device_ops_count_torch_ops_that_launch_and_the_stubbed_launches():
    """device_ops: views are free, other torch ops and each stubbed Triton launch count one."""
    from eval.host_overhead import device_ops

    x = torch.randn(4, 6)
    assert device_ops(lambda: (x.t(), x[1:], x.view(6, 4))) == 0
    assert device_ops(lambda: (x + 1).mul_(2).sum()) == 3
    step = layer_step("4bit", 1, 40)
    with stubbed_launches():
        step()  # plans made
        ops = device_ops(step)
        from tq_hf.kernels import fast_launch
        calls = []
        original = fast_launch.LaunchSite.__call__
        fast_launch.LaunchSite.__call__ = lambda self, *args: calls.append(1)
        try:
            assert device_ops(step) == ops - len(calls)  # the launches no longer counted
        finally:
            fast_launch.LaunchSite.__call__ = original
    assert len(calls) >= 2  # the store and the attention at least


def test_verification_steps_attend_several_tokens_and_crop_one(tmp_path):
    """--queries Q: each layer step stores Q tokens, attends them and crops one (assisted decoding's crop), so the
    cache grows by Q - 1 per step; the rows carry their device ops."""
    import tq_hf
    from eval.host_overhead import _model_config, _step_over
    from tq_hf.attention import turboquant_attention_forward

    cache = tq_hf.TurboQuantCache(_model_config((4, 2, 32), "turboquant"), preset="4bit")
    step = _step_over(cache, turboquant_attention_forward, 1, 40, (4, 2, 32), queries=6)
    with stubbed_launches():
        step()
        step()
    assert cache.get_seq_length() == 40 + 2 * 5
    report = main(["--presets", "4bit", "--queries", "6", "--steps", "2", "--rounds", "1", "--context", "40",
                   "--out", str(tmp_path)])
    assert [r["queries"] for r in report["rows"]] == [6, 6] and all(r["device_ops"] > 0 for r in report["rows"])
    assert "new tokens" in (tmp_path / "table.md").read_text()
