"""The first prefill's per-layer check: a layer whose attention quantized keys would move keeps K/V dense.

The guard model is a tiny Qwen2 whose first layer does what Qwen2.5's does: k_proj biases far
larger than the keys' content (RoPE turns them, so centering cannot remove them) and sharp queries.
"""

from __future__ import annotations

import pytest
import torch
from models import tiny_model, with_cache
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, StaticLayer

from tq_hf import PRESETS, TurboQuantCache, TurboQuantConfig, reference
from tq_hf.sensitivity import key_quantization_kl

PROMPT, STEPS = 320, 24  # past the 128-token exact ring, so most keys are read compressed
GUARD_KL = 0.02  # mean next-token KL vs DynamicCache over the decode steps, every preset with its defaults


def plain_kl(query, key, cfg, scale, offset, kv_start):
    """The same measure by the definition, one (row, head, query) at a time, over every key."""
    b, hq, length, d = query.shape
    group = hq // key.shape[1]
    k_hat = reference.dequantize_keys(*reference.quantize_keys(key.float(), cfg, offset[:, :, None]), cfg, d,
                                      offset[:, :, None])
    total, count = 0.0, 0
    for r in range(b):
        for h in range(hq):
            for t in range(length - 8, length):
                keys = slice(int(kv_start[r]), t + 1)
                if keys.start > t:
                    continue
                s = query[r, h, t].float() @ key[r, h // group, keys].float().T * scale
                s_hat = query[r, h, t].float() @ k_hat[r, h // group, keys].T * scale
                p = s.softmax(-1)
                total += float((p * (s.log_softmax(-1) - s_hat.log_softmax(-1))).sum())
                count += 1
    return total / count


def test_the_measure_matches_its_definition():
    torch.manual_seed(3)
    query, key = torch.randn(2, 4, 40, 32) * 2, torch.randn(2, 2, 40, 32) + torch.randn(2, 2, 1, 32) * 3
    cfg = TurboQuantConfig.from_preset("k3v4")
    offset, kv_start = key.mean(2), torch.tensor([0, 35])  # the second row: left padding up to 35
    # 8 queries of the measure: SAMPLE_QUERIES is larger, so restrict the plain one to the same ones
    import tq_hf.sensitivity as sensitivity

    sample = sensitivity.SAMPLE_QUERIES
    sensitivity.SAMPLE_QUERIES = 8
    try:
        got = key_quantization_kl(query, key, cfg, 32**-0.5, offset, kv_start)
    finally:
        sensitivity.SAMPLE_QUERIES = sample
    assert got == pytest.approx(plain_kl(query, key, cfg, 32**-0.5, offset, kv_start), rel=1e-4)
    assert got > 0


def guard_model(seed: int = 0, bias: float = 40.0):
    """Tiny Qwen2 whose layer 0 has Qwen2.5's boundary-layer keys: huge biases, sharp queries. At bias 40 even FP8
    keys move its attention too far (the layer goes dense); at 7 they keep it within a fifth of the threshold (0.07
    nats; 3-4-bit keys move it by 0.7 and more)."""
    model = tiny_model("qwen2", seed=seed)
    with torch.no_grad():
        attn = model.model.layers[0].self_attn
        attn.k_proj.bias.normal_(0.0, bias)
        attn.q_proj.weight.mul_(6.0)
    return model


def next_token_kl(model, ids, cache) -> float:
    """Mean KL(p_dense || p_cache) of next-token distributions: a prefill, then forced decode steps."""
    dense, logits = DynamicCache(), []
    with torch.no_grad():
        for c in (dense, cache):
            out = model(input_ids=ids[:, :PROMPT], use_cache=True, **with_cache(c))
            steps = [out.logits[:, -1]]
            for t in range(PROMPT, PROMPT + STEPS):
                steps.append(model(input_ids=ids[:, t : t + 1], use_cache=True, **with_cache(c)).logits[:, -1])
            logits.append(torch.stack(steps).float().log_softmax(-1))
    p, q = logits
    return float((p.exp() * (p - q)).sum(-1).mean())


@pytest.mark.parametrize("preset", list(PRESETS))
def test_guard_every_preset_stays_close_to_dynamic_cache(preset):
    model = guard_model()
    ids = torch.randint(3, model.config.vocab_size, (2, PROMPT + STEPS), generator=torch.Generator().manual_seed(5))
    cache = TurboQuantCache(model.config, preset=preset)
    kl = next_token_kl(model, ids, cache)
    assert cache.dense_by_check == [0], cache.dense_by_check
    assert isinstance(cache.layers[0], DynamicLayer) and cache.layers[0].keys.shape[2] == PROMPT + STEPS
    assert "kept dense by the first prefill's check" in cache.summary()
    assert kl < GUARD_KL, f"{preset}: KL {kl:.4f} vs DynamicCache"
    unchecked = TurboQuantCache(model.config, tq_config=TurboQuantConfig.from_preset(preset, dense_layer_kl=None))
    assert next_token_kl(model, ids, unchecked) > 2.5 * GUARD_KL  # the guard can fail (0.10-0.50 without the check)


def test_ordinary_layers_stay_compressed():
    model = tiny_model("qwen2")
    ids = torch.randint(3, model.config.vocab_size, (1, PROMPT + STEPS), generator=torch.Generator().manual_seed(6))
    cache = TurboQuantCache(model.config, preset="3bit")
    next_token_kl(model, ids, cache)
    assert cache.dense_by_check == []


def test_fixed_capacity_keeps_a_static_dense_layer():
    model = guard_model()
    ids = torch.randint(3, model.config.vocab_size, (1, PROMPT + STEPS), generator=torch.Generator().manual_seed(7))
    growing = TurboQuantCache(model.config, preset="4bit")
    fixed = TurboQuantCache(model.config, preset="4bit", max_cache_len=PROMPT + STEPS + 1)
    assert next_token_kl(model, ids, fixed) == pytest.approx(next_token_kl(model, ids, growing), abs=1e-5)
    assert fixed.dense_by_check == [0] and isinstance(fixed.layers[0], StaticLayer)


def test_the_threshold_is_validated():
    with pytest.raises(ValueError, match="dense_layer_kl must be a positive number of nats or None"):
        TurboQuantConfig(dense_layer_kl=0)
    with pytest.raises(ValueError, match="dense_layer_kl"):
        TurboQuantConfig(dense_layer_kl="0.5")


CODEBOOK_PRESETS = [p for p in PRESETS if PRESETS[p]["key_bits"] != 8]


@pytest.mark.parametrize("preset", CODEBOOK_PRESETS)
def test_a_layer_that_fp8_keys_keep_close_takes_them(preset):
    """Layer 0 of the milder guard: its 3-4-bit keys fail the check, FP8 keys pass it. It stays compressed with
    FP8 keys and 4-bit values, in exactly the state a k8v4 cache's layer 0 reaches on the same prompt (layer 0's
    K/V do not depend on the cache), and the decode is as close to DynamicCache as the k8v4 preset's."""
    model = guard_model(bias=7.0)
    ids = torch.randint(3, model.config.vocab_size, (2, PROMPT + STEPS), generator=torch.Generator().manual_seed(5))
    cache, k8v4 = TurboQuantCache(model.config, preset=preset), TurboQuantCache(model.config, preset="k8v4")
    with torch.no_grad():
        for c in (cache, k8v4):
            model(input_ids=ids[:, :PROMPT], use_cache=True, **with_cache(c))
    assert cache.fp8_keys_by_check == [0] and cache.dense_by_check == [] and k8v4.fp8_keys_by_check == []
    got, want = cache.layers[0], k8v4.layers[0]
    assert got.layout == want.layout and got.layout.config.key_bits == 8 and got.layout.config.value_bits == 4
    used = -(-PROMPT // got.layout.block_size) * got.rows
    assert torch.equal(got.pool[:used], want.pool[:used])
    assert torch.equal(got.key_offset, want.key_offset) and torch.equal(got.recent_keys, want.recent_keys)
    assert cache.layers[1].layout.config.key_bits == PRESETS[preset]["key_bits"]  # the other layers keep theirs
    assert "1 with FP8 keys by the first prefill's check" in cache.summary()

    fresh, k8v4 = TurboQuantCache(model.config, preset=preset), TurboQuantCache(model.config, preset="k8v4")
    unchecked = TurboQuantCache(model.config, tq_config=TurboQuantConfig.from_preset(preset, dense_layer_kl=None))
    kl, kl_k8v4, kl_unchecked = (next_token_kl(model, ids, c) for c in (fresh, k8v4, unchecked))
    assert kl <= 1.2 * kl_k8v4 + 1e-3 and kl < kl_unchecked / 3, (kl, kl_k8v4, kl_unchecked)
    dense = TurboQuantCache(model.config, tq_config=TurboQuantConfig.from_preset(preset, sensitive_layer_keys="dense"))
    next_token_kl(model, ids, dense)
    assert dense.dense_by_check == [0] and dense.fp8_keys_by_check == []


def test_fp8_keys_by_check_at_fixed_capacity():
    """A fixed-capacity cache's layer takes FP8 keys the same way (its new pool at a static address): the same
    decode as the growing cache."""
    model = guard_model(bias=7.0)
    ids = torch.randint(3, model.config.vocab_size, (1, PROMPT + STEPS), generator=torch.Generator().manual_seed(7))
    growing = TurboQuantCache(model.config, preset="4bit")
    fixed = TurboQuantCache(model.config, preset="4bit", max_cache_len=PROMPT + STEPS + 1)
    assert next_token_kl(model, ids, fixed) == pytest.approx(next_token_kl(model, ids, growing), abs=1e-5)
    assert fixed.fp8_keys_by_check == growing.fp8_keys_by_check == [0]


def test_the_fallback_is_validated():
    with pytest.raises(ValueError, match="sensitive_layer_keys"):
        TurboQuantConfig(sensitive_layer_keys="int8")
    assert TurboQuantConfig.from_preset("k8v4").fp8_key_fallback() is None
    assert TurboQuantConfig.from_preset("3bit").fp8_key_fallback() == TurboQuantConfig.from_preset("k8v4")
