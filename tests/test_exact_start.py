"""A compressed layer's exact start (TurboQuantConfig.compress_from_tokens): below the length from which compression
saves memory a layer holds its tokens as DynamicCache does; the forward that takes it past that length hands the
whole history to a TurboQuantLayer as one first update."""

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig

from tests.models import FakeQuantCache, tiny_model, with_cache
from tq_hf import TurboQuantCache, TurboQuantConfig
from tq_hf.cache import ExactStartLayer, TurboQuantLayer, break_even_tokens, chunk_history_room
from tq_hf.layout import BlockLayout

pytestmark = pytest.mark.exact_start

# a short exact start (head_dim 32: 33 tokens in float32 with an exact ring, 19 with an int8 ring)
SMALL = dict(recent_window=16, exact_prefix_tokens=2, recent_format="exact", exact_dtype="model")


def small_config(**fields) -> TurboQuantConfig:
    return TurboQuantConfig.from_preset("4bit", **{**SMALL, **fields})


def forward(model, ids, cache, mask=None):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, use_cache=True, **with_cache(cache)).logits.float()


def kinds(cache) -> set[str]:
    return {type(layer).__name__ for layer in cache.layers}


def dense_bytes(cache, element_bytes: int) -> int:
    """K/V bytes a DynamicCache of `element_bytes` per element holds for the same tokens (independent of the cache's
    own accounting: rows x KV heads x tokens x head_dim, from the model config)."""
    cfg = cache._text_config
    heads = cfg.num_key_value_heads
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rows = next(layer.keys.shape[0] if isinstance(layer, ExactStartLayer) else layer.rows for layer in cache.layers)
    return 2 * element_bytes * rows * heads * cache.get_seq_length() * dim * len(cache.layers)


@pytest.mark.parametrize("recent_format,side", [("int8", 4 * 512 + 128 * 2 * 144), ("exact", 132 * 512)])
def test_break_even_by_hand(recent_format, side):
    """4bit at head_dim 128, 64-token blocks of 134 bytes per token and head, 4 exact prefix tokens of 512 bytes
    (fp16) and a 128-token ring of two 144-byte int8 records per token (or 512 exact bytes): from n tokens on,
    (n / 64 + 1 + n / (64 * 64)) blocks of 8576 bytes plus the side buffers stay within n * 512."""
    layout = BlockLayout(TurboQuantConfig.from_preset("4bit", recent_format=recent_format), 8, 128)
    n = break_even_tokens(layout, 2)
    assert (n / 64 + 1 + n / 4096) * 8576 + side <= n * 512 < ((n - 1) / 64 + 1 + (n - 1) / 4096) * 8576 + side + 512
    assert (190 < n < 230) if recent_format == "exact" else (100 < n < 140)
    assert break_even_tokens(layout, 4) < n  # float32 dense tokens cost twice as much: compressing pays earlier


@pytest.mark.parametrize("dtype,exact_dtype,element_bytes,recent_format",
                         [(torch.float32, "16bit", 2, "exact"), (torch.bfloat16, "model", 2, "exact"),
                          (torch.float32, "model", 4, "exact"), (torch.float32, "16bit", 2, "int8"),
                          (torch.bfloat16, "model", 2, "int8"), (torch.float32, "16bit", 2, "auto")])
def test_memory_never_above_the_dense_cache(dtype, exact_dtype, element_bytes, recent_format):
    """Token by token from 1 to 3x the exact start: the cache never allocates more K/V bytes than a DynamicCache at
    the exact tokens' element size (the model's; 2 bytes, an fp16 cache, for a float32 model with
    exact_dtype="16bit"); past the exact start every layer is compressed; far past it, the bytes approach the
    format's."""
    model = tiny_model("llama", dtype=dtype)
    cache = TurboQuantCache(model.config, tq_config=small_config(exact_dtype=exact_dtype, recent_format=recent_format))
    start = break_even_tokens(BlockLayout(cache.tq_config, 2, 32), element_bytes)
    ids = torch.randint(3, model.config.vocab_size, (2, 3 * start))
    for t in range(ids.shape[1]):
        forward(model, ids[:, t : t + 1], cache)
        assert cache.memory_footprint() <= dense_bytes(cache, element_bytes), t + 1
        assert kinds(cache) == ({"ExactStartLayer"} if t + 1 <= start else {"TurboQuantLayer"}), t + 1
    assert cache.memory_footprint() < 0.75 * dense_bytes(cache, element_bytes)


@pytest.mark.parametrize("exact_dtype,tol", [("model", 1e-5), ("16bit", 0.05)])
def test_exact_start_is_dynamic_cache(exact_dtype, tol):
    """Below the exact start the logits are DynamicCache's, prefill and decode, with left padding: exactly with the
    model's dtype, within bfloat16 rounding for a float32 model's default (bfloat16 exact tokens)."""
    model = tiny_model("qwen2")
    ids = torch.randint(3, model.config.vocab_size, (2, 30))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    cache, dense = TurboQuantCache(model.config, tq_config=small_config(exact_dtype=exact_dtype)), DynamicCache()
    for c in (cache, dense):
        c.logits = [forward(model, ids[:, :20], c, mask[:, :20])]
        for t in range(20, 30):
            c.logits.append(forward(model, ids[:, t : t + 1], c, mask[:, : t + 1]))
    assert kinds(cache) == {"ExactStartLayer"}
    assert cache.layers[0].keys.dtype == (torch.float32 if exact_dtype == "model" else torch.bfloat16)
    for a, b in zip(cache.logits, dense.logits):
        torch.testing.assert_close(a, b, atol=tol, rtol=0)


@pytest.mark.parametrize("chunks", [(20, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1), (20, 30), (10, 10, 40), (30, 20)])
def test_onset_equals_one_prefill(chunks):
    """The forward that crosses the exact start (a decode step, or a chunk) leaves layer 0 (whose K/V do not depend
    on attention) as one prefill of the same tokens into a cache that compresses from the first token. (Its K/V
    differ by ~1e-6 between forward shapes, float32 GEMM blocking: a code on a rounding boundary may flip.)"""
    model = tiny_model("llama")
    config = small_config()  # (exact tokens in the model's dtype: "16bit" would round the history first)
    ids = torch.randint(3, model.config.vocab_size, (2, sum(chunks)))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    cache, at = TurboQuantCache(model.config, tq_config=config), 0
    for n in chunks:
        forward(model, ids[:, at : at + n], cache, mask[:, : at + n])
        at += n
    whole = TurboQuantCache(model.config, tq_config=small_config(compress_from_tokens=0))
    forward(model, ids, whole, mask)
    a, b = cache.layers[0], whole.layers[0]
    assert isinstance(a, TurboQuantLayer) and isinstance(b, TurboQuantLayer)
    assert a.length == b.length == ids.shape[1]
    assert torch.equal(a.kv_start, b.kv_start)
    torch.testing.assert_close(a.key_offset, b.key_offset, atol=1e-5, rtol=1e-5)
    used = -(-a.length // a.layout.block_size) * a.rows
    assert (a.pool[:used] != b.pool[:used]).float().mean() < 0.002
    for name in ("prefix_keys", "prefix_values", "recent_keys", "recent_values"):
        torch.testing.assert_close(getattr(a, name), getattr(b, name), atol=1e-5, rtol=1e-5)
    for x, y in zip(a.dequantized(), b.dequantized()):
        torch.testing.assert_close(x, y, atol=0.05, rtol=0)


def test_generate_across_the_onset_with_padding_and_beams():
    """generate() from a short padded prompt past the exact start: greedy tokens and beams stay close to
    DynamicCache (the compressed part as the format allows), rows keep their padding."""
    model = tiny_model("llama")
    ids = torch.randint(3, model.config.vocab_size, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    kwargs = dict(max_new_tokens=70, min_new_tokens=70, do_sample=False, return_dict_in_generate=True,
                  output_logits=True)
    cache = TurboQuantCache(model.config, tq_config=small_config())
    ours = model.generate(input_ids=ids, attention_mask=mask, **with_cache(cache), **kwargs)
    ref = model.generate(input_ids=ids, attention_mask=mask, **with_cache(DynamicCache()), **kwargs)
    assert kinds(cache) == {"TurboQuantLayer"}
    assert cache.layers[0].kv_start.tolist() == [0, 4]
    p = torch.stack(ref.logits).float().log_softmax(-1)
    q = torch.stack(ours.logits).float().log_softmax(-1)
    kl = (p.exp() * (p - q)).sum(-1)
    assert kl[:20].max() < 1e-6  # below the exact start (12 + 20 < 33 tokens, float32's 4 bytes): exact
    same = (ours.sequences == ref.sequences)[:, ids.shape[1]:].all(0).int().cumprod(0).sum()  # steps before a divergence
    assert same > 21 and kl[:same].mean() < 0.05
    beams = model.generate(input_ids=ids, attention_mask=mask, num_beams=2, max_new_tokens=60, do_sample=False,
                           **with_cache(TurboQuantCache(model.config, tq_config=small_config())))
    assert beams.shape == (2, 72)


def test_reset_and_summary():
    """summary() says which layers are still exact; reset() starts every compressed layer exact again."""
    model = tiny_model("llama")
    cache = TurboQuantCache(model.config, tq_config=small_config())
    forward(model, torch.randint(3, 90, (1, 10)), cache)
    assert "3 layers still exact" in cache.summary() and "compressed from 33 tokens" in cache.summary()
    forward(model, torch.randint(3, 90, (1, 40)), cache)
    assert kinds(cache) == {"TurboQuantLayer"} and "still exact" not in cache.summary()
    cache.reset()
    assert kinds(cache) == {"ExactStartLayer"} and cache.get_seq_length() == 0
    forward(model, torch.randint(3, 90, (3, 5)), cache)  # another batch size after reset
    assert cache.get_seq_length() == 5


def test_fixed_capacity_and_zero_compress_from_the_first_token():
    model = tiny_model("llama")
    for cache in (TurboQuantCache(model.config, tq_config=small_config(), max_cache_len=64),
                  TurboQuantCache(model.config, tq_config=small_config(compress_from_tokens=0))):
        forward(model, torch.randint(3, 90, (1, 5)), cache)
        assert kinds(cache) == {"TurboQuantLayer"}


def test_explicit_compress_from():
    model = tiny_model("llama")
    cache = TurboQuantCache(model.config, tq_config=small_config(compress_from_tokens=8))
    forward(model, torch.randint(3, 90, (1, 8)), cache)
    assert kinds(cache) == {"ExactStartLayer"}
    forward(model, torch.randint(3, 90, (1, 1)), cache)
    assert kinds(cache) == {"TurboQuantLayer"} and cache.get_seq_length() == 9
    with pytest.raises(ValueError, match="compress_from_tokens must be an int >= 0"):
        TurboQuantConfig(compress_from_tokens=-1)


def test_check_at_the_onset_gives_fp8_keys():
    """A layer the per-layer check flags gets FP8 keys at its onset too (the check runs on the onset forward's
    queries against the whole history)."""
    from tests.test_sensitivity import guard_model

    model = guard_model(bias=7.0)
    cache = TurboQuantCache(model.config, preset="4bit")
    ids = torch.randint(3, model.config.vocab_size, (2, 320))
    forward(model, ids[:, :40], cache)
    assert isinstance(cache.layers[0], ExactStartLayer)
    forward(model, ids[:, 40:], cache)
    assert cache.fp8_keys_by_check == [0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunks_past_the_exact_start_attend_its_tokens_exactly(dtype):
    """The forward that leaves the exact start brings the exact start's tokens in the compressed layer's first
    update: with chunk_history_tokens=None the layer keeps the latest that fit within a dense layer's bytes
    (chunk_history_room; the cache stays within a DynamicCache's), as the exact start held them (DynamicCache's
    K/V), and the next chunk attends them as the oracle does a history of as many tokens kept by a first forward of
    the same tokens. A prompt fed in one forward keeps none."""
    model = tiny_model("llama", dtype=dtype)
    cfg = small_config(compress_from_tokens=96)
    ids = torch.randint(3, 90, (2, 160))
    ours, dense = TurboQuantCache(model.config, tq_config=cfg), DynamicCache()
    for cache in (ours, dense):
        for i in range(0, 128, 32):
            forward(model, ids[:, i : i + 32], cache)
    kept = min(128, chunk_history_room(ours.layers[0].layout, 128, dtype.itemsize, dtype.itemsize))
    assert ours.memory_footprint() <= dense_bytes(ours, dtype.itemsize)
    for i, layer in enumerate(ours.layers):  # after the handover (the chunk at 96-128): every K/V from exact attention
        assert isinstance(layer, TurboQuantLayer) and layer.ring_size < kept == layer._chunk_history_tokens(), i
        for got, want in zip(layer._chunk_history_window(), (dense.layers[i].keys, dense.layers[i].values)):
            torch.testing.assert_close(got, want[:, :, 128 - kept :], atol=1e-5 if dtype == torch.float32 else 2e-2,
                                       rtol=0)
    if dtype == torch.float32:  # (the oracle's float32 semantics)
        oracle = FakeQuantCache(model.config, dataclasses.replace(cfg, chunk_history_tokens=kept))
        forward(model, ids[:, :128], oracle)
        torch.testing.assert_close(forward(model, ids[:, 128:], ours), forward(model, ids[:, 128:], oracle),
                                   atol=1e-4, rtol=0)
    one = TurboQuantCache(model.config, tq_config=cfg)
    forward(model, ids, one)
    assert all(layer.chunk_history_bytes() == 0 for layer in one.layers)
