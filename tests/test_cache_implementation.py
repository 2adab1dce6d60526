"""TurboQuant turned on the way transformers users turn caches on: cache_implementation="turboquant"."""

from __future__ import annotations

import pytest
import torch
from models import assert_close, generate, left_padded_batch, tiny_model, with_cache
from transformers import DynamicCache, GenerationConfig

import tq_hf.generation
from tq_hf import TurboQuantCache, TurboQuantConfig


@pytest.fixture
def built(monkeypatch):
    """Every cache tq_hf.generation builds, in order."""
    caches = []
    build = tq_hf.generation.cache_from_options

    def spy(*args, **kwargs):
        caches.append(build(*args, **kwargs))
        return caches[-1]

    monkeypatch.setattr(tq_hf.generation, "cache_from_options", spy)
    return caches


@pytest.mark.parametrize("preset", ["4bit", "k8v4"])
def test_cache_implementation_equals_an_explicit_cache(preset, built):
    model = tiny_model("llama")
    ids, mask, _ = left_padded_batch([9, 5], seed=3)
    options = {"preset": preset, "recent_window": 0}  # no exact ring: the short prompts are compressed
    tokens, logits = generate(model, ids, mask, cache_implementation="turboquant", cache_config=options)
    cfg = TurboQuantConfig.from_preset(preset, recent_window=0)
    expected_tokens, expected_logits = generate(model, ids, mask, TurboQuantCache(model.config, tq_config=cfg))
    assert len(built) == 1 and isinstance(built[0], TurboQuantCache)
    assert built[0].tq_config == cfg
    assert built[0].get_seq_length() == ids.shape[1] + 7  # the cache generate() used: the last token is not stored
    assert torch.equal(tokens, expected_tokens)
    assert_close(logits, expected_logits, atol=1e-5, what="cache_implementation vs explicit cache")
    _, dense = generate(model, ids, mask, DynamicCache())
    assert (dense - logits).abs().max() > 1e-3, "the generated cache compressed nothing"


def test_generation_config_enables_it_once_with_field_overrides(built):
    model = tiny_model("qwen2")
    model.generation_config.cache_implementation = "turboquant"
    model.generation_config.cache_config = {"preset": "k3v4", "recent_window": 16, "max_cache_tokens": 4096}
    ids, mask, _ = left_padded_batch([7, 11], seed=4)
    generate(model, ids, mask)
    generate(model, ids, mask, max_new_tokens=3)
    assert len(built) == 2 and built[0] is not built[1]  # a fresh cache per call, as transformers builds them
    assert built[0].tq_config == TurboQuantConfig.from_preset("k3v4", recent_window=16)
    assert model.generation_config.cache_config["preset"] == "k3v4"  # the options are not consumed


def test_generation_config_round_trips_through_save(tmp_path):
    config = GenerationConfig(cache_implementation="turboquant", cache_config={"preset": "3bit"})
    config.validate(strict=True)
    config.save_pretrained(tmp_path)
    loaded = GenerationConfig.from_pretrained(tmp_path)
    assert (loaded.cache_implementation, loaded.cache_config) == ("turboquant", {"preset": "3bit"})


def test_turboquant_attention_alone_gets_a_turboquant_cache(built):
    model = tiny_model("gemma3")
    ids, mask, _ = left_padded_batch([6, 10], seed=5)
    generate(model, ids, mask)
    assert len(built) == 1 and built[0].tq_config == TurboQuantConfig.from_preset("4bit")


def test_other_attention_keeps_dynamic_cache_unless_asked(built):
    model = tiny_model("llama", attn="sdpa")
    ids, mask, _ = left_padded_batch([6, 4], seed=6)
    generate(model, ids, mask)
    assert built == []
    generate(model, ids, mask, cache_implementation="turboquant")  # dense attention over the dequantized cache
    assert len(built) == 1


def test_an_explicit_cache_wins_and_both_at_once_is_an_error(built):
    model = tiny_model("llama")
    ids, mask, _ = left_padded_batch([5], seed=7)
    cache = DynamicCache()
    generate(model, ids, mask, cache)
    assert built == [] and cache.get_seq_length() > 0
    with pytest.raises(ValueError, match="cache_implementation='turboquant' and a cache"):
        generate(model, ids, mask, TurboQuantCache(model.config), cache_implementation="turboquant")


def test_use_cache_false_builds_nothing(built):
    model = tiny_model("llama")
    ids, mask, _ = left_padded_batch([5], seed=8)
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False, use_cache=False)
    assert built == []


@pytest.mark.parametrize("options, message", [
    ({"preset": "2bit"}, "unknown preset '2bit'"),
    ({"bits": 4}, r"unknown cache_config keys .*\['bits'\].*supported: 'preset'"),
    ({"tq_config": TurboQuantConfig.from_preset("4bit"), "preset": "4bit"}, "'tq_config' alone"),
])
def test_bad_cache_config_names_the_supported_values(options, message):
    model = tiny_model("llama")
    ids, mask, _ = left_padded_batch([5], seed=9)
    with pytest.raises(ValueError, match=message):
        generate(model, ids, mask, cache_implementation="turboquant", cache_config=options)


def test_pipeline_default_enables_it(built):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, pipeline

    model = tiny_model("llama")
    vocab = {f"t{i}": i for i in range(model.config.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t3"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t3", pad_token="t0")
    model.generation_config.cache_implementation = "turboquant"
    model.generation_config.cache_config = {"preset": "k8v4"}
    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
    text = pipe("t5 t9 t17 t33", max_new_tokens=4, do_sample=False)[0]["generated_text"]
    assert text.startswith("t5 t9 t17 t33") and len(built) == 1
    assert built[0].tq_config == TurboQuantConfig.from_preset("k8v4")


def test_cache_kwarg_helper_matches_this_transformers():
    """The tests pass caches under the name this transformers version takes (no deprecation path)."""
    model = tiny_model("llama")
    ids = torch.tensor([[5, 6, 7]])
    model(input_ids=ids, **with_cache(DynamicCache()))


def test_assisted_decoding_gives_the_assistant_a_croppable_cache(built):
    """generate() crops the assistant's cache after rejected candidates; its exact sliding layers
    must record their past for that, as transformers arranges for the caches it builds."""
    model, assistant = tiny_model("gemma3"), tiny_model("gemma3", seed=1)
    ids, _, _ = left_padded_batch([20], seed=7)  # 3x past the sliding window
    tokens, _ = generate(model, ids, None, max_new_tokens=12, assistant_model=assistant)
    assert len(built) == 2 and all(isinstance(c, TurboQuantCache) for c in built)
    expected, logits = generate(model, ids, None, TurboQuantCache(model.config), max_new_tokens=12)
    # greedy assisted decoding keeps the target model's tokens, up to a near tie of its top two logits: a verification
    # forward attends its own tokens exactly where decode steps read the last ones from the int8 ring, which moves
    # this 3-layer model's logits by a few hundredths (its fifth token here: 55 over 9 by 0.0012 to 0.027 of a
    # logit, depending on the CPU and the transformers version)
    new, want = tokens[0, ids.shape[1]:], expected[0, ids.shape[1]:]
    differ = (new != want).nonzero().flatten()
    if differ.numel():
        i = int(differ[0])
        top = logits[i, 0].topk(2)
        assert float(top.values[0] - top.values[1]) < 0.05 and int(new[i]) in top.indices.tolist(), (
            f"assisted decoding left the target's tokens at step {i} without a near tie: {new.tolist()} vs "
            f"{want.tolist()}, top two logits {top.values.tolist()} for {top.indices.tolist()}")
