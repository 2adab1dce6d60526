"""Which sliding-window layers are compressed, and a cache that compresses nothing says so."""

from __future__ import annotations

import pytest
import torch
from models import FakeQuantCache, assert_close, generate, left_padded_batch, with_cache
from transformers import AutoModelForCausalLM, Gemma3TextConfig, MistralConfig
from transformers.cache_utils import DynamicSlidingWindowLayer

import tq_hf.cache
from tq_hf import TurboQuantCache, TurboQuantConfig
from tq_hf.cache import TurboQuantLayer
from tq_hf.config import SLIDING_COMPRESS_MIN_WINDOW

SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, pad_token_id=0, bos_token_id=1, eos_token_id=2)


@pytest.fixture
def warnings_logged(monkeypatch):
    logged = []
    monkeypatch.setattr(tq_hf.cache.logger, "warning_once", logged.append)
    return logged


def kinds(cache) -> list[str]:
    return ["compressed" if isinstance(layer, TurboQuantLayer) else
            "window" if isinstance(layer, DynamicSlidingWindowLayer) else "dense" for layer in cache.layers]


@pytest.mark.parametrize("window, positions", [(4096, 32768), (SLIDING_COMPRESS_MIN_WINDOW, 16384),
                                               (262144, 131072)])
def test_long_windows_are_compressed_by_default(window, positions, warnings_logged):
    """Mistral-7B-v0.1 (4096 of 32k), Starcoder2 (4096 of 16k), a window longer than the context."""
    config = MistralConfig(**SMALL, sliding_window=window, max_position_embeddings=positions)
    cache = TurboQuantCache(config, preset="4bit")
    assert kinds(cache) == ["compressed"] * 3
    assert warnings_logged == [] and cache.nothing_compressed() == ""


def test_short_windows_stay_exact_and_the_rest_is_compressed(warnings_logged):
    config = Gemma3TextConfig(**SMALL, sliding_window=512,
                              layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    assert kinds(TurboQuantCache(config)) == ["window", "compressed", "window"]
    assert kinds(TurboQuantCache(config, tq_config=TurboQuantConfig(sliding_layers="compressed"))) == ["compressed"] * 3
    assert kinds(TurboQuantCache(config, tq_config=TurboQuantConfig(sliding_layers="exact"))) == [
        "window", "compressed", "window"]
    assert warnings_logged == []


def test_a_cache_that_compresses_nothing_warns_and_says_so(warnings_logged):
    config = MistralConfig(**SMALL, sliding_window=1024)
    cache = TurboQuantCache(config, preset="k8v4")
    assert kinds(cache) == ["window"] * 3
    assert len(warnings_logged) == 1
    assert "compresses none of this model's 3 layers" in warnings_logged[0]
    assert "sliding_layers='compressed'" in warnings_logged[0]
    model = AutoModelForCausalLM.from_config(config, attn_implementation="turboquant").eval()
    with torch.no_grad():
        model(input_ids=torch.tensor([[5, 6, 7, 8]]), use_cache=True, **with_cache(cache))
    assert "compresses none" in cache.summary() and "(2.000x of fp16)" in cache.summary()  # a float32 model
    dense_only = TurboQuantCache(MistralConfig(**SMALL), tq_config=TurboQuantConfig(full_precision_layers=(0, 1, 2)))
    assert "3 layers are full_precision_layers" in dense_only.nothing_compressed()


def test_compressed_long_window_layers_match_the_oracle():
    """A 4096-token window over a short prompt: the compressed layers attend as the reference cache does."""
    config = MistralConfig(**SMALL, sliding_window=4096, initializer_range=0.15)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="turboquant").eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    cfg = TurboQuantConfig.from_preset("4bit", recent_window=4, exact_prefix_tokens=2, exact_dtype="model")
    ids, mask, _ = left_padded_batch([11, 6], seed=12)
    tokens, logits = generate(model, ids, mask, TurboQuantCache(model.config, tq_config=cfg))
    expected_tokens, expected_logits = generate(model, ids, mask, FakeQuantCache(model.config, cfg, mask))
    assert torch.equal(tokens, expected_tokens)
    assert_close(logits, expected_logits, atol=1e-4, rtol=1e-4, what="compressed 4096-token window layers")
