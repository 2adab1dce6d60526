"""TurboQuantConfig.exact_dtype="16bit": a float32 model's exact tokens (prefix, ring, exact start) in bfloat16, so they
cost what an fp16 cache's do; a forward's own tokens are still attended in float32."""

import dataclasses

import pytest
import torch

from tests.models import FakeQuantCache, assert_close, generate, tiny_model, tq_config, with_cache
from tq_hf import TurboQuantCache, TurboQuantConfig


@pytest.mark.parametrize("dtype,expected", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16),
                                            (torch.float16, torch.float16)])
def test_exact_buffers_take_a_16_bit_dtype(dtype, expected):
    config = TurboQuantConfig.from_preset("4bit", recent_window=8, exact_prefix_tokens=2, exact_dtype="16bit",
                                          recent_format="exact")
    assert config.exact_dtype_for(dtype) == expected
    assert TurboQuantConfig.from_preset("4bit").exact_dtype_for(dtype) == expected  # the default: 16-bit
    assert TurboQuantConfig.from_preset("4bit", exact_dtype="model").exact_dtype_for(dtype) == dtype
    cache = TurboQuantCache(tiny_model("llama").config, tq_config=config)
    k = torch.randn(2, 2, 12, 32, dtype=dtype)
    cache.update(k, k.clone(), 0)
    layer = cache.layers[0]
    for name in ("prefix_keys", "prefix_values", "recent_keys", "recent_values"):
        assert getattr(layer, name).dtype == expected, name
    assert_close(layer.recent_keys[:, :, :4].float(), k[:, :, 8:].to(expected).float(), atol=0, what="ring: rounded")
    with pytest.raises(ValueError, match="exact_dtype"):
        TurboQuantConfig(exact_dtype="float64")
    records = TurboQuantCache(tiny_model("llama").config, tq_config=dataclasses.replace(config, recent_format="int8"))
    records.update(k, k.clone(), 0)  # the default int8 ring: records whatever the dtype, the prefix in exact_dtype
    assert records.layers[0].recent_keys.dtype == torch.int8 and records.layers[0].prefix_keys.dtype == expected


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_bfloat16_exact_tokens_match_the_oracle(family):
    """A float32 model's greedy, left-padded generate() against the oracle holding the same bfloat16 exact tokens;
    float32 exact tokens would move these logits by ~1e-2."""
    model = tiny_model(family)
    cfg = tq_config(exact_dtype="16bit")
    ids = torch.randint(3, model.config.vocab_size, (2, 14))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    _, ours = generate(model, ids, mask, TurboQuantCache(model.config, tq_config=cfg), max_new_tokens=10)
    _, want = generate(model, ids, mask, FakeQuantCache(model.config, cfg, mask), max_new_tokens=10)
    assert_close(ours, want, atol=2e-3, rtol=0, what=f"{family} bfloat16 exact tokens")
    _, exact = generate(model, ids, mask, FakeQuantCache(model.config, tq_config(exact_dtype="model"), mask),
                        max_new_tokens=10)
    assert (ours - exact).abs().max() > 2e-3  # the rounding shows: the comparison above can fail


def test_a_forwards_own_tokens_stay_float32():
    """A forward of several tokens over a history: its own tokens reach the attention unrounded, the ring's
    history rounded to bfloat16 (LayerStep.window)."""
    model = tiny_model("llama")
    cache = TurboQuantCache(model.config, tq_config=TurboQuantConfig.from_preset("4bit", recent_window=8,
                                                                                  exact_dtype="16bit",
                                                                                  recent_format="exact"))
    ids = torch.randint(3, 90, (1, 40))
    with torch.no_grad():
        model(input_ids=ids[:, :30], use_cache=True, **with_cache(cache))
    layer = cache.layers[0]
    k, v = torch.randn(1, 2, 6, 32) * 3, torch.randn(1, 2, 6, 32)
    ring_k = layer.recent_keys.clone()
    window_k, _ = layer.forward_window(k, v, 30)
    assert window_k.dtype == torch.float32
    pos = torch.arange(22, 36)
    in_order = window_k[:, :, pos % 14]
    assert torch.equal(in_order[:, :, 8:], k)  # own tokens: as given
    assert torch.equal(in_order[:, :, :8], ring_k[:, :, pos[:8] % 8].float())  # history: the bfloat16 ring


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "gpt_oss"])
def test_gpu_kernels_read_bfloat16_exact_tokens_of_a_float32_model(family, monkeypatch):
    """The kernels (float32 queries, bfloat16 prefix and ring) against the reference path on the same model
    (H200: greedy logits within 0.01; float32 exact tokens differ from these by ~1e-2 as well, so this checks
    that the kernels read the buffers, not the rounding)."""
    model = tiny_model(family, device="cuda")
    cfg = tq_config(exact_dtype="16bit")
    ids = torch.randint(3, model.config.vocab_size, (2, 14), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    _, kernels = generate(model, ids, mask, TurboQuantCache(model.config, tq_config=cfg), max_new_tokens=10)
    monkeypatch.setenv("TQ_HF_FORCE_REFERENCE", "1")
    _, reference = generate(model, ids, mask, TurboQuantCache(model.config, tq_config=cfg), max_new_tokens=10)
    assert_close(kernels, reference, atol=0.05, rtol=0, what=f"{family} kernels vs reference")
